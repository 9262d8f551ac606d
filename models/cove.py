"""CoVe's MT-LSTM: an attentional LSTM encoder-decoder trained to translate (McCann et al. 2017, sec. 3).

The encoder reads frozen word vectors (GloVe, or random ones without a
GloVe file; words outside the vocabulary share one learned vector) with a
2-layer biLSTM; CoVe(x) is its top layer's states, H (sec. 4). The decoder
is a 2-layer LSTM with input feeding and global attention over H:

    s_t       = LSTM([z_{t-1}; h~_{t-1}], s_{t-1}),  s_0 = the encoder's final states
    alpha_t   = softmax(H (W1 s_t + b1))
    h~_t      = tanh(W2 [H^T alpha_t; s_t] + b2)
    p(y_t |.) = softmax(W_out h~_t + b_out)

Sizes follow the released model's OpenNMT run: 300-d word vectors, 300
cells per encoder direction, a 600-cell decoder (OpenNMT's rnn_size 600
with a bidirectional encoder), dropout 0.2 (salesforce/cove's OpenNMT-py
Models.py: on the inputs of every LSTM layer, on the encoder's states, on h~,
and once more on the decoder's word vector and fed h~ before its first layer).

Batches follow the translation spec with one example per row
(data.pack=False): source_ids (B, S) word ids, 0 = padding, no end marker;
target_input_ids, target_ids (B, L) subword ids. Decoding (translate.py)
calls `decoder`, below: the encoder once, then `decode_step` per token with
the LSTM states and h~ as the state. Each decoder layer starts from the
encoder layer's final (c, h), forward and backward side by side, as
OpenNMT-py's NMTModel starts it (so the two have as many layers).

Shape letters: B batch, S source words, L target tokens, W word vector
width, E target embedding width, X encoder state width (2 x cells), D
decoder cells, G gates (i, f, g, o), V target vocabulary, N decoding rows,
I an LSTM layer's input width, P its recurrent input (D), Y = X + D.
"""

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.dropout import Dropout
from models import layers
from models import lstm

Array = jax.Array

UNKNOWN_WORD_ID = 2  # input_pipeline/common/words.py: <S> </S> <UNK>, then words


@dataclasses.dataclass(frozen=True)
class Config:
  """The released MT-LSTM's sizes by default (salesforce/cove, OpenNMT-py -brnn -rnn_size 600)."""
  vocab_size: int = 50_000  # the target vocabulary (the decoder's softmax)
  source_vocab_size: int = 100_000  # source words, GloVe's where a GloVe file is given
  word_dim: int = 300  # GloVe's width
  hidden_size: int = 300  # cells per encoder direction; CoVe(x) has 2 x hidden_size
  num_encoder_layers: int = 2
  num_decoder_layers: int = 2
  target_embed_dim: int = 300
  dropout_rate: float = 0.2
  init_scale: float = 0.1  # uniform(-0.1, 0.1), OpenNMT's param_init
  dtype: str = 'float32'

  def __post_init__(self):
    for name in ('vocab_size', 'source_vocab_size', 'word_dim', 'hidden_size',
                 'num_encoder_layers', 'num_decoder_layers', 'target_embed_dim'):
      if getattr(self, name) < 1:
        raise ValueError(f'model.{name}={getattr(self, name)} must be positive: raise it.')
    if self.source_vocab_size <= UNKNOWN_WORD_ID:
      raise ValueError(f'model.source_vocab_size={self.source_vocab_size} leaves no room for '
                       'words after <S> </S> <UNK>: use thousands.')
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f'model.dropout_rate={self.dropout_rate} must be in [0, 1): lower it.')
    if self.num_decoder_layers != self.num_encoder_layers:
      raise ValueError(f'model.num_decoder_layers={self.num_decoder_layers} but '
                       f'model.num_encoder_layers={self.num_encoder_layers}: the decoder starts '
                       "from each encoder layer's final states (OpenNMT's); set both to the "
                       'same number.')

  @property
  def decoder_size(self) -> int:
    """D: the decoder's cells, as wide as the encoder's states (OpenNMT's rnn_size)."""
    return 2 * self.hidden_size


def check_config(config) -> None:
  """The pipeline must give one example per row: an LSTM cannot keep packed examples apart."""
  if config.data.get('pack', True):
    raise ValueError('CoVe reads one sentence pair per row: set --config.data.pack=False.')
  if config.data.get('source_tokenizer') != 'words':
    raise ValueError("CoVe's encoder reads word vectors: set --config.data.source_tokenizer="
                     'words.')
  if config.data.source_vocab_size != config.model.source_vocab_size:
    raise ValueError(f'data.source_vocab_size={config.data.source_vocab_size} but '
                     f'model.source_vocab_size={config.model.source_vocab_size}: set both to '
                     'the same value.')


def _uniform(cfg: Config) -> Callable[..., Array]:
  return lstm.symmetric_uniform(cfg.init_scale)


class WordVectors(nn.Module):
  """Word ids (B, S) -> vectors (B, S, W): the table's row, or the learned vector for <UNK>.

  The table is GloVe's vectors of the vocabulary's words (train.py fills it
  through `load_pretrained` on a fresh run) and stays frozen; without a
  GloVe file it keeps its random initialization.
  """
  config: Config

  @nn.compact
  def __call__(self, ids_BS: Array) -> Array:
    cfg = self.config
    table = layers.Embed(cfg.source_vocab_size, cfg.word_dim, ('vocab', 'embed'),
                         nn.initializers.normal(1.0), jnp.float32, name='table')
    unknown_W = self.param('unknown', nn.with_logical_partitioning(
        nn.initializers.zeros_init(), ('embed',)), (cfg.word_dim,), jnp.float32)
    # No gradient into the frozen table (optimizer.frozen also keeps weight decay off it).
    vectors_BSW = jax.lax.stop_gradient(table(ids_BS))
    return jnp.where((ids_BS == UNKNOWN_WORD_ID)[..., None], unknown_W, vectors_BSW)


class Encoder(nn.Module):
  """Word vectors (B, S, W) and lengths (B,) -> each biLSTM layer's states, a list of (B, S, X).

  CoVe(x) is the last one. Each layer's input is dropped out (OpenNMT's
  dropout on the embeddings and between the stacked LSTM layers).
  """
  config: Config

  @nn.compact
  def __call__(self, vectors_BSW: Array, lengths_B: Array, deterministic: bool,
               final: bool = False) -> list[Array] | tuple[list[Array], list[Any]]:
    """Each layer's states; with `final`, also each layer's final (c, h), both (B, X): the
    forward direction's after the last word and the backward one's after the first, side by
    side (OpenNMT-py's _fix_enc_hidden, which the decoder starts from)."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    x_BSX = vectors_BSW.astype(dtype)
    states, finals = [], []
    for i in range(cfg.num_encoder_layers):
      x_BSX = Dropout(cfg.dropout_rate)(x_BSX, deterministic=deterministic)
      # PyTorch's LSTM (which trained the released CoVe) adds no forget-gate bias.
      directions = [lstm.LSTM(cfg.hidden_size, forget_bias=0.0, reverse=reverse,
                              kernel_init=_uniform(cfg), dtype=dtype,
                              name=f'layer{i}_{name}')(x_BSX, lengths_B, final=True)
                    for name, reverse in (('forward', False), ('backward', True))]
      x_BSX = jnp.concatenate([out for out, _ in directions], axis=-1)
      states.append(x_BSX)
      finals.append(tuple(jnp.concatenate([state[k] for _, state in directions], axis=-1)
                          for k in (0, 1)))
    return (states, finals) if final else states


class DecoderCell(nn.Module):
  """One decoder step: (state, z_{t-1}) -> (state, h~_t, alpha_t), with the equations above.

  state = (c, h) of each LSTM layer, each (B, D), and h~_{t-1} (B, D);
  H_BSX is the encoder's top layer, source_mask_BS 1 at real words.
  """
  config: Config

  @nn.compact
  def __call__(self, state, z_BE: Array, H_BSX: Array, source_mask_BS: Array,
               deterministic: bool) -> tuple[Any, tuple[Array, Array]]:
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    D, X = cfg.decoder_size, H_BSX.shape[-1]
    cells, feed_BD = state
    # As salesforce/cove's OpenNMT-py Decoder: the word vector and the fed h~ each dropped,
    # then the input of every layer again (its StackedLSTM), the first layer's too.
    drop = lambda x_BX: Dropout(cfg.dropout_rate)(x_BX, deterministic=deterministic)  # noqa: E731
    x_BI = jnp.concatenate([drop(z_BE.astype(jnp.float32)), drop(feed_BD)], axis=-1)
    new_cells = []
    for i, (c_BD, h_BD) in enumerate(cells):
      x_BI = drop(x_BI)
      c_BD, h_BD = _lstm_cell(self, f'layer{i}', x_BI, c_BD, h_BD, D, dtype)
      new_cells.append((c_BD, h_BD))
      x_BI = h_BD
    s_BD = x_BI
    dense = functools.partial(layers.Einsum, kernel_init=_uniform(cfg), dtype=dtype)
    query_BX = dense('BD,DX->BX', (D, X), ('cell', 'embed'), name='attention_query')(s_BD)
    scores_BS = jnp.einsum('BSX,BX->BS', H_BSX.astype(jnp.float32), query_BX.astype(jnp.float32))
    scores_BS = jnp.where(source_mask_BS > 0, scores_BS, layers.NEG_INF)
    alpha_BS = jax.nn.softmax(scores_BS, axis=-1)
    context_BX = jnp.einsum('BS,BSX->BX', alpha_BS, H_BSX.astype(jnp.float32))
    combined_BY = jnp.concatenate([context_BX, s_BD], axis=-1)
    h_tilde_BD = jnp.tanh(dense('BY,YD->BD', (X + D, D), ('embed', 'cell'),
                                name='attention_output')(combined_BY).astype(jnp.float32))
    # Dropped once: the softmax reads this h~ and the next step is fed it (and drops it again).
    h_tilde_BD = drop(h_tilde_BD)
    return (tuple(new_cells), h_tilde_BD), (h_tilde_BD, alpha_BS)


def _lstm_cell(module: nn.Module, name: str, x_BI: Array, c_BD: Array, h_BD: Array, D: int,
               dtype) -> tuple[Array, Array]:
  """PyTorch's LSTMCell (gates i, f, g, o; no forget bias); the cell in float32."""
  init = _uniform(module.config)
  param = lambda suffix, init, shape, axes: module.param(  # noqa: E731
      f'{name}_{suffix}', nn.with_logical_partitioning(init, axes), shape, jnp.float32)
  input_kernel = param('input_kernel', init, (x_BI.shape[-1], 4, D), ('embed', None, 'cell'))
  recurrent_kernel = param('recurrent_kernel', init, (D, 4, D), ('embed', None, 'cell'))
  bias = param('bias', nn.initializers.zeros_init(), (4, D), (None, 'cell'))
  z_BGD = (jnp.einsum('BI,IGD->BGD', x_BI.astype(dtype), input_kernel.astype(dtype))
           + jnp.einsum('BP,PGD->BGD', h_BD.astype(dtype), recurrent_kernel.astype(dtype)))
  z_BGD = z_BGD.astype(jnp.float32) + bias
  i, f, g, o = (z_BGD[:, k] for k in range(4))
  c_BD = jax.nn.sigmoid(f) * c_BD + jax.nn.sigmoid(i) * jnp.tanh(g)
  return c_BD, jax.nn.sigmoid(o) * jnp.tanh(c_BD)


class Model(nn.Module):
  """The MT-LSTM; `__call__` returns the target 'logits' (B, L, V), 'cove' (B, S, X) and the
  attention weights 'alpha' (B, L, S)."""
  config: Config

  def setup(self):
    cfg = self.config
    self.word_vectors = WordVectors(cfg)  # frozen by configs/cove.py (optimizer.frozen)
    self.encoder = Encoder(cfg)
    self.target_embed = layers.Embed(cfg.vocab_size, cfg.target_embed_dim, ('vocab', 'embed'),
                                     _uniform(cfg), jnp.dtype(cfg.dtype))
    self.decoder = DecoderCell(cfg)
    self.output = layers.Einsum('...D,DV->...V', (cfg.decoder_size, cfg.vocab_size),
                                ('embed', 'vocab'), kernel_init=_uniform(cfg),
                                dtype=jnp.dtype(cfg.dtype))
    self.dropout = Dropout(cfg.dropout_rate)

  def encode(self, batch: Mapping[str, Array], *, deterministic: bool = True) -> list[Array]:
    """Every encoder layer's states (B, S, X), from the word ids."""
    ids_BS = batch['source_ids']
    return self.encode_vectors(self.word_vectors(ids_BS), source_lengths(batch),
                               deterministic=deterministic)

  def encode_vectors(self, vectors_BSW: Array, lengths_B: Array, *,
                     deterministic: bool = True) -> list[Array]:
    """Every encoder layer's states from given word vectors (feature extraction with any GloVe)."""
    return self.encoder(vectors_BSW, lengths_B, deterministic)

  def encode_for_decoding(self, batch: Mapping[str, Array], *, deterministic: bool = True
                          ) -> tuple[Array, Any]:
    """The encoder's top layer H (B, S, X) and the decoder's state before the first token:
    each LSTM layer's (c, h) the final ones of the encoder layer of the same number, both
    directions side by side (OpenNMT-py's NMTModel, whose rnn_size 600 is 2 x 300 for this),
    and h~_0 = 0."""
    states, finals = self.encoder(self.word_vectors(batch['source_ids']), source_lengths(batch),
                                  deterministic, final=True)
    cells = tuple((c.astype(jnp.float32), h.astype(jnp.float32)) for c, h in finals)
    return states[-1], (cells, jnp.zeros_like(cells[0][0]))

  def _logits(self, h_tilde: Array) -> Array:
    """The softmax's logits of h~, which the decoder cell has dropped already."""
    return self.output(h_tilde).astype(jnp.float32)

  def decode_step(self, state, token_N: Array, H_NSX: Array, source_mask_NS: Array):
    """Logits (N, V) of the token after `token_N`, and the next state (no dropout)."""
    z_NE = self.target_embed(token_N)
    state, (h_tilde_ND, _) = self.decoder(state, z_NE, H_NSX, source_mask_NS, True)
    return self._logits(h_tilde_ND), state

  def __call__(self, batch: Mapping[str, Array], *, deterministic: bool = True
               ) -> dict[str, Array]:
    H_BSX, start = self.encode_for_decoding(batch, deterministic=deterministic)
    memory_BSX = self.dropout(H_BSX, deterministic=deterministic)
    source_mask_BS = source_mask(batch)
    z_BLE = self.target_embed(batch['target_input_ids'])

    def step(cell, state, z_BE, H_BSX, source_mask_BS):
      return cell(state, z_BE, H_BSX, source_mask_BS, deterministic)

    # Input feeding makes the decoder sequential: one scan step per target token.
    scan = nn.scan(step, variable_broadcast='params', split_rngs={'params': False, 'dropout': True},
                   in_axes=(1, nn.broadcast, nn.broadcast), out_axes=1)
    _, (h_tilde_BLD, alpha_BLS) = scan(self.decoder, start, z_BLE, memory_BSX, source_mask_BS)
    return {'logits': self._logits(h_tilde_BLD), 'cove': H_BSX,
            'alpha': alpha_BLS}


def source_mask(batch: Mapping[str, Array]) -> Array:
  """1 at the source's words, 0 at padding (B, S)."""
  if 'source_segment_ids' in batch:
    return (batch['source_segment_ids'] > 0).astype(jnp.int32)
  return (batch['source_ids'] > 0).astype(jnp.int32)


def source_lengths(batch: Mapping[str, Array]) -> Array:
  """Words per row (B,)."""
  return source_mask(batch).sum(axis=1)


def decoder(model: Model, params: Any, source_ids_BS: Array, *, beam_size: int,
            max_length: int) -> tuple[Callable, Any, Callable | None]:
  """(step, state, reorder) for decoding.greedy_search / beam_search: B * beam_size rows.

  The state is the decoder's LSTM states and h~, the encoder's states and the
  source mask, all with rows first (decoding.gather_rows reorders them).
  """
  del max_length  # an LSTM has no cache to size
  batch = {'source_ids': source_ids_BS}
  H_BSX, start = model.apply({'params': params}, batch, method='encode_for_decoding')
  repeat = lambda x: jnp.repeat(x, beam_size, axis=0)  # noqa: E731
  state = (jax.tree.map(repeat, start), repeat(H_BSX), repeat(source_mask(batch)))

  def step(token_N, state):
    lstm_state, H_NSX, mask_NS = state
    logits_NV, lstm_state = model.apply({'params': params}, lstm_state, token_N, H_NSX, mask_NS,
                                        method='decode_step')
    return logits_NV, (lstm_state, H_NSX, mask_NS)

  return step, state, None


def load_pretrained(config, params: Any, tokenizer) -> Any:
  """`params` with GloVe's vectors of the source vocabulary in the word table (data.glove_file)."""
  if not config.data.get('glove_file'):
    return params
  from input_pipeline.common import glove  # pylint: disable=g-import-not-at-top
  table = params['word_vectors']['table']['embedding']
  # The vocabulary holds only words of the file (input_pipeline/translation.py), and the
  # rows of <S> </S> <UNK> stay zero: <UNK> reads the learned vector instead.
  vectors, _ = glove.vectors_for(tokenizer.source.words, config.data.glove_file,
                                 config.data.lower_case)
  # The table has model.source_vocab_size rows; a smaller vocabulary leaves the rest unused.
  vectors = np.pad(vectors, ((0, table.shape[0] - len(vectors)), (0, 0)))
  loaded = jax.make_array_from_callback(table.shape, table.sharding,
                                        lambda index: vectors[index])
  params = dict(params)
  params['word_vectors'] = {**params['word_vectors'], 'table': {'embedding': loaded}}
  return params


def train_flops_per_example(cfg: Config, data_cfg) -> float:
  """Analytic training FLOPs of one sentence pair padded to data.max_seq_length a side: 3x the
  forward matmul FLOPs (2 per multiply-add), every step of both LSTMs and every attention score."""
  S = L = data_cfg.max_seq_length
  H, W, E, D, V = (cfg.hidden_size, cfg.word_dim, cfg.target_embed_dim, cfg.decoder_size,
                   cfg.vocab_size)
  X = 2 * H
  encoder, width = 0, W
  for _ in range(cfg.num_encoder_layers):
    encoder += 2 * S * 2 * (width + H) * 4 * H  # two directions
    width = X
  decoder, width = 0, E + D
  for _ in range(cfg.num_decoder_layers):
    decoder += L * 2 * (width + D) * 4 * D
    width = D
  attention = L * 2 * (D * X + 2 * S * X + (X + D) * D)
  return 3.0 * (encoder + decoder + attention + L * 2 * D * V)
