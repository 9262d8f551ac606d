"""BERT: a bidirectional post-LN Transformer encoder with MLM and NSP heads (Devlin et al. 2018, sec. 3).

Inputs follow the BERT feature spec of input_pipeline/bert_pretraining.py:
input_ids, segment_ids, input_mask (B, L) and, for the MLM head,
masked_lm_positions (B, P).

With num_labels, a fine-tuning head is added (sec. 4, figure 4), named as
the output it gives:
  classify  'logits' (B, N) from the pooled [CLS] state; N = 1 is regression
  span      'start_logits', 'end_logits' (B, L): SQuAD's start and end vectors (sec. 4.2)
  tag       'logits' (B, L, N) from every token's final state (sec. 5.3)
"""

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.dropout import Dropout
from models import layers

Array = jax.Array

HEADS = ('classify', 'span', 'tag')
# Task heads' modules: fresh when init_from was fine-tuned on another task (train.init_params).
TASK_HEADS = ('classifier', 'span_head', 'tagger')


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 30522
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-12
  dtype: str = 'float32'
  # 'xla'; 'flash' (the Pallas TPU kernel); 'cudnn' or 'triton' (ours, with the attention
  # dropout in the kernel: models/flash_dropout.py) on NVIDIA GPUs; 'auto' picks
  attention: str = 'xla'
  scan_layers: bool = False
  remat: bool = False
  num_labels: int = 0  # 0 = no fine-tuning head; classes, 1 = regression, 2 for 'span'
  head: str = 'classify'

  def __post_init__(self):
    layers.check_heads(self.hidden_size, self.num_heads)
    layers.check_attention(self.attention, self.attention_dropout_rate)
    if self.head not in HEADS:
      raise ValueError(f'model.head={self.head!r} is unknown: use one of {HEADS}.')
    if self.head == 'span' and self.num_labels not in (0, 2):
      raise ValueError(f'model.head=span has a start and an end score, not num_labels='
                       f'{self.num_labels}: set model.num_labels=2.')


class Model(nn.Module):
  """BERT for pretraining; returns every layer's hidden states and both heads' logits."""
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Any]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    ids_BL = batch['input_ids']
    L = ids_BL.shape[1]
    if L > cfg.max_position_embeddings:
      raise ValueError(
          f'Sequence length {L} exceeds max_position_embeddings='
          f'{cfg.max_position_embeddings}: shorten data.max_seq_length.')
    init = layers.truncated_normal(cfg.initializer_range)

    token_embed = layers.Embed(cfg.vocab_size, cfg.hidden_size, ('vocab', 'embed'),
                               init, dtype, name='token_embed')
    x_BLD = token_embed(ids_BL)
    x_BLD += layers.Embed(cfg.max_position_embeddings, cfg.hidden_size, (None, 'embed'),
                          init, dtype, name='position_embed')(jnp.arange(L))[None]
    x_BLD += layers.Embed(cfg.type_vocab_size, cfg.hidden_size, (None, 'embed'),
                          init, dtype, name='segment_embed')(batch['segment_ids'])
    x_BLD = layers.layer_norm(cfg.layer_norm_eps, dtype, 'embed_ln')(x_BLD)
    x_BLD = Dropout(cfg.dropout_rate)(x_BLD, deterministic=deterministic)
    x_BLD = nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))

    block = functools.partial(
        layers.PostLNBlock, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
        dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
        layer_norm_eps=cfg.layer_norm_eps, init_stddev=cfg.initializer_range, dtype=dtype)
    mask_B11S = (layers.SegmentMask(batch['input_mask'], batch['input_mask'],
                                    kernel=cfg.attention, right_padded=True)
                 if cfg.attention in layers.FUSED_KERNELS
                 else layers.padding_mask(batch['input_mask']))
    hidden = layers.run_layers(
        block, cfg.num_layers, x_BLD, mask_B11S,
        deterministic=deterministic, scan=cfg.scan_layers, remat=cfg.remat)
    out_BLD = hidden[-1]

    pooled_BD = jnp.tanh(layers.Einsum(
        'BD,DE->BE', (cfg.hidden_size, cfg.hidden_size), ('embed', 'mlp'),
        kernel_init=init, dtype=dtype, name='pooler')(out_BLD[:, 0]))
    outputs = {
        'hidden_states': [x_BLD] + hidden,  # embeddings, then each layer
        'sequence_output': out_BLD,
        'pooled_output': pooled_BD,
        'nsp_logits': layers.Einsum(
            'BD,DT->BT', (cfg.hidden_size, 2), ('embed', None), kernel_init=init,
            dtype=dtype, name='nsp_head')(pooled_BD).astype(jnp.float32),
    }
    if 'masked_lm_positions' in batch:
      outputs['mlm_logits'], outputs['mlm_output'] = self._mlm_logits(
          out_BLD, batch['masked_lm_positions'], token_embed, init, dtype)
    if cfg.num_labels:
      outputs.update(self._task_head(out_BLD, pooled_BD, init, dtype, deterministic))
    return outputs

  def _task_head(self, out_BLD, pooled_BD, init, dtype, deterministic: bool) -> dict[str, Array]:
    """The one new output layer of fine-tuning (sec. 4): classes, a span, or a tag per token."""
    cfg = self.config
    D, N = cfg.hidden_size, cfg.num_labels
    if cfg.head == 'span':  # run_squad.py: no dropout before the start/end vectors
      logits_BLT = layers.Einsum('BLD,DT->BLT', (D, 2), ('embed', None), kernel_init=init,
                                 dtype=dtype, name='span_head')(out_BLD).astype(jnp.float32)
      return {'start_logits': logits_BLT[..., 0], 'end_logits': logits_BLT[..., 1]}
    dropout = Dropout(cfg.dropout_rate)
    if cfg.head == 'tag':
      x_BLD = dropout(out_BLD, deterministic=deterministic)
      return {'logits': layers.Einsum('BLD,DN->BLN', (D, N), ('embed', None), kernel_init=init,
                                      dtype=dtype, name='tagger')(x_BLD).astype(jnp.float32)}
    x_BD = dropout(pooled_BD, deterministic=deterministic)
    return {'logits': layers.Einsum('BD,DN->BN', (D, N), ('embed', None), kernel_init=init,
                                    dtype=dtype, name='classifier')(x_BD).astype(jnp.float32)}

  def _mlm_logits(self, x_BLD, positions_BP, token_embed, init, dtype
                  ) -> tuple[Array, dict[str, Array]]:
    # Only the masked positions reach the vocabulary projection: the largest
    # matmul of the step shrinks from L to P rows per example.
    cfg = self.config
    x_BPD = jnp.take_along_axis(x_BLD, positions_BP[..., None], axis=1)
    x_BPD = layers.Einsum('BPD,DE->BPE', (cfg.hidden_size, cfg.hidden_size),
                          ('embed', 'mlp'), kernel_init=init, dtype=dtype,
                          name='mlm_transform')(x_BPD)
    x_BPD = layers.gelu(x_BPD)
    x_BPD = layers.layer_norm(cfg.layer_norm_eps, dtype, 'mlm_ln')(x_BPD)
    bias_V = self.param('mlm_output_bias',
                        nn.with_logical_partitioning(nn.initializers.zeros_init(), ('vocab',)),
                        (cfg.vocab_size,), jnp.float32)
    # The loss makes the logits in chunks from these (lm.output_layer_loss); mlm_logits is then
    # never computed (XLA drops what nothing reads).
    output = {'x': x_BPD, 'table': token_embed.output_table(), 'bias': bias_V}
    return layers.add_bias(token_embed.attend(x_BPD), bias_V), output


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs per example: 3x the forward matmul FLOPs (2 per multiply-add).

  XLA's cost analysis is not used: it counts a scanned layer once.
  """
  D, F, V = cfg.hidden_size, cfg.mlp_dim, cfg.vocab_size
  L, P = data_cfg.max_seq_length, data_cfg.get('max_predictions_per_seq', 0)
  per_layer = 2 * L * (4 * D * D + 2 * D * F) + 2 * 2 * L * L * D
  heads = 2 * (D * D + 2 * D)  # pooler and NSP
  if cfg.num_labels:  # fine-tuning: the task head instead of the MLM head
    heads += 2 * D * cfg.num_labels * (1 if cfg.head == 'classify' else L)
  else:
    heads += 2 * P * (D * D + D * V)
  return 3.0 * (cfg.num_layers * per_layer + heads)
