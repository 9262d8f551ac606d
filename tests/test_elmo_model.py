"""Tests of ELMo's biLM, sampled classes and layer mix (Peters et al. 2018, sec. 3)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import char_cnn
from models import elmo
from models import layers
from models import lstm

B, L, W = 2, 7, 8
TINY = elmo.Config(vocab_size=50, char_dim=4, max_characters_per_token=W,
                   filters=((1, 4), (2, 4), (3, 8)), projection_dim=8, lstm_dim=16,
                   num_sampled=10, dropout_rate=0.1)
LENGTHS = np.array([L, 4])


def _char_ids(seed=0):
  ids = np.random.RandomState(seed).randint(1, elmo.NUM_CHARS, (B, L, W))
  ids[np.arange(L)[None, :] >= LENGTHS[:, None]] = 0  # padding tokens are all zeros
  return jnp.asarray(ids)


@pytest.fixture(scope='module')
def bilm():
  module = elmo.BiLM(TINY)
  params = jax.jit(module.init)(jax.random.PRNGKey(0), _char_ids(), jnp.asarray(LENGTHS))
  return module, params


# The biLM (sec. 3.1).


def test_each_direction_sees_only_its_side(bilm):
  module, params = bilm
  token_BLD = jax.jit(functools.partial(module.apply, method=elmo.BiLM.encode_tokens))(
      params, _char_ids(), jnp.asarray(LENGTHS))

  def states(token_BLD):
    forward, backward = module.apply(params, token_BLD, jnp.asarray(LENGTHS), deterministic=True,
                                     method=elmo.BiLM.contextualize)
    return jnp.stack([jnp.stack(forward), jnp.stack(backward)]).sum(-1)  # (2, layers, B, L)

  jac = np.asarray(jax.jit(jax.jacrev(states))(token_BLD))  # (2, layers, B, L, B, L, D)
  influence = np.abs(jac).sum(-1)  # output (direction, layer, b, t) <- input (b', t')
  t, s = np.arange(L)[:, None], np.arange(L)[None, :]
  for b, n in enumerate(LENGTHS):
    real = (t < n) & (s < n)
    for direction, allowed in ((0, s <= t), (1, s >= t)):
      block = influence[direction, :, b, :, b, :]  # (layers, t, t')
      assert not block[:, ~allowed].any()  # never the other side
      assert not block[:, ~real].any()  # padding neither reads nor is read
      assert (block[:, allowed & real] > 0).all()  # and everything on its side counts
    assert not influence[:, :, b, :, 1 - b].any()  # rows are independent


def test_padding_is_zero_and_changes_nothing(bilm):
  module, params = bilm
  ids = _char_ids()
  apply = jax.jit(module.apply)
  out = apply(params, ids, jnp.asarray(LENGTHS))
  for x in [out['token_BLD'], *out['forward'], *out['backward']]:
    assert x.shape == (B, L, TINY.projection_dim)
    assert not np.asarray(x[1, LENGTHS[1]:]).any() and np.asarray(x[1, :LENGTHS[1]]).all()
  # Other characters in the padding positions change no real position.
  noisy = ids.at[1, LENGTHS[1]:].set(_char_ids(seed=1)[0, LENGTHS[1]:])
  out2 = apply(params, noisy, jnp.asarray(LENGTHS))
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), out, out2)


def test_residual_adds_the_first_layers_output(bilm):
  module, params = bilm
  out = jax.jit(module.apply)(params, _char_ids(), jnp.asarray(LENGTHS))
  lstm_1 = lstm.LSTM(TINY.lstm_dim, TINY.projection_dim, TINY.cell_clip, TINY.proj_clip)
  h_2 = jax.jit(lstm_1.apply)({'params': params['params']['forward_1']}, out['forward'][0], LENGTHS)
  np.testing.assert_allclose(out['forward'][1], h_2 + out['forward'][0], rtol=1e-5, atol=1e-6)


def test_elmo_layers_duplicate_the_token_layer():
  token, f, b = (jnp.full((B, L, 3), v) for v in (1.0, 2.0, 3.0))
  got = np.asarray(elmo.elmo_layers(token, [f, f + 10], [b, b + 10]))
  assert got.shape == (B, 3, L, 6)  # J = num_layers + 1 = 3 (the paper's 2L + 1 vectors)
  np.testing.assert_array_equal(got[0, :, 0], [[1, 1, 1, 1, 1, 1], [2, 2, 2, 3, 3, 3],
                                               [12, 12, 12, 13, 13, 13]])


# The pretraining model's outputs and size.


def test_model_outputs_in_eval_and_training():
  model = elmo.Model(TINY)
  batch = {'char_ids': _char_ids(), 'lengths': jnp.asarray(LENGTHS),
           'token_ids': jnp.zeros((B, L), jnp.int32)}
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), batch)
  assert set(variables['params']) == {'bilm', 'softmax'}
  assert set(variables['params']['softmax']) == {'kernel', 'bias'}
  D, V = TINY.projection_dim, TINY.vocab_size
  shapes = {'forward_states': (B, L, D), 'backward_states': (B, L, D), 'softmax_kernel': (V, D),
            'softmax_bias': (V,), 'layers': (B, 3, L, 2 * D)}
  apply = jax.jit(model.apply, static_argnames='deterministic')
  out = apply(variables, batch, deterministic=True)
  assert {k: v.shape for k, v in out.items()} == shapes
  rngs = {'dropout': jax.random.PRNGKey(1), 'sampling': jax.random.PRNGKey(2)}
  train = apply(variables, batch, deterministic=False, rngs=rngs)
  assert {k: v.shape for k, v in train.items()} == {
      **shapes, 'sampled_ids': (2, TINY.num_sampled), 'log_expected_counts': (V,)}
  # One sample per direction, drawn apart (bilm-tf calls sampled_softmax_loss for each).
  assert not np.array_equal(train['sampled_ids'][0], train['sampled_ids'][1])
  assert train['softmax_kernel'].dtype == jnp.float32
  assert not np.allclose(train['forward_states'], out['forward_states'])  # dropout is on
  full = elmo.Model(dataclasses.replace(TINY, num_sampled=0))
  assert 'sampled_ids' not in jax.eval_shape(
      functools.partial(full.apply, deterministic=False, rngs=rngs), variables, batch)


def test_char_filters_start_as_bilm_tfs_for_their_activation():
  # bilm-tf's make_convolutions: uniform(-0.05, 0.05) with relu, normal(0, sqrt(1 / (w E)))
  # with tanh (its released small models' activation).
  ids = jnp.ones((1, 1, 8), jnp.int32)
  for activation in ('relu', 'tanh'):
    cnn = char_cnn.CharCNN(char_dim=16, filters=((4, 512),), num_highway=0, output_dim=0,
                           activation=activation)
    kernel = np.asarray(nn.meta.unbox(cnn.init(jax.random.key(0), ids))['params']['conv_0_kernel'])
    if activation == 'relu':
      assert np.abs(kernel).max() <= 0.05 and np.std(kernel) == pytest.approx(0.05 / 3 ** 0.5,
                                                                             rel=0.03)
    else:
      assert np.std(kernel) == pytest.approx((4 * 16) ** -0.5, rel=0.03)


def test_full_size_parameter_count():
  # bilm-tf's options.json: 262 chars x 16, filters of widths 1..7 (2048), 2 highways,
  # projection to 512, 2 layers x 2 directions of 4096-cell LSTMs projected to 512.
  filters = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
  N, D, S, V = 2048, 512, 4096, 793471
  char_cnn = 262 * 16 + sum(w * 16 * n + n for w, n in filters) + 2 * 2 * (N * N + N) + N * D + D
  lstm = (D + D) * 4 * S + 4 * S + S * D  # [input; recurrent] kernel, bias, projection
  expected = char_cnn + 4 * lstm
  print(f'biLM {expected:,} (char CNN {char_cnn:,}, LSTMs {4 * lstm:,}), softmax {V * D + V:,}')
  model = elmo.Model(elmo.Config())
  batch = {'char_ids': jnp.zeros((1, 2, 50), jnp.int32), 'lengths': jnp.ones((1,), jnp.int32)}
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), batch)['params'])
  assert layers.count_params(shapes['bilm']) == expected == 93_600_864  # the paper's ~93.6M
  assert layers.count_params(shapes['softmax']) == V * D + V


def test_the_token_layer_is_projected_only_to_another_width():
  # bilm-tf: use_proj = n_filters != projection_dim (configs/elmo.py:tiny's 128 filters are
  # its 128-wide token layer as they come out of the highways).
  def char_cnn_params(**kw):
    config = dataclasses.replace(TINY, **kw)
    shapes = jax.eval_shape(elmo.BiLM(config).init, jax.random.PRNGKey(0), _char_ids(),
                            jnp.asarray(LENGTHS))
    return set(nn.meta.unbox(shapes['params'])['char_cnn'])
  assert 'projection_kernel' in char_cnn_params()  # 16 filters to 8
  assert 'projection_kernel' not in char_cnn_params(projection_dim=16)


def test_config_normalizes_and_checks_its_fields():
  cfg = elmo.Config(filters=[[1, 4], [2, 8]])
  assert cfg.filters == ((1, 4), (2, 8))
  for bad in (dict(filters=((9, 4),), max_characters_per_token=8), dict(num_layers=0),
              dict(num_sampled=-1), dict(filters=())):
    with pytest.raises(ValueError):
      elmo.Config(**bad)


def test_train_flops_per_example_by_hand():
  cfg = dataclasses.replace(TINY, num_sampled=0)
  data = type('Data', (), {'max_seq_length': 5})
  cnn = (8 * 1 * 4 * 4) + (7 * 2 * 4 * 4) + (6 * 3 * 4 * 8)
  per_token = cnn + 2 * 2 * 16 * 16 + 16 * 8 + 4 * (8 * 64 + 8 * 64 + 16 * 8) + 2 * 8 * 50
  assert elmo.train_flops_per_example(cfg, data) == 6 * 5 * per_token
  sampled = elmo.train_flops_per_example(TINY, data)
  assert sampled == 6 * 5 * (per_token - 2 * 8 * 50 + 2 * 8 * 11)


# The sampled softmax's classes.


def test_sampled_classes():
  V, K = 20, 5
  q = np.exp(elmo.log_uniform_log_probs(V))
  np.testing.assert_allclose(q.sum(), 1.0, rtol=1e-5)
  np.testing.assert_allclose(q[:2], np.log([2, 1.5]) / np.log(V + 1), rtol=1e-5)

  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  ids, log_counts = jax.vmap(lambda k: elmo.sample_candidates(k, V, K, True))(keys)
  ids = np.asarray(ids)
  assert all(len(set(row)) == K for row in ids) and ids.min() >= 0 and ids.max() < V
  counts = np.exp(np.asarray(log_counts[0]))
  np.testing.assert_allclose(counts.sum(), K, rtol=1e-4)
  inclusion = np.bincount(ids.ravel(), minlength=V) / len(keys)
  assert np.abs(inclusion - counts).max() < 0.05  # TF's approximation, not exact

  ids, log_counts = elmo.sample_candidates(jax.random.PRNGKey(1), V, 25, True)
  np.testing.assert_array_equal(np.sort(ids), np.arange(V))
  np.testing.assert_array_equal(log_counts, np.zeros(V))

  ids, log_counts = elmo.sample_candidates(jax.random.PRNGKey(2), V, 20000, False)
  np.testing.assert_allclose(np.exp(log_counts), 20000 * q, rtol=1e-5)
  np.testing.assert_allclose(np.bincount(np.asarray(ids), minlength=V) / 20000, q, atol=0.01)

  # Inside jit at the paper's size.
  ids, log_counts = jax.jit(elmo.sample_candidates, static_argnums=(1, 2, 3))(
      jax.random.PRNGKey(3), 793471, 8192, True)
  assert len(np.unique(ids)) == 8192
  np.testing.assert_allclose(np.exp(log_counts).sum(), 8192, rtol=1e-3)


# The task-learned mix (sec. 3.2, eq. 1).


def _mix(layers_BJLX, mask_BL, params=None, **kw):
  module = elmo.ScalarMix(layers_BJLX.shape[1], **kw)
  variables = module.init(jax.random.PRNGKey(0), layers_BJLX, mask_BL)
  if params is not None:
    variables = {'params': params}
  mix, l2 = module.apply(variables, layers_BJLX, mask_BL)
  return np.asarray(mix), float(l2), variables


def test_scalar_mix():
  rng = np.random.RandomState(0)
  h_BJLX = rng.normal(size=(B, 3, L, 4)).astype(np.float32)
  mask = np.ones((B, L), np.float32)
  s, gamma = np.array([0.5, -1.0, 2.0], np.float32), np.float32(1.7)
  params = {'scalar_weights': s, 'gamma': gamma}
  same = np.repeat(h_BJLX[:, :1], 3, axis=1)
  mix, l2, _ = _mix(same, mask, params)
  np.testing.assert_allclose(mix, gamma * same[:, 0], rtol=1e-5, atol=1e-6)  # weights sum to 1
  assert np.isclose(l2, (s ** 2).sum())
  w = np.exp(s) / np.exp(s).sum()
  mix, _, _ = _mix(h_BJLX, mask, params)
  np.testing.assert_allclose(mix, gamma * np.einsum('j,bjlx->blx', w, h_BJLX), rtol=1e-5,
                             atol=1e-6)
  doubled, _, _ = _mix(h_BJLX, mask, {'scalar_weights': s, 'gamma': 2 * gamma})
  np.testing.assert_allclose(doubled, 2 * mix, rtol=1e-5)
  # Initially an average of the layers with gamma 1.
  mix, l2, variables = _mix(h_BJLX, mask)
  np.testing.assert_allclose(mix, h_BJLX.mean(axis=1), rtol=1e-5, atol=1e-6)
  assert l2 == 0.0 and set(variables['params']) == {'scalar_weights', 'gamma'}

  mix, l2, variables = _mix(h_BJLX, mask, top_only=True)
  assert set(variables['params']) == {'gamma'} and l2 == 0.0
  mix, _, _ = _mix(h_BJLX, mask, {'gamma': gamma}, top_only=True)
  np.testing.assert_allclose(mix, gamma * h_BJLX[:, -1], rtol=1e-6)
  for j in range(3):  # one layer alone (sec. 5.3)
    mix, l2, variables = _mix(h_BJLX, mask, {'gamma': gamma}, single_layer=j)
    assert set(variables['params']) == {'gamma'} and l2 == 0.0
    np.testing.assert_allclose(mix, gamma * h_BJLX[:, j], rtol=1e-6)
  with pytest.raises(ValueError, match='single_layer=3'):
    _mix(h_BJLX, mask, single_layer=3)


def test_scalar_mix_layer_norm_uses_only_unmasked_values():
  rng = np.random.RandomState(1)
  h_BJLX = (rng.normal(size=(B, 3, L, 4)) * 3 + 5).astype(np.float32)
  mask = (np.arange(L)[None, :] < LENGTHS[:, None]).astype(np.float32)
  h_BJLX[1, :, LENGTHS[1]:] = 1e4  # padding garbage must not enter the statistics
  keep = mask[:, None, :, None] > 0
  expected = np.zeros_like(h_BJLX)
  for j in range(3):
    values = h_BJLX[:, j][np.broadcast_to(keep[:, 0], h_BJLX[:, j].shape)]
    expected[:, j] = (h_BJLX[:, j] - values.mean()) / values.std()
  s = np.array([0.3, -0.2, 0.1], np.float32)
  w = np.exp(s) / np.exp(s).sum()
  expected = np.einsum('j,bjlx->blx', w, expected) * mask[:, :, None]
  mix, _, _ = _mix(h_BJLX, mask, {'scalar_weights': s, 'gamma': np.float32(1.0)}, layer_norm=True)
  np.testing.assert_allclose(mix, expected, rtol=1e-4, atol=1e-5)
