"""Transformer layers shared by BERT, GPT and the Transformer (Vaswani et al. 2017, sec. 3).

Kernels keep their full rank (e.g. the query kernel is (D, H, K)) and carry
logical axis names, so the mesh rules in the config can shard any of them.

Shape legend for names such as `x_BLD`:
  B batch, L length (queries), S length (keys/values), D model width,
  H heads, K head dim, F mlp width, V vocab, P predicted positions,
  C characters, T segment types.
"""

import functools
import math
import zlib
from typing import Any, Callable, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

try:  # an experimental module: a jax newer than the pin may move it (then model.attention=xla)
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
except ImportError:
  tpu_flash = None
try:  # below jax's public API: the only way to cuDNN's dropout (then it is refused in one line)
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fmha
except ImportError:
  cudnn_fmha = None

from models import flash_dropout
from models.dropout import Dropout
from models.dropout import dropout

Array = jax.Array
Initializer = Callable[..., Array]

NEG_INF = -1e9  # finite, so fully masked rows give a uniform softmax, not NaN


def check_heads(hidden_size: int, num_heads: int) -> None:
  """A model Config's check: the heads split the width evenly."""
  if hidden_size % num_heads:
    raise ValueError(f'model.hidden_size={hidden_size} is not divisible by '
                     f'model.num_heads={num_heads}: pick a head count that divides it.')


# 'flash': the Pallas TPU kernel; 'cudnn': cuDNN's fused (flash) attention on NVIDIA GPUs;
# 'triton': our Pallas flash attention with the dropout in the kernel, on NVIDIA GPUs.
FUSED_KERNELS = ('flash', 'cudnn', 'triton')
ATTENTION_KERNELS = ('auto', 'xla') + FUSED_KERNELS


def check_attention(attention: str, attention_dropout_rate: float) -> None:
  """A model Config's check of its attention kernel (checks.model_config resolves 'auto')."""
  if attention not in ATTENTION_KERNELS:
    raise ValueError(f'model.attention={attention!r}: use one of {ATTENTION_KERNELS}.')
  if attention == 'flash' and attention_dropout_rate:
    raise ValueError(f'model.attention=flash has no dropout on the attention probabilities '
                     f'but model.attention_dropout_rate={attention_dropout_rate}: set it to 0 or '
                     'use model.attention=xla (or triton or cudnn on NVIDIA GPUs).')
  if attention == 'cudnn' and attention_dropout_rate and cudnn_fmha is None:
    raise ValueError(f'model.attention=cudnn with model.attention_dropout_rate='
                     f'{attention_dropout_rate} needs jax._src.cudnn.fused_attention_stablehlo, '
                     f'which this jax ({jax.__version__}) lacks: use model.attention=xla.')


def truncated_normal(stddev: float) -> Initializer:
  """BERT's initializer: a normal truncated at two standard deviations."""
  return nn.initializers.truncated_normal(stddev)


def as_matrix(init: Initializer, in_axes: int) -> Initializer:
  """`init` drawn for the kernel as the matrix it multiplies by: its first `in_axes` axes the
  inputs, the rest the outputs. A fan-based initializer (Glorot) then counts the fans of that
  matrix: given a (D, H, K) kernel as it is, flax's takes the last two axes as the fans and D as
  a receptive field (the Transformer's query kernel came out 6x too small at 512 x 8 x 64).
  Normal and truncated-normal draws are the same values either way."""
  def init_matrix(key, shape, dtype=jnp.float32):
    inputs = math.prod(shape[:in_axes])
    return init(key, (inputs, math.prod(shape) // inputs), dtype).reshape(shape)
  return init_matrix


def _einsum_as_matmul(equation: str, x: Array, kernel: Array) -> Array:
  """einsum(equation, x, kernel); as one 2-D matmul when x's last axes contract with the
  kernel's first ones and the output is x's other axes, then the kernel's ('BLD,DHK->BLHK',
  'BLHK,HKD->BLD').

  Then XLA's CPU dots read x and the gradients in place; as a 3-D einsum their weight
  gradients first copied them into transposed layouts (BERT mini: 139 ms of the attention
  projections' backward against 68 ms).
  """
  inputs, out = equation.split('->')
  x_letters, kernel_letters = inputs.split(',')
  n = len([c for c in kernel_letters if c in x_letters])
  contracted = kernel_letters[:n]
  if (not n or not x_letters.endswith(contracted) or
      out != x_letters[:-n] + kernel_letters[n:] or len(set(equation) - set(',->')) !=
      len(x_letters) + len(kernel_letters) - n):
    return jnp.einsum(equation, x, kernel)
  lead, rest = x.shape[:-n], kernel.shape[n:]
  y = x.reshape(-1, math.prod(kernel.shape[:n])) @ kernel.reshape(-1, math.prod(rest))
  return y.reshape(*lead, *rest)


class Einsum(nn.Module):
  """A projection `einsum(equation, x, kernel) (+ bias)` with a named kernel.

  The bias covers the kernel axes that appear in the output, e.g.
  'BLD,DHK->BLHK' has a (H, K) bias.
  """
  equation: str
  shape: Sequence[int]
  axes: Sequence[str | None]
  use_bias: bool = True
  kernel_init: Initializer = truncated_normal(0.02)
  dtype: Any = jnp.float32
  bias_in_matmul: bool = False  # with a bias: _biased_matmul (GPU steps, before a custom call)

  @nn.compact
  def __call__(self, x: Array | None, weights: bool = False) -> Array | tuple[Array, Array]:
    """The projection of x; with `weights`, (kernel, bias) instead (x unused; bias None
    without one), for a caller that fuses projections into one matmul (MultiHeadAttention's
    q, k and v)."""
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(self.kernel_init, self.axes),
        tuple(self.shape), jnp.float32)
    if not self.use_bias:
      if weights:
        return kernel, None
      return _einsum_as_matmul(self.equation, x.astype(self.dtype), kernel.astype(self.dtype))
    kernel_letters = self.equation.split(',')[1].split('->')[0]
    out_letters = self.equation.split('->')[1]
    kept = [i for i, c in enumerate(kernel_letters) if c in out_letters]
    bias = self.param(
        'bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                     tuple(self.axes[i] for i in kept)),
        tuple(self.shape[i] for i in kept), jnp.float32)
    if weights:
      return kernel, bias
    if self.bias_in_matmul:
      return _biased_matmul(self.equation, x.astype(self.dtype), kernel, bias, self.dtype)
    y = _einsum_as_matmul(self.equation, x.astype(self.dtype), kernel.astype(self.dtype))
    return y + bias.astype(self.dtype)


def _biased_matmul(equation: str, x: Array, kernel: Array, bias: Array, dtype: Any) -> Array:
  """einsum(equation, x, kernel) + bias as one matmul: x gains a column of ones (and seven of
  zeros, to keep the width a multiple of 8) and the kernel the bias as its row for it.

  For an XLA GPU step whose projection feeds a custom call (cuDNN's attention), which takes
  no elementwise work into it: there the bias add was a pass of its own over the output and
  the bias gradient a column sum of its own; this way both are part of the matmuls, and the
  ones column part of the kernel that writes x (BERT-base, 256 x 128 on one H100, aot.py's
  estimate: 47.0 -> 45.5 ms). Only for x's last axis contracting with the kernel's first.
  """
  x_letters, kernel_letters = equation.split('->')[0].split(',')
  if kernel_letters[0] != x_letters[-1] or kernel_letters[1:2] and kernel_letters[1] in x_letters:
    raise ValueError(f'bias_in_matmul needs x\'s last axis alone contracted with the kernel\'s '
                     f'first, not {equation!r}.')
  ones = jnp.ones((*x.shape[:-1], 1), dtype)
  zeros = jnp.zeros((*x.shape[:-1], 7), dtype)
  x = jnp.concatenate([x, ones, zeros], axis=-1)
  kernel = jnp.concatenate([kernel, bias[None], jnp.zeros((7, *bias.shape), kernel.dtype)])
  return _einsum_as_matmul(equation, x, kernel.astype(dtype))


class Embed(nn.Module):
  """A lookup table (num, D) that can also score vectors against its rows."""
  num_embeddings: int
  features: int
  axes: tuple[str | None, str | None] = ('vocab', 'embed')
  embedding_init: Initializer = truncated_normal(0.02)
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = self.param(
        'embedding', nn.with_logical_partitioning(self.embedding_init, self.axes),
        (self.num_embeddings, self.features), jnp.float32)

  def __call__(self, ids: Array) -> Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, x_BPD: Array, table_VD: Array | None = None) -> Array:
    """Scores against every row in float32 (tied output layer); `table_VD` for the rows of
    output_table() changed (GPT's dropped table)."""
    table_VD = self.output_table() if table_VD is None else table_VD
    return jnp.einsum('...D,VD->...V', x_BPD.astype(jnp.float32), table_VD.astype(jnp.float32))

  def output_table(self) -> Array:
    """The table as the tied output layer reads it (attend, objectives.lm.output_layer_loss)."""
    table_VD = self.embedding
    if _split_both_ways(self.axes):
      # Gathered over `embed` first: with the table sharded on both axes, XLA (jax 0.10.2)
      # gets the gradient of the activations wrong on a data x fsdp x tensor mesh
      # (tests/test_train.py catches it). Only then: the constraint also makes XLA sum the
      # table's gradient whole over every device (an all-reduce across nodes) where it
      # otherwise sums each device's FSDP shard over the data axis alone.
      table_VD = nn.with_logical_constraint(table_VD, (self.axes[0], None))
    return table_VD


def _split_both_ways(axes: Sequence[str | None]) -> bool:
  """Whether the current mesh and logical axis rules split a 2-D parameter along both axes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  ways = []
  for mesh_axes in nn.logical_to_mesh_axes(tuple(axes)):
    mesh_axes = (() if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str)
                 else tuple(mesh_axes))
    ways.append(math.prod(mesh.shape[a] for a in mesh_axes))
  return all(w > 1 for w in ways)


def _gelu(x: Array, approximate: bool = False) -> Array:
  """GELU (Hendrycks & Gimpel 2016): exact as google-research/bert's release
  wrote it, 0.5 x (1 + erf(x / sqrt 2)) (its later code, and OpenAI GPT, use
  the tanh approximation, within 5e-4 of it), or the tanh approximation.

  jax.nn.gelu's exact form goes through erfc, which costs 4x more on a CPU
  (8.7 ms against 2.4 ms on 4096 x 1024) for the same values within 1e-6.

  Its gradient keeps x alone and computes the derivative from it, in float32
  (_gelu_backward). Differentiated through its formula, the tanh form kept
  an intermediate of x's size for the backward besides x: on a GPU, another
  array the forward writes and the backward reads. Reverse mode, and forward
  over reverse (Hessians, jvp of a gradient), differentiate it; forward mode
  alone (jax.jvp of the model) does not: jax refuses a jvp of a custom VJP.
  (A custom JVP that kept x alone cost more in the compiled steps: aot.py's
  estimate BERT-base 44.4 -> 45.2 ms, GPT-1 56.7 -> 57.5 ms.)
  """
  if approximate:
    return jax.nn.gelu(x, approximate=True)
  return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(0.7071067811865476, x.dtype)))


gelu = jax.custom_vjp(_gelu, nondiff_argnums=(1,))


def _gelu_forward(x: Array, approximate: bool) -> tuple[Array, Array]:
  return _gelu(x, approximate), x  # the plain function, so that forward over reverse works


def _gelu_backward(approximate: bool, x: Array, g: Array) -> tuple[Array]:
  """g times GELU's derivative at x, computed in float32 from x."""
  x32 = x.astype(jnp.float32)
  if approximate:  # d/dx of x (1 + tanh(u)) / 2, u = c (x + 0.044715 x^3), c = sqrt(2 / pi)
    # (1 + tanh(u)) / 2 = s(2u) and (1 - tanh(u)^2) / 2 = 2 s(2u) s(-2u), s the sigmoid: no
    # cancellation where tanh(u) nears -1.
    c = math.sqrt(2 / math.pi)
    u2 = 2 * c * (x32 + 0.044715 * x32 ** 3)
    s = jax.nn.sigmoid(u2)
    slope = s + x32 * 2 * s * jax.nn.sigmoid(-u2) * c * (1 + 3 * 0.044715 * x32 ** 2)
  else:  # Phi(x) + x phi(x)
    slope = (0.5 * (1 + jax.lax.erf(x32 * 0.7071067811865476))
             + x32 * jnp.exp(-0.5 * x32 * x32) * (1 / math.sqrt(2 * math.pi)))
  return ((g.astype(jnp.float32) * slope).astype(x.dtype),)


gelu.defvjp(_gelu_forward, _gelu_backward)


def column_sum(g_NV: Array) -> Array:
  """g.sum(axis=0); on a CPU as the matrix-vector product ones(N) @ g.

  XLA's CPU column sum of a wide (N, V) array reads it column by column:
  70 ms for BERT's 640 x 30522 MLM logits' gradient, against 2 ms as the
  product. Other platforms keep the sum.
  """
  return jax.lax.platform_dependent(
      g_NV, cpu=lambda g: jnp.ones(g.shape[:1], g.dtype) @ g, default=lambda g: g.sum(axis=0))


@jax.custom_vjp
def add_bias(x_XV: Array, bias_V: Array) -> Array:
  """x + bias over the last axis, whose bias gradient is a column_sum."""
  return x_XV + bias_V


def _add_bias_forward(x_XV, bias_V):
  # Empty arrays carry the dtypes: residuals must be arrays.
  return x_XV + bias_V, (jnp.empty(0, x_XV.dtype), jnp.empty(0, bias_V.dtype))


def _add_bias_backward(dtypes, g_XV):
  dtypes = [d.dtype for d in dtypes]
  g_NV = g_XV.reshape(-1, g_XV.shape[-1]).astype(dtypes[1])
  return g_XV.astype(dtypes[0]), column_sum(g_NV)


add_bias.defvjp(_add_bias_forward, _add_bias_backward)


def layer_norm(eps: float, dtype: Any, name: str | None = None) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=eps, dtype=dtype, param_dtype=jnp.float32, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',)))


def padding_mask(input_mask_BS: Array) -> Array:
  """(B, S) 1/0 -> boolean (B, 1, 1, S), broadcast over heads and queries."""
  return (input_mask_BS > 0)[:, None, None, :]


def causal_mask(length: int) -> Array:
  """Boolean (1, 1, L, L): query t sees keys <= t (Vaswani et al. 2017, sec. 3.2.3)."""
  return jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]


def segment_causal_mask(segment_ids_BL: Array) -> Array:
  """Boolean (B, 1, L, L): causal, within the query's document piece, never onto padding (id 0).

  Packed rows hold several documents; none may attend to another.
  """
  same_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
  real_B1S = (segment_ids_BL > 0)[:, None, :]
  return causal_mask(segment_ids_BL.shape[1]) & (same_BLS & real_B1S)[:, None]


@flax.struct.dataclass
class SegmentMask:
  """Who attends to whom as segment ids, the form the fused kernels take instead of a dense
  mask: query i sees key j where their ids are equal (and, if causal, j <= i). Padding has id 0
  in both, so real queries never see it; padding queries see padding only (their outputs are
  never read). `kernel` is the fused kernel that runs it (FUSED_KERNELS); `right_padded` says
  every row's ids are 1s then 0s (BERT's input_mask, a GPT row without segments), which cuDNN
  takes as lengths rather than as a dense mask."""
  q_BL: Array
  kv_BS: Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  kernel: str = flax.struct.field(pytree_node=False, default='flash')
  right_padded: bool = flax.struct.field(pytree_node=False, default=False)

  def dense(self) -> Array:
    """The boolean (B, 1, L, S) mask of dot_product_attention (padding queries see nothing)."""
    return flash_dropout.visible(self.q_BL, self.kv_BS, self.causal)


def cudnn_arguments(mask: SegmentMask) -> dict[str, Any]:
  """The mask of jax.nn.dot_product_attention's cuDNN path for `mask`: lengths and causality
  where the rows are right-padded (cuDNN skips the masked tiles), else the dense mask (cuDNN
  adds it as a bias) with causality. The same arguments give the same function on XLA's path."""
  if mask.right_padded:
    return {'query_seq_lengths': (mask.q_BL > 0).sum(-1, dtype=jnp.int32),
            'key_value_seq_lengths': (mask.kv_BS > 0).sum(-1, dtype=jnp.int32),
            'is_causal': mask.causal}
  return {'mask': mask.dense(), 'is_causal': mask.causal}


def fused_attention(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, mask: SegmentMask,
                    dropout_rate: float = 0.0, dropout_seed: int = 0) -> Array:
  """The fused kernel `mask.kernel` names; the same function as dot_product_attention (with
  dropout on the probabilities at `dropout_rate`: cuDNN only, see cudnn_dropout_attention)."""
  if dropout_rate:
    return cudnn_dropout_attention(q_BLHK, k_BSHK, v_BSHK, mask, dropout_rate, dropout_seed)
  if mask.kernel == 'cudnn':  # XLA partitions the cuDNN call over the batch and heads itself
    return jax.nn.dot_product_attention(q_BLHK, k_BSHK, v_BSHK, **cudnn_arguments(mask),
                                        implementation='cudnn')
  return flash_attention(q_BLHK, k_BSHK, v_BSHK, mask)


def cudnn_dropout_attention(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, mask: SegmentMask,
                            rate: float, seed: int) -> Array:
  """cuDNN's fused attention with dropout on the probabilities, inside the kernel (jax's
  function below jax.nn.dot_product_attention, which has no dropout argument).

  The mask is not drawn from the step's RNG: cuDNN draws it from `seed`, a constant of the
  compiled step, and a count of the kernel's calls in the process (an H200 drew another mask
  at each call of one compiled kernel). So each layer takes a seed of its own, the masks do
  not depend on config.seed, a resumed run draws other masks than an uninterrupted one would
  (the same distribution), and under lax.scan the backward calls drew other masks than their
  forward calls (trainer/checks.py refuses scan_layers with it): docs/accelerators.md.
  """
  arguments = cudnn_arguments(mask)
  if 'mask' in arguments:
    lengths, mask_B1LS = (None, None), arguments['mask']
  else:
    lengths, mask_B1LS = (arguments['query_seq_lengths'], arguments['key_value_seq_lengths']), None
  types = cudnn_fmha.MaskType
  padded = lengths[0] is not None
  mask_type = ((types.PADDING_CAUSAL if padded else types.CAUSAL) if mask.causal else
               types.PADDING if padded else types.NO_MASK)
  return cudnn_fmha.dot_product_attention(
      q_BLHK, k_BSHK, v_BSHK, None, mask_B1LS, *lengths, scale=q_BLHK.shape[-1] ** -0.5,
      mask_type=mask_type, seed=seed, dropout_rate=rate, qkv_layout='BTNH')


def flash_attention(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, mask: SegmentMask) -> Array:
  """The Pallas TPU flash attention kernel (jax.experimental.pallas.ops.tpu), run on each
  device's shard of the batch and heads; the same function as dot_product_attention."""
  L, S, K = q_BLHK.shape[1], k_BSHK.shape[1], q_BLHK.shape[3]
  if L % 128 or S % 128:  # the kernel's tiles are 128 queries and keys: other lengths take XLA's
    return jax.nn.dot_product_attention(q_BLHK, k_BSHK, v_BSHK, mask=mask.dense())

  def attend(q_BHLK, k_BHSK, v_BHSK, q_ids_BL, kv_ids_BS):
    return tpu_flash.flash_attention(
        q_BHLK, k_BHSK, v_BHSK, segment_ids=tpu_flash.SegmentIds(q_ids_BL, kv_ids_BS),
        causal=mask.causal, sm_scale=K ** -0.5)

  heads = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  (B, L, H, K) <-> (B, H, L, K)
  args = (heads(q_BLHK), heads(k_BSHK), heads(v_BSHK), mask.q_BL, mask.kv_BS)
  spec_BHLK = ('batch', 'act_heads', None, None)
  return heads(_per_shard(attend, args, (spec_BHLK,) * 3 + (('batch', None),) * 2, spec_BHLK))


def triton_attention(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, mask: SegmentMask,
                     rate: float, keys_BH: Array) -> Array:
  """models/flash_dropout.py's kernel (dropout at `rate` with the counted masks of `keys_BH`),
  run on each device's shard of the batch and heads."""

  def attend(q_BLHK, k_BSHK, v_BSHK, q_ids_BL, kv_ids_BS, keys_BH):
    return flash_dropout.attention(q_BLHK, k_BSHK, v_BSHK, q_ids_BL, kv_ids_BS, keys_BH, rate,
                                   mask.causal)

  spec_BLHK = ('batch', None, 'act_heads', None)
  return _per_shard(attend, (q_BLHK, k_BSHK, v_BSHK, mask.q_BL, mask.kv_BS, keys_BH),
                    (spec_BLHK,) * 3 + (('batch', None),) * 2 + (('batch', 'act_heads'),),
                    spec_BLHK)


def triton_self_attention(qkv_BL3HK: Array, mask: SegmentMask, rate: float,
                          keys_BH: Array) -> Array:
  """triton_attention of a self-attention whose q, k and v are one (B, L, 3, H, K) array
  (flash_dropout.self_attention reads it in place and writes its gradient as one)."""

  def attend(qkv_BL3HK, q_ids_BL, kv_ids_BL, keys_BH):
    return flash_dropout.self_attention(qkv_BL3HK, q_ids_BL, kv_ids_BL, keys_BH, rate,
                                        mask.causal)

  return _per_shard(attend, (qkv_BL3HK, mask.q_BL, mask.kv_BS, keys_BH),
                    (('batch', None, None, 'act_heads', None),) + (('batch', None),) * 2 +
                    (('batch', 'act_heads'),), ('batch', None, 'act_heads', None))


def _per_shard(attend: Callable[..., Array], args: tuple[Array, ...],
               in_axes: tuple[tuple[str | None, ...], ...], out_axes: tuple[str | None, ...]
               ) -> Array:
  """attend(*args) on each device's shard (logical axes `in_axes`, `out_axes`): XLA does not
  partition a Pallas kernel."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:  # shapes only (model.init under eval_shape), or one device
    return attend(*args)
  specs = tuple(nn.logical_to_mesh_axes(axes) for axes in in_axes)
  return jax.shard_map(attend, mesh=mesh, in_specs=specs,
                       out_specs=nn.logical_to_mesh_axes(out_axes), check_vma=False)(*args)


class MultiHeadAttention(nn.Module):
  """Scaled dot-product multi-head attention (Vaswani et al. 2017, sec. 3.2).

  `mask` is boolean, broadcastable to (B, 1, L, S), or a SegmentMask, which
  runs a fused kernel (model.attention=flash on TPU, cudnn or triton on GPU). With `decode`, this is
  self-attention over a key/value cache (collection 'cache', made by `init`
  with the full-length input; zeros, see decoding.init_cache): each call
  appends its L new keys/values at `cache_index` and attends over all S
  cached slots, so `mask` must be (B, 1, L, S) over the whole cache and hide
  the slots not written yet (DecodeMask builds it).
  """
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  init_stddev: float = 0.02
  dtype: Any = jnp.float32
  decode: bool = False
  kernel_init: Initializer | None = None  # default: truncated_normal(init_stddev)
  use_bias: bool = True  # the projections' biases: BERT's, GPT's; tensor2tensor's have none

  @nn.compact
  def __call__(self, x_BLD: Array, kv_BSD: Array, mask_B11S: Array, *,
               deterministic: bool) -> Array:
    D, H, K = x_BLD.shape[-1], self.num_heads, self.head_dim
    init = self.kernel_init or truncated_normal(self.init_stddev)
    # A GPU kernel's call fuses no bias add: the projections take their biases in their matmuls.
    gpu_call = isinstance(mask_B11S, SegmentMask) and mask_B11S.kernel in ('cudnn', 'triton')
    proj = lambda name: Einsum(  # noqa: E731
        'BLD,DHK->BLHK', (D, H, K), ('embed', 'heads', 'kv'),
        kernel_init=as_matrix(init, 1), dtype=self.dtype, name=name, bias_in_matmul=gpu_call,
        use_bias=self.use_bias)
    out = lambda: Einsum(  # noqa: E731
        'BLHK,HKD->BLD', (H, K, D), ('heads', 'kv', 'embed'), kernel_init=as_matrix(init, 2),
        dtype=self.dtype, name='out', use_bias=self.use_bias)
    if (gpu_call and mask_B11S.kernel == 'triton' and kv_BSD is x_BLD and not self.decode
        and flash_dropout.reads_in_place(x_BLD.shape[1], K)):
      return out()(self._fused_self_attention(proj, x_BLD, mask_B11S, deterministic))
    q_BLHK = proj('query')(x_BLD)
    k_BSHK = proj('key')(kv_BSD)
    v_BSHK = proj('value')(kv_BSD)
    q_BLHK = nn.with_logical_constraint(q_BLHK, ('batch', 'length', 'act_heads', 'kv'))
    if self.decode:
      k_BSHK, v_BSHK = self._update_cache(k_BSHK, v_BSHK)
    if isinstance(mask_B11S, SegmentMask) and mask_B11S.kernel == 'triton':
      rate, keys_BH = self._kernel_dropout(q_BLHK.shape[0], deterministic)
      out_BLHK = triton_attention(q_BLHK, k_BSHK, v_BSHK, mask_B11S, rate, keys_BH)
    elif isinstance(mask_B11S, SegmentMask):  # check_attention allows dropout to cuDNN only
      rate = 0.0 if deterministic else self.dropout_rate
      # A seed of this layer's own (cudnn_dropout_attention): its module path, hashed.
      seed = zlib.crc32('/'.join(self.scope.path).encode()) & 0x7FFFFFFF if rate else 0
      out_BLHK = fused_attention(q_BLHK, k_BSHK, v_BSHK, mask_B11S, rate, seed)
    elif deterministic or self.dropout_rate == 0.0:
      out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BSHK, v_BSHK, mask=mask_B11S)
    else:
      out_BLHK = self._attend_with_dropout(q_BLHK, k_BSHK, v_BSHK, mask_B11S)
    return out()(out_BLHK)

  def _fused_self_attention(self, proj, x_BLD: Array, mask: SegmentMask,
                            deterministic: bool) -> Array:
    """Self-attention in models/flash_dropout.py's kernels with q, k and v from one matmul (the
    three projections' kernels and biases stacked at run time: the same parameters), which the
    kernels read in place; so its backward is one matmul too, not three and a sum of their input
    gradients. Lengths the kernels do not take that way keep three projections."""
    weights = [proj(name)(None, weights=True) for name in ('query', 'key', 'value')]
    kernel_D3HK = jnp.stack([kernel for kernel, _ in weights], axis=1)
    if self.use_bias:
      bias_3HK = jnp.stack([bias for _, bias in weights])
      qkv_BL3HK = _biased_matmul('BLD,DTHK->BLTHK', x_BLD.astype(self.dtype), kernel_D3HK,
                                 bias_3HK, self.dtype)
    else:
      qkv_BL3HK = _einsum_as_matmul('BLD,DTHK->BLTHK', x_BLD.astype(self.dtype),
                                    kernel_D3HK.astype(self.dtype))
    qkv_BL3HK = nn.with_logical_constraint(qkv_BL3HK,
                                           ('batch', 'length', None, 'act_heads', 'kv'))
    rate, keys_BH = self._kernel_dropout(x_BLD.shape[0], deterministic)
    return triton_self_attention(qkv_BL3HK, mask, rate, keys_BH)

  def _kernel_dropout(self, batch: int, deterministic: bool) -> tuple[float, Array]:
    """The rate and the (B, H) keys of flash_dropout's counted masks (zeros without dropout)."""
    rate = 0.0 if deterministic else self.dropout_rate
    if not rate:
      return rate, jnp.zeros((batch, self.num_heads), jnp.uint32)
    return rate, flash_dropout.dropout_keys(self.make_rng('dropout'), batch, self.num_heads)

  def _update_cache(self, k_BLHK: Array, v_BLHK: Array) -> tuple[Array, Array]:
    """Writes the new keys/values at the cache index; returns the whole (B, S, H, K) cache."""
    # `init` creates the cache with the shape of its input, so S = max length;
    # the created cache stays zeros and this first call attends to itself only.
    initialized = self.has_variable('cache', 'cached_key')
    key = self.variable('cache', 'cached_key', jnp.zeros, k_BLHK.shape, k_BLHK.dtype)
    value = self.variable('cache', 'cached_value', jnp.zeros, v_BLHK.shape, v_BLHK.dtype)
    index = self.variable('cache', 'cache_index', lambda: jnp.zeros((), jnp.int32))
    if not initialized:
      return k_BLHK, v_BLHK
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_BLHK.astype(key.value.dtype),
                                             (0, i, 0, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BLHK.astype(value.value.dtype),
                                               (0, i, 0, 0))
    index.value = i + k_BLHK.shape[1]
    return key.value.astype(self.dtype), value.value.astype(self.dtype)

  def _attend_with_dropout(self, q_BLHK, k_BSHK, v_BSHK, mask_B11S):
    # The fused kernel has no dropout on the attention probabilities, which
    # BERT and GPT train with (attention_probs_dropout_prob = 0.1).
    # Scores in float32 from bfloat16 q and k (as jax.nn.dot_product_attention and the kernels).
    logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q_BLHK, k_BSHK,
                             preferred_element_type=jnp.float32)
    logits_BHLS = logits_BHLS / jnp.sqrt(q_BLHK.shape[-1]).astype(jnp.float32)
    logits_BHLS = jnp.where(mask_B11S, logits_BHLS, NEG_INF)
    probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
    probs_BHLS = dropout(probs_BHLS, self.dropout_rate, self.make_rng('dropout'))
    return jnp.einsum('BHLS,BSHK->BLHK', probs_BHLS.astype(self.dtype), v_BSHK)


class DecodeMask(nn.Module):
  """The decoding cache's bookkeeping: the attention mask over its slots and the new positions.

  Slots fill left to right, L per call: a right-padded prompt (valid = False
  on its padding), then one token at a time. Padding keeps its slot but is
  never attended to, and positions count real tokens only, so each row of a
  batch of prompts of different lengths decodes as if it were alone.
  Returns the (B, 1, L, S) mask of the new queries over the S slots and
  their (B, L) positions. `init` with the full-length input sets S.
  """

  @nn.compact
  def __call__(self, valid_BL: Array) -> tuple[Array, Array]:
    B, L = valid_BL.shape
    initialized = self.has_variable('cache', 'valid')
    valid = self.variable('cache', 'valid', jnp.zeros, (B, L), jnp.bool_)
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    next_position = self.variable('cache', 'next_position', jnp.zeros, (B,), jnp.int32)
    positions_BL = (next_position.value[:, None]
                    + jnp.maximum(jnp.cumsum(valid_BL, axis=1, dtype=jnp.int32) - 1, 0))
    if not initialized:
      return causal_mask(L) & padding_mask(valid_BL), positions_BL
    i = index.value
    valid.value = jax.lax.dynamic_update_slice(valid.value, valid_BL.astype(jnp.bool_), (0, i))
    index.value = i + L
    next_position.value = next_position.value + valid_BL.sum(axis=1, dtype=jnp.int32)
    S = valid.value.shape[1]
    written_LS = jnp.arange(S)[None, :] <= i + jnp.arange(L)[:, None]
    return written_LS[None, None] & padding_mask(valid.value), positions_BL


class Mlp(nn.Module):
  """Position-wise feed-forward network with GELU (Hendrycks & Gimpel 2016) or another activation.

  BERT uses the exact GELU; GPT the tanh approximation of OpenAI's code; the
  Transformer a ReLU (`activation=nn.relu`, Vaswani et al. 2017, eq. 2).
  """
  mlp_dim: int
  init_stddev: float = 0.02
  dtype: Any = jnp.float32
  approximate_gelu: bool = False
  kernel_init: Initializer | None = None  # default: truncated_normal(init_stddev)
  activation: Callable[[Array], Array] | None = None  # default: GELU

  @nn.compact
  def __call__(self, x_BLD: Array) -> Array:
    D, F = x_BLD.shape[-1], self.mlp_dim
    init = self.kernel_init or truncated_normal(self.init_stddev)
    h_BLF = Einsum('BLD,DF->BLF', (D, F), ('embed', 'mlp'), kernel_init=init,
                   dtype=self.dtype, name='wi')(x_BLD)
    h_BLF = nn.with_logical_constraint(h_BLF, ('batch', 'length', 'act_mlp'))
    if self.activation is None:
      h_BLF = gelu(h_BLF, approximate=self.approximate_gelu)
    else:
      h_BLF = self.activation(h_BLF)
    return Einsum('BLF,FD->BLD', (F, D), ('mlp', 'embed'), kernel_init=init,
                  dtype=self.dtype, name='wo')(h_BLF)


class PostLNBlock(nn.Module):
  """Post-LN Transformer encoder block: x = LN(x + Drop(Sublayer(x))) twice."""
  num_heads: int
  mlp_dim: int
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_eps: float
  init_stddev: float = 0.02
  dtype: Any = jnp.float32
  approximate_gelu: bool = False
  decode: bool = False
  kernel_init: Initializer | None = None  # default: truncated_normal(init_stddev)
  activation: Callable[[Array], Array] | None = None  # default: GELU
  attention_bias: bool = True  # MultiHeadAttention's use_bias

  @nn.compact
  def __call__(self, x_BLD: Array, mask_B11S: Array, deterministic: bool) -> Array:
    D = x_BLD.shape[-1]
    y_BLD = MultiHeadAttention(
        self.num_heads, D // self.num_heads, self.attention_dropout_rate,
        self.init_stddev, self.dtype, decode=self.decode, kernel_init=self.kernel_init,
        use_bias=self.attention_bias, name='attention')(x_BLD, x_BLD, mask_B11S,
                                                        deterministic=deterministic)
    y_BLD = Dropout(self.dropout_rate)(y_BLD, deterministic=deterministic)
    x_BLD = layer_norm(self.layer_norm_eps, self.dtype, 'attention_ln')(x_BLD + y_BLD)
    y_BLD = Mlp(self.mlp_dim, self.init_stddev, self.dtype, self.approximate_gelu,
                self.kernel_init, self.activation, name='mlp')(x_BLD)
    y_BLD = Dropout(self.dropout_rate)(y_BLD, deterministic=deterministic)
    x_BLD = layer_norm(self.layer_norm_eps, self.dtype, 'mlp_ln')(x_BLD + y_BLD)
    return nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))


class _ScanStep(nn.Module):
  """Adapts a block to nn.scan's (carry, x) -> (carry, y) signature."""
  block: Callable[..., nn.Module]
  deterministic: bool

  @nn.compact
  def __call__(self, x_BLD: Array, *args: Array):
    x_BLD = self.block(name='block')(x_BLD, *args, self.deterministic)
    return x_BLD, x_BLD


def run_layers(block: Callable[..., nn.Module], num_layers: int, x_BLD: Array,
               *args: Array, deterministic: bool, scan: bool,
               remat: bool, decode: bool = False) -> list[Array]:
  """Applies `num_layers` blocks, each called as block(x, *args, deterministic); returns every
  layer's output.

  `args` are the same for every layer (masks, the encoder's output). With
  `scan`, the blocks' parameters (and decoding caches) are stacked on a
  leading 'layers' axis and one block is compiled once (shorter compiles for
  deep models). `decode` is passed to the blocks (which must take it).
  Must be called inside a compact module method.
  """
  if decode:
    block = functools.partial(block, decode=True)
  elif remat:  # nothing to rematerialize without a backward pass
    block = nn.remat(block, static_argnums=(2 + len(args),))  # deterministic (self is 0)
  if not scan:
    outputs = []
    for i in range(num_layers):
      x_BLD = block(name=f'layer_{i}')(x_BLD, *args, deterministic)
      outputs.append(x_BLD)
    return outputs
  step = nn.scan(
      _ScanStep, variable_axes={'params': 0, 'cache': 0},
      split_rngs={'params': True, 'dropout': True}, in_axes=nn.broadcast, length=num_layers,
      metadata_params={nn.PARTITION_NAME: 'layers'})
  _, ys_NBLD = step(block, deterministic, name='layers')(x_BLD, *args)
  return [ys_NBLD[i] for i in range(num_layers)]


def count_params(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))

