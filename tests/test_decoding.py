"""Decoding: the key/value cache reproduces the full forward pass; cached sampling = uncached."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decoding
from models import gpt

V = 50
PROMPTS = np.array([[11, 12, 13, 14, 15, 16],
                    [21, 22, 0, 0, 0, 0],
                    [31, 32, 33, 34, 0, 0]], np.int32)
LENGTHS = np.array([6, 2, 4], np.int32)


def _model(scan=False):
  # Large weights give peaked, varied next-token distributions: tokens differ step to step.
  return gpt.Model(gpt.Config(
      vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
      max_position_embeddings=24, initializer_range=0.5, scan_layers=scan))


def _params(model):
  return nn.meta.unbox(model.init(jax.random.key(0), {'input_ids': jnp.zeros((1, 4), jnp.int32)}
                                  )['params'])


def test_init_cache_is_empty_and_scanned_with_the_layers():
  cache = decoding.init_cache(_model(), 3, 20)
  assert cache['layer_0']['attention']['cached_key'].shape == (3, 20, 4, 8)
  assert cache['decode_mask']['valid'].shape == (3, 20)
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(cache))
  scanned = decoding.init_cache(_model(scan=True), 3, 20)
  assert scanned['layers']['block']['attention']['cached_value'].shape == (2, 3, 20, 4, 8)
  with pytest.raises(ValueError, match='max_position_embeddings'):
    decoding.init_cache(_model(), 1, 25)


@pytest.mark.parametrize('scan', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cache_reproduces_the_full_forward_pass(scan):
  # Right-padded prompts in one call, then one token per call: every row's logits
  # equal those of its own unpadded sequence computed at once.
  model = _model(scan)
  params = _params(model)
  if scan:
    unrolled = _params(_model())
    params = {k: v for k, v in unrolled.items() if not k.startswith('layer_')}
    params['layers'] = {'block': jax.tree.map(lambda *xs: jnp.stack(xs),
                                              unrolled['layer_0'], unrolled['layer_1'])}
  continuation = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
  cache = decoding.init_cache(model, 3, 9)
  valid = (np.arange(6) < LENGTHS[:, None]).astype(np.int32)
  apply = jax.jit(lambda c, b: model.apply({'params': params, 'cache': c}, b, decode=True,
                                           mutable=['cache']))
  out, variables = apply(cache, {'input_ids': PROMPTS, 'segment_ids': valid})
  prompt_logits = out['lm_logits']
  step_logits = []
  for t in range(3):
    out, variables = apply(variables['cache'], {'input_ids': continuation[:, t:t + 1]})
    step_logits.append(out['lm_logits'][:, 0])
  # Each row alone, contiguous (what follows it is causally invisible).
  sequences = np.zeros((3, 9), np.int32)
  for b, n in enumerate(LENGTHS):
    sequences[b, :n + 3] = np.concatenate([PROMPTS[b, :n], continuation[b]])
  full = model.apply({'params': params}, {'input_ids': sequences})['lm_logits']
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(prompt_logits[b, :n], full[b, :n], atol=1e-4)
    for t in range(3):
      np.testing.assert_allclose(step_logits[t][b], full[b, n + t], atol=1e-4)


def _sample(model, params, use_cache, prompts=PROMPTS, lengths=LENGTHS, **kw):
  return np.asarray(decoding.sample(model, params, jnp.asarray(prompts), jnp.asarray(lengths),
                                    max_new_tokens=10, rng=jax.random.key(7),
                                    use_cache=use_cache, **kw))


HOWS = {'greedy': dict(), 'top5': dict(temperature=1.0, top_k=5), 'temp0.7': dict(temperature=0.7)}


# The cache under scanned layers once in the fast tier (greedy); every sampling under both in the
# slow tier (each case compiles two programs of its own).
@pytest.mark.parametrize('scan,how', [
    pytest.param(scan, how, id=f'{name}-{scan}',
                 marks=[pytest.mark.slow] if scan and name != 'greedy' else [])
    for name, how in HOWS.items() for scan in (False, True)])
def test_cached_sampling_equals_uncached(scan, how):
  model = _model(scan)
  params = _params(model)
  cached = _sample(model, params, True, **how)
  uncached = _sample(model, params, False, **how)
  assert cached.shape == (3, 10)
  assert len(np.unique(cached)) >= 6  # a varied sequence, so agreement means something
  np.testing.assert_array_equal(cached, uncached)


def test_greedy_rows_are_their_own_argmax_continuations():
  # Padding of the shorter prompts, and the other rows, change nothing.
  model = _model()
  params = _params(model)
  greedy = _sample(model, params, True)
  forward = jax.jit(lambda ids: model.apply({'params': params}, {'input_ids': ids})['lm_logits'])
  for b, n in enumerate(LENGTHS):
    sequence = np.zeros((1, 16), np.int32)
    sequence[0, :n] = PROMPTS[b, :n]
    for t in range(10):
      sequence[0, n + t] = int(forward(sequence)[0, n + t - 1].argmax())
    np.testing.assert_array_equal(greedy[b], sequence[0, n:n + 10])


def test_top1_is_greedy():
  model = _model()
  params = _params(model)
  greedy = _sample(model, params, True)
  np.testing.assert_array_equal(_sample(model, params, True, temperature=2.0, top_k=1), greedy)
  assert not np.array_equal(_sample(model, params, True, temperature=2.0), greedy)


def test_top_k_draws_among_exactly_k_tokens_even_with_ties():
  # Four tied tokens: top_k=1 is the argmax (token 0), top_k=2 draws only tokens 0 and 1.
  logits = jnp.tile(jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]]), (256, 1))
  rng = jax.random.key(0)
  for step in range(4):
    top1 = decoding.choose_tokens(logits, rng, step, temperature=1.0, top_k=1)
    np.testing.assert_array_equal(top1, np.zeros(256, np.int32))
    top2 = np.asarray(decoding.choose_tokens(logits, rng, step, temperature=1.0, top_k=2))
    assert set(top2.tolist()) == {0, 1}
  # k above the vocabulary keeps all of it.
  wide = np.asarray(decoding.choose_tokens(logits, rng, 0, temperature=1.0, top_k=99))
  assert set(wide.tolist()) == {0, 1, 2, 3, 4}


def test_negative_temperature_or_top_k_is_refused():
  model = _model()
  params = _params(model)
  for how in (dict(temperature=-1.0), dict(temperature=1.0, top_k=-1)):
    with pytest.raises(ValueError, match='use temperature >= 0') as error:
      _sample(model, params, True, **how)
    assert '\n' not in str(error.value)


def test_generation_stops_at_end_of_text():
  model = _model()
  params = _params(model)
  free = _sample(model, params, True, temperature=1.0)
  eot = int(free[0, 3])
  first = [int(np.argmax(row == eot)) if (row == eot).any() else 10 for row in free]
  for use_cache in (True, False):
    stopped = _sample(model, params, use_cache, temperature=1.0, eot_id=eot, pad_id=0)
    for b, row in enumerate(stopped):
      np.testing.assert_array_equal(row[:first[b] + 1], free[b, :first[b] + 1])
      assert (row[first[b] + 1:] == 0).all()


@pytest.mark.parametrize('top_k', [0, 3])
def test_banned_tokens_are_never_drawn(top_k):
  model = _model()
  params = _params(model)
  free = _sample(model, params, True, temperature=0.0)
  banned = tuple(sorted(set(free[:, :3].ravel().tolist())))  # the greedy rows' first tokens
  for temperature in (0.0, 1.0):
    drawn = _sample(model, params, True, temperature=temperature, top_k=top_k, banned_ids=banned)
    assert not np.isin(drawn, banned).any(), (temperature, drawn)


def test_too_long_generation_is_refused():
  model = _model()
  with pytest.raises(ValueError, match='max_position_embeddings'):
    decoding.sample(model, _params(model), jnp.asarray(PROMPTS), jnp.asarray(LENGTHS),
                    max_new_tokens=19, rng=jax.random.key(0))


def test_generation_stays_within_the_positions_the_run_trained():
  """configs/gpt.py's tiny trains 128 of its 512 positions: generate.py refuses to decode into
  rows that never had a gradient, in one line naming the fix, unless told to go on."""
  import generate  # pylint: disable=import-outside-toplevel
  generate.check_length(100, 28, table=512, trained=128)
  generate.check_length(100, 28, table=512, trained=None)  # a checkpoint that does not say
  with pytest.raises(ValueError, match='--max_new_tokens=28 or less') as error:
    generate.check_length(100, 29, table=512, trained=128)
  assert '\n' not in str(error.value) and 'allow_untrained_positions' in str(error.value)
  generate.check_length(100, 29, table=512, trained=128, allow_untrained=True)
  with pytest.raises(ValueError, match='exceeds the 512 positions'):
    generate.check_length(500, 13, table=512, trained=512, allow_untrained=True)


def test_a_prompt_that_is_not_utf8_is_one_line_before_the_model_loads(tmp_path):
  """A shell passes other bytes as surrogates; the tokenizer ended in a TypeError traceback."""
  import generate  # pylint: disable=import-outside-toplevel
  latin1 = b'caf\xe9'.decode('utf-8', 'surrogateescape')
  with pytest.raises(ValueError, match='not UTF-8') as error:
    generate.generate(str(tmp_path), [latin1], max_new_tokens=1, temperature=0, top_k=0, seed=0)
  assert '\n' not in str(error.value)
