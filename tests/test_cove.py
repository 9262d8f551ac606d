"""CoVe's MT-LSTM (McCann et al. 2017, sec. 3): the attention equations against NumPy,
causality, padding, step-by-step decoding, search, unknown words, and GloVe loading."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import cove as cove_config
from input_pipeline import translation
import input_pipeline
from input_pipeline.common import glove
from input_pipeline.common import words as words_lib
from models import cove
from models import decoding
from trainer import sharding
import trainer.checks
import trainer.optimizer

V, SOURCE_V = 30, 25
BOS, EOS = 2, 1


def _config(**kw):
  kw = {'vocab_size': V, 'source_vocab_size': SOURCE_V, 'word_dim': 6, 'hidden_size': 5,
        'target_embed_dim': 4, 'dropout_rate': 0.0, 'init_scale': 0.5, **kw}
  return cove.Config(**kw)


def _ids(high, *shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(3, high, shape), jnp.int32)


def _setup(seed=0, **kw):
  model = cove.Model(_config(**kw))
  batch = {'source_ids': _ids(SOURCE_V, 3, 7, seed=seed).at[1, 4:].set(0),
           'target_input_ids': _ids(V, 3, 6, seed=seed + 1)}
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(seed), batch)['params'])
  return model, params, batch


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_attention_equations_match_numpy():
  # s_t = LSTM([z; h~_{t-1}], s_{t-1}); alpha = softmax(H (W1 s_t + b1));
  # h~_t = tanh(W2 [H^T alpha; s_t] + b2), on one step with padded source positions.
  cfg = _config(num_encoder_layers=1, num_decoder_layers=1)
  cell = cove.DecoderCell(cfg)
  rng = np.random.default_rng(3)
  B, S, X, D, E = 2, 5, 10, cfg.decoder_size, cfg.target_embed_dim
  H = rng.normal(size=(B, S, X)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.int32)
  z = rng.normal(size=(B, E)).astype(np.float32)
  c0, h0, feed = (rng.normal(size=(B, D)).astype(np.float32) for _ in range(3))
  state = (((jnp.asarray(c0), jnp.asarray(h0)),), jnp.asarray(feed))
  params = nn.meta.unbox(cell.init(jax.random.key(0), state, z, H, mask, True)['params'])
  params = jax.tree.map(lambda p: p + 0.3 * rng.normal(size=p.shape).astype(np.float32), params)
  (cells, h_tilde), (out, alpha) = cell.apply({'params': params}, state, z, H, mask, True)
  p = jax.tree.map(np.asarray, params)

  x = np.concatenate([z, feed], -1)
  gates = (np.einsum('bi,igd->bgd', x, p['layer0_input_kernel'])
           + np.einsum('bd,dgk->bgk', h0, p['layer0_recurrent_kernel']) + p['layer0_bias'])
  c = _sigmoid(gates[:, 1]) * c0 + _sigmoid(gates[:, 0]) * np.tanh(gates[:, 2])
  s = _sigmoid(gates[:, 3]) * np.tanh(c)
  query = s @ p['attention_query']['kernel'] + p['attention_query']['bias']
  scores = np.einsum('bsx,bx->bs', H, query)
  scores = np.where(mask > 0, scores, -np.inf)
  expected_alpha = np.exp(scores - scores.max(-1, keepdims=True))
  expected_alpha /= expected_alpha.sum(-1, keepdims=True)
  context = np.einsum('bs,bsx->bx', expected_alpha, H)
  expected = np.tanh(np.concatenate([context, s], -1) @ p['attention_output']['kernel']
                     + p['attention_output']['bias'])
  np.testing.assert_allclose(alpha, expected_alpha, atol=1e-5)
  assert np.all(np.asarray(alpha)[1, 2:] == 0)  # padded words get no attention
  np.testing.assert_allclose(out, expected, atol=1e-5)
  np.testing.assert_allclose(h_tilde, expected, atol=1e-5)
  np.testing.assert_allclose(cells[0][0], c, atol=1e-5)
  np.testing.assert_allclose(cells[0][1], s, atol=1e-5)


def test_decoder_dropout_is_placed_as_the_released_models_opennmt():
  # salesforce/cove's OpenNMT-py Decoder drops the word vector and the fed h~, its StackedLSTM
  # drops each layer's input again (the first's too), and the h~ the softmax reads, which the
  # next step is fed, is dropped once. At rate 0.5 a word vector's entry and the fed h~'s reach
  # the first layer with probability 0.25 each, and the h~ out is 0 or twice a tanh.
  rate, B, S = 0.5, 4000, 3
  cfg = _config(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=rate)
  cell = cove.DecoderCell(cfg)
  E, D, X = cfg.target_embed_dim, cfg.decoder_size, 2 * cfg.hidden_size
  rng = np.random.default_rng(0)
  H = jnp.asarray(rng.normal(size=(B, S, X)), jnp.float32)
  mask = jnp.ones((B, S), jnp.int32)
  zeros = jnp.zeros((B, D))
  state = (((zeros, zeros),), zeros)
  z = jnp.zeros((B, E))
  params = nn.meta.unbox(cell.init(jax.random.key(0), state, z, H, mask, True)['params'])
  for row, (z_in, feed_in) in ((0, (z.at[:, 0].set(1.0), zeros)),
                               (E, (z, zeros.at[:, 0].set(1.0)))):
    # Every gate of every unit reads input `row` alone: a cell is nonzero where it arrived.
    kernel = jnp.zeros_like(params['layer0_input_kernel']).at[row].set(1.0)
    reading = dict(params, layer0_input_kernel=kernel,
                   layer0_recurrent_kernel=jnp.zeros_like(params['layer0_recurrent_kernel']))
    (cells, h_tilde), (out, _) = cell.apply(
        {'params': reading}, (((zeros, zeros),), feed_in), z_in, H, mask, False,
        rngs={'dropout': jax.random.key(1)})
    arrived = float((np.asarray(cells[0][0])[:, 0] != 0).mean())
    assert arrived == pytest.approx(0.25, abs=0.03), (row, arrived)
    h_tilde = np.asarray(h_tilde)
    np.testing.assert_array_equal(h_tilde, out)  # what the softmax reads is what is fed
    assert (h_tilde != 0).mean() == pytest.approx(1 - rate, abs=0.03)
    assert np.abs(h_tilde).max() > 1.0 and np.abs(h_tilde).max() <= 1 / (1 - rate) + 1e-6


def test_the_decoder_starts_from_the_encoders_final_states():
  # OpenNMT-py's NMTModel (_fix_enc_hidden): decoder layer l starts from encoder layer l's final
  # (c, h), forward and backward side by side: the forward's after the last word, the
  # backward's after the first. h~_0 is zero.
  model, params, batch = _setup()
  apply = jax.jit(lambda p, b: model.apply({'params': p}, b, method='encode_for_decoding'))
  H, (cells, feed) = apply(params, batch)
  states = jax.jit(lambda p, b: model.apply({'params': p}, b, method='encode'))(params, batch)
  np.testing.assert_array_equal(H, states[-1])
  half = model.config.hidden_size
  for (c, h), X in zip(cells, states):
    for b, n in enumerate([7, 4, 7]):
      np.testing.assert_allclose(h[b, :half], X[b, n - 1, :half], atol=1e-6)
      np.testing.assert_allclose(h[b, half:], X[b, 0, half:], atol=1e-6)
    assert np.all(np.abs(c) > 0)
  assert not np.any(feed)
  with pytest.raises(ValueError, match='model.num_decoder_layers=1 but model.num_encoder_layers=2'):
    _config(num_decoder_layers=1)


@pytest.mark.slow  # an LSTM decoder; tests/test_transformer.py checks the attention decoders
def test_decoder_is_causal():
  model, params, batch = _setup()
  logits = model.apply({'params': params}, batch)['logits']
  changed = dict(batch, target_input_ids=batch['target_input_ids'].at[:, 3:].set(7))
  other = model.apply({'params': params}, changed)['logits']
  np.testing.assert_allclose(logits[:, :3], other[:, :3], atol=1e-6)
  assert not np.allclose(logits[:, 3:], other[:, 3:])


def test_encoder_padding_changes_nothing():
  model, params, batch = _setup()
  apply = jax.jit(model.apply)
  out = apply({'params': params}, batch)
  padded = dict(batch, source_ids=jnp.pad(batch['source_ids'], ((0, 0), (0, 4))))
  out_padded = apply({'params': params}, padded)
  np.testing.assert_allclose(out['logits'], out_padded['logits'], atol=1e-5)
  np.testing.assert_allclose(out['cove'], out_padded['cove'][:, :7], atol=1e-6)
  # Row 1 has 4 words: its CoVe states past them are zeros, and no attention goes there.
  assert np.all(np.asarray(out['cove'])[1, 4:] == 0)
  assert np.all(np.asarray(out['alpha'])[1, :, 4:] == 0)
  # And a word past a row's length is never read: the other rows' words change nothing.
  other = dict(batch, source_ids=batch['source_ids'].at[1, 4:].set(9))
  lengths_kept = dict(other, source_segment_ids=(batch['source_ids'] > 0).astype(jnp.int32))
  np.testing.assert_allclose(apply({'params': params}, lengths_kept)['logits'],
                             out['logits'], atol=1e-6)


def test_step_by_step_decoding_equals_the_full_pass():
  model, params, batch = _setup(seed=4)
  T = 6
  step, state, reorder = cove.decoder(model, params, batch['source_ids'], beam_size=1,
                                      max_length=T)
  assert reorder is None
  target = batch['target_input_ids']
  expected = jax.jit(model.apply)({'params': params},
                                  dict(batch, target_input_ids=target))['logits']
  step = jax.jit(step)
  for t in range(T):
    logits, state = step(target[:, t], state)
    np.testing.assert_allclose(logits, expected[:, t], atol=1e-5)


def test_beam_of_one_is_greedy_and_greedy_is_each_steps_argmax():
  model, params, batch = _setup(seed=5, init_scale=1.0)
  source = batch['source_ids']
  step, state, _ = cove.decoder(model, params, source, beam_size=1, max_length=8)
  greedy = decoding.greedy_search(step, state, 3, bos_id=BOS, eos_id=EOS, max_length=8)
  beam, _ = decoding.beam_search(step, state, 3, beam_size=1, bos_id=BOS, eos_id=EOS,
                                 max_length=8, alpha=0.0)
  np.testing.assert_array_equal(greedy, beam)
  np.testing.assert_array_equal(
      decoding.translate_ids(model, params, source, beam_size=1, alpha=0.0, max_length=8,
                             bos_id=BOS, eos_id=EOS), greedy)
  # The reference: the full teacher-forced pass on the tokens chosen so far.
  tokens = np.full((3, 9), BOS, np.int32)
  apply = jax.jit(model.apply)  # one compile for the 8 passes (op by op: 12.4 -> 7.9 s alone)
  for t in range(8):
    logits = apply({'params': params}, {'source_ids': source,
                                        'target_input_ids': jnp.asarray(tokens[:, :8])})
    tokens[:, t + 1] = np.argmax(logits['logits'][:, t], -1)
  done = np.cumsum(np.asarray(greedy) == EOS, axis=1) - (np.asarray(greedy) == EOS) > 0
  np.testing.assert_array_equal(np.where(done, 0, greedy), np.where(done, 0, tokens[:, 1:]))
  # Beam search reorders the LSTM states with its beams: the score it returns is the
  # teacher-forced log-probability of the tokens it returns, at least greedy's.
  step4, state4, _ = cove.decoder(model, params, source, beam_size=4, max_length=8)
  beam4, scores = decoding.beam_search(step4, state4, 3, beam_size=4, bos_id=BOS, eos_id=EOS,
                                       max_length=8, alpha=0.0)
  np.testing.assert_allclose(scores, _log_prob(model, params, source, beam4), atol=1e-4)
  assert np.all(_log_prob(model, params, source, beam4) >=
                _log_prob(model, params, source, greedy) - 1e-4)
  np.testing.assert_array_equal(
      decoding.translate_ids(model, params, source, beam_size=4, alpha=0.0, max_length=8,
                             bos_id=BOS, eos_id=EOS), beam4)


def _log_prob(model, params, source, tokens_BT):
  """Sum of log p(token) up to and including each row's first EOS, by teacher forcing."""
  tokens_BT = np.asarray(tokens_BT)
  inputs = np.concatenate([np.full((len(tokens_BT), 1), BOS), tokens_BT[:, :-1]], axis=1)
  logits = jax.jit(model.apply)({'params': params}, {'source_ids': source,
                                                      'target_input_ids': jnp.asarray(inputs)}
                                 )['logits']
  logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), tokens_BT[..., None], -1)
  ended_before = np.cumsum(tokens_BT == EOS, axis=1) - (tokens_BT == EOS) > 0
  return np.where(ended_before, 0.0, logp[..., 0]).sum(axis=1)


def test_unknown_words_share_one_learned_vector():
  model, params, batch = _setup()
  params['word_vectors']['unknown'] = jnp.arange(6, dtype=jnp.float32)
  ids = jnp.array([[cove.UNKNOWN_WORD_ID, 5, cove.UNKNOWN_WORD_ID]])
  vectors = model.apply({'params': params}, ids, method=lambda m, i: m.word_vectors(i))
  np.testing.assert_array_equal(vectors[0, 0], np.arange(6))
  np.testing.assert_array_equal(vectors[0, 2], np.arange(6))
  np.testing.assert_array_equal(vectors[0, 1], params['word_vectors']['table']['embedding'][5])


def test_gradients_reach_the_unknown_vector_and_the_encoder():
  model, params, batch = _setup()
  batch = dict(batch, source_ids=batch['source_ids'].at[0, 0].set(cove.UNKNOWN_WORD_ID))
  grads = jax.jit(jax.grad(lambda p: model.apply({'params': p}, batch)['logits'].sum()))(params)
  assert np.abs(grads['word_vectors']['unknown']).sum() > 0
  assert np.abs(grads['encoder']['layer0_forward']['input_kernel']).sum() > 0


def test_only_the_word_table_is_frozen():
  import optax  # pylint: disable=g-import-not-at-top
  model, params, _ = _setup()
  config = cove_config.get_config('tiny')
  tx = trainer.optimizer.make_optimizer(config.optimizer, optax.constant_schedule(0.1))
  grads = jax.tree.map(jnp.ones_like, params)
  # One compiled program: the optimizer op by op, over every parameter's shape, took 8.6 s.
  updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)
  assert not np.asarray(updates['word_vectors']['table']['embedding']).any()
  assert np.asarray(updates['word_vectors']['unknown']).all()
  assert np.asarray(updates['encoder']['layer1_backward']['input_kernel']).all()


def test_a_frozen_name_that_matches_nothing_is_refused():
  model, params, _ = _setup()
  # No 'bilm' part: nothing to freeze.
  trainer.optimizer.check_frozen(('word_vectors/table', 'bilm'), params)
  with pytest.raises(ValueError, match="'word_vector/table', which is no parameter"):
    trainer.optimizer.check_frozen(('word_vectors', 'word_vector/table'), params)
  with pytest.raises(ValueError, match="'encoder/layer9'"):
    trainer.optimizer.check_frozen(('encoder/layer9',), params)


def test_config_errors_are_one_line():
  config = cove_config.get_config('tiny')
  config.data.pack = True
  with pytest.raises(ValueError, match='data.pack=False'):
    cove.check_config(config)
  config = cove_config.get_config('tiny')
  config.model.hidden_size = 0
  with pytest.raises(ValueError, match='model.hidden_size'):
    trainer.checks.model_config(config)
  config = cove_config.get_config('tiny')
  config.data.glove_file = '/nonexistent/glove.txt'
  with pytest.raises(ValueError, match='data.glove_file'):
    input_pipeline.check_config(config)
  # One value for the source vocabulary of the pipeline and the model.
  config = cove_config.get_config('tiny')
  config.data.source_vocab_size = 123
  assert trainer.checks.model_config(config).source_vocab_size == 123


# GloVe: the standard text format, unknown words.

_GLOVE = ['the 0.1 0.2 0.3', 'cat -1 0.5 2', 'sat 3 3 3', 'at&t inc. 7 8 9', 'mat 0 0 1.5']


def _write_glove(path, lines=_GLOVE, header=False):
  text = ([f'{len(lines)} 3'] if header else []) + lines
  path.write_text('\n'.join(text) + '\n', encoding='utf-8')
  return str(path)


@pytest.mark.parametrize('header', [False, True])
def test_glove_file_reading(tmp_path, header):
  path = _write_glove(tmp_path / 'glove.txt', header=header)
  assert glove.width(path) == 3
  assert glove.known_words(path, {'cat', 'dog', 'at&t inc.', 'The'}) == {'cat', 'at&t inc.'}
  assert glove.known_words(path, {'the', 'cat'}, lower_case=True) == {'the', 'cat'}
  table, found = glove.vectors_for(['<S>', 'cat', 'dog', 'at&t inc.'], path)
  np.testing.assert_array_equal(table, [[0, 0, 0], [-1, 0.5, 2], [0, 0, 0], [7, 8, 9]])
  assert found.tolist() == [False, True, False, True]
  # An uncased vocabulary reads a word's own entry ('i'), though 'I' comes first, and a folded
  # match only where the file has none (glove.840B has 'Zebra' and no 'zebra', say).
  cased = _write_glove(tmp_path / 'cased.txt', ['I 1 1 1', 'Zebra 2 2 2', 'i 3 3 3'])
  table, found = glove.vectors_for(['i', 'zebra', 'dog'], cased, lower_case=True)
  np.testing.assert_array_equal(table, [[3, 3, 3], [2, 2, 2], [0, 0, 0]])
  assert found.tolist() == [True, True, False]
  bad = _write_glove(tmp_path / 'bad.txt', _GLOVE + ['dog 1 2'])
  with pytest.raises(ValueError, match='bad.txt:6 has 2 fields'):
    glove.vectors_for(['dog'], bad)
  with pytest.raises(ValueError, match='not found'):
    glove.width(str(tmp_path / 'missing.txt'))


def _cove_data(tmp_path, glove_file='') -> ml_collections.ConfigDict:
  config = cove_config.get_config('tiny')
  source = ['the cat sat on the mat .', 'the dog sat .', 'a cat , the cat !'] * 20
  target = [translation.cipher(s) for s in source]
  (tmp_path / 'src.txt').write_text('\n'.join(source) + '\n', encoding='utf-8')
  (tmp_path / 'tgt.txt').write_text('\n'.join(target) + '\n', encoding='utf-8')
  config.data.update(pairs='files', source_files=str(tmp_path / 'src.txt'),
                     target_files=str(tmp_path / 'tgt.txt'), data_dir=str(tmp_path / 'data'),
                     glove_file=glove_file, source_vocab_size=20)
  config.model.update(vocab_size=300, word_dim=3)
  return config


def test_glove_vocabulary_and_vectors_in_the_parameters(tmp_path):
  config = _cove_data(tmp_path, _write_glove(tmp_path / 'glove.txt'))
  trainer.checks.validate(config, sharding.make_mesh(config.mesh, jax.devices()[:1]))
  tokenizer = translation.get_tokenizer(config.data, config.model.vocab_size)
  # Source words are the training sources' words that GloVe has, by frequency.
  assert tokenizer.source.words == [*words_lib.SPECIAL_WORDS, 'the', 'cat', 'sat', 'mat']
  assert tokenizer.encode_source_batch(['the dog sat'])[0] == [3, 2, 5]  # dog is <UNK>
  assert set(tokenizer.files()) == {'words.txt', 'tokenizer.json'}
  model = cove.Model(trainer.checks.model_config(config))
  example = translation.example_batch(config.data, 300, 2)
  assert example['source_ids'].max() < 20 and example['source_segment_ids'].max() == 1
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), example)['params'])
  params = cove.load_pretrained(config, params, tokenizer)
  table = np.asarray(params['word_vectors']['table']['embedding'])
  np.testing.assert_allclose(table[3:7], [[0.1, 0.2, 0.3], [-1, 0.5, 2], [3, 3, 3],
                                          [0, 0, 1.5]], rtol=1e-6)
  assert not table[7:].any()  # rows past the learned vocabulary
  # An unknown word reads the learned <UNK> vector, not a row of the table.
  params['word_vectors']['unknown'] = jnp.full(3, 4.0)
  ids = jnp.asarray(tokenizer.encode_source_batch(['dog the'])[0])[None]
  vectors = model.apply({'params': params}, ids, method=lambda m, i: m.word_vectors(i))
  np.testing.assert_allclose(vectors[0], [[4, 4, 4], [0.1, 0.2, 0.3]], rtol=1e-6)
  # A run without a GloVe file keeps every frequent word, with random vectors.
  plain = translation.get_tokenizer(_cove_data(tmp_path).data, 300)
  assert 'dog' in plain.source.words and ',' in plain.source.words
  wide = _cove_data(tmp_path, _write_glove(tmp_path / 'glove.txt'))
  wide.model.word_dim = 4
  with pytest.raises(ValueError, match='3-d vectors but model.word_dim=4'):
    input_pipeline.check_config(wide)
