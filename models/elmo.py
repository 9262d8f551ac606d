"""ELMo: a char-CNN biLM and its layer mix (Peters et al. 2018, sec. 3).

The biLM (sec. 3.1, 3.4) encodes each token from its characters (CharCNN),
runs separate forward and backward L-layer LSTM LMs over the tokens (4096
cells projected to 512, residual from layer 2 on, as bilm-tf) and shares the
token encoder and the softmax between the two directions. The objective
(objectives/bilm.py) scores the top states with the softmax, sampled in
training (Jean et al. 2015). ELMo (sec. 3.2) is a task-learned scalar mix of
the L + 1 layers, each [forward; backward] (the token layer duplicated).

Batch (input_pipeline/bilm.py): char_ids (B, L, W), lengths (B,), token_ids
(B, L). Shape letters: B batch, L tokens, W characters per token, D
projection width, S LSTM cells, V vocab, K sampled classes, J mixed layers
(num_layers + 1), X mixed width (2D).
"""

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.char_cnn import CharCNN
from models.dropout import Dropout
from models.lstm import LSTM

Array = jax.Array

NUM_CHARS = 262  # 256 bytes + 1, the sentence and word markers, in-word padding; 0 = no token


@dataclasses.dataclass(frozen=True)
class Config:
  """The released ELMo by default (bilm-tf's options.json; sec. 3.4)."""
  vocab_size: int = 793471
  char_dim: int = 16
  max_characters_per_token: int = 50
  filters: tuple = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
  num_highway: int = 2
  projection_dim: int = 512  # D: the token layer and the LSTM projection
  lstm_dim: int = 4096  # S
  num_layers: int = 2
  cell_clip: float = 3.0
  proj_clip: float = 3.0
  # bilm-tf's options.json use_skip_connections: a residual around each LSTM layer after the first.
  skip_connections: bool = True
  char_activation: str = 'relu'  # of the char CNN's pooled filters (bilm-tf: relu or tanh)
  dropout_rate: float = 0.1
  num_sampled: int = 8192  # 0 = full softmax in training too
  sample_unique: bool = True  # sampling without replacement (TF's default)
  dtype: str = 'float32'

  def __post_init__(self):
    # ml_collections may hand over lists of lists.
    object.__setattr__(self, 'filters', tuple((int(w), int(n)) for w, n in self.filters))
    sizes = ('vocab_size', 'char_dim', 'max_characters_per_token', 'projection_dim', 'lstm_dim',
             'num_layers')
    for name in sizes:
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)} must be positive: raise it.')
    if not self.filters or any(w < 1 or n < 1 for w, n in self.filters):
      raise ValueError(f'model.filters={self.filters} needs (width, count) pairs of positive '
                       'sizes: e.g. ((1, 32), (2, 32)).')
    widest = max(w for w, _ in self.filters)
    if widest > self.max_characters_per_token:
      raise ValueError(f'model.filters has a width {widest} above model.max_characters_per_token='
                       f'{self.max_characters_per_token}: narrow it or allow more characters.')
    if self.num_highway < 0 or self.num_sampled < 0:
      raise ValueError(f'model.num_highway={self.num_highway} and model.num_sampled='
                       f'{self.num_sampled} must be >= 0: set them to 0 or more.')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'model.dropout_rate={self.dropout_rate} must be in [0, 1): lower it.')


def length_mask(lengths_B: Array, length: int) -> Array:
  """(B, L) boolean: True at the real tokens t < length."""
  return jnp.arange(length)[None, :] < lengths_B[:, None]


class BiLM(nn.Module):
  """The shared char-CNN token encoder and the forward and backward LSTM LMs (sec. 3.1).

  Returns 'token_BLD' and, per direction, every layer's (B, L, D) output
  ('forward', 'backward'); all are zeros at t >= length. Each LSTM layer's
  input gets dropout in training; from the second layer on its output adds
  that (dropped-out) input back, as bilm-tf's DropoutWrapper(ResidualWrapper)
  (unless skip_connections is off).
  """
  config: Config

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    # bilm-tf projects the filters' outputs only when they are not already projection_dim wide
    # (use_proj = n_filters != projection_dim).
    filters = sum(count for _, count in cfg.filters)
    self.char_cnn = CharCNN(NUM_CHARS, cfg.char_dim, cfg.filters, cfg.num_highway,
                            0 if filters == cfg.projection_dim else cfg.projection_dim,
                            cfg.char_activation, dtype)
    # bilm-tf projects only when the cells are wider than the output.
    projection = 0 if cfg.lstm_dim == cfg.projection_dim else cfg.projection_dim
    lstm = functools.partial(LSTM, cfg.lstm_dim, projection, cfg.cell_clip, cfg.proj_clip,
                             forget_bias=1.0, dtype=dtype)
    self.forward = [lstm() for _ in range(cfg.num_layers)]  # params 'forward_0', ...
    self.backward = [lstm(reverse=True) for _ in range(cfg.num_layers)]
    self.dropout = Dropout(cfg.dropout_rate)

  def __call__(self, char_ids_BLW: Array, lengths_B: Array, *,
               deterministic: bool = True) -> dict[str, Any]:
    token_BLD = self.encode_tokens(char_ids_BLW, lengths_B)
    forward, backward = self.contextualize(token_BLD, lengths_B, deterministic=deterministic)
    return {'token_BLD': token_BLD, 'forward': forward, 'backward': backward}

  def encode_tokens(self, char_ids_BLW: Array, lengths_B: Array) -> Array:
    """The context-free token layer (B, L, D), zeros at t >= length."""
    W = char_ids_BLW.shape[-1]
    if W != self.config.max_characters_per_token:
      raise ValueError(f'char_ids have {W} characters per token, model.max_characters_per_token='
                       f'{self.config.max_characters_per_token}: make the data and model agree.')
    token_BLD = self.char_cnn(char_ids_BLW)
    token_BLD = jnp.where(length_mask(lengths_B, token_BLD.shape[1])[..., None], token_BLD, 0.0)
    return nn.with_logical_constraint(token_BLD, ('batch', 'length', 'act_embed'))

  def contextualize(self, token_BLD: Array, lengths_B: Array, *,
                    deterministic: bool = True) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """Every layer's output of the forward and of the backward LM over the token layer."""
    def run(lstms):
      outputs, x_BLD = [], token_BLD
      for i, lstm in enumerate(lstms):
        x_BLD = self.dropout(x_BLD, deterministic=deterministic)
        h_BLD = lstm(x_BLD, lengths_B)
        x_BLD = h_BLD + x_BLD if i and self.config.skip_connections else h_BLD
        x_BLD = nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))
        outputs.append(x_BLD)
      return tuple(outputs)
    return run(self.forward), run(self.backward)


class Softmax(nn.Module):
  """The output layer shared by both directions: a (V, D) kernel and a (V,) bias."""
  vocab_size: int
  features: int

  def setup(self):
    # bilm-tf: normal(0, 1/sqrt(D)) kernel, zero bias.
    self.kernel = self.param(
        'kernel', nn.with_logical_partitioning(nn.initializers.normal(self.features ** -0.5),
                                               ('vocab', 'embed')),
        (self.vocab_size, self.features), jnp.float32)
    self.bias = self.param(
        'bias', nn.with_logical_partitioning(nn.initializers.zeros_init(), ('vocab',)),
        (self.vocab_size,), jnp.float32)

  def __call__(self) -> tuple[Array, Array]:
    return self.kernel, self.bias


class Model(nn.Module):
  """The biLM pretraining model: top states of both directions, the softmax and the ELMo layers.

  In training (not deterministic) the top states get dropout, as bilm-tf's
  before its softmax, and with num_sampled > 0 the classes of the sampled
  softmax are drawn here from the 'sampling' rng: 'sampled_ids' (2, K), one
  sample for each direction (bilm-tf's two sampled_softmax_loss calls draw
  theirs apart), and 'log_expected_counts' (V,).
  """
  config: Config

  @nn.compact
  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True) -> dict[str, Any]:
    cfg = self.config
    bilm = BiLM(cfg, name='bilm')(batch['char_ids'], batch['lengths'],
                                  deterministic=deterministic)
    dropout = Dropout(cfg.dropout_rate)
    kernel_VD, bias_V = Softmax(cfg.vocab_size, cfg.projection_dim, name='softmax')()
    outputs = {
        'forward_states': dropout(bilm['forward'][-1], deterministic=deterministic),
        'backward_states': dropout(bilm['backward'][-1], deterministic=deterministic),
        'softmax_kernel': kernel_VD,
        'softmax_bias': bias_V,
        'layers': elmo_layers(bilm['token_BLD'], bilm['forward'], bilm['backward']),
    }
    if not deterministic and cfg.num_sampled > 0:
      draws = [sample_candidates(key, cfg.vocab_size, cfg.num_sampled, cfg.sample_unique)
               for key in jax.random.split(self.make_rng('sampling'))]
      outputs['sampled_ids'] = jnp.stack([ids for ids, _ in draws])  # forward's, backward's
      outputs['log_expected_counts'] = draws[0][1]  # a function of V and K alone
    return outputs


def elmo_layers(token_BLD: Array, forward: Sequence[Array], backward: Sequence[Array]) -> Array:
  """(B, J, L, 2D): [token; token], then [forward_j; backward_j] per layer (sec. 3.2)."""
  pairs = [(token_BLD, token_BLD)] + list(zip(forward, backward))
  return jnp.stack([jnp.concatenate(pair, axis=-1) for pair in pairs], axis=1)


class ScalarMix(nn.Module):
  """ELMo_task = gamma * sum_j softmax(s)_j h_j (sec. 3.2, eq. 1); also returns sum(s ** 2).

  With `layer_norm`, each layer is first normalized by the mean and variance
  of its unmasked values over the whole batch (as allennlp's ScalarMix).
  `top_only` is the ablation gamma * top layer (sec. 5.2), without s;
  `single_layer` j likewise takes layer j alone (sec. 5.3 compares the
  first and second biLM layers on syntax and semantics tasks).
  Returns (mix (B, L, X) float32, zeros at masked positions; l2).
  """
  num_layers: int  # J
  layer_norm: bool = False
  top_only: bool = False
  single_layer: int | None = None

  @nn.compact
  def __call__(self, layers_BJLX: Array, mask_BL: Array) -> tuple[Array, Array]:
    if layers_BJLX.shape[1] != self.num_layers:
      raise ValueError(f'ScalarMix got {layers_BJLX.shape[1]} layers but num_layers='
                       f'{self.num_layers}: build it with the biLM num_layers + 1.')
    gamma = self.param('gamma', nn.with_logical_partitioning(nn.initializers.ones_init(), ()),
                       (), jnp.float32)
    keep_B1L1 = (mask_BL > 0)[:, None, :, None]
    h_BJLX = jnp.where(keep_B1L1, layers_BJLX.astype(jnp.float32), 0.0)
    if self.single_layer is not None and not 0 <= self.single_layer < self.num_layers:
      raise ValueError(f'ScalarMix single_layer={self.single_layer}: use a layer in '
                       f'0..{self.num_layers - 1}.')
    if self.top_only or self.single_layer is not None:
      j = self.num_layers - 1 if self.top_only else self.single_layer
      return gamma * h_BJLX[:, j], jnp.zeros((), jnp.float32)
    s_J = self.param('scalar_weights',
                     nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
                     (self.num_layers,), jnp.float32)
    if self.layer_norm:
      count = jnp.maximum(keep_B1L1.sum() * h_BJLX.shape[-1], 1)
      mean_J = h_BJLX.sum(axis=(0, 2, 3)) / count
      centered_BJLX = h_BJLX - mean_J[:, None, None]
      var_J = jnp.where(keep_B1L1, centered_BJLX ** 2, 0.0).sum(axis=(0, 2, 3)) / count
      h_BJLX = jnp.where(keep_B1L1, centered_BJLX * jax.lax.rsqrt(var_J + 1e-12)[:, None, None],
                         0.0)
    mix_BLX = gamma * jnp.einsum('J,BJLX->BLX', jax.nn.softmax(s_J), h_BJLX)
    return mix_BLX, jnp.sum(s_J ** 2)


# The sampled softmax's classes (Jean et al. 2015; TF's log_uniform_candidate_sampler).


def log_uniform_log_probs(vocab_size: int) -> Array:
  """log q(c), q(c) = log((c + 2) / (c + 1)) / log(V + 1): Zipf over ids sorted by frequency."""
  c_V = jnp.arange(vocab_size, dtype=jnp.float32)
  return jnp.log(jnp.log1p(1.0 / (c_V + 1.0))) - math.log(math.log(vocab_size + 1.0))


def sample_candidates(rng: Array, vocab_size: int, num_sampled: int,
                      unique: bool) -> tuple[Array, Array]:
  """K class ids drawn from q and the log expected count of every class in such a sample.

  With replacement, the expected count is K q(c). Without (`unique`, Gumbel
  top-k), it is 1 - (1 - q(c))^T, TF's approximation by its number of tries
  T, with T set so that the counts sum to K; with K >= V, all V ids, each
  counted once.
  """
  log_q_V = log_uniform_log_probs(vocab_size)
  if not unique:
    # Inverting q's CDF, (c + 1) = floor((V + 1)^u), gives q exactly.
    u_K = jax.random.uniform(rng, (num_sampled,))
    ids_K = jnp.floor(jnp.exp(u_K * math.log(vocab_size + 1.0))).astype(jnp.int32) - 1
    return jnp.clip(ids_K, 0, vocab_size - 1), log_q_V + math.log(num_sampled)
  if num_sampled >= vocab_size:
    return jnp.arange(vocab_size, dtype=jnp.int32), jnp.zeros((vocab_size,), jnp.float32)
  _, ids_K = jax.lax.top_k(log_q_V + jax.random.gumbel(rng, (vocab_size,)), num_sampled)
  return ids_K.astype(jnp.int32), jnp.asarray(
      _log_expected_counts_without_replacement(vocab_size, num_sampled))


@functools.lru_cache(maxsize=8)
def _log_expected_counts_without_replacement(vocab_size: int, num_sampled: int) -> np.ndarray:
  """log(1 - (1 - q)^T) with T such that the counts sum to K: a constant of (V, K), so numpy once."""
  c_V = np.arange(vocab_size, dtype=np.float64)
  q_V = np.log1p(1.0 / (c_V + 1.0)) / math.log(vocab_size + 1.0)
  log1m_q_V = np.log1p(-q_V)
  counts = lambda log_tries: -np.expm1(np.exp(log_tries) * log1m_q_V)  # noqa: E731
  # K tries give at most K distinct classes; 30 / min q tries give all of them.
  low, high = math.log(num_sampled), math.log(30.0 / q_V.min())
  for _ in range(60):
    middle = 0.5 * (low + high)
    low, high = (low, middle) if counts(middle).sum() > num_sampled else (middle, high)
  return np.log(counts(0.5 * (low + high))).astype(np.float32)


def bilm_macs_per_token(cfg: Config) -> float:
  """Multiply-adds of the biLM's forward pass per token, the softmax left out."""
  W, E, D, S = cfg.max_characters_per_token, cfg.char_dim, cfg.projection_dim, cfg.lstm_dim
  N = sum(n for _, n in cfg.filters)
  char_cnn = sum((W - w + 1) * w * E * n for w, n in cfg.filters)
  token_encoder = char_cnn + cfg.num_highway * 2 * N * N + N * D
  lstm = 2 * D * 4 * S + (S * D if S != D else 0)  # input and recurrent kernels, projection
  return token_encoder + 2 * cfg.num_layers * lstm


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs per example: 6x the forward multiply-adds (2 FLOPs each, 3 passes).

  XLA's cost analysis counts the LSTM's time loop once. The softmax covers
  V classes, or the K samples and the target with the sampled softmax.
  """
  classes = cfg.vocab_size if cfg.num_sampled == 0 else min(cfg.num_sampled, cfg.vocab_size) + 1
  per_token = bilm_macs_per_token(cfg) + 2 * cfg.projection_dim * classes
  return 6.0 * data_cfg.max_seq_length * per_token
