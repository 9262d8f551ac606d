"""The fused attention paths checked against XLA's attention on this CPU, as the models call them.

TPU: the Pallas flash kernel runs in Pallas' TPU interpret mode, which executes the kernel's
own code (its tiles, online softmax, segment and causal masks, backward kernels): outputs and
gradients on each device's shard of the batch and heads under shard_map (layers.flash_attention)
and whole models' training gradients. GPU: cuDNN runs on NVIDIA GPUs only; the arguments the
models give it (lengths, masks, causality, scale, layout) are run by XLA's implementation of the
same call, so the two paths cannot drift apart.
"""

import dataclasses
import importlib

import flax.linen as nn
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from configs import bert_base
from configs import common
from configs import gpt
from configs import transformer_wmt
import input_pipeline
from models import layers
from trainer import sharding
import trainer.checks

# Largest |kernel - XLA| allowed, in units of the largest |XLA| entry of the compared array.
# Float32: both are exact softmaxes up to rounding (seen: below 1e-6). Bfloat16: both round
# their inputs and probabilities to 8 bits of mantissa in different places (seen: below 1e-2).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _ids(rows, length):
  """Segment ids (B, length) from each row's (segment, count) runs, then padding (id 0)."""
  ids = np.zeros((len(rows), length), np.int32)
  for b, runs in enumerate(rows):
    at = 0
    for segment, count in runs:
      ids[b, at:at + count] = segment
      at += count
  return jnp.asarray(ids)


# Who sees whom in each family (models/bert.py, gpt.py, transformer.py), over two 128-tiles
# (and one for the Transformer's target side): runs cross tile edges; rows end in padding.
MASKS = {
    'bert_padding': lambda: layers.SegmentMask(
        _ids([[(1, 200)], [(1, 77)]], 256), _ids([[(1, 200)], [(1, 77)]], 256),
        right_padded=True),
    'gpt_packed_causal': lambda: layers.SegmentMask(
        _ids([[(1, 100), (2, 60), (3, 96)], [(1, 5), (2, 140), (3, 40)]], 256),
        _ids([[(1, 100), (2, 60), (3, 96)], [(1, 5), (2, 140), (3, 40)]], 256), causal=True),
    'transformer_cross': lambda: layers.SegmentMask(  # target pieces attend to their sources
        _ids([[(1, 50), (2, 70)], [(1, 9), (2, 30), (3, 40)]], 128),
        _ids([[(1, 120), (2, 100)], [(1, 20), (2, 50), (3, 150)]], 256)),
}


def _mesh():
  """The batch over data x fsdp, the heads over tensor, as the loop's mesh. Four devices, not
  the tests' eight: interpret mode meets every device at a barrier inside each kernel call, and
  on a 2-core CPU the runtime ran eight devices' calls at once only with a deadlock."""
  return sharding.make_mesh((('data', 1), ('fsdp', 2), ('tensor', 2)), jax.devices()[:4])


def _rules():
  config = bert_base.get_config('tiny')
  common.set_mesh_and_rules(config)
  return config.logical_axis_rules


def _inputs(mask, dtype, heads=2, head_dim=64):
  (B, L), S = mask.q_BL.shape, mask.kv_BS.shape[1]
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, L, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (B, S, heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (B, S, heads, head_dim), dtype)
  cotangent = jax.random.normal(keys[3], (B, L, heads, head_dim), jnp.float32)
  return q, k, v, cotangent


def _output_and_grads(attention, q, k, v, cotangent, real_BL, with_jaxpr=False):
  """The attention output and the gradients of <output, cotangent> over the real queries
  (padding queries' outputs are never read) with respect to q, k and v, all in float32; with
  `with_jaxpr`, also the text of the jaxpr that was compiled for them (one trace for both)."""
  def loss(q, k, v):
    out = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * cotangent * real_BL[:, :, None, None]), out
  traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True)).trace(q, k, v)
  grads, out = traced.lower().compile()(q, k, v)
  as_f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
  results = [as_f32(out) * np.asarray(real_BL)[:, :, None, None]] + [as_f32(g) for g in grads]
  return (results, str(traced.jaxpr)) if with_jaxpr else results


def _flash(mask):
  return lambda q, k, v: layers.flash_attention(q, k, v, mask)


def _xla(mask, dense=None, scale=None):
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask.dense() if dense is None else dense, scale=scale)


def _within(got, expected, tolerance):
  return all(np.abs(g - e).max() <= tolerance * np.abs(e).max() for g, e in zip(got, expected))


def _wrong_variants(mask, head_dim):
  """XLA's attention with one convention wrong each: what a kernel call that got it wrong
  would compute. The tolerance must tell every one of them from the right answer."""
  dense = mask.dense()
  L, S = dense.shape[-2:]
  real_q, real_kv = (mask.q_BL > 0)[:, None, :, None], (mask.kv_BS > 0)[:, None, None, :]
  causal = jnp.tril(jnp.ones((L, S), bool)) if mask.causal else True
  wrong_masks = {'padding keys visible': (dense | real_q) & causal,
                 'segments ignored': real_q & real_kv & causal}
  if mask.causal:
    unmasked_future = dataclasses.replace(mask, causal=False).dense()
    wrong_masks.update({'causal off': unmasked_future,
                        'diagonal hidden': dense & ~jnp.eye(L, S, dtype=bool),
                        'one future key seen': unmasked_future & jnp.tril(jnp.ones((L, S), bool), 1)})
  elif L == S:
    wrong_masks['causal on'] = dataclasses.replace(mask, causal=True).dense()
  variants = {'scale 1': _xla(mask, scale=1.0), 'scale 1/K': _xla(mask, scale=1.0 / head_dim)}
  for name, wrong in wrong_masks.items():
    if not bool(jnp.array_equal(wrong & real_q, dense)):  # a convention this mask exercises
      variants[name] = _xla(mask, dense=wrong)
  return variants


def _check_kernel(mask, dtype, heads=2, head_dim=64):
  q, k, v, cotangent = _inputs(mask, dtype, heads, head_dim)
  real_BL = (mask.q_BL > 0).astype(jnp.float32)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()), pltpu.force_tpu_interpret_mode():
    got, jaxpr = _output_and_grads(_flash(mask), q, k, v, cotangent, real_BL, with_jaxpr=True)
  assert 'pallas_call' in jaxpr  # not XLA's fallback
  # The reference: XLA's attention in float32 on the same (rounded) inputs.
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  expected = _output_and_grads(_xla(mask), *f32, cotangent, real_BL)
  for what, g, e in zip(('output', 'dq', 'dk', 'dv'), got, expected):
    error = np.abs(g - e).max() / np.abs(e).max()
    assert error <= TOLERANCE[dtype], f'{what}: error {error:.2e} of its largest entry'


@pytest.mark.parametrize('name,dtype', [
    (name, dtype) if dtype == jnp.float32 or name == 'gpt_packed_causal'
    else pytest.param(name, dtype, marks=pytest.mark.slow)  # bfloat16: one mask in the fast tier
    for name in MASKS for dtype in (jnp.float32, jnp.bfloat16)])
def test_flash_kernel_matches_xla_attention_with_gradients(name, dtype):
  _check_kernel(MASKS[name](), dtype)


@pytest.mark.parametrize('name', MASKS)
def test_the_tolerance_tells_every_wrong_convention_apart(name):
  mask = MASKS[name]()
  q, k, v, cotangent = _inputs(mask, jnp.float32)
  real_BL = (mask.q_BL > 0).astype(jnp.float32)
  expected = _output_and_grads(_xla(mask), q, k, v, cotangent, real_BL)
  variants = _wrong_variants(mask, q.shape[-1])
  assert len(variants) >= 4
  for wrong, attention in variants.items():
    assert not _within(_output_and_grads(attention, q, k, v, cotangent, real_BL), expected,
                       max(TOLERANCE.values())), f'the tolerance does not tell "{wrong}" apart'


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
def test_flash_kernel_matches_xla_attention_at_gpt_base_shapes(dtype):
  """512 tokens in four tiles per row, packed documents, 128-wide heads."""
  ids = _ids([[(1, 300), (2, 100), (3, 60)], [(1, 17), (2, 495)]], 512)
  _check_kernel(layers.SegmentMask(ids, ids, causal=True), dtype, heads=4, head_dim=128)


# The models' own masks (BERT's padded rows, GPT's packed documents or rows of one, the
# Transformer's packed pairs), from each pipeline's example batch at one tile of 128 tokens.
FAMILIES = {'bert_padded': (bert_base, True), 'gpt_packed': (gpt, True),
            'gpt_rows': (gpt, False), 'transformer_packed': (transformer_wmt, True)}


def _family(name):
  """The tiny config of a family, its example batch and parameters with lively attention."""
  module, packed = FAMILIES[name]
  config = module.get_config('tiny')
  config.model.attention_dropout_rate = 0.0  # the fused kernels have none (check_attention)
  config.data.max_seq_length = 128  # one tile: shorter rows take XLA's path in flash_attention
  batch = dict(input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2))
  if not packed:
    batch.pop('segment_ids')  # rows of one document: causal alone
  model = importlib.import_module(f'models.{config.model_name}').Model(
      trainer.checks.model_config(config, 'cpu'))
  params = model.init(jax.random.key(0), batch)['params']
  # At BERT's and GPT's initialization (normal, 0.02) the attention logits are near 0 and any
  # mask or scale gives about uniform weights; query and key kernels 5x larger give logits of
  # about unit spread (measured: 0.9-1.25). The Transformer's Glorot kernels give that spread
  # already (0.9-1.5; 5x larger, 24-37, saturated the softmax, and there the two paths'
  # cross-attention key gradients differed by up to 2.8e-5 of the largest one: over the bound).
  scale = 1 if config.model_name == 'transformer' else 5
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * scale if {'query', 'key'} & {getattr(k, 'key', None) for k in path}
      else x, params)
  return config, batch, params


def _loss_and_grads(config, kernel, params, batch):
  """The jitted family's training loss (its objective over its model's outputs) and gradients."""
  model = importlib.import_module(f'models.{config.model_name}').Model(
      dataclasses.replace(trainer.checks.model_config(config, 'cpu'), attention=kernel))
  objective = importlib.import_module(f'objectives.{config.objective}')

  def loss(params):
    outputs = model.apply({'params': params}, batch, deterministic=True)
    return objective.loss_fn(outputs, batch, **config.get('loss', {}))[0]
  return jax.jit(jax.value_and_grad(loss))


def _assert_same_training(got, expected):
  """Float32 throughout: the loss and every gradient agree to rounding (seen: 1e-7 of the
  largest gradient entry); one wrong mask or a 1% wrong scale moves them by far more."""
  (got_loss, got_grads), (expected_loss, expected_grads) = got, expected
  np.testing.assert_allclose(got_loss, expected_loss, rtol=1e-6)
  scale = max(np.abs(e).max() for e in jax.tree.leaves(expected_grads))
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                          jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # the fast tier checks the kernel as layers.flash_attention runs it, above
@pytest.mark.parametrize('name', ['bert_padded', 'gpt_packed', 'transformer_packed'])
def test_models_train_the_same_with_the_flash_kernel(name):
  config, batch, params = _family(name)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()), pltpu.force_tpu_interpret_mode():
    step = _loss_and_grads(config, 'flash', params, batch)
    assert 'pallas_call' in str(jax.make_jaxpr(step)(params))
    got = step(params)
  _assert_same_training(got, _loss_and_grads(config, 'xla', params, batch)(params))


@pytest.fixture
def cudnn_on_xla(monkeypatch):
  """jax.nn.dot_product_attention with implementation='cudnn' runs XLA's implementation (cuDNN
  runs on NVIDIA GPUs only): what the models pass to cuDNN, computed by XLA."""
  original = jax.nn.dot_product_attention
  calls = []

  def attention(*args, implementation=None, **kwargs):
    calls.append(implementation)
    return original(*args, implementation='xla' if implementation == 'cudnn' else implementation,
                    **kwargs)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', attention)
  return calls


@pytest.mark.parametrize('name', [name if name == 'gpt_rows' else pytest.param(
    name, marks=pytest.mark.slow) for name in FAMILIES])
def test_models_give_cudnn_the_xla_paths_masks_and_scale(name, cudnn_on_xla):
  config, batch, params = _family(name)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()):
    got = _loss_and_grads(config, 'cudnn', params, batch)(params)
    assert 'cudnn' in cudnn_on_xla
    _assert_same_training(got, _loss_and_grads(config, 'xla', params, batch)(params))


@pytest.fixture
def cudnn_dropout_on_xla(monkeypatch):
  """cuDNN's attention with dropout (layers.cudnn_fmha) run by XLA's implementation, its dropout
  left out: the masks, lengths, causality and scale the models give it, computed by XLA, and the
  seeds and rates they pass (cuDNN's dropout itself: peers/attention_dropout_gpu.py on a GPU)."""
  types = layers.cudnn_fmha.MaskType
  calls = []

  def attention(query, key, value, bias, mask, q_seqlen, kv_seqlen, *, scale, mask_type, seed,
                dropout_rate, qkv_layout):
    calls.append({'seed': seed, 'rate': dropout_rate, 'scale': scale, 'layout': qkv_layout})
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, query_seq_lengths=q_seqlen,
        key_value_seq_lengths=kv_seqlen, scale=scale, implementation='xla',
        is_causal=mask_type in (types.CAUSAL, types.PADDING_CAUSAL))

  monkeypatch.setattr(layers.cudnn_fmha, 'dot_product_attention', attention)
  return calls


@pytest.mark.parametrize('name', ['gpt_rows', pytest.param('bert_padded', marks=pytest.mark.slow),
                                  pytest.param('gpt_packed', marks=pytest.mark.slow)])
def test_cudnn_dropout_gets_the_xla_paths_masks_and_scale_and_a_seed_per_layer(
    name, cudnn_dropout_on_xla):
  config, batch, params = _family(name)
  config.model.dropout_rate = 0.0  # the attention's dropout alone
  module = importlib.import_module(f'models.{config.model_name}')
  objective = importlib.import_module(f'objectives.{config.objective}')

  def training(kernel, rate):
    model = module.Model(dataclasses.replace(trainer.checks.model_config(config, 'cpu'),
                                             attention=kernel, attention_dropout_rate=rate))

    def loss(params):
      outputs = model.apply({'params': params}, batch, deterministic=False,
                            rngs={'dropout': jax.random.key(1)})
      return objective.loss_fn(outputs, batch)[0]
    return jax.jit(jax.value_and_grad(loss))(params)

  with jax.set_mesh(_mesh()), nn.logical_axis_rules(_rules()):
    got = training('cudnn', 0.1)  # dropout, which the stand-in leaves out
    expected = training('xla', 0.0)
  _assert_same_training(got, expected)
  layers_count = config.model.num_layers
  assert len(cudnn_dropout_on_xla) == layers_count  # traced once, each layer's call
  assert len({c['seed'] for c in cudnn_dropout_on_xla}) == layers_count  # a seed each
  head_dim = config.model.hidden_size // config.model.num_heads
  for call in cudnn_dropout_on_xla:
    assert (call['rate'], call['layout']) == (0.1, 'BTNH')
    assert call['scale'] == pytest.approx(head_dim ** -0.5)
