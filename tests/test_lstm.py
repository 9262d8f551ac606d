"""Tests of the LSTM layer (Hochreiter & Schmidhuber 1997; Sak et al. 2014), as TF's LSTMCell."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

import aot
from configs import elmo as elmo_config
from models import lstm
from trainer import hlo
from trainer import sharding

B, L, D, S, P = 2, 7, 8, 16, 6
CELL_CLIP, PROJ_CLIP = 0.4, 0.15


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _numpy_lstm(params, x_BLD, cell_clip, proj_clip, forget_bias=1.0):
  """A step-by-step loop over full rows; also returns the largest |c| before clipping."""
  wx, wh = np.asarray(params['input_kernel'], np.float64), np.asarray(params['recurrent_kernel'])
  b, wp = np.asarray(params['bias'], np.float64), np.asarray(params['projection_kernel'])
  c, h = np.zeros((x_BLD.shape[0], S)), np.zeros((x_BLD.shape[0], P))
  outputs, largest_c = [], 0.0
  for t in range(x_BLD.shape[1]):
    z = np.einsum('bd,dgs->bgs', x_BLD[:, t], wx) + np.einsum('bp,pgs->bgs', h, wh) + b
    i, f, o = _sigmoid(z[:, 0]), _sigmoid(z[:, 1] + forget_bias), _sigmoid(z[:, 3])
    c = f * c + i * np.tanh(z[:, 2])
    largest_c = max(largest_c, np.abs(c).max())
    c = np.clip(c, -cell_clip, cell_clip)
    h = np.clip((o * np.tanh(c)) @ wp, -proj_clip, proj_clip)
    outputs.append(h)
  return np.stack(outputs, axis=1), largest_c


def _setup(reverse=False):
  layer = lstm.LSTM(S, P, CELL_CLIP, PROJ_CLIP, reverse=reverse)
  x_BLD = jax.random.normal(jax.random.PRNGKey(0), (B, L, D)) * 2.0
  params = layer.init(jax.random.PRNGKey(1), x_BLD, jnp.array([L, L]))['params']
  params = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(params))
  # Larger weights than the initializer's, so both clips bite.
  params = {k: v * 4.0 for k, v in params.items()}
  jitted = jax.jit(layer.apply)

  def apply(x, lengths):
    return np.asarray(jitted({'params': params}, x, jnp.asarray(lengths)))
  return params, np.asarray(x_BLD), apply


def test_matches_a_numpy_loop_with_projection_and_clipping():
  params, x_BLD, apply = _setup()
  assert params['input_kernel'].shape == (D, 4, S) and params['recurrent_kernel'].shape == (P, 4, S)
  assert params['bias'].shape == (4, S) and params['projection_kernel'].shape == (S, P)
  expected, largest_c = _numpy_lstm(params, x_BLD, CELL_CLIP, PROJ_CLIP)
  assert largest_c > CELL_CLIP and np.isclose(np.abs(expected).max(), PROJ_CLIP)  # both clips bite
  np.testing.assert_allclose(apply(x_BLD, [L, L]), expected, rtol=1e-4, atol=1e-5)


def test_padding_gives_the_truncated_rows_states_and_zeros_after():
  _, x_BLD, apply = _setup()
  lengths = [L, 3]
  padded = apply(x_BLD, lengths)
  for b, n in enumerate(lengths):
    alone = apply(x_BLD[b:b + 1, :n], [n])[0]
    np.testing.assert_allclose(padded[b, :n], alone, rtol=1e-5, atol=1e-6)
    assert not padded[b, n:].any()


def test_reverse_is_the_forward_lstm_over_each_reversed_row():
  params, x_BLD, _ = _setup()
  forward = lstm.LSTM(S, P, CELL_CLIP, PROJ_CLIP)
  backward = lstm.LSTM(S, P, CELL_CLIP, PROJ_CLIP, reverse=True)
  lengths = np.array([5, 2])
  x_rev = x_BLD.copy()
  for b, n in enumerate(lengths):
    x_rev[b, :n] = x_BLD[b, :n][::-1]
  h_rev = np.asarray(jax.jit(forward.apply)({'params': params}, x_rev, lengths))
  expected = np.zeros_like(h_rev)
  for b, n in enumerate(lengths):
    expected[b, :n] = h_rev[b, :n][::-1]
  got = np.asarray(jax.jit(backward.apply)({'params': params}, x_BLD, lengths))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # The last real position has seen only itself: its state is the first step's.
  first_step = np.asarray(jax.jit(forward.apply)({'params': params}, x_BLD[:, 4:5],
                                                  np.array([1, 1])))
  np.testing.assert_allclose(got[0, 4], first_step[0, 0], rtol=1e-5, atol=1e-6)


def test_reverse_within_lengths_by_hand():
  x = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
  got = lstm.reverse_within_lengths(x, jnp.array([3, 1, 0]))
  np.testing.assert_array_equal(got, [[3, 2, 1, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
  # Trailing feature axes move with their position.
  x_BL2 = jnp.stack([x, -x], axis=-1)
  got = lstm.reverse_within_lengths(x_BL2, jnp.array([4, 2, 3]))
  np.testing.assert_array_equal(got[..., 0], [[4, 3, 2, 1], [6, 5, 7, 8], [11, 10, 9, 12]])
  np.testing.assert_array_equal(got[..., 1], -got[..., 0])


def test_hand_written_gradient_matches_autodiff_of_the_loop():
  # Clipping that bites, with and without a projection, and skipped steps: padding, and
  # a gap inside row 1 (which no batch has, but the state must carry over it as well).
  keys = jax.random.split(jax.random.PRNGKey(2), 4)
  valid_LB = jnp.array([[True] * L, [True, True, False, True, True, False, False]]).T
  z_LBGS = jax.random.normal(keys[0], (L, B, 4, S)) * 2.0
  for projection_SP, width in ((jax.random.normal(keys[1], (S, P)), P), (None, S)):
    recurrent_PGS = jax.random.normal(keys[2], (width, 4, S)) * 0.5
    dout_LBP = jax.random.normal(keys[3], (L, B, width))
    # The final state's gradient too (CoVe's decoder starts from it): row 1 ends in a skip.
    dc_BS, dh_BP = (jax.random.normal(k, shape) for k, shape in zip(
        jax.random.split(keys[3]), ((B, S), (B, width))))

    def loss(recurrence, z, recurrent, projection):
      out, (c, h) = recurrence(z, valid_LB, recurrent, projection, 1.0, CELL_CLIP,
                               2.0 * PROJ_CLIP)
      return (out * dout_LBP).sum() + (c * dc_BS).sum() + (h * dh_BP).sum()

    autodiff = lambda *a: loss(lambda *b: lstm._scan(*b)[:2], *a)  # noqa: E731
    by_hand = functools.partial(loss, lstm._recurrence)
    want, have = (jax.jit(jax.grad(f, argnums=(0, 1, 2)))(z_LBGS, recurrent_PGS, projection_SP)
                  for f in (autodiff, by_hand))
    for w, h in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(have)):
      assert np.abs(w).max() > 0
      np.testing.assert_allclose(h, w, rtol=2e-4, atol=2e-5)


def _fsdp_step(layer, params, x_BLD, lengths, devices, mesh_cfg):
  """The layer's jitted loss and gradients on a mesh of `devices` under the configs' rules,
  with the parameters and batch placed (abstractly where `params` is abstract)."""
  rules = elmo_config.get_config('tiny').logical_axis_rules
  mesh = sharding.make_mesh(mesh_cfg, devices)
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(layer.init, jax.random.PRNGKey(1), x_BLD, lengths)['params']
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  batch = NamedSharding(mesh, PartitionSpec(sharding.BATCH_AXES))

  def loss(params, x_BLD):
    with nn.logical_axis_rules(rules):
      return (layer.apply({'params': params}, x_BLD, lengths) ** 2).sum()
  place = lambda x, s: (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
                        if params is None else jax.device_put(x, s))
  args = (jax.tree.map(place, params or nn.meta.unbox(abstract), shardings), place(x_BLD, batch))
  return mesh, jax.jit(jax.value_and_grad(loss)), args


def test_fsdp_computes_the_same_and_gathers_the_loops_kernels_before_it(monkeypatch):
  """On a data x fsdp x tensor mesh (the configs' rules) the layer gives one device's outputs
  and gradients; compiled for a TPU, no all-gather runs inside the time loop: the kernels it
  uses are gathered along FSDP's axis before it (XLA gathered them at every step: ELMo at
  fsdp=16 on v5e-16, 1.3 GiB per train step)."""
  layer = lstm.LSTM(S, 8, CELL_CLIP, PROJ_CLIP)  # the projection (8) splits over fsdp
  x_BLD = jax.random.normal(jax.random.PRNGKey(0), (4, L, D))
  lengths = jnp.array([L, 3, L, 5])
  params = nn.meta.unbox(layer.init(jax.random.PRNGKey(1), x_BLD, lengths)['params'])
  expected = jax.jit(jax.value_and_grad(
      lambda p, x: (layer.apply({'params': p}, x, lengths) ** 2).sum()))(params, x_BLD)
  mesh, step, args = _fsdp_step(layer, params, x_BLD, lengths, jax.devices(),
                                (('data', 2), ('fsdp', 2), ('tensor', 2)))
  with jax.set_mesh(mesh):
    got = step(*args)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

  for name, value in aot.QUIET_LIBTPU.items():
    monkeypatch.setenv(name, value)
  _, tpus = aot.topology_devices('v4:2x2x1')
  mesh, step, args = _fsdp_step(layer, None, x_BLD, lengths, tpus,
                                (('data', 1), ('fsdp', 4), ('tensor', 1)))
  with jax.set_mesh(mesh):
    hlo_text = step.lower(*args).compile().as_text()
  instructions = hlo.hlo_instructions(hlo_text)
  assert any(times == L for *_, times in instructions)  # the time loop's body was found
  in_loops = [(opcode, shapes) for _, shapes, opcode, _, times in instructions
              if times > 1 and opcode.removesuffix('-start') in hlo.COLLECTIVES]
  assert not in_loops, in_loops
