"""Dropout (Srivastava et al. 2014) on 16 bits of a counted hash per element, for every model.

flax.linen.Dropout draws a float32 uniform per element from 32 threefry bits: twenty rounds of
adds, rotations and xors for each 32-bit word, about 130 PTX instructions a word in the kernel
XLA compiles for an H100. That arithmetic, not the memory the mask takes, bounds a dropout. Here
the mask is counted from the element's position instead, as models/flash_dropout.py's kernels
count the attention probabilities' inside the kernel, so the two give the same mask for the same
RNG. On a 2-core CPU a dropout of BERT's (32, 128, 768) activations takes 2 ms where threefry's
16 bits an element took 29 (docs/benchmarks.md).

For an array (..., rows, columns), `draw_keys` draws one 32-bit key per leading index (B for
activations (B, L, D); (B, H) for attention probabilities (B, H, L, S)) from the RNG with
threefry. Row r has the word mix(key ^ mix(r)), the pair of columns (2c, 2c + 1) the word
mix(c ^ COLUMN_SALT), a constant of the program, and their pair's draw is mix(row ^ column),
`mix` MurmurHash3's 32-bit finalizer: a bijection whose output bits each depend on every input
bit. The draw's low 16 bits decide column 2c, its high 16 bits column 2c + 1; an element is
dropped where its 16 bits fall below rate * 2^16. So the rate is the nearest multiple of 2^-16
(0.1 -> 0.1000061), and kept values are scaled by one over the exact keep probability: every
element's expectation is unchanged. tests/test_dropout.py checks the draws against independent
ones (rates, their spread, neighbours, and the parity of a rectangle's corners, which a hash
linear in xor fails).

The keys are drawn with the leading axes and the rows and columns counted from their positions,
so a batch-sharded input draws its mask on its own shard, the same mask as unsharded; and the
masks come from the step's RNG, so a resumed run draws what the uninterrupted run would.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_LEVELS = 1 << 16
COLUMN_SALT = 0x9E3779B9  # keeps the word of column pair c apart from row c's


def shift_in(x: Array) -> Array:
  """`mix`'s first step, x ^ (x >> 16). It distributes over xor, so the rows' and the columns'
  words (`row_words`, `column_words`) take it once a word, and a pair's draw, `mix_on` of their
  xor, is `mix` of the plain words' xor at two instructions less."""
  return x ^ (x >> 16)


def mix_on(x: Array) -> Array:
  """The rest of `mix` after `shift_in`: two multiplies around an xorshift, a last xorshift."""
  uint32 = np.uint32 if isinstance(x, np.ndarray) else jnp.uint32
  x = x * uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def mix(x: Array) -> Array:
  """A bijection of uint32 words in which every output bit depends on every input bit
  (MurmurHash3's finalizer: two xorshift-multiply rounds and a last xorshift). `x` is a jax
  array, or a numpy one (column_words)."""
  return mix_on(shift_in(x))


def threshold(rate: float) -> int:
  """Elements whose 16 bits fall below this are dropped: the rate to the nearest multiple of
  2^-16 (0.1 -> 0.1000061)."""
  return round(rate * _LEVELS)


def keep_scale(dropped: int) -> float:
  """1 / P(keep) for elements dropped below `dropped`: what the kept values are multiplied by."""
  return _LEVELS / (_LEVELS - dropped)


def draw_keys(rng: Array, lead: tuple[int, ...]) -> Array:
  """The uint32 keys of one call's masks, one per leading index, drawn from `rng`."""
  return jax.random.bits(rng, lead, jnp.uint32)


def row_words(keys: Array, rows: Array) -> Array:
  """The words of rows `rows` (a vector) under each key (`keys` broadcast against `rows`),
  mix(key ^ mix(r)), through `shift_in`."""
  return shift_in(mix(keys ^ mix(rows.astype(jnp.uint32))))


def column_words(columns: int) -> np.ndarray:
  """The words of the columns' pairs (2c, 2c + 1), mix(c ^ COLUMN_SALT) through `shift_in`,
  ceil(columns / 2) of them, the same for every call: a constant of the compiled program (numpy's,
  so no device holds it while tracing)."""
  return shift_in(mix(np.arange((columns + 1) // 2, dtype=np.uint32) ^ np.uint32(COLUMN_SALT)))


def keep_pairs(rows: Array, pairs: Array, dropped: int) -> Array:
  """The kept elements (..., R, 2 P) of row words (..., R) and pair words (P,), the element
  dropped where its 16 bits fall below `dropped` (at most 2^16 - 1): `keep_mask`'s mask with one
  `mix` for each pair of elements, as the kernels compute a tile's. Each pair's draw, mix(row ^
  column) of the plain words, gives its low 16 bits to column 2c and its high 16 bits to column
  2c + 1."""
  draws = mix_on(rows[..., :, None] ^ pairs)
  low = (draws & jnp.uint32(0xFFFF)) >= jnp.uint32(dropped)
  high = draws >= jnp.uint32(dropped << 16)  # (draws >> 16) >= dropped
  both = jnp.stack([low, high], axis=-1)
  return both.reshape(*both.shape[:-2], 2 * both.shape[-2])


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> tuple[Array, float]:
  """(boolean mask of the kept elements, the scale of kept values 1 / P(keep))."""
  dropped = threshold(rate)
  if dropped >= _LEVELS:
    return jnp.zeros(shape, jnp.bool_), 0.0
  if not dropped:
    return jnp.ones(shape, jnp.bool_), 1.0
  *lead, rows, columns = (1, 1, *shape)[-max(len(shape), 2):]  # a vector (or scalar): one row
  keep = keep_for_keys(draw_keys(rng, tuple(lead)), rows, columns, dropped)
  return keep.reshape(shape), keep_scale(dropped)


def keep_for_keys(keys: Array, rows: int, columns: int, dropped: int) -> Array:
  """The kept elements (*keys.shape, rows, columns) under these keys, an element dropped where
  its 16 bits fall below `dropped` (at most 2^16 - 1): `keep_pairs`' mask element by element,
  column j taking its pair's word and the half j % 2 picks. One elementwise expression, which
  XLA fuses into the kernels around it; with keep_pairs' stacked halves XLA wrote GPT-1's
  attention mask to memory (aot.py's H100 estimate of its step with XLA's attention: 97.4 ms
  against 81.6)."""
  return _keep(row_words(keys[..., None], jnp.arange(rows, dtype=jnp.uint32)), columns, dropped)


def keep_rows(key: Array, rows: Array, columns: int, dropped: int) -> Array:
  """The kept elements (*rows.shape, columns) of the rows numbered `rows` (any integer array) of
  a table `columns` wide, under one key: the mask of a dropout of the whole table, read at
  those rows, so that a row has one mask wherever it is read."""
  return _keep(row_words(key, rows), columns, dropped)


def _keep(words: Array, columns: int, dropped: int) -> Array:
  """The kept elements (*words.shape, columns) of rows with these words."""
  pair_of_column = np.repeat(column_words(columns), 2)[:columns]
  shift = np.resize(np.uint32([0, 16]), columns)
  draws = mix_on(words[..., None] ^ pair_of_column) >> shift
  return (draws & jnp.uint32(0xFFFF)) >= jnp.uint32(dropped)


def dropout(x: Array, rate: float, rng: Array) -> Array:
  """x with each element zeroed with probability `rate`, the others scaled to keep the mean."""
  keep, scale = keep_mask(rng, rate, x.shape)
  return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


class TableDropout(nn.Module):
  """The dropout of an embedding table applied before the lookup, as OpenAI's GPT code drops
  its table (`we = dropout(we, embd_pdrop, train)`, then the gather): on the looked-up rows
  x (..., D) of ids `rows`, with one mask per row of the table for the whole step, the same
  wherever (in the batch, at whichever position) the row is read. Only the rows read are
  computed, unless `table` (num_rows, D) is given: then (x, the whole table under the same
  mask), for a tied output layer, which OpenAI's code computes from the dropped table too.
  Rngs 'dropout'."""
  rate: float
  rng_collection: str = 'dropout'

  @nn.compact
  def __call__(self, x: Array, rows: Array, deterministic: bool,
               table: Array | None = None) -> Array | tuple[Array, Array]:
    if deterministic or self.rate == 0.0:
      return x if table is None else (x, table)
    dropped = threshold(self.rate)
    key = draw_keys(self.make_rng(self.rng_collection), ())

    def drop(y: Array, ids: Array) -> Array:
      if dropped >= _LEVELS:
        return jnp.zeros_like(y)
      keep = keep_rows(key, ids.astype(jnp.uint32), y.shape[-1], dropped)
      return jnp.where(keep, y * jnp.asarray(keep_scale(dropped), y.dtype), jnp.zeros((), y.dtype))

    if table is None:
      return drop(x, rows)
    return drop(x, rows), drop(table, jnp.arange(table.shape[0]))


class Dropout(nn.Module):
  """flax.linen.Dropout's interface: Dropout(rate)(x, deterministic=...), rngs 'dropout'."""
  rate: float
  rng_collection: str = 'dropout'

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng(self.rng_collection))
