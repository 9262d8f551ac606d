"""Transformer layers shared by BERT, GPT and the Transformer (Vaswani et al. 2017, sec. 3).

Kernels keep their full rank (e.g. the query kernel is (D, H, K)) and carry
logical axis names, so the mesh rules in the config can shard any of them.

Shape legend for names such as `x_BLD`:
  B batch, L length (queries), S length (keys/values), D model width,
  H heads, K head dim, F mlp width, V vocab, P predicted positions,
  C characters, T segment types.
"""

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Initializer = Callable[..., Array]

NEG_INF = -1e9  # finite, so fully masked rows give a uniform softmax, not NaN


def truncated_normal(stddev: float) -> Initializer:
  """BERT's initializer: a normal truncated at two standard deviations."""
  return nn.initializers.truncated_normal(stddev)


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

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(self.kernel_init, self.axes),
        tuple(self.shape), jnp.float32)
    y = jnp.einsum(self.equation, x.astype(self.dtype), kernel.astype(self.dtype))
    if not self.use_bias:
      return y
    kernel_letters = self.equation.split(',')[1].split('->')[0]
    out_letters = self.equation.split('->')[1]
    kept = [i for i, c in enumerate(kernel_letters) if c in out_letters]
    bias = self.param(
        'bias',
        nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                     tuple(self.axes[i] for i in kept)),
        tuple(self.shape[i] for i in kept), jnp.float32)
    return y + bias.astype(self.dtype)


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

  def attend(self, x_BPD: Array) -> Array:
    """Scores against every row in float32 (tied output layer)."""
    # Gathered over `embed` first, as FSDP does anyway: with the table sharded
    # on both axes, XLA (jax 0.10.2) gets the gradient of the activations
    # wrong on a data x fsdp x tensor mesh (tests/test_train.py catches it).
    table_VD = nn.with_logical_constraint(self.embedding, (self.axes[0], None))
    return jnp.einsum('...D,VD->...V', x_BPD.astype(jnp.float32), table_VD.astype(jnp.float32))


def layer_norm(eps: float, dtype: Any, name: str | None = None) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=eps, dtype=dtype, param_dtype=jnp.float32, name=name,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ('embed',)))


def padding_mask(input_mask_BS: Array) -> Array:
  """(B, S) 1/0 -> boolean (B, 1, 1, S), broadcast over heads and queries."""
  return (input_mask_BS > 0)[:, None, None, :]


class MultiHeadAttention(nn.Module):
  """Scaled dot-product multi-head attention (Vaswani et al. 2017, sec. 3.2)."""
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  init_stddev: float = 0.02
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BLD: Array, kv_BSD: Array, mask_B11S: Array, *,
               deterministic: bool) -> Array:
    D, H, K = x_BLD.shape[-1], self.num_heads, self.head_dim
    proj = lambda name: Einsum(  # noqa: E731
        'BLD,DHK->BLHK', (D, H, K), ('embed', 'heads', 'kv'),
        kernel_init=truncated_normal(self.init_stddev), dtype=self.dtype, name=name)
    q_BLHK = proj('query')(x_BLD)
    k_BSHK = proj('key')(kv_BSD)
    v_BSHK = proj('value')(kv_BSD)
    q_BLHK = nn.with_logical_constraint(q_BLHK, ('batch', 'length', 'act_heads', 'kv'))
    if deterministic or self.dropout_rate == 0.0:
      out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BSHK, v_BSHK, mask=mask_B11S)
    else:
      out_BLHK = self._attend_with_dropout(q_BLHK, k_BSHK, v_BSHK, mask_B11S)
    return Einsum('BLHK,HKD->BLD', (H, K, D), ('heads', 'kv', 'embed'),
                  kernel_init=truncated_normal(self.init_stddev), dtype=self.dtype,
                  name='out')(out_BLHK)

  def _attend_with_dropout(self, q_BLHK, k_BSHK, v_BSHK, mask_B11S):
    # The fused kernel has no dropout on the attention probabilities, which
    # BERT and GPT train with (attention_probs_dropout_prob = 0.1).
    logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q_BLHK, k_BSHK).astype(jnp.float32)
    logits_BHLS = logits_BHLS / jnp.sqrt(q_BLHK.shape[-1]).astype(jnp.float32)
    logits_BHLS = jnp.where(mask_B11S, logits_BHLS, NEG_INF)
    probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
    keep = jax.random.bernoulli(self.make_rng('dropout'), 1.0 - self.dropout_rate,
                                probs_BHLS.shape)
    probs_BHLS = jnp.where(keep, probs_BHLS / (1.0 - self.dropout_rate), 0.0)
    return jnp.einsum('BHLS,BSHK->BLHK', probs_BHLS.astype(self.dtype), v_BSHK)


class Mlp(nn.Module):
  """Position-wise feed-forward network with GELU (Hendrycks & Gimpel 2016)."""
  mlp_dim: int
  init_stddev: float = 0.02
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BLD: Array) -> Array:
    D, F = x_BLD.shape[-1], self.mlp_dim
    h_BLF = Einsum('BLD,DF->BLF', (D, F), ('embed', 'mlp'),
                   kernel_init=truncated_normal(self.init_stddev), dtype=self.dtype,
                   name='wi')(x_BLD)
    h_BLF = nn.with_logical_constraint(h_BLF, ('batch', 'length', 'act_mlp'))
    h_BLF = nn.gelu(h_BLF, approximate=False)
    return Einsum('BLF,FD->BLD', (F, D), ('mlp', 'embed'),
                  kernel_init=truncated_normal(self.init_stddev), dtype=self.dtype,
                  name='wo')(h_BLF)


class PostLNBlock(nn.Module):
  """Post-LN Transformer encoder block: x = LN(x + Drop(Sublayer(x))) twice."""
  num_heads: int
  mlp_dim: int
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_eps: float
  init_stddev: float = 0.02
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BLD: Array, mask_B11S: Array, deterministic: bool) -> Array:
    D = x_BLD.shape[-1]
    y_BLD = MultiHeadAttention(
        self.num_heads, D // self.num_heads, self.attention_dropout_rate,
        self.init_stddev, self.dtype, name='attention')(
            x_BLD, x_BLD, mask_B11S, deterministic=deterministic)
    y_BLD = nn.Dropout(self.dropout_rate)(y_BLD, deterministic=deterministic)
    x_BLD = layer_norm(self.layer_norm_eps, self.dtype, 'attention_ln')(x_BLD + y_BLD)
    y_BLD = Mlp(self.mlp_dim, self.init_stddev, self.dtype, name='mlp')(x_BLD)
    y_BLD = nn.Dropout(self.dropout_rate)(y_BLD, deterministic=deterministic)
    x_BLD = layer_norm(self.layer_norm_eps, self.dtype, 'mlp_ln')(x_BLD + y_BLD)
    return nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))


class _ScanStep(nn.Module):
  """Adapts a block to nn.scan's (carry, x) -> (carry, y) signature."""
  block: Callable[..., nn.Module]
  deterministic: bool

  @nn.compact
  def __call__(self, x_BLD: Array, mask_B11S: Array):
    x_BLD = self.block(name='block')(x_BLD, mask_B11S, self.deterministic)
    return x_BLD, x_BLD


def run_layers(block: Callable[..., nn.Module], num_layers: int, x_BLD: Array,
               mask_B11S: Array, *, deterministic: bool, scan: bool,
               remat: bool) -> list[Array]:
  """Applies `num_layers` blocks; returns every layer's output.

  With `scan`, the blocks' parameters are stacked on a leading 'layers' axis
  and one block is compiled once (shorter compiles for deep models).
  Must be called inside a compact module method.
  """
  if remat:
    block = nn.remat(block, static_argnums=(3,))
  if not scan:
    outputs = []
    for i in range(num_layers):
      x_BLD = block(name=f'layer_{i}')(x_BLD, mask_B11S, deterministic)
      outputs.append(x_BLD)
    return outputs
  step = nn.scan(
      _ScanStep, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
      in_axes=nn.broadcast, length=num_layers,
      metadata_params={nn.PARTITION_NAME: 'layers'})
  _, ys_NBLD = step(block, deterministic, name='layers')(x_BLD, mask_B11S)
  return [ys_NBLD[i] for i in range(num_layers)]


def count_params(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))

