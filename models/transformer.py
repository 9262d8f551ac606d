"""The Transformer: a post-LN encoder-decoder for translation (Vaswani et al. 2017, sec. 3).

Batches follow the translation spec (input_pipeline/translation.py):
source_ids (B, S) and target_input_ids, target_ids (B, L), 0 = padding;
target_input_ids is target_ids shifted right behind BOS. Packed rows add
source/target segment_ids (1, 2, ... per example, 0 = padding) and positions
that restart per example; without them each row is one example.

Decoding (decoding.py) calls `encode` once, then `decode` one token at a
time with the self-attention keys/values in the 'cache' collection.
"""

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.dropout import Dropout
from models import layers

Array = jax.Array

POSITIONS = ('sinusoidal', 'learned')


@dataclasses.dataclass(frozen=True)
class Config:
  """Transformer base by default (Table 3): N=6, d_model 512, d_ff 2048, h=8, P_drop 0.1."""
  vocab_size: int = 37000  # one BPE vocabulary shared by source and target (sec. 5.1)
  hidden_size: int = 512
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  mlp_dim: int = 2048
  dropout_rate: float = 0.1  # residual and embedding dropout (sec. 5.4)
  attention_dropout_rate: float = 0.0  # not in the paper; tensor2tensor later used 0.1
  layer_norm_eps: float = 1e-6
  positions: str = 'sinusoidal'  # or 'learned' (sec. 3.5, Table 3 row E)
  max_position_embeddings: int = 256  # the learned table's size; sinusoids take any length
  share_embeddings: bool = True  # source, target and pre-softmax matrices are one (sec. 3.4)
  dtype: str = 'float32'
  # 'xla'; 'flash' (the Pallas TPU kernel); 'cudnn' or 'triton' (ours, with the attention
  # dropout in the kernel: models/flash_dropout.py) on NVIDIA GPUs; 'auto' picks
  attention: str = 'xla'
  scan_layers: bool = False
  remat: bool = False

  def __post_init__(self):
    layers.check_heads(self.hidden_size, self.num_heads)
    layers.check_attention(self.attention, self.attention_dropout_rate)
    if self.positions not in POSITIONS:
      raise ValueError(f'model.positions={self.positions!r} is unknown: use one of {POSITIONS}.')


def sinusoids(positions_BL: Array, width: int) -> Array:
  """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (sec. 3.5), (B, L, D)."""
  rates_D2 = 1.0 / (10000.0 ** (np.arange(0, width, 2, dtype=np.float32) / width))
  angles_BLD2 = positions_BL.astype(jnp.float32)[..., None] * rates_D2
  # Interleaved as the paper writes it: sin at even dimensions, cos at odd ones.
  return jnp.stack([jnp.sin(angles_BLD2), jnp.cos(angles_BLD2)], axis=-1).reshape(
      positions_BL.shape + (width,))


def _xavier():
  return nn.initializers.xavier_uniform()


class DecoderBlock(nn.Module):
  """Post-LN decoder layer: masked self-attention, attention over the encoder, feed-forward.

  Each sublayer is LN(x + Dropout(Sublayer(x))) (sec. 3.1, 5.4). With `decode`,
  the self-attention keys/values are cached; the encoder's keys/values are
  projected again at each step.
  """
  num_heads: int
  mlp_dim: int
  dropout_rate: float
  attention_dropout_rate: float
  layer_norm_eps: float
  dtype: Any = jnp.float32
  decode: bool = False

  @nn.compact
  def __call__(self, y_BLD: Array, memory_BSD: Array, self_mask_B1LL: Array,
               cross_mask_B1LS: Array, deterministic: bool) -> Array:
    D = y_BLD.shape[-1]
    attention = functools.partial(
        layers.MultiHeadAttention, self.num_heads, D // self.num_heads,
        self.attention_dropout_rate, dtype=self.dtype, kernel_init=_xavier(), use_bias=False)
    drop = lambda x: Dropout(self.dropout_rate)(x, deterministic=deterministic)  # noqa: E731
    norm = lambda name: layers.layer_norm(self.layer_norm_eps, self.dtype, name)  # noqa: E731
    out_BLD = attention(decode=self.decode, name='self_attention')(
        y_BLD, y_BLD, self_mask_B1LL, deterministic=deterministic)
    y_BLD = norm('self_attention_ln')(y_BLD + drop(out_BLD))
    out_BLD = attention(name='cross_attention')(
        y_BLD, memory_BSD, cross_mask_B1LS, deterministic=deterministic)
    y_BLD = norm('cross_attention_ln')(y_BLD + drop(out_BLD))
    out_BLD = layers.Mlp(self.mlp_dim, dtype=self.dtype, kernel_init=_xavier(),
                         activation=nn.relu, name='mlp')(y_BLD)
    y_BLD = norm('mlp_ln')(y_BLD + drop(out_BLD))
    return nn.with_logical_constraint(y_BLD, ('batch', 'length', 'act_embed'))


class Model(nn.Module):
  """Encoder-decoder; `__call__` returns the target logits (B, L, V) and the encoder's output."""
  config: Config

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    # Scaled by sqrt(d_model) on the way in (sec. 3.4), so N(0, d^-1/2) gives unit-variance
    # inputs, and the same matrix scores the decoder's output (tensor2tensor's choice).
    embed = functools.partial(layers.Embed, cfg.vocab_size, cfg.hidden_size, ('vocab', 'embed'),
                              nn.initializers.normal(cfg.hidden_size ** -0.5), dtype)
    self.source_embed = embed(name='token_embed' if cfg.share_embeddings else 'source_embed')
    self.target_embed = self.source_embed if cfg.share_embeddings else embed(name='target_embed')
    if not cfg.share_embeddings:
      self.output_embed = embed(name='output_embed')
    if cfg.positions == 'learned':
      self.position_embed = layers.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                                         (None, 'embed'), nn.initializers.normal(0.02), dtype)
    self.encoder_block = functools.partial(
        layers.PostLNBlock, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
        dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
        layer_norm_eps=cfg.layer_norm_eps, dtype=dtype, kernel_init=_xavier(),
        activation=nn.relu, attention_bias=False)
    self.decoder_block = functools.partial(
        DecoderBlock, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
        dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
        layer_norm_eps=cfg.layer_norm_eps, dtype=dtype)
    self.encoder = _Stack(self.encoder_block, cfg.num_encoder_layers, cfg.scan_layers, cfg.remat)
    self.decoder = _Stack(self.decoder_block, cfg.num_decoder_layers, cfg.scan_layers, cfg.remat)
    self.embed_dropout = Dropout(cfg.dropout_rate)
    self.decode_mask = layers.DecodeMask()

  def _inputs(self, embed, ids_BL: Array, positions_BL: Array, deterministic: bool) -> Array:
    cfg = self.config
    x_BLD = embed(ids_BL) * jnp.sqrt(jnp.float32(cfg.hidden_size)).astype(embed.dtype)
    if cfg.positions == 'learned':
      x_BLD += self.position_embed(positions_BL)
    else:
      x_BLD += sinusoids(positions_BL, cfg.hidden_size).astype(x_BLD.dtype)
    x_BLD = self.embed_dropout(x_BLD, deterministic=deterministic)
    return nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))

  def encode(self, batch: Mapping[str, Array], *, deterministic: bool = True) -> Array:
    """The encoder's output (B, S, D); padding positions hold values no query attends to."""
    ids_BS = batch['source_ids']
    self._check_length(ids_BS.shape[1], 'source')
    segments_BS = _segments(batch, 'source', ids_BS)
    positions_BS = _positions(batch, 'source', ids_BS)
    if self.config.attention in layers.FUSED_KERNELS:
      mask_B1SS = layers.SegmentMask(segments_BS, segments_BS, kernel=self.config.attention)
    else:
      mask_B1SS = (segments_BS[:, :, None] == segments_BS[:, None, :])[:, None]
      mask_B1SS &= layers.padding_mask(segments_BS)
    x_BSD = self._inputs(self.source_embed, ids_BS, positions_BS, deterministic)
    return self.encoder(x_BSD, mask_B1SS, deterministic=deterministic)[-1]

  def decode(self, memory_BSD: Array, batch: Mapping[str, Array], *,
             deterministic: bool = True, decode: bool = False) -> Array:
    """Float32 logits (B, L, V) of the next target token at each target input position.

    With `decode`, each call appends `batch['target_input_ids']` (B, 1 or
    more) to the self-attention cache (collection 'cache', made by `init`
    with decode=True and the longest target input) and attends over the
    slots written so far; positions count from the cache.
    """
    ids_BL = batch['target_input_ids']
    source_segments_BS = _segments(batch, 'source', batch['source_ids'])
    if decode:  # one example per row
      self_mask, positions_BL = self.decode_mask(jnp.ones(ids_BL.shape, jnp.bool_))
      cross_mask = layers.padding_mask(source_segments_BS)
    else:
      self._check_length(ids_BL.shape[1], 'target')
      target_segments_BL = _segments(batch, 'target', ids_BL)
      positions_BL = _positions(batch, 'target', ids_BL)
      # Each target piece attends to its own source piece only.
      if self.config.attention in layers.FUSED_KERNELS:
        kernel = self.config.attention
        self_mask = layers.SegmentMask(target_segments_BL, target_segments_BL, causal=True,
                                       kernel=kernel)
        cross_mask = layers.SegmentMask(target_segments_BL, source_segments_BS, kernel=kernel)
      else:
        self_mask = layers.segment_causal_mask(target_segments_BL)
        cross_mask = (target_segments_BL[:, :, None] == source_segments_BS[:, None, :])[:, None]
        cross_mask &= layers.padding_mask(source_segments_BS)
    y_BLD = self._inputs(self.target_embed, ids_BL, positions_BL, deterministic)
    y_BLD = self.decoder(y_BLD, memory_BSD, self_mask, cross_mask,
                         deterministic=deterministic, decode=decode)[-1]
    output = self.target_embed if self.config.share_embeddings else self.output_embed
    return output.attend(y_BLD)

  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True,
               decode: bool = False) -> dict[str, Array]:
    memory_BSD = self.encode(batch, deterministic=deterministic)
    logits_BLV = self.decode(memory_BSD, batch, deterministic=deterministic, decode=decode)
    return {'logits': logits_BLV, 'encoder_output': memory_BSD}

  def _check_length(self, length: int, side: str) -> None:
    cfg = self.config
    if cfg.positions == 'learned' and length > cfg.max_position_embeddings:
      raise ValueError(f'The {side} length {length} exceeds model.max_position_embeddings='
                       f'{cfg.max_position_embeddings}: shorten data.max_seq_length or raise it.')


class _Stack(nn.Module):
  """`num_layers` blocks applied in turn (layers.run_layers)."""
  block: Any
  num_layers: int
  scan: bool
  remat: bool

  @nn.compact
  def __call__(self, x_BLD: Array, *args: Array, deterministic: bool,
               decode: bool = False) -> list[Array]:
    return layers.run_layers(self.block, self.num_layers, x_BLD, *args,
                             deterministic=deterministic, scan=self.scan, remat=self.remat,
                             decode=decode)


def _segments(batch: Mapping[str, Array], side: str, ids_BL: Array) -> Array:
  """Segment ids (1, 2, ... per packed example, 0 = padding); one example per row without them."""
  key = f'{side}_segment_ids'
  return batch[key] if key in batch else (ids_BL > 0).astype(jnp.int32)


def _positions(batch: Mapping[str, Array], side: str, ids_BL: Array) -> Array:
  key = f'{side}_positions'
  return batch[key] if key in batch else jnp.broadcast_to(jnp.arange(ids_BL.shape[1]),
                                                          ids_BL.shape)


def decoder(model: Model, params: Any, source_ids_BS: Array, *, beam_size: int,
            max_length: int) -> tuple[Any, Any, Any]:
  """(step, state, reorder) for decoding.greedy_search / beam_search: B * beam_size rows.

  The state is the self-attention cache (sized for max_length target
  tokens), the encoder's output and the source ids.
  """
  N = source_ids_BS.shape[0] * beam_size
  memory_BSD = model.apply({'params': params}, {'source_ids': source_ids_BS}, method='encode')
  source_NS = jnp.repeat(source_ids_BS, beam_size, axis=0)
  memory_NSD = jnp.repeat(memory_BSD, beam_size, axis=0)

  def make_cache():  # only its shapes are traced
    batch = {'source_ids': source_NS, 'target_input_ids': jnp.zeros((N, max_length), jnp.int32)}
    return model.init(jax.random.key(0), batch, decode=True)['cache']
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(make_cache))

  def step(token_N, state):
    cache, memory_NSD, source_NS = state
    logits_N1V, variables = model.apply(
        {'params': params, 'cache': cache}, memory_NSD,
        {'source_ids': source_NS, 'target_input_ids': token_N[:, None]},
        decode=True, method='decode', mutable=['cache'])
    return logits_N1V[:, 0], (variables['cache'], memory_NSD, source_NS)

  return step, (cache, memory_NSD, source_NS), _reorder


def _reorder(state: Any, rows_N: Array) -> Any:
  """Beam rows of the decoding state; scanned decoder layers keep their cache rows on axis 1,
  and their cache index one per layer (a vector, which has no rows)."""
  def gather(path, x):
    scanned = any(getattr(k, 'key', None) == 'layers' for k in path)
    if jnp.ndim(x) <= (1 if scanned else 0):  # a cache index
      return x
    return x[:, rows_N] if scanned else x[rows_N]
  return jax.tree_util.tree_map_with_path(gather, state)


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs of one packed row pair: 3x the forward matmul FLOPs (2 per multiply-add).

  Every one of the S = L = data.max_seq_length slots of a side is counted,
  padding included; attention over all L x L (or L x S) scores, as computed.
  The encoder's keys/values are projected once per decoder layer.
  """
  D, F, V = cfg.hidden_size, cfg.mlp_dim, cfg.vocab_size
  L = data_cfg.max_seq_length
  attention = 2 * L * 4 * D * D + 2 * 2 * L * L * D
  mlp = 2 * L * 2 * D * F
  encoder = cfg.num_encoder_layers * (attention + mlp)
  decoder = cfg.num_decoder_layers * (2 * attention + mlp)
  return 3.0 * (encoder + decoder + 2 * L * D * V)
