"""A biLSTM tagger over features of a frozen BERT (Devlin et al. 2018, sec. 5.3, table 7).

The feature-based approach of sec. 5.3: BERT's parameters stay as
pretrained and "a two-layer 768-dimensional BiLSTM before the classification
layer" reads the activations of one or more of its layers. BERT
(models/bert.py, under params['bert'] as in a pretraining run, so
train.init_params fills it from config.init_from) runs without dropout
behind a stop-gradient; optimizer.frozen=('bert',) keeps weight decay off it.

Inputs follow the tagging spec of input_pipeline/bert_finetune.py:
input_ids, segment_ids, input_mask (B, L) over [CLS] wordpieces [SEP]
[PAD]...; the labels sit on each word's first piece. The biLSTM runs over
the input_mask.sum(-1) real tokens, [CLS] and [SEP] included.

feature_layers picks one row of table 7, from BERT's hidden states (index 0
the embedding output, i the output of layer i):
  embeddings        layer 0
  second_to_last    layer L-1
  last              layer L
  sum_last_four     layers L-3..L summed
  concat_last_four  layers L, L-1, L-2, L-3 concatenated (4D wide), the paper's best
  sum_all           layers 1..L summed: the paper's "weighted sum all 12 layers" of
                    BERT-BASE is read as its 12 Transformer layers without the
                    embeddings, with equal weights (no learned weights are described)

Shape letters: B batch, L tokens, D BERT width, N labels, X a feature width
(the combination's D or 4D, the biLSTM's 2 x task_lstm_dim).
"""

import dataclasses
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import bert
from models.dropout import Dropout
from models import layers
from models import lstm

Array = jax.Array

# train.py's init_from accepts a BERT run, whose parameters fill params['bert'].
PRETRAINED_MODEL = 'bert'
PRETRAINED_PARAMS = 'bert'

FEATURE_LAYERS = ('embeddings', 'second_to_last', 'last', 'sum_last_four', 'concat_last_four',
                  'sum_all')
# The Transformer layers a combination reads beyond the embeddings.
_LAYERS_NEEDED = {'second_to_last': 2, 'sum_last_four': 4, 'concat_last_four': 4}


def check_feature_layers(feature_layers: str, num_layers: int, what: str) -> None:
  """One-line ValueError unless `feature_layers` names a combination this BERT's depth has."""
  if feature_layers not in FEATURE_LAYERS:
    raise ValueError(f'{what}={feature_layers!r}: use one of {", ".join(FEATURE_LAYERS)}.')
  needed = _LAYERS_NEEDED.get(feature_layers, 1)
  if num_layers < needed:
    raise ValueError(f'{what}={feature_layers} reads {needed} Transformer layers and this BERT '
                     f'has {num_layers}: pick last, embeddings or sum_all.')


def combine_layers(hidden_states: Sequence[Array], feature_layers: str) -> Array:
  """Table 7's token features (..., L, D or 4D) from [embeddings, layer 1, ..., layer L]."""
  h = hidden_states
  if feature_layers == 'embeddings':
    return h[0]
  if feature_layers == 'second_to_last':
    return h[-2]
  if feature_layers == 'last':
    return h[-1]
  if feature_layers == 'sum_last_four':
    return h[-1] + h[-2] + h[-3] + h[-4]
  if feature_layers == 'concat_last_four':
    return jnp.concatenate([h[-1], h[-2], h[-3], h[-4]], axis=-1)
  if feature_layers == 'sum_all':
    return sum(h[2:], h[1])
  raise ValueError(f'feature_layers={feature_layers!r}: use one of {", ".join(FEATURE_LAYERS)}.')


def feature_width(cfg) -> int:
  return cfg.hidden_size * (4 if cfg.feature_layers == 'concat_last_four' else 1)


@dataclasses.dataclass(frozen=True)
class Config(bert.Config):
  """BERT's fields (models/bert.py, same names and defaults) and the task model's.

  BERT's dropout fields are unused: the frozen BERT runs deterministically.
  The paper gives no dropout for this task model; 0.5 is the usual rate of
  biLSTM taggers over fixed features (ELMo's NER model, models/elmo_tagger.py).
  """
  num_labels: int = 9  # CoNLL 2003's IOB tags
  head: str = 'tag'  # this model's head; the BERT inside has none
  feature_layers: str = 'concat_last_four'  # table 7's best: 96.1 dev F1
  task_lstm_dim: int = 768  # cells per direction (sec. 5.3)
  task_num_layers: int = 2
  task_dropout_rate: float = 0.5  # between biLSTM layers and before the classifier

  def __post_init__(self):
    super().__post_init__()
    if self.head != 'tag':
      raise ValueError(f'model.head={self.head!r}: the feature-based tagger has only the tag '
                       "head; set model.head='tag'.")
    check_feature_layers(self.feature_layers, self.num_layers, 'model.feature_layers')
    for name in ('num_labels', 'task_lstm_dim', 'task_num_layers'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)}: set it to a positive integer.')
    if not 0.0 <= self.task_dropout_rate < 1.0:
      raise ValueError(f'model.task_dropout_rate={self.task_dropout_rate}: use a rate in [0, 1).')


def check_config(config) -> None:
  """Features of a random BERT are noise, and weight decay would move an unfrozen one (train.py
  calls this)."""
  if not config.get('init_from'):
    raise ValueError('model_name=bert_feature_tagger reads a pretrained BERT: set '
                     '--config.init_from to the workdir of a BERT run.')
  if 'bert' not in tuple(config.optimizer.get('frozen', ())):
    raise ValueError("BERT stays frozen in the feature-based approach (sec. 5.3): add 'bert' to "
                     "optimizer.frozen, e.g. --config.optimizer.frozen='(\"bert\",)'.")


def bert_config(cfg: Config) -> bert.Config:
  """The pretraining model's Config with the BERT fields of a tagger Config, and no head."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(bert.Config)}
  return bert.Config(**{**fields, 'num_labels': 0, 'head': 'classify'})


class Model(nn.Module):
  """Tag logits (B, L, num_labels) from a task biLSTM over a frozen BERT's combined layers."""
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Any]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    lengths_B = batch['input_mask'].sum(axis=-1).astype(jnp.int32)
    # Frozen: no dropout inside BERT and no gradient into it (sec. 5.3).
    encoder = bert.Model(bert_config(cfg), name='bert')(
        {k: batch[k] for k in ('input_ids', 'segment_ids', 'input_mask')}, deterministic=True)
    hidden = jax.lax.stop_gradient([h.astype(jnp.float32) for h in encoder['hidden_states']])
    features_BLX = combine_layers(hidden, cfg.feature_layers)

    h_BLX = features_BLX.astype(dtype)
    for i in range(cfg.task_num_layers):
      if i:
        h_BLX = Dropout(cfg.task_dropout_rate)(h_BLX, deterministic=deterministic)
      h_BLX = jnp.concatenate([
          lstm.LSTM(cfg.task_lstm_dim, projection=0, reverse=reverse, dtype=dtype,
                    name=f'task_{direction}_{i}')(h_BLX, lengths_B)
          for direction, reverse in (('forward', False), ('backward', True))], axis=-1)
    h_BLX = Dropout(cfg.task_dropout_rate)(h_BLX, deterministic=deterministic)
    logits_BLN = layers.Einsum('BLX,XN->BLN', (h_BLX.shape[-1], cfg.num_labels), ('embed', None),
                               dtype=dtype, name='classifier')(h_BLX)
    return {'logits': logits_BLN.astype(jnp.float32), 'features': features_BLX}


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs per example: BERT's layers forward once (frozen: no backward; its
  pooler and NSP head feed nothing and are compiled away), the task biLSTM and classifier
  three times (forward and backward). 2 FLOPs per multiply-add."""
  L, S, D, F = data_cfg.max_seq_length, cfg.task_lstm_dim, cfg.hidden_size, cfg.mlp_dim
  bert_forward = cfg.num_layers * (2 * L * (4 * D * D + 2 * D * F) + 2 * 2 * L * L * D)
  task, width = 0, feature_width(cfg)
  for _ in range(cfg.task_num_layers):  # input and recurrent kernels, both directions
    task += 2 * 2 * (width * 4 * S + S * 4 * S)
    width = 2 * S
  task += 2 * width * cfg.num_labels
  return bert_forward + 3.0 * L * task
