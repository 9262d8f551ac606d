"""A biLSTM tagger over [x_k; ELMo_k] from a frozen biLM (Peters et al. 2018, sec. 3.3 and 5.1 NER).

Inputs follow the tagging batch spec (input_pipeline/tagging.py): token_ids
(B, L), char_ids (B, L, W), lengths (B,). The biLM (models/elmo.py BiLM,
under params['bilm'] exactly as in the pretraining model, so init_from fills
it) runs without dropout and behind a stop-gradient: ELMo's biLM is frozen
and only the scalar mix, the word embedding and the task model learn
(sec. 3.3). With use_elmo=False the same task model runs on x_k alone, the
baseline of Table 1.

Shape letters: B batch, L tokens, J biLM layers mixed (num_layers + 1), N
labels, X a feature width (word vector, ELMo's 2D, their concatenation, the
biLSTM's 2 x task_lstm_dim).
"""

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.dropout import Dropout
from models import elmo
from models import layers
from models import lstm

Array = jax.Array

# train.py's init_from accepts a run of this model: the biLM's params come from it.
PRETRAINED_MODEL = 'elmo'


@dataclasses.dataclass(frozen=True)
class Config(elmo.Config):
  """The biLM's fields (models/elmo.py, same names and defaults) and the task model's.

  The task model's defaults are those of the NER model in allennlp's ELMo
  configuration (2 biLSTM layers of 200 cells per direction, dropout 0.5);
  the paper's CRF (sec. 5.1) is replaced by a softmax per token.
  """
  num_labels: int = 9  # CoNLL 2003's IOB tags
  use_elmo: bool = True  # False = the baseline without ELMo (the elmo_* fields are then unused)
  elmo_at_output: bool = False  # also [h_k; ELMo_k] at the biLSTM's output (sec. 3.3)
  elmo_top_only: bool = False  # ELMo_k = gamma * top layer instead of the scalar mix
  elmo_layer: int = -1  # >= 0: ELMo_k = gamma * that layer alone (0 = the char-CNN's tokens)
  elmo_layer_norm: bool = False  # layer-normalize each biLM layer before mixing
  elmo_dropout_rate: float = 0.5  # "a moderate amount of dropout to ELMo" (sec. 3.3)
  word_dim: int = 100  # x_k: a learned word embedding of token_ids
  task_lstm_dim: int = 200  # cells per direction
  task_num_layers: int = 2
  task_dropout_rate: float = 0.5  # between biLSTM layers and before the classifier

  def __post_init__(self):
    super().__post_init__()
    for name in ('num_labels', 'word_dim', 'task_lstm_dim', 'task_num_layers'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)}: set it to a positive integer.')
    for name in ('elmo_dropout_rate', 'task_dropout_rate'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f'model.{name}={getattr(self, name)}: use a rate in [0, 1).')
    if not -1 <= self.elmo_layer <= self.num_layers:
      raise ValueError(f'model.elmo_layer={self.elmo_layer}: use -1 (the scalar mix) or a layer '
                       f'in 0..{self.num_layers} (0 is the char-CNN token layer).')
    if self.elmo_layer >= 0 and self.elmo_top_only:
      raise ValueError('model.elmo_layer and model.elmo_top_only both pick one layer: set one.')


def check_config(config) -> None:
  """ELMo needs a pretrained biLM: a frozen random one would only add noise (train.py calls this)."""
  if config.model.use_elmo and not config.get('init_from'):
    raise ValueError('model.use_elmo=True needs a pretrained biLM: set --config.init_from to the '
                     'workdir of a configs/elmo.py run, or --config.model.use_elmo=False for '
                     'the baseline.')


def bilm_config(cfg: Config) -> elmo.Config:
  """The pretraining model's Config with the biLM fields of a tagger Config."""
  return elmo.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(elmo.Config)})


class Model(nn.Module):
  """Tag logits (B, L, num_labels) from a task biLSTM over [x_k; ELMo_k], and the mix's L2."""
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Any]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    token_ids_BL, lengths_B = batch['token_ids'], batch['lengths']
    L = token_ids_BL.shape[1]
    # The words, between <S> and </S>: the biLM reads the boundaries, the task model and the
    # mix's layer norm do not (bilm-tf's layers_without_bos_eos and mask_wo_bos_eos).
    t_1L = jnp.arange(L)[None]
    mask_BL = (t_1L >= 1) & (t_1L < lengths_B[:, None] - 1)
    if 'example_weights' in batch:
      # Eval's padding rows repeat a real sentence: the mix's layer norm must not count them.
      mask_BL = mask_BL & (batch['example_weights'] > 0)[:, None]

    # A word vector has unit expected norm, whatever word_dim.
    word_init = nn.initializers.normal(cfg.word_dim ** -0.5)
    x_BLX = layers.Embed(cfg.vocab_size, cfg.word_dim, ('vocab', 'embed'), word_init, dtype,
                         name='word_embed')(token_ids_BL)
    mix_l2 = jnp.zeros((), jnp.float32)
    if cfg.use_elmo:
      # Frozen: no dropout inside the biLM and no gradient into it (sec. 3.3).
      bilm = elmo.BiLM(bilm_config(cfg), name='bilm')(
          batch['char_ids'], lengths_B, deterministic=True)
      bilm = jax.lax.stop_gradient(bilm)
      layers_BJLX = elmo.elmo_layers(bilm['token_BLD'], bilm['forward'], bilm['backward'])
      mix_names = ('input_mix', 'output_mix') if cfg.elmo_at_output else ('input_mix',)
      elmo_BLX = {}
      for name in mix_names:
        mix_BLX, l2 = elmo.ScalarMix(layers_BJLX.shape[1], layer_norm=cfg.elmo_layer_norm,
                                     top_only=cfg.elmo_top_only, name=name,
                                     single_layer=None if cfg.elmo_layer < 0 else cfg.elmo_layer
                                     )(layers_BJLX, mask_BL)
        elmo_BLX[name] = Dropout(cfg.elmo_dropout_rate)(
            mix_BLX.astype(dtype), deterministic=deterministic)
        mix_l2 = mix_l2 + l2
      x_BLX = jnp.concatenate([x_BLX, elmo_BLX['input_mix']], axis=-1)

    # The task biLSTM over the words alone (positions 1.. of the row, lengths - 2 of them), so
    # each direction starts from a zero state at a word, not at <S>'s or </S>'s input.
    h_BLX, word_lengths_B = x_BLX[:, 1:], jnp.maximum(lengths_B - 2, 0)
    for i in range(cfg.task_num_layers):
      if i:
        h_BLX = Dropout(cfg.task_dropout_rate)(h_BLX, deterministic=deterministic)
      h_BLX = jnp.concatenate([
          lstm.LSTM(cfg.task_lstm_dim, projection=0, reverse=reverse, dtype=dtype,
                    name=f'task_{direction}_{i}')(h_BLX, word_lengths_B)
          for direction, reverse in (('forward', False), ('backward', True))], axis=-1)
    h_BLX = Dropout(cfg.task_dropout_rate)(h_BLX, deterministic=deterministic)
    if cfg.use_elmo and cfg.elmo_at_output:
      h_BLX = jnp.concatenate([h_BLX, elmo_BLX['output_mix'][:, 1:]], axis=-1)

    logits_BLN = layers.Einsum('BLX,XN->BLN', (h_BLX.shape[-1], cfg.num_labels), ('embed', None),
                               dtype=dtype, name='classifier')(h_BLX)
    # Back at the batch's positions (<S>'s row of zeros; its label weight is 0).
    logits_BLN = jnp.pad(logits_BLN, ((0, 0), (1, 0), (0, 0)))
    return {'logits': logits_BLN.astype(jnp.float32), 'mix_l2': mix_l2}


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs per example: the frozen biLM forward once (no backward into it),
  the task biLSTM and classifier three times (forward and backward); 2 FLOPs per multiply-add."""
  L, S = data_cfg.max_seq_length, cfg.task_lstm_dim
  elmo_dim = 2 * cfg.projection_dim if cfg.use_elmo else 0
  bilm = elmo.bilm_macs_per_token(cfg) if cfg.use_elmo else 0
  task, width = 0, cfg.word_dim + elmo_dim
  for _ in range(cfg.task_num_layers):  # input and recurrent kernels, both directions
    task += 2 * (width * 4 * S + S * 4 * S)
    width = 2 * S
  task += (width + (elmo_dim if cfg.elmo_at_output else 0)) * cfg.num_labels
  return 2.0 * L * bilm + 6.0 * L * task
