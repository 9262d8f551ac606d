"""The Biattentive Classification Network over [GloVe(w); CoVe(w)] (McCann et al. 2017, sec. 5).

For the two inputs x and y of a task (single-sentence tasks: y = x), with
w~ = [GloVe(w); CoVe(w)] from a CoVe run's frozen word vectors and encoder:

    X = biLSTM(f(w~x)),  Y = biLSTM(f(w~y))        f: a ReLU feed-forward layer
    A = X Y^T,  Ax = softmax(A),  Ay = softmax(A^T) (over x's and y's words)
    Cx = Ax^T X,  Cy = Ay^T Y
    X|y = biLSTM([X; X - Cy; X * Cy]),  Y|x = biLSTM([Y; Y - Cx; Y * Cx])
    beta_x = softmax(X|y v1 + d1),  x_self = X|y^T beta_x   (and y_self with v2, d2)
    x_pool = [max(X|y); mean(X|y); min(X|y); x_self]        (over real words only)
    logits = maxout network (3 layers, pool 4) of [x_pool; y_pool]

The biLSTM encoding X and Y is one shared module, and so is the integrator;
d1 and d2 are left out, as a softmax ignores a constant shift.
The paper batch-normalizes the maxout network; with no batch statistics here, LayerNorm does it.

The word vectors and the encoder are cove.WordVectors and cove.Encoder under
the same names as in models/cove.py ('word_vectors', 'encoder'), so that
train.py's init_from fills them from a CoVe run; they run without dropout and
behind a stop-gradient (configs/cove_classifier.py also freezes them in the
optimizer). With use_cove=False the BCN reads GloVe(w) alone, the paper's
GloVe-only baseline. The BCN's sizes and dropout default to AllenNLP's
reproduction of the paper's model (biattentive_classification_network.jsonnet).

Batches follow input_pipeline/word_classification.py: x_ids, y_ids (B, L)
word ids, x_lengths, y_lengths (B,).

Shape letters: B batch, L x's words, S y's words, R = 2B rows and T =
max(L, S) words where x and y share one array (one LSTM scan reads both),
W word vector width, E w~'s width, F the feed-forward width, X the biLSTM's
states (2 x bilstm_dim), I the integrator's states (2 x integrator_dim), P
pooled features, K maxout units, Q maxout pool size, N labels.
"""

import dataclasses
import json
import os
from typing import Any, Mapping

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from models import cove
from models.dropout import Dropout
from models import layers
from models import lstm

Array = jax.Array

# train.py's init_from accepts a run of this model: the word vectors and the encoder come from it.
PRETRAINED_MODEL = 'cove'
# Our field -> the CoVe run's, compared by train.check_init_from.
INIT_FROM_FIELDS = {'vocab_size': 'source_vocab_size', 'word_dim': 'word_dim',
                    'hidden_size': 'hidden_size', 'num_encoder_layers': 'num_encoder_layers'}
_LAYER_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Config:
  """The CoVe run's encoder sizes, and the BCN's (AllenNLP's reproduction of the paper's)."""
  vocab_size: int = 100_000  # the CoVe run's source words (its model.source_vocab_size)
  word_dim: int = 300  # GloVe's width
  hidden_size: int = 300  # CoVe's cells per direction: CoVe(w) has 2 x hidden_size
  num_encoder_layers: int = 2
  use_cove: bool = True  # False: GloVe(w) alone, the paper's baseline
  num_labels: int = 2
  feedforward_dim: int = 300  # f, the ReLU layer before the biLSTM
  bilstm_dim: int = 300  # cells per direction of the biLSTM giving X and Y
  integrator_dim: int = 300  # cells per direction of the integrating biLSTM
  maxout_dims: tuple = (1200, 600)  # the first two maxout layers; the third gives the logits
  maxout_pool_size: int = 4
  embedding_dropout_rate: float = 0.25  # on w~
  feedforward_dropout_rate: float = 0.25  # on f(w~)
  integrator_dropout_rate: float = 0.1  # on [x_pool; y_pool]
  maxout_dropout_rates: tuple = (0.2, 0.3)  # after each of the first two maxout layers
  dtype: str = 'float32'
  # optimizer.frozen (trainer.checks.model_config gives it): no gradient is computed into a
  # frozen 'word_vectors' or 'encoder'; left out, it fine-tunes.
  frozen: tuple = ('word_vectors', 'encoder')

  def __post_init__(self):
    # ml_collections may hand over lists.
    object.__setattr__(self, 'frozen', tuple(self.frozen))
    object.__setattr__(self, 'maxout_dims', tuple(int(k) for k in self.maxout_dims))
    object.__setattr__(self, 'maxout_dropout_rates',
                       tuple(float(r) for r in self.maxout_dropout_rates))
    for name in ('vocab_size', 'word_dim', 'hidden_size', 'num_encoder_layers', 'feedforward_dim',
                 'bilstm_dim', 'integrator_dim', 'maxout_pool_size'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)} must be positive: raise it.')
    if self.vocab_size <= cove.UNKNOWN_WORD_ID:
      raise ValueError(f'model.vocab_size={self.vocab_size} leaves no room for words after '
                       '<S> </S> <UNK>: set it to the CoVe run\'s model.source_vocab_size.')
    if self.num_labels < 2:
      raise ValueError(f'model.num_labels={self.num_labels}: the BCN classifies into 2 or more '
                       'labels; set it from the task (configs/cove_classifier.py does).')
    if not self.maxout_dims or min(self.maxout_dims) < 1:
      raise ValueError(f'model.maxout_dims={self.maxout_dims} needs positive widths: e.g. '
                       '(1200, 600).')
    if len(self.maxout_dropout_rates) != len(self.maxout_dims):
      raise ValueError(f'model.maxout_dropout_rates={self.maxout_dropout_rates} needs one rate '
                       f'per layer of model.maxout_dims={self.maxout_dims}: give as many.')
    rates = (self.embedding_dropout_rate, self.feedforward_dropout_rate,
             self.integrator_dropout_rate, *self.maxout_dropout_rates)
    if not all(0.0 <= r < 1.0 for r in rates):
      raise ValueError(f'A dropout rate of model is outside [0, 1) ({rates}): lower it.')


def check_config(config) -> None:
  """The word vectors and vocabulary come from a CoVe run, even without CoVe (train.py calls it)."""
  if not config.get('init_from'):
    uses = ('GloVe(w) and CoVe(w)' if config.model.get('use_cove', True)
            else 'GloVe(w) (the use_cove=False baseline too)')
    raise ValueError(f'The BCN reads {uses} and the word vocabulary of a trained CoVe run: set '
                     '--config.init_from to the workdir of a configs/cove.py run of the same '
                     'size.')
  saved = os.path.join(config.init_from, 'config.json')
  if os.path.isfile(saved):
    with open(saved, encoding='utf-8') as f:
      glove_file = json.load(f).get('data', {}).get('glove_file', '')
    if not glove_file:  # fine for the tiny offline runs, not for the paper's comparison
      logging.warning('The CoVe run in config.init_from was trained on random word vectors, '
                      'not GloVe: "GloVe(w)" here is those vectors.')


def cove_config(cfg: Config) -> cove.Config:
  """The CoVe model's Config with the encoder sizes of a BCN Config (its decoder is not built)."""
  return cove.Config(source_vocab_size=cfg.vocab_size, word_dim=cfg.word_dim,
                     hidden_size=cfg.hidden_size, num_encoder_layers=cfg.num_encoder_layers,
                     num_decoder_layers=cfg.num_encoder_layers, dtype=cfg.dtype)


def length_mask(lengths_B: Array, length: int) -> Array:
  """Boolean (B, length): True at a row's first lengths[b] positions."""
  return jnp.arange(length)[None, :] < lengths_B[:, None]


def biattention(X_BLX: Array, Y_BSX: Array, x_mask_BL: Array, y_mask_BS: Array
                ) -> tuple[Array, Array]:
  """(Cx (B, S, X), Cy (B, L, X)): for each word of y the attended X, for each word of x the
  attended Y; A = X Y^T, softmax over the real words only (sec. 5), in float32."""
  X_BLX, Y_BSX = X_BLX.astype(jnp.float32), Y_BSX.astype(jnp.float32)
  A_BLS = jnp.einsum('BLX,BSX->BLS', X_BLX, Y_BSX)
  # Ax = softmax(A) normalizes over x's words; Ay = softmax(A^T) over y's (kept as (B, L, S)).
  Ax_BLS = jax.nn.softmax(jnp.where(x_mask_BL[:, :, None], A_BLS, layers.NEG_INF), axis=1)
  Ay_BLS = jax.nn.softmax(jnp.where(y_mask_BS[:, None, :], A_BLS, layers.NEG_INF), axis=2)
  Cx_BSX = jnp.einsum('BLS,BLX->BSX', Ax_BLS, X_BLX)
  Cy_BLX = jnp.einsum('BLS,BSX->BLX', Ay_BLS, Y_BSX)
  return Cx_BSX, Cy_BLX


def pool(h_BLI: Array, mask_BL: Array, scores_BL: Array) -> Array:
  """[max; mean; min; self-attentive] pooling over the real positions (B, 4I), in float32 (sec. 5).

  scores_BL = h v, the self-attentive pooling's logits.
  """
  h_BLI = h_BLI.astype(jnp.float32)
  mask_BL1 = mask_BL[:, :, None]
  # Finite fills: a row without words (never fed) gives finite features, not infinities.
  max_BI = jnp.where(mask_BL1, h_BLI, layers.NEG_INF).max(axis=1)
  min_BI = jnp.where(mask_BL1, h_BLI, -layers.NEG_INF).min(axis=1)
  count_B1 = jnp.maximum(mask_BL.sum(axis=1, keepdims=True), 1).astype(jnp.float32)
  mean_BI = jnp.where(mask_BL1, h_BLI, 0.0).sum(axis=1) / count_B1
  beta_BL = jax.nn.softmax(jnp.where(mask_BL, scores_BL.astype(jnp.float32), layers.NEG_INF),
                           axis=-1)
  self_BI = jnp.einsum('BL,BLI->BI', beta_BL, h_BLI)
  return jnp.concatenate([max_BI, mean_BI, min_BI, self_BI], axis=-1)


def _glorot_3d() -> Any:
  """Glorot-uniform over a (X, K, Q) kernel's input X and output K x Q."""
  return nn.initializers.variance_scaling(1.0, 'fan_avg', 'uniform', in_axis=0, out_axis=(1, 2))


class Maxout(nn.Module):
  """(B, X) -> (B, K): the max of Q affine maps of the normalized input (Goodfellow et al. 2013)."""
  features: int
  pool_size: int
  output_axis: str | None = 'mlp'
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BX: Array) -> Array:
    x_BX = layers.layer_norm(_LAYER_NORM_EPS, self.dtype, name='norm')(x_BX)
    z_BKQ = layers.Einsum('BX,XKQ->BKQ', (x_BX.shape[-1], self.features, self.pool_size),
                          ('embed', self.output_axis, None), kernel_init=_glorot_3d(),
                          dtype=self.dtype, name='pieces')(x_BX)
    return z_BKQ.max(axis=-1)


def _pair_rows(x_BL: Array, y_BS: Array) -> Array:
  """x and y interleaved as the rows of one (2B, T, ...) array, T = max(L, S), zero-padded.

  One LSTM scan then reads both; interleaving (not concatenating) keeps each
  example's two rows on the device that holds the example.
  """
  T = max(x_BL.shape[1], y_BS.shape[1])
  pad = lambda a: jnp.pad(a, [(0, 0), (0, T - a.shape[1])] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
  both = jnp.stack([pad(x_BL), pad(y_BS)], axis=1)
  return both.reshape((-1,) + both.shape[2:])


def _split_rows(rows: Array, L: int, S: int) -> tuple[Array, Array]:
  """The inverse of _pair_rows: x's rows cut to L and y's to S."""
  both = rows.reshape((-1, 2) + rows.shape[1:])
  return both[:, 0, :L], both[:, 1, :S]


class Model(nn.Module):
  """The BCN; `__call__` returns 'logits' (B, num_labels) and 'pooled', [x_pool; y_pool] (B, P)."""
  config: Config

  def _bilstm(self, name: str, cells: int, x_RTD: Array, lengths_R: Array) -> Array:
    # PyTorch's LSTM, as CoVe's encoder: no forget-gate bias.
    return jnp.concatenate([
        lstm.LSTM(cells, forget_bias=0.0, reverse=reverse, dtype=jnp.dtype(self.config.dtype),
                  name=f'{name}_{direction}')(x_RTD, lengths_R)
        for direction, reverse in (('forward', False), ('backward', True))], axis=-1)

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Array]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    drop = lambda rate, x: Dropout(rate)(x, deterministic=deterministic)  # noqa: E731
    L, S = batch['x_ids'].shape[1], batch['y_ids'].shape[1]
    ids_RT = _pair_rows(batch['x_ids'], batch['y_ids'])
    lengths_R = _pair_rows(batch['x_lengths'][:, None], batch['y_lengths'][:, None])[:, 0]
    mask_RT = length_mask(lengths_R, ids_RT.shape[1])

    # w~ = [GloVe(w); CoVe(w)]: no dropout inside CoVe, and no gradient computed that only a
    # frozen part would take (through a frozen encoder to trained word vectors it flows).
    vectors_RTW = cove.WordVectors(cove_config(cfg), name='word_vectors')(ids_RT)
    if 'word_vectors' in cfg.frozen:
      vectors_RTW = jax.lax.stop_gradient(vectors_RTW)
    w_RTE = vectors_RTW.astype(dtype)
    if cfg.use_cove:
      cove_RTX = cove.Encoder(cove_config(cfg), name='encoder')(
          vectors_RTW, lengths_R, deterministic=True)[-1]
      if _encoder_gets_no_gradient(cfg):
        cove_RTX = jax.lax.stop_gradient(cove_RTX)
      w_RTE = jnp.concatenate([w_RTE, cove_RTX.astype(dtype)], axis=-1)
    w_RTE = drop(cfg.embedding_dropout_rate, w_RTE)

    f_RTF = layers.Einsum('RTE,EF->RTF', (w_RTE.shape[-1], cfg.feedforward_dim),
                          ('embed', 'mlp'), kernel_init=nn.initializers.glorot_uniform(),
                          dtype=dtype, name='feedforward')(w_RTE)
    f_RTF = drop(cfg.feedforward_dropout_rate, jax.nn.relu(f_RTF))
    X_BLX, Y_BSX = _split_rows(self._bilstm('bilstm', cfg.bilstm_dim, f_RTF, lengths_R), L, S)

    x_mask_BL, y_mask_BS = _split_rows(mask_RT, L, S)
    Cx_BSX, Cy_BLX = biattention(X_BLX, Y_BSX, x_mask_BL, y_mask_BS)
    X_BLX, Y_BSX = X_BLX.astype(jnp.float32), Y_BSX.astype(jnp.float32)
    integrator_in_RT3X = _pair_rows(
        jnp.concatenate([X_BLX, X_BLX - Cy_BLX, X_BLX * Cy_BLX], axis=-1),
        jnp.concatenate([Y_BSX, Y_BSX - Cx_BSX, Y_BSX * Cx_BSX], axis=-1)).astype(dtype)
    x_given_y_BLI, y_given_x_BSI = _split_rows(
        self._bilstm('integrator', cfg.integrator_dim, integrator_in_RT3X, lengths_R), L, S)

    I = 2 * cfg.integrator_dim
    self_scores = lambda name, h: layers.Einsum(  # noqa: E731
        '...I,I->...', (I,), ('embed',), use_bias=False, kernel_init=nn.initializers.normal(
            I ** -0.5), dtype=jnp.float32, name=name)(h)
    pooled_BP = jnp.concatenate([
        pool(x_given_y_BLI, x_mask_BL, self_scores('x_self_attention', x_given_y_BLI)),
        pool(y_given_x_BSI, y_mask_BS, self_scores('y_self_attention', y_given_x_BSI))], axis=-1)

    h_BK = drop(cfg.integrator_dropout_rate, pooled_BP)
    for i, (units, rate) in enumerate(zip(cfg.maxout_dims, cfg.maxout_dropout_rates)):
      h_BK = drop(rate, Maxout(units, cfg.maxout_pool_size, dtype=dtype, name=f'maxout_{i}')(h_BK))
    logits_BN = Maxout(cfg.num_labels, cfg.maxout_pool_size, output_axis=None, dtype=dtype,
                       name=f'maxout_{len(cfg.maxout_dims)}')(h_BK)
    return {'logits': logits_BN.astype(jnp.float32), 'pooled': pooled_BP}


def _encoder_gets_no_gradient(cfg: Config) -> bool:
  """Both the encoder and the word vectors under it frozen: no backward pass through CoVe."""
  return {'encoder', 'word_vectors'} <= set(cfg.frozen)


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs of one example, x and y padded to data.max_seq_length (2 per
  multiply-add): a frozen CoVe encoder over frozen word vectors forward once (no gradient
  reaches it; else 3x), 3x the forward of the rest (its backward is 2x), every LSTM step and attention
  score counted."""
  T, W, H = data_cfg.max_seq_length, cfg.word_dim, cfg.hidden_size
  F, X, I = cfg.feedforward_dim, 2 * cfg.bilstm_dim, 2 * cfg.integrator_dim

  def bilstm(inputs, cells):  # both directions, input and recurrent gates, one sequence
    return 2 * T * 2 * (inputs + cells) * 4 * cells

  cove_encoder, width = 0, W
  if cfg.use_cove:
    for _ in range(cfg.num_encoder_layers):
      cove_encoder += bilstm(width, H)
      width = 2 * H
  E = W + (2 * H if cfg.use_cove else 0)
  per_sequence = (2 * T * E * F + bilstm(F, cfg.bilstm_dim) + bilstm(3 * X, cfg.integrator_dim)
                  + 2 * T * I)
  attention = 3 * 2 * T * T * X  # the scores, Cx and Cy
  Q, widths = cfg.maxout_pool_size, (8 * I, *cfg.maxout_dims, cfg.num_labels)
  maxout = sum(2 * a * b * Q for a, b in zip(widths[:-1], widths[1:]))
  passes = 1.0 if _encoder_gets_no_gradient(cfg) else 3.0
  return passes * 2 * cove_encoder + 3.0 * (2 * per_sequence + attention + maxout)
