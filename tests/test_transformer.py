"""The Transformer (Vaswani et al. 2017): causality, padding, packing, sizes, label smoothing,
cached decoding, and greedy and beam search."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decoding
from models import layers
from models import transformer
from objectives import seq2seq

V = 40
BOS, EOS = 2, 1


def _config(**kw):
  kw = {'vocab_size': V, 'hidden_size': 32, 'num_encoder_layers': 2, 'num_decoder_layers': 2,
        'num_heads': 4, 'mlp_dim': 64, 'dropout_rate': 0.0, 'max_position_embeddings': 32, **kw}
  return transformer.Config(**kw)


def _ids(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(5, V, shape), jnp.int32)


def _batch(seed=0):
  return {'source_ids': _ids(2, 7, seed=seed), 'target_input_ids': _ids(2, 6, seed=seed + 1)}


def _params(model, batch):
  return nn.meta.unbox(model.init(jax.random.key(0), batch)['params'])


def test_base_and_big_parameter_counts():
  # Table 3: base 65M, big 213M, with a shared 37000-token vocabulary.
  def count(**kw):
    model = transformer.Model(transformer.Config(**kw))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), _batch()))
    return layers.count_params(nn.meta.unbox(shapes['params']))
  D, F, N, V_ = 512, 2048, 6, 37000
  # The attention's projections have no biases (tensor2tensor's, the paper's W^Q, W^K, W^V, W^O).
  attention, mlp, ln = 4 * D * D, D * F + F + F * D + D, 2 * D
  expected_base = V_ * D + N * (attention + mlp + 2 * ln) + N * (2 * attention + mlp + 3 * ln)
  assert count() == expected_base
  base, big = count(), count(hidden_size=1024, num_heads=16, mlp_dim=4096)
  print(f'base {base:,}, big {big:,} parameters')
  assert round(base / 1e6) == 63 and round(big / 1e6) == 214  # the paper rounds to 65M, 213M


def test_sinusoids_are_the_papers_formula():
  pe = np.asarray(transformer.sinusoids(jnp.arange(50)[None], 16))[0]
  pos, i = 37, 3
  np.testing.assert_allclose(pe[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 16)), rtol=1e-5)
  np.testing.assert_allclose(pe[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 16)), rtol=1e-5)


@pytest.mark.parametrize('positions', ['sinusoidal',
                                       pytest.param('learned', marks=pytest.mark.slow)])
def test_decoder_is_causal(positions):
  """The logits at target position t do not move when any later input token changes (sec. 3.2.3)."""
  model = transformer.Model(_config(positions=positions))
  batch = _batch()
  params = _params(model, batch)
  logits = jax.jit(lambda target: model.apply(  # noqa: E731
      {'params': params}, {**batch, 'target_input_ids': target})['logits'])
  base = logits(batch['target_input_ids'])
  for t in range(6):
    later = batch['target_input_ids'].at[:, t:].set(_ids(2, 6 - t, seed=10 + t))
    changed = logits(later)
    np.testing.assert_array_equal(changed[:, :t], base[:, :t])
    assert np.abs(changed[:, t:] - base[:, t:]).max() > 1e-4  # what it may see does matter


def test_encoder_padding_changes_nothing():
  model = transformer.Model(_config())
  batch = _batch()
  params = _params(model, batch)
  short = {**batch, 'source_ids': batch['source_ids'].at[:, 5:].set(0)}
  longer = {**short, 'source_ids': jnp.pad(short['source_ids'], ((0, 0), (0, 4)))}
  a = model.apply({'params': params}, short)
  b = model.apply({'params': params}, longer)
  np.testing.assert_allclose(a['logits'], b['logits'], atol=1e-5)
  np.testing.assert_allclose(a['encoder_output'][:, :5], b['encoder_output'][:, :5], atol=1e-5)
  # What stands in the padding does not matter either.
  noisy = {**short, 'source_ids': jnp.where(short['source_ids'] == 0, 9, short['source_ids']),
           'source_segment_ids': (short['source_ids'] > 0).astype(jnp.int32)}
  np.testing.assert_allclose(model.apply({'params': params}, noisy)['logits'], a['logits'],
                             atol=1e-5)


def test_packed_rows_equal_examples_alone():
  model = transformer.Model(_config())
  s1, s2, t1, t2 = _ids(4, seed=1), _ids(3, seed=2), _ids(5, seed=3), _ids(2, seed=4)
  packed = {
      'source_ids': jnp.concatenate([s1, s2, jnp.zeros(1, jnp.int32)])[None],
      'source_segment_ids': jnp.array([[1] * 4 + [2] * 3 + [0]]),
      'source_positions': jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
      'target_input_ids': jnp.concatenate([t1, t2, jnp.zeros(1, jnp.int32)])[None],
      'target_segment_ids': jnp.array([[1] * 5 + [2] * 2 + [0]]),
      'target_positions': jnp.array([[0, 1, 2, 3, 4, 0, 1, 0]]),
  }
  params = _params(model, packed)
  apply = jax.jit(lambda batch: model.apply({'params': params}, batch)['logits'])
  logits = apply(packed)[0]
  # Each example alone, padded to the row's length.
  for (s, t), span in (((s1, t1), slice(0, 5)), ((s2, t2), slice(5, 7))):
    alone = apply({'source_ids': jnp.pad(s, (0, 8 - len(s)))[None],
                   'target_input_ids': jnp.pad(t, (0, 8 - len(t)))[None]})
    np.testing.assert_allclose(logits[span], alone[0, :len(t)], atol=1e-5)


def test_shared_embeddings_are_one_matrix_and_separate_ones_are_three():
  batch = _batch()
  shared = _params(transformer.Model(_config()), batch)
  assert [k for k in shared if 'embed' in k] == ['token_embed']
  separate = _params(transformer.Model(_config(share_embeddings=False)), batch)
  assert sorted(k for k in separate if 'embed' in k) == ['output_embed', 'source_embed',
                                                          'target_embed']


def test_attention_kernels_are_glorot_over_the_matrices_they_multiply_by():
  # Sec. 5.3 names no initializer; tensor2tensor and flax's WMT example draw each projection
  # as a D x D matrix, Glorot-uniform: std sqrt(2 / (D + D)). Drawn for the (D, H, K) kernel as
  # it is, flax counted H * D and K * D as the fans (0.0395 here, 0.0074 at 512 x 8 x 64).
  model = transformer.Model(_config(hidden_size=64, num_heads=4, mlp_dim=128,
                                    num_encoder_layers=1, num_decoder_layers=1))
  params = _params(model, _batch())
  attention = params['encoder']['layer_0']['attention']
  for name in ('query', 'key', 'value', 'out'):
    np.testing.assert_allclose(np.std(attention[name]['kernel']), np.sqrt(2 / 128), rtol=0.05)
  wi = params['encoder']['layer_0']['mlp']['wi']['kernel']  # 2-D: as before, sqrt(2 / (D + F))
  np.testing.assert_allclose(np.std(wi), np.sqrt(2 / (64 + 128)), rtol=0.05)


def test_label_smoothing_on_a_hand_computed_example():
  logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
  batch = {'target_ids': jnp.array([[1, 0]]), 'target_segment_ids': jnp.array([[1, 0]])}
  eps = 0.1
  # Target q = 0.9 * onehot(1) + 0.1 / 3: -sum q log p; the padding position counts nothing.
  q = np.array([0.1 / 3, 0.9 + 0.1 / 3, 0.1 / 3])
  expected = -(q * np.log([0.5, 0.25, 0.25])).sum()
  loss, metrics = seq2seq.loss_fn({'logits': logits}, batch, label_smoothing=eps)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics['nll'], [np.log(4.0), 1.0], rtol=1e-6)
  np.testing.assert_allclose(metrics['token_accuracy'], [0.0, 1.0])
  summary = seq2seq.summarize({k: np.asarray(v) for k, v in metrics.items()})
  np.testing.assert_allclose(summary['perplexity'], 4.0, rtol=1e-5)
  unsmoothed, _ = seq2seq.loss_fn({'logits': logits}, batch, label_smoothing=0.0)
  np.testing.assert_allclose(unsmoothed, np.log(4.0), rtol=1e-6)


class _Tokens:
  """A BPE stand-in: ids are the words' numbers; decode writes a line break between two."""
  lower_case, start_id, eot_id = False, BOS, EOS

  def encode_batch(self, texts):
    return [[5 + len(word) for word in text.split()] for text in texts]

  def decode(self, ids):
    return ' '.join(map(str, ids[:2])) + '\n' + ' '.join(map(str, ids[2:]))


def test_translations_are_one_line_each_and_bad_decoding_flags_are_refused():
  model = transformer.Model(_config())
  params = _params(model, _batch())
  sentences = ['a bb ccc', 'dddd', '']
  out = decoding.translate(model, params, _Tokens(), sentences, beam_size=2, max_extra_length=4,
                           batch_size=2)
  assert len(out) == 3 and not any('\n' in t for t in out)
  for options in (dict(alpha=-1.0), dict(batch_size=0)):
    with pytest.raises(ValueError, match=r'use alpha >= 0 .* batch_size >= 1'):
      decoding.translate(model, params, _Tokens(), sentences, **options)


def test_bleu_of_a_lower_casing_run_is_case_insensitive():
  references = ['The Cat sat on the Mat .', 'Hello , World !']
  hypotheses = [r.lower() for r in references]  # what a lower-cased target vocabulary writes
  assert seq2seq.bleu(hypotheses, references) < 90
  assert seq2seq.bleu(hypotheses, references, lowercase=True) == pytest.approx(100.0)

  class Words:  # CoVe's SourceWords: the target BPE says
    target = _Tokens()
  lowering = _Tokens()
  lowering.lower_case = True
  assert not seq2seq.lowercases_targets(_Tokens()) and not seq2seq.lowercases_targets(Words())
  assert seq2seq.lowercases_targets(lowering)


def test_cove_divides_its_summed_loss_by_the_sentences_as_opennmt():
  """OpenNMT-py sums the NLL and divides by the batch's sentences: two targets of 2 and 3
  tokens (and an empty row) give the sum over 5 tokens / 2, and each real token's logit
  gradient (softmax - onehot) / 2; per token it is / 5."""
  logits = jax.random.normal(jax.random.key(0), (3, 4, 6))
  batch = {'target_ids': jnp.array([[1, 2, 0, 0], [3, 4, 5, 0], [0, 0, 0, 0]])}
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch['target_ids'][..., None], -1)[..., 0]
  real = batch['target_ids'] > 0
  total = jnp.where(real, nll, 0.0).sum()
  for normalize, divisor in (('sentences', 2.0), ('tokens', 5.0)):
    loss_of = lambda x: seq2seq.loss_fn({'logits': x}, batch, label_smoothing=0.0,  # noqa: E731
                                        normalize=normalize)[0]
    np.testing.assert_allclose(loss_of(logits), total / divisor, rtol=1e-6)
    grad = jax.grad(loss_of)(logits)
    expected = (jax.nn.softmax(logits) - jax.nn.one_hot(batch['target_ids'], 6)) / divisor
    np.testing.assert_allclose(grad[real], expected[real], rtol=1e-5, atol=1e-7)
  packed = {'target_ids': jnp.array([[1, 2, 3, 4, 5, 0]]),
            'target_segment_ids': jnp.array([[1, 1, 2, 2, 2, 0]])}
  assert seq2seq.sentences(packed) == 2
  from configs import cove  # pylint: disable=g-import-not-at-top
  assert cove.get_config('base').loss.normalize == 'sentences'  # with OpenNMT's SGD at 1
  with pytest.raises(ValueError, match="loss.normalize='words': use one of tokens, sentences"):
    seq2seq.loss_fn({'logits': logits}, batch, normalize='words')


def _trained_like_params(model, batch):
  # Large weights give peaked, varied distributions: different steps pick different tokens.
  params = _params(model, batch)
  return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)


@pytest.mark.slow  # the fast tier checks the cache in tests/test_decoding.py
@pytest.mark.parametrize('scan', [False, True])
def test_cached_decoding_equals_recomputation(scan):
  model = transformer.Model(_config(scan_layers=scan))
  source = _ids(3, 6, seed=5).at[1, 4:].set(0)
  params = _trained_like_params(model, {'source_ids': source,
                                        'target_input_ids': _ids(3, 5)})
  T = 8
  cached = decoding.translate_ids(model, params, source, beam_size=1, alpha=0.0, max_length=T,
                                  bos_id=BOS, eos_id=-1)
  # The reference: each step reruns the decoder on everything so far, no cache (the later
  # slots of the buffer are zeros, which a causal decoder does not see).
  full = jax.jit(lambda target: model.apply({'params': params}, {
      'source_ids': source, 'target_input_ids': target})['logits'])
  tokens = np.zeros((3, T + 1), np.int32)
  tokens[:, 0] = BOS
  for t in range(T):
    tokens[:, t + 1] = np.argmax(full(jnp.asarray(tokens[:, :T]))[:, t], -1)
  np.testing.assert_array_equal(cached, tokens[:, 1:])
  # Given tokens fed one at a time through the cache give the full pass's logits at every step.
  target = _ids(3, T, seed=7)
  expected = full(target)
  cache = jax.tree.map(jnp.zeros_like, model.init(
      jax.random.key(0), {'source_ids': source, 'target_input_ids': target}, decode=True)['cache'])
  memory = model.apply({'params': params}, {'source_ids': source}, method='encode')

  @jax.jit
  def step(cache, token_B1):
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, memory,
        {'source_ids': source, 'target_input_ids': token_B1},
        decode=True, method='decode', mutable=['cache'])
    return logits[:, 0], variables['cache']
  for t in range(T):
    logits, cache = step(cache, target[:, t:t + 1])
    np.testing.assert_allclose(logits, expected[:, t], atol=1e-3, rtol=1e-4)  # logits up to ~40


def test_beam_search_under_scanned_layers_equals_unscanned():
  # Scanned layers keep one cache index per layer: reordering the beams indexed it as rows and
  # stopped every beam search (the BLEU evals, translate.py) of a model with scan_layers=True.
  source = _ids(2, 6, seed=2).at[1, 4:].set(0)
  unrolled = jax.tree.map(lambda x: 2 * x if x.ndim > 1 else x, _params(  # beams that reorder
      transformer.Model(_config()), {'source_ids': source, 'target_input_ids': _ids(2, 5)}))
  scanned = {'token_embed': unrolled['token_embed']}
  for side in ('encoder', 'decoder'):
    scanned[side] = {'layers': {'block': jax.tree.map(
        lambda *xs: jnp.stack(xs), unrolled[side]['layer_0'], unrolled[side]['layer_1'])}}
  found = []
  for scan, params in ((False, unrolled), (True, scanned)):
    step, state, reorder = transformer.decoder(transformer.Model(_config(scan_layers=scan)),
                                               params, source, beam_size=3, max_length=6)
    found.append(decoding.beam_search(step, state, 2, beam_size=3, bos_id=BOS, eos_id=EOS,
                                      max_length=6, reorder=reorder))
  np.testing.assert_array_equal(found[0][0], found[1][0])
  np.testing.assert_allclose(found[0][1], found[1][1], rtol=1e-5)  # the scores: the cache's rows


@pytest.mark.slow  # the fast tier checks the shared beam search on CoVe (tests/test_cove.py)
def test_beam_of_one_is_greedy_search():
  model = transformer.Model(_config())
  source = _ids(3, 6, seed=6)
  params = _trained_like_params(model, {'source_ids': source, 'target_input_ids': _ids(3, 5)})
  memory = model.apply({'params': params}, {'source_ids': source}, method='encode')
  def step(token_N, state):
    # No cache: the decoder reruns on the tokens so far, which the state carries.
    tokens_NT, t = state
    tokens_NT = tokens_NT.at[:, t].set(token_N)
    logits = model.apply({'params': params}, memory, {'source_ids': source,
                                                      'target_input_ids': tokens_NT},
                         method='decode')
    return logits[:, t], (tokens_NT, t + 1)
  state = (jnp.zeros((3, 10), jnp.int32), 0)
  greedy = decoding.greedy_search(step, state, 3, bos_id=BOS, eos_id=EOS, max_length=10)
  beam, _ = decoding.beam_search(step, state, 3, beam_size=1, bos_id=BOS, eos_id=EOS,
                                 max_length=10, alpha=0.0)
  np.testing.assert_array_equal(greedy, beam)
  # And through the cached path of translate.py.
  cached = decoding.translate_ids(model, params, source, beam_size=1, alpha=0.0, max_length=10,
                                  bos_id=BOS, eos_id=EOS)
  np.testing.assert_array_equal(cached, greedy)


def _markov_step():
  """A model whose next token depends on the last one only; greedy takes the wrong first step."""
  P = np.full((6, 6), 1e-6)
  P[BOS, 3], P[BOS, 4] = 0.6, 0.4  # greedy takes 3 ...
  P[3, 3], P[3, 5], P[3, EOS] = 0.35, 0.35, 0.3  # ... after which nothing is likely;
  P[4, EOS] = 1.0  # 4 then EOS has probability 0.4 in all.
  P[5, EOS] = P[EOS, EOS] = P[0, EOS] = 1.0
  logp = jnp.log(jnp.asarray(P / P.sum(1, keepdims=True)))
  return (lambda token_N, state: (logp[token_N], state)), np.asarray(logp)


def _score(logp, tokens):
  total, last = 0.0, BOS
  for token in tokens:
    total += logp[last, token]
    if token == EOS:
      break
    last = token
  return total


def test_beam_search_beats_greedy_where_greedy_is_wrong():
  step, logp = _markov_step()
  greedy = np.asarray(decoding.greedy_search(step, jnp.zeros(2), 2, bos_id=BOS, eos_id=EOS,
                                             max_length=6))
  beam, scores = decoding.beam_search(step, jnp.zeros(2 * 3), 2, beam_size=3, bos_id=BOS,
                                      eos_id=EOS, max_length=6, alpha=0.0)
  beam = np.asarray(beam)
  assert greedy[0, 0] == 3 and list(beam[0, :2]) == [4, EOS]
  np.testing.assert_allclose(scores, np.log(0.4), rtol=1e-4)
  assert _score(logp, beam[0]) > _score(logp, greedy[0]) + 1.0


def test_length_penalty_and_the_finished_hypothesis_it_prefers():
  np.testing.assert_allclose(decoding.length_penalty(jnp.asarray(7), 0.6), (12 / 6) ** 0.6)
  step, logp = _markov_step()
  # With alpha 0 the short hypothesis wins; its score is its log-probability over lp(2) otherwise.
  _, scores = decoding.beam_search(step, jnp.zeros(4), 1, beam_size=4, bos_id=BOS, eos_id=EOS,
                                   max_length=6, alpha=1.0)
  # 4 then EOS is the best under the penalty too (3 5 EOS: log 0.21 / (8/6) = -1.17): its score
  # exactly, so that a penalty of another length (lp(3), say: -0.69) fails.
  best_short = _score(logp, [4, EOS]) / ((5 + 2) / 6)
  np.testing.assert_allclose(scores[0], best_short, rtol=1e-5)
