"""Cross-View Training's biLSTM tagger: a primary module and four restricted views (Clark et al. 2018).

Encoder (sec. 3.1, cvt_text's sizes by default): a word embedding (times a
learned scalar, cvt_text's emb_scale) concatenated with a char CNN's max-pooled
filters, then two biLSTM layers with projections. The first layer's forward and
backward states h1_fw, h1_bw feed the auxiliary modules; the primary module
reads [h1_fw; h1_bw; h2]. A prediction module is softmax(W ReLU(W' x + b') + b)
(sec. 2). The auxiliary views of token i (sec. 3.1, sequence tagging): forward
h1_fw[i], backward h1_bw[i], future h1_fw[i-1] (not token i itself), past
h1_bw[i+1].

On an unlabeled training batch (no 'labels' in it, sec. 2) the model runs
the encoder twice: once without dropout for the primary module's soft
targets (the teacher, behind a stop-gradient), once with dropout for the
auxiliary modules (the students). Labeled training batches use the primary
module alone. Dropout is cvt_text's: on the encoder's input and on each LSTM
layer's output (its DropoutWrapper), at the rate of the batch (labeled or
unlabeled); the modules read those states with no dropout of their own. One
primary module and one set of auxiliary modules per task (sec. 3.3).

Shape letters: B batch, L tokens, X a feature width, H the prediction
modules' hidden width, N a task's labels.
"""

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import char_cnn
from models.dropout import Dropout
from models import layers
from models import lstm

Array = jax.Array

AUX_VIEWS = ('forward', 'backward', 'future', 'past')


@dataclasses.dataclass(frozen=True)
class Config:
  """cvt_text's model (research/cvt_text base/configure.py) by default."""
  vocab_size: int = 100_000
  num_labels: tuple = (17,)  # per task, in config.data.tasks order (BIOES CoNLL NER: 17)
  word_dim: int = 300
  char_dim: int = 50
  filters: tuple = ((2, 100), (3, 100), (4, 100))  # (width, count) of the char CNN
  max_characters_per_token: int = 22  # max_word_length 20, and the word's two markers
  first_lstm_dim: int = 1024  # cells per direction
  second_lstm_dim: int = 512
  projection_dim: int = 512  # the LSTMs' projections and the prediction modules' hidden layer
  labeled_dropout_rate: float = 0.5
  unlabeled_dropout_rate: float = 0.2
  dtype: str = 'float32'

  def __post_init__(self):
    # ml_collections may hand over lists.
    object.__setattr__(self, 'num_labels', tuple(int(n) for n in self.num_labels))
    object.__setattr__(self, 'filters', tuple((int(w), int(n)) for w, n in self.filters))
    for name in ('vocab_size', 'word_dim', 'char_dim', 'max_characters_per_token',
                 'first_lstm_dim', 'second_lstm_dim', 'projection_dim'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)} must be positive: raise it.')
    if not self.num_labels or min(self.num_labels) < 2:
      raise ValueError(f'model.num_labels={self.num_labels} needs two or more labels per task: '
                       'set it from the tasks (configs/cvt.py does).')
    if not self.filters or any(w < 1 or n < 1 for w, n in self.filters):
      raise ValueError(f'model.filters={self.filters} needs (width, count) pairs of positive '
                       'sizes: e.g. ((2, 100), (3, 100)).')
    if max(w for w, _ in self.filters) > self.max_characters_per_token:
      raise ValueError(f'model.filters={self.filters} has a filter wider than '
                       f'model.max_characters_per_token={self.max_characters_per_token}: '
                       'narrow it or allow more characters.')
    for name in ('labeled_dropout_rate', 'unlabeled_dropout_rate'):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f'model.{name}={getattr(self, name)} must be in [0, 1): lower it.')


class PredictionModule(nn.Module):
  """softmax(W ReLU(W' x + b') + b), as logits (sec. 2)."""
  hidden: int
  num_labels: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BLX: Array) -> Array:
    h_BLH = layers.Einsum('BLX,XH->BLH', (x_BLX.shape[-1], self.hidden), ('embed', 'mlp'),
                          kernel_init=nn.initializers.glorot_uniform(), dtype=self.dtype,
                          name='hidden')(x_BLX)
    h_BLH = jax.nn.relu(h_BLH)
    logits = layers.Einsum('BLH,HN->BLN', (self.hidden, self.num_labels), ('mlp', None),
                           kernel_init=nn.initializers.glorot_uniform(), dtype=self.dtype,
                           name='output')(h_BLH)
    return logits.astype(jnp.float32)


class Encoder(nn.Module):
  """Tokens -> (h1_fw, h1_bw, h2): the first biLSTM's two directions and the second's output."""
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], dropout_rate: float, deterministic: bool
               ) -> tuple[Array, Array, Array]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    drop = lambda x: Dropout(dropout_rate)(x, deterministic=deterministic)  # noqa: E731
    lengths_B = batch['lengths']
    words_BLX = layers.Embed(cfg.vocab_size, cfg.word_dim, ('vocab', 'embed'),
                             nn.initializers.normal(cfg.word_dim ** -0.5), dtype,
                             name='word_embed')(batch['token_ids'])
    # cvt_text scales the word vectors by a learned scalar (its emb_scale), from 1.
    emb_scale = self.param('emb_scale', nn.with_logical_partitioning(
        nn.initializers.ones_init(), ()), (), jnp.float32)
    words_BLX = words_BLX * emb_scale.astype(dtype)
    chars_BLX = char_cnn.CharCNN(char_dim=cfg.char_dim, filters=cfg.filters, num_highway=0,
                                 output_dim=0, dtype=dtype, name='char_cnn')(batch['char_ids'])
    x_BLX = drop(jnp.concatenate([words_BLX, chars_BLX.astype(dtype)], axis=-1))

    def bilstm(x, cells, prefix):
      return [lstm.LSTM(cells, projection=cfg.projection_dim, reverse=reverse, dtype=dtype,
                        name=f'{prefix}_{direction}')(x, lengths_B)
              for direction, reverse in (('forward', False), ('backward', True))]

    h1_fw, h1_bw = bilstm(x_BLX, cfg.first_lstm_dim, 'first')
    h1_fw, h1_bw = drop(h1_fw), drop(h1_bw)
    h2_BLX = drop(jnp.concatenate(
        bilstm(jnp.concatenate([h1_fw, h1_bw], axis=-1), cfg.second_lstm_dim, 'second'), axis=-1))
    return h1_fw, h1_bw, h2_BLX


def views(h1_fw_BLX: Array, h1_bw_BLX: Array) -> dict[str, Array]:
  """Each auxiliary module's input at each position (zeros where the neighbour is missing)."""
  zeros_B1X = jnp.zeros_like(h1_fw_BLX[:, :1])
  return {
      'forward': h1_fw_BLX,
      'backward': h1_bw_BLX,
      'future': jnp.concatenate([zeros_B1X, h1_fw_BLX[:, :-1]], axis=1),  # state at i - 1
      'past': jnp.concatenate([h1_bw_BLX[:, 1:], zeros_B1X], axis=1),  # state at i + 1
  }


class Model(nn.Module):
  """Primary logits per task, and on unlabeled training batches the auxiliary logits."""
  config: Config

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    self.encoder = Encoder(cfg)
    module = lambda n, name: PredictionModule(cfg.projection_dim, n, dtype, name=name)  # noqa: E731
    self.primary = [module(n, f'task_{t}_primary') for t, n in enumerate(cfg.num_labels)]
    self.auxiliary = [{view: module(n, f'task_{t}_{view}') for view in AUX_VIEWS}
                      for t, n in enumerate(cfg.num_labels)]

  def _primary(self, h1_fw, h1_bw, h2) -> tuple[Array, ...]:
    # The encoder's states are dropped out already (cvt_text's DropoutWrapper on each LSTM's
    # output): the modules read them as they are, with no dropout of their own.
    x_BLX = jnp.concatenate([h1_fw, h1_bw, h2], axis=-1)
    return tuple(module(x_BLX) for module in self.primary)

  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Any]:
    cfg = self.config
    if 'labels' in batch and not deterministic:  # a labeled training batch
      h = self.encoder(batch, cfg.labeled_dropout_rate, False)
      return {'primary_logits': self._primary(*h)}
    # Eval, or the teacher of an unlabeled batch: no dropout anywhere.
    h = self.encoder(batch, 0.0, True)
    outputs = {'primary_logits': self._primary(*h)}
    if deterministic and not self.is_initializing():
      return outputs
    outputs['primary_logits'] = jax.lax.stop_gradient(outputs['primary_logits'])
    # The students: another pass with dropout, each module on its restricted view.
    h1_fw, h1_bw, _ = self.encoder(batch, cfg.unlabeled_dropout_rate, deterministic)
    inputs = views(h1_fw, h1_bw)
    outputs['aux_logits'] = tuple({view: modules[view](inputs[view]) for view in AUX_VIEWS}
                                  for modules in self.auxiliary)
    return outputs


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Matmul FLOPs of a labeled training step per sentence (3x the forward: backward is 2x).

  An unlabeled step costs more: a forward pass for the targets, then forward
  and backward through the encoder and the four auxiliary modules.
  """
  length, width = data_cfg.max_seq_length, data_cfg.max_characters_per_token
  P, H = cfg.projection_dim, cfg.projection_dim
  chars = sum(2 * (width - w + 1) * w * cfg.char_dim * n for w, n in cfg.filters)

  def lstm_layer(inputs, cells):  # input and recurrent gates, projection; both directions
    return 2 * (2 * inputs * 4 * cells + 2 * P * 4 * cells + 2 * cells * P)
  first = lstm_layer(cfg.word_dim + sum(n for _, n in cfg.filters), cfg.first_lstm_dim)
  second = lstm_layer(2 * P, cfg.second_lstm_dim)
  primary = sum(2 * 4 * P * H + 2 * H * n for n in cfg.num_labels)
  return 3.0 * length * (chars + first + second + primary)
