"""Flash attention with the dropout in the kernel (models/flash_dropout.py), in Pallas' interpret
mode on this CPU: the kernels' outputs and gradients against the same function in XLA ops with
the same counted mask (models/dropout.py's: tests/test_dropout.py checks its definition and
statistics), and the models' use of it (a mask per layer, per step and per shard, drawn from the
step's RNG)."""

import dataclasses
import functools
import importlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import bert_base
from configs import common
from configs import gpt
import input_pipeline
from models import flash_dropout
from models import layers
from test_fused_attention import _ids  # segment ids (B, length) from each row's runs
from trainer import sharding
import trainer.checks

TOLERANCE = 1e-5  # float32: the kernels and XLA's softmax agree to rounding (seen: below 1e-6)


# BERT's padded rows, GPT's packed documents and a GPT row of one document, the Transformer's
# cross attention: runs cross the tiles' edges (128 queries and 64 keys forward, 64 and 64
# backward) and rows end in padding; tiles whose every query sees every key, whose masking the
# kernels leave out, and the others (test_whole_tiles_are_those_whose_queries_see_every_key).
# With each, the backward kernel it takes: a (b, h)'s 128 queries in one tile ('all', with
# WHOLE_QUERIES 128), as many query tiles as key tiles ('qkv'), or dQ's and dK's and dV's
# kernels ('q', 'kv').
MASKS = {
    'bert_padding': (lambda: layers.SegmentMask(
        _ids([[(1, 200)], [(1, 77)]], 256), _ids([[(1, 200)], [(1, 77)]], 256),
        kernel='triton', right_padded=True), 'qkv'),
    'bert_padding_128': (lambda: layers.SegmentMask(
        _ids([[(1, 100)], [(1, 77)]], 128), _ids([[(1, 100)], [(1, 77)]], 128),
        kernel='triton', right_padded=True), 'all'),
    'gpt_packed_causal': (lambda: layers.SegmentMask(
        _ids([[(1, 100), (2, 60), (3, 96)], [(1, 5), (2, 140), (3, 40)]], 256),
        _ids([[(1, 100), (2, 60), (3, 96)], [(1, 5), (2, 140), (3, 40)]], 256),
        causal=True, kernel='triton'), 'qkv'),
    'gpt_one_document_causal': (lambda: layers.SegmentMask(
        _ids([[(1, 256)], [(1, 230)]], 256), _ids([[(1, 256)], [(1, 230)]], 256), causal=True,
        kernel='triton'), 'qkv'),
    'gpt_packed_causal_128': (lambda: layers.SegmentMask(
        _ids([[(1, 50), (2, 30), (3, 48)], [(1, 5), (2, 70), (3, 20)]], 128),
        _ids([[(1, 50), (2, 30), (3, 48)], [(1, 5), (2, 70), (3, 20)]], 128),
        causal=True, kernel='triton'), 'all'),
    'transformer_cross': (lambda: layers.SegmentMask(
        _ids([[(1, 50), (2, 70)], [(1, 9), (2, 30), (3, 40)]], 128),
        _ids([[(1, 120), (2, 100)], [(1, 20), (2, 50), (3, 150)]], 256), kernel='triton'), 'all'),
    'transformer_cross_more_queries': (lambda: layers.SegmentMask(
        _ids([[(1, 120), (2, 100)], [(1, 20), (2, 50), (3, 150)]], 256),
        _ids([[(1, 50), (2, 70)], [(1, 9), (2, 30), (3, 40)]], 128), kernel='triton'), 'q'),
}


def _mesh():
  """The batch over fsdp, the heads over tensor, as the loop's mesh (four devices)."""
  return sharding.make_mesh((('data', 1), ('fsdp', 2), ('tensor', 2)), jax.devices()[:4])


def _rules():
  config = bert_base.get_config('tiny')
  common.set_mesh_and_rules(config)
  return config.logical_axis_rules


def _inputs(mask, heads=2, head_dim=16):
  (B, L), S = mask.q_BL.shape, mask.kv_BS.shape[1]
  rngs = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(rngs[0], (B, L, heads, head_dim)) * 2  # logits of about unit spread
  k = jax.random.normal(rngs[1], (B, S, heads, head_dim)) * 2
  v = jax.random.normal(rngs[2], (B, S, heads, head_dim))
  # Padding queries' outputs are never read: the loss gives them no gradient.
  cotangent = jax.random.normal(rngs[3], q.shape) * (mask.q_BL > 0)[:, :, None, None]
  keys = flash_dropout.dropout_keys(rngs[4], B, heads)
  return q, k, v, cotangent, keys


def _output_and_grads(attention, q, k, v, cotangent, real_BL, with_jaxpr=False):
  """The output over the real queries and the gradients of <output, cotangent>; with
  `with_jaxpr`, also the text of the jaxpr that was compiled for them (one trace for both)."""
  def loss(q, k, v):
    out = attention(q, k, v)
    return jnp.sum(out * cotangent), out
  traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True)).trace(q, k, v)
  grads, out = traced.lower().compile()(q, k, v)
  results = [np.asarray(out) * np.asarray(real_BL)[:, :, None, None]] + [np.asarray(g)
                                                                         for g in grads]
  return (results, str(traced.jaxpr)) if with_jaxpr else results


def _errors(got, expected):
  return [float(np.abs(g - e).max() / np.abs(e).max()) for g, e in zip(got, expected)]


@pytest.mark.parametrize('rate', [0.1, pytest.param(0.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize('name', MASKS)
def test_kernels_match_xla_with_the_same_mask_with_gradients(name, rate, monkeypatch):
  make_mask, backward = MASKS[name]
  if backward == 'all':  # opt-in until a GPU checks it
    monkeypatch.setattr(flash_dropout, 'WHOLE_QUERIES', 128)
  mask = make_mask()
  q, k, v, cotangent, keys = _inputs(mask)
  real_BL = (mask.q_BL > 0).astype(jnp.float32)
  kernel = lambda keys: lambda q, k, v: layers.triton_attention(q, k, v, mask, rate, keys)  # noqa
  reference = lambda keys: lambda q, k, v: flash_dropout.reference(  # noqa: E731
      q, k, v, mask.q_BL, mask.kv_BS, keys, rate, mask.causal)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()):
    got, jaxpr = _output_and_grads(kernel(keys), q, k, v, cotangent, real_BL, with_jaxpr=True)
  assert 'flash_dropout_forward' in jaxpr  # no fallback
  taken = re.findall(r'name=flash_dropout_backward_(\w+)', jaxpr)
  assert set(taken) == ({'q', 'kv'} if backward == 'q' else {backward}), taken
  expected = _output_and_grads(reference(keys), q, k, v, cotangent, real_BL)
  for what, error in zip(('output', 'dq', 'dk', 'dv'), _errors(got, expected)):
    assert error <= TOLERANCE, f'{what}: error {error:.2e} of its largest entry'
  if rate:  # the tolerance tells another mask apart, in each of the four
    other = _output_and_grads(reference(keys + 1), q, k, v, cotangent, real_BL)
    assert min(_errors(other, expected)) > 100 * TOLERANCE


def test_whole_tiles_are_those_whose_queries_see_every_key():
  """_whole_tiles, the tiles whose masking the kernels leave out: exactly those of the dense mask
  (`visible`) that are all seen, at the forward's, the backward's and the one-tile backward's
  tiles; the masks above hold both kinds (so their kernels' tests take both branches)."""
  # pylint: disable-next=protected-access
  whole_tiles, kv_ids = flash_dropout._whole_tiles, flash_dropout._kv_ids
  kinds = set()
  for make_mask, _ in MASKS.values():
    mask = make_mask()
    (B, L), S = mask.q_BL.shape, mask.kv_BS.shape[1]
    seen = np.asarray(flash_dropout.visible(mask.q_BL, mask.kv_BS, mask.causal))[:, 0]
    for block_q, block_k in (flash_dropout.FORWARD_BLOCKS, flash_dropout.BACKWARD_BLOCKS, (L, 64)):
      whole = np.asarray(whole_tiles(mask.q_BL.astype(jnp.int32), kv_ids(mask.kv_BS), block_q,
                                     block_k, mask.causal))
      tiles = seen.reshape(B, L // block_q, block_q, S // block_k, block_k).all(axis=(2, 4))
      np.testing.assert_array_equal(whole, tiles.astype(np.int32))
      kinds |= {(mask.causal, bool(x)) for x in whole.flat}
  assert kinds == {(False, True), (False, False), (True, True), (True, False)}


def test_a_query_that_sees_no_key_spreads_evenly_over_the_key_tiles():
  """A padding query's output (never read) is reference's where the kernel visits every key:
  its exponents are 0 in each key tile, so the tiles weigh alike (UNSEEN times the scale is
  exact; -1e9's product rounds by up to 8, which the exponent's fused multiply-add kept)."""
  mask = MASKS['bert_padding'][0]()  # 256 keys: four forward tiles
  q, k, v, _, keys = _inputs(mask)
  got = flash_dropout.attention(q, k, v, mask.q_BL, mask.kv_BS, keys, 0.1, False)
  expected = flash_dropout.reference(q, k, v, mask.q_BL, mask.kv_BS, keys, 0.1, False)
  padding = np.asarray(mask.q_BL) == 0
  assert padding.sum() == 56 + 179
  assert _errors([np.asarray(got)[padding]], [np.asarray(expected)[padding]])[0] <= TOLERANCE


@pytest.mark.parametrize('name,whole_queries,backward_blocks', [
    ('bert_padding', 0, (64, 64)), ('gpt_packed_causal_128', 128, (64, 64)),
    pytest.param('bert_padding', 0, (64, 32), marks=pytest.mark.slow)])
def test_self_attention_reads_q_k_v_in_place_as_attention_their_slices(
    name, whole_queries, backward_blocks, monkeypatch):
  """flash_dropout.self_attention of one (B, L, 3, H, K) array: the output and the gradient
  (one array) of `attention` of its three slices, with the same masks; in the kernels' one
  'qkv' backward and in the 'all' one (WHOLE_QUERIES). Where the backward's tiles differ (no
  single array of dq, dk and dv a tile) it gives `attention` the slices: there the jaxpr's is
  what this checks (the numbers are the same computation's)."""
  monkeypatch.setattr(flash_dropout, 'WHOLE_QUERIES', whole_queries)
  monkeypatch.setattr(flash_dropout, 'BACKWARD_BLOCKS', backward_blocks)
  mask = MASKS[name][0]()
  q, k, v, cotangent, keys = _inputs(mask)
  qkv = jnp.stack([q, k, v], axis=2)
  fused = lambda qkv: flash_dropout.self_attention(  # noqa: E731
      qkv, mask.q_BL, mask.kv_BS, keys, 0.1, mask.causal)
  sliced = lambda qkv: flash_dropout.attention(  # noqa: E731
      qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask.q_BL, mask.kv_BS, keys, 0.1, mask.causal)
  takes_one_array = backward_blocks[0] == backward_blocks[1]
  assert ('name=_self_attention' in str(jax.make_jaxpr(fused)(qkv))) == takes_one_array
  real = (mask.q_BL > 0)[:, :, None, None]
  results = []
  for attend in (fused, sliced):
    out, vjp = jax.vjp(attend, qkv)
    results.append((np.asarray(out * real), np.asarray(vjp(cotangent.astype(out.dtype))[0])))
  for got, expected in zip(*results):
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * np.abs(expected).max())


def test_a_self_attention_takes_q_k_v_from_one_matmul_with_the_same_parameters():
  """MultiHeadAttention in our kernels as a self-attention (kv is x): q, k and v come from one
  matmul of the three projections' kernels and biases stacked at run time, and the kernels read
  them in place. The parameters are the same as every other path's (a checkpoint's), and the
  output and gradients those of the three projections' path with the same masks (kv a copy of
  x, which the layer cannot tell is x)."""
  mask = MASKS['bert_padding'][0]()
  (B, L), D = mask.q_BL.shape, 32
  mha = layers.MultiHeadAttention(2, 16, 0.1)
  x = jax.random.normal(jax.random.key(0), (B, L, D))
  init = lambda m: mha.init({'params': jax.random.key(1), 'dropout': jax.random.key(2)},  # noqa
                            x, x, m, deterministic=False)['params']
  params = init(mask)
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, init(mask.dense()))
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(init(mask.dense()))):
    np.testing.assert_array_equal(got, expected)
  real, weights = (mask.q_BL > 0)[:, :, None], jnp.cos(jnp.arange(D))

  def loss(params, x, fused):
    out = mha.apply({'params': params}, x, x if fused else x * 1.0, mask, deterministic=False,
                    rngs={'dropout': jax.random.key(3)})
    return jnp.sum(out * real * weights)

  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()):
    for fused in (True, False):
      jaxpr = str(jax.make_jaxpr(functools.partial(loss, fused=fused))(params, x))
      assert ('name=_self_attention' in jaxpr) == fused and 'flash_dropout_forward' in jaxpr
    got, expected = (jax.jit(jax.value_and_grad(functools.partial(loss, fused=fused),
                                                argnums=(0, 1)))(params, x)
                     for fused in (True, False))
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
  # Of the largest entry of all: the key bias's gradient is zero but for rounding (a softmax
  # does not see what it adds to every score of a row).
  scale = max(np.abs(e).max() for e in jax.tree.leaves(expected[1]))
  for g, e in zip(jax.tree.leaves(got[1]), jax.tree.leaves(expected[1])):
    np.testing.assert_allclose(g, e, rtol=0, atol=TOLERANCE * scale)


def test_the_output_shows_the_mask_of_keep_mask():
  """Queries and keys of zeros spread each query evenly over the keys; values of the identity
  then show, query by query, which keys were kept: exactly keep_mask's, scaled."""
  B, H, L = 1, 2, 128
  keys = flash_dropout.dropout_keys(jax.random.key(3), B, H)
  zeros, ones = jnp.zeros((B, L, H, L)), jnp.ones((B, L), jnp.int32)
  v = jnp.broadcast_to(jnp.eye(L)[None, :, None, :], (B, L, H, L))
  out = flash_dropout.attention(zeros, zeros, v, ones, ones, keys, 0.5, causal=False)
  kept = np.asarray(flash_dropout.keep_mask(keys, L, L, 0.5))  # (B, H, L, S)
  np.testing.assert_allclose(np.asarray(out).transpose(0, 2, 1, 3),
                             kept * flash_dropout.keep_scale(0.5) / L, rtol=1e-6)


@pytest.mark.parametrize('name', ['gpt_rows', 'gpt_rows_scanned',
                                  pytest.param('bert_padded', marks=pytest.mark.slow)])
def test_models_draw_a_mask_per_layer_and_step_from_the_steps_rng(name, monkeypatch):
  """The tiny family with model.attention=triton: its training loss and gradients on the
  four-device mesh equal those of the kernels' function in XLA ops on one device (the same
  masks; under scan_layers too, where the backward recomputes the forward's masks inside the
  scan), each layer draws its own keys, and the same RNG draws the same ones."""
  module = bert_base if name == 'bert_padded' else gpt
  config = module.get_config('tiny')
  config.data.max_seq_length = 128
  batch = dict(input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2))
  if name != 'bert_padded':
    batch.pop('segment_ids')  # rows of one document: causal alone
  model_module = importlib.import_module(f'models.{config.model_name}')
  objective = importlib.import_module(f'objectives.{config.objective}')
  model = model_module.Model(dataclasses.replace(
      trainer.checks.model_config(config, 'cpu'), attention='triton', attention_dropout_rate=0.1,
      scan_layers=name.endswith('scanned')))
  params = model.init(jax.random.key(0), batch)['params']
  drawn = []
  draw = flash_dropout.dropout_keys
  monkeypatch.setattr(flash_dropout, 'dropout_keys',
                      lambda *args: drawn.append(draw(*args)) or drawn[-1])

  def training(rng, model=model, kernels=False):
    def loss(params):
      outputs = model.apply({'params': params}, batch, deterministic=False,
                            rngs={'dropout': rng})
      return objective.loss_fn(outputs, batch)[0]
    traced = jax.jit(jax.value_and_grad(loss)).trace(params)  # one trace, read and compiled
    if kernels:
      assert 'pallas_call' in str(traced.jaxpr)
    return traced.lower().compile()(params)

  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()):
    got = training(jax.random.key(1), kernels=True)
  monkeypatch.setattr(flash_dropout, 'tiles', lambda *_: False)  # XLA ops, same masks
  expected = training(jax.random.key(1))
  (got_loss, got_grads), (expected_loss, expected_grads) = got, expected
  # XLA's attention (model.attention=xla, models/dropout.py's mask of the probabilities) drops
  # what the kernels drop for the same RNG: the same loss and gradients again.
  xla_loss, xla_grads = training(jax.random.key(1), model_module.Model(
      dataclasses.replace(model.config, attention='xla')))
  scale = max(np.abs(e).max() for e in jax.tree.leaves(expected_grads))
  for loss, grads in ((got_loss, got_grads), (xla_loss, xla_grads)):
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
      np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * scale)
  if name.endswith('scanned'):
    return  # the scan draws the layers' keys in one traced body (flax splits its RNG per layer)
  @jax.jit
  def drawn_keys(rng):  # the keys themselves, as the traced forward drew them
    drawn.clear()
    model.apply({'params': params}, batch, deterministic=False, rngs={'dropout': rng})
    return list(drawn)
  step1, again, step2 = (drawn_keys(jax.random.key(rng)) for rng in (1, 1, 2))
  layers_count = config.model.num_layers
  assert len(step1) == len(step2) == layers_count
  words = lambda keys: {tuple(np.asarray(k).ravel()) for k in keys}  # noqa: E731
  assert len(words(step1)) == layers_count  # a mask per layer
  assert words(step1) == words(again)  # from the RNG: a resumed step draws the same
  assert not words(step1) & words(step2)  # another step, other masks
