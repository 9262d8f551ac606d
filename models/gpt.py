"""GPT: a causal post-LN Transformer decoder with a tied output layer (Radford et al. 2018, sec. 3).

Inputs follow the LM and fine-tuning batch specs (input_pipeline packed_lm and
gpt_finetune): input_ids (B, L) or (B, C, L); optional segment_ids and
positions of the same shape (packed document pieces; absent = one document
starting at position 0); for the task head, extract_positions (B, C).
"""

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.dropout import Dropout, TableDropout
from models import layers

Array = jax.Array

HEADS = ('classify', 'choice')
EMBEDDING_DROPOUTS = ('table', 'tokens')  # model.embedding_dropout
# Task heads' modules: fresh when init_from was fine-tuned on another task (train.init_params).
TASK_HEADS = ('classifier',)


@dataclasses.dataclass(frozen=True)
class Config:
  """GPT-1 by default (sec. 4.1): 12 layers, 768 wide, 12 heads, 3072 inner, 512 positions."""
  vocab_size: int = 40478
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_position_embeddings: int = 512
  dropout_rate: float = 0.1  # residual and embedding dropout
  # 'table': OpenAI's code drops elements of the token and position tables before the lookup,
  # one mask per row for the step (a token has the same wherever it occurs); 'tokens': of each
  # looked-up sum (HF's openai-gpt).
  embedding_dropout: str = 'table'
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-5
  dtype: str = 'float32'
  # 'xla'; 'flash' (the Pallas TPU kernel); 'cudnn' or 'triton' (ours, with the attention
  # dropout in the kernel: models/flash_dropout.py) on NVIDIA GPUs; 'auto' picks
  attention: str = 'xla'
  scan_layers: bool = False
  remat: bool = False
  num_labels: int = 0  # 0 = no task head
  head: str = 'classify'
  classifier_dropout_rate: float = 0.1

  def __post_init__(self):
    layers.check_heads(self.hidden_size, self.num_heads)
    layers.check_attention(self.attention, self.attention_dropout_rate)
    if self.head not in HEADS:
      raise ValueError(f'model.head={self.head!r} is unknown: use one of {HEADS}.')
    if self.embedding_dropout not in EMBEDDING_DROPOUTS:
      raise ValueError(f'model.embedding_dropout={self.embedding_dropout!r} is unknown: use one '
                       f'of {EMBEDDING_DROPOUTS}.')


class Model(nn.Module):
  """GPT: every layer's hidden states, the tied LM logits and, with num_labels, the task logits.

  With `decode`, the 'cache' collection must be mutable and start from
  decoding.init_cache; each call appends its tokens to the cache, with
  positions counted from the cache unless batch['positions'] is given.
  """
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True,
               decode: bool = False) -> dict[str, Any]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    ids = batch['input_ids']
    lead, L = ids.shape[:-1], ids.shape[-1]  # (B,) or (B, C); sequences are flattened to N
    flat = lambda x: x.reshape((-1, L))  # noqa: E731
    unflat = lambda x: x.reshape(lead + x.shape[1:])  # noqa: E731
    ids_NL = flat(ids)
    segment_ids_NL = flat(batch['segment_ids']) if 'segment_ids' in batch else None

    if L > cfg.max_position_embeddings:  # with decode, init's L is the cache length
      raise ValueError(
          f'Sequence length {L} exceeds max_position_embeddings='
          f'{cfg.max_position_embeddings}: shorten data.max_seq_length.')
    if decode:
      valid_NL = segment_ids_NL > 0 if segment_ids_NL is not None else jnp.ones_like(ids_NL, bool)
      mask_N1LS, positions_NL = layers.DecodeMask(name='decode_mask')(valid_NL)
    elif cfg.attention in layers.FUSED_KERNELS:  # without segment ids, a row is one piece
      pieces_NL = segment_ids_NL if segment_ids_NL is not None else jnp.ones_like(ids_NL)
      mask_N1LS = layers.SegmentMask(pieces_NL, pieces_NL, causal=True, kernel=cfg.attention,
                                     right_padded=segment_ids_NL is None)
      positions_NL = jnp.arange(L)[None]
    elif segment_ids_NL is None:
      mask_N1LS, positions_NL = layers.causal_mask(L), jnp.arange(L)[None]
    else:
      mask_N1LS, positions_NL = layers.segment_causal_mask(segment_ids_NL), jnp.arange(L)[None]
    if 'positions' in batch:
      positions_NL = flat(batch['positions'])

    # OpenAI's code draws every weight from N(0, 0.02), untruncated.
    init = nn.initializers.normal(cfg.initializer_range)
    token_embed = layers.Embed(cfg.vocab_size, cfg.hidden_size, ('vocab', 'embed'),
                               init, dtype, name='token_embed')
    tokens_NLD = token_embed(ids_NL)
    positions_NLD = layers.Embed(cfg.max_position_embeddings, cfg.hidden_size, (None, 'embed'),
                                init, dtype, name='position_embed')(positions_NL)
    output_VD = token_embed.output_table()
    if cfg.embedding_dropout == 'table':
      # The tied output layer reads the dropped table, as OpenAI's code (`lm_logits =
      # tf.matmul(lm_h, we, transpose_b=True)` with the `we` it dropped).
      tokens_NLD, output_VD = TableDropout(cfg.dropout_rate)(
          tokens_NLD, ids_NL, deterministic, table=output_VD)
      positions_NLD = TableDropout(cfg.dropout_rate)(positions_NLD, positions_NL, deterministic)
      x_NLD = tokens_NLD + positions_NLD
    else:
      x_NLD = Dropout(cfg.dropout_rate)(tokens_NLD + positions_NLD, deterministic=deterministic)
    x_NLD = nn.with_logical_constraint(x_NLD, ('batch', 'length', 'act_embed'))

    block = functools.partial(
        layers.PostLNBlock, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
        dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
        layer_norm_eps=cfg.layer_norm_eps, dtype=dtype, approximate_gelu=True,
        kernel_init=init)
    hidden = layers.run_layers(
        block, cfg.num_layers, x_NLD, mask_N1LS, deterministic=deterministic,
        scan=cfg.scan_layers, remat=cfg.remat, decode=decode)
    out_NLD = hidden[-1]

    outputs = {
        'hidden_states': [unflat(h) for h in [x_NLD] + hidden],  # embeddings, then each layer
        'sequence_output': unflat(out_NLD),
        'lm_logits': unflat(token_embed.attend(out_NLD, output_VD)),  # W_e^T (sec. 3.1, eq. 2)
        # The same layer unapplied: the loss makes its logits in chunks (lm.output_layer_loss);
        # lm_logits is then never computed (XLA drops what nothing reads).
        'lm_output': {'x': unflat(out_NLD), 'table': output_VD, 'bias': None},
    }
    if cfg.num_labels and not decode:
      outputs['logits'] = self._task_logits(unflat(out_NLD), batch, init, deterministic)
    return outputs

  def _task_logits(self, h_XLD: Array, batch, init, deterministic: bool) -> Array:
    """The linear head on the extract tokens' final states (sec. 3.2, 3.3)."""
    cfg = self.config
    if 'extract_positions' not in batch:
      raise ValueError(f'model.num_labels={cfg.num_labels} needs batch["extract_positions"]: '
                       'use the gpt_finetune pipeline or set model.num_labels=0.')
    h_BCLD = h_XLD if h_XLD.ndim == 4 else h_XLD[:, None]
    extract_BC = batch['extract_positions'].reshape(h_BCLD.shape[:2])
    h_BCD = jnp.take_along_axis(h_BCLD, extract_BC[:, :, None, None], axis=2)[:, :, 0]
    D = cfg.hidden_size
    dropout = Dropout(cfg.classifier_dropout_rate)
    if cfg.head == 'classify':
      # Similarity: the states of both orderings are added before the linear layer (sec. 3.3).
      h_BD = dropout(h_BCD.sum(axis=1), deterministic=deterministic)
      logits = layers.Einsum('BD,DN->BN', (D, cfg.num_labels), ('embed', None),
                             kernel_init=init, dtype=h_BD.dtype, name='classifier')(h_BD)
    else:
      # Multiple choice: one score per sequence, normalized over choices by the loss. One
      # dropout mask for all choices of an example (OpenAI's noise shape [B, 1, D]), so that
      # the choices are scored through the same units.
      h_BCD = h_BCD * dropout(jnp.ones_like(h_BCD[:, :1]), deterministic=deterministic)
      logits = layers.Einsum('BCD,DO->BCO', (D, 1), ('embed', None), kernel_init=init,
                             dtype=h_BCD.dtype, name='classifier')(h_BCD)[..., 0]
    return logits.astype(jnp.float32)


def train_flops_per_example(cfg: Config, data_cfg, loss_cfg=None) -> float:
  """Analytic training FLOPs per example: 3x the forward matmul FLOPs (2 per multiply-add).

  XLA's cost analysis is not used: it counts a scanned layer once. Attention
  is counted over all L x L scores, as computed (masking saves nothing). A
  fine-tuning at loss_cfg.lm_coef=0 runs the LM head forward only (its
  lm_loss metric), so that head counts once, not 3x.
  """
  D, F, V = cfg.hidden_size, cfg.mlp_dim, cfg.vocab_size
  L = data_cfg.max_seq_length
  per_layer = 2 * L * (4 * D * D + 2 * D * F) + 2 * 2 * L * L * D
  lm_head = 2 * L * D * V
  lm_passes = 1.0 if loss_cfg is not None and loss_cfg.get('lm_coef', 1.0) == 0 else 3.0
  sequences = getattr(data_cfg, 'num_choices', None) or 1
  head = 2 * D * (cfg.num_labels if cfg.head == 'classify' else sequences) if cfg.num_labels else 0
  return (3.0 * (sequences * cfg.num_layers * per_layer + head)
          + lm_passes * sequences * lm_head)
