"""Dropout on 16 bits of a counted hash per element (models/dropout.py): the mask as its docstring
defines it, its statistics against independent draws, and what the models rely on (the rate and
scale, the step's RNG, sharding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import dropout
from models import flash_dropout


@pytest.mark.parametrize('shape', [(64, 1001), (8, 4, 32, 32), (2, 3, 7), (7,)])
def test_drops_the_rate_and_scales_the_rest_to_keep_the_mean(shape):
  x = jnp.full(shape, 3.0)
  y = np.asarray(dropout.dropout(x, 0.1, jax.random.key(0)))
  n, dropped = y.size, int((y == 0).sum())
  # Binomial(n, 0.1000061): within 5 standard deviations.
  assert abs(dropped - 0.1 * n) < 5 * np.sqrt(n * 0.1 * 0.9) + 1
  kept = y[y != 0]
  np.testing.assert_allclose(kept, 3.0 * 65536 / (65536 - 6554), rtol=1e-6)


def test_the_mask_follows_the_key_and_differs_between_halves_of_a_draw():
  x = jnp.ones((16, 256))
  a, b = (np.asarray(dropout.dropout(x, 0.5, jax.random.key(k))) for k in (0, 1))
  np.testing.assert_array_equal(a, np.asarray(dropout.dropout(x, 0.5, jax.random.key(0))))
  assert (a != b).mean() > 0.4
  # The two 16-bit halves of one 32-bit draw decide two elements: they must not agree.
  assert (a[:, 0::2] != a[:, 1::2]).mean() > 0.4


def _fmix32(x: np.ndarray) -> np.ndarray:
  """MurmurHash3's 32-bit finalizer, written here from its definition."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


@pytest.mark.parametrize('shape', [(2, 3, 16, 10), (5, 16, 9), (16, 10), (9,)])
def test_keep_mask_is_the_documented_hash(shape):
  """The mask as models/dropout.py's docstring defines it, computed here in numpy: one key per
  leading index drawn with threefry, row r the word mix(key ^ mix(r)), column pair c the word
  mix(c ^ 0x9E3779B9), and mix(row ^ column) gives columns 2c and 2c + 1 its low and high 16
  bits, kept where they reach rate * 2^16 (an array of one axis is one row)."""
  rate, rng = 0.3, jax.random.key(7)
  *lead, rows, columns = (1, *shape) if len(shape) == 1 else shape
  keys = np.asarray(jax.random.bits(rng, tuple(lead), jnp.uint32))
  with np.errstate(over='ignore'):
    row_words = _fmix32(keys[..., None] ^ _fmix32(np.arange(rows, dtype=np.uint32)))
    pair_words = _fmix32(np.arange((columns + 1) // 2, dtype=np.uint32) ^ np.uint32(0x9E3779B9))
    draws = _fmix32(row_words[..., None] ^ pair_words)  # (..., rows, pairs)
  halves = np.stack([draws & np.uint32(0xFFFF), draws >> np.uint32(16)], axis=-1)
  expected = (halves >= round(rate * 2 ** 16)).reshape(*lead, rows, -1)[..., :columns]
  keep, scale = dropout.keep_mask(rng, rate, shape)
  np.testing.assert_array_equal(np.asarray(keep), expected.reshape(shape))
  assert scale == 65536 / (65536 - round(rate * 65536))


def test_attention_probabilities_take_the_mask_of_the_flash_kernels():
  """XLA's attention (layers) and models/flash_dropout.py's kernels drop the same elements of
  the (B, H, L, S) probabilities for the same RNG: the kernels' keys are dropout.draw_keys'."""
  B, H, L, S, rng = 2, 3, 128, 64, jax.random.key(11)
  expected = flash_dropout.keep_mask(flash_dropout.dropout_keys(rng, B, H), L, S, 0.1)
  np.testing.assert_array_equal(np.asarray(dropout.keep_mask(rng, 0.1, (B, H, L, S))[0]),
                                np.asarray(expected))


@pytest.mark.parametrize('shape', [(4, 4, 128, 128), (512, 512)])
def test_masks_are_independent_draws_at_the_rate(shape):
  """16 draws: each draw's rate within the binomial spread, the draws' spread that of
  independent elements (cuDNN's was twice it on an H200: docs/accelerators.md), and neighbours
  along every axis (the keys' axes, rows, columns), the two halves of a draw, two draws, and the
  corners of a rectangle, agreeing as independent elements would. (512, 512): one key, rows
  apart by their words alone."""
  rate = 0.1
  draws = np.stack([np.asarray(dropout.keep_mask(jax.random.key(seed), rate, shape)[0])
                    for seed in range(16)])
  n = np.prod(shape)
  binomial_sd = np.sqrt(rate * (1 - rate) / n)
  dropped = 1 - draws.reshape(16, -1).mean(axis=1)
  assert np.abs(dropped - rate).max() < 4.5 * binomial_sd
  assert 0.5 * binomial_sd < dropped.std(ddof=1) < 1.5 * binomial_sd
  independent = (1 - rate) ** 2 + rate ** 2  # P(two independent elements agree)
  sd = np.sqrt(independent * (1 - independent) / (16 * n))
  for axis in range(1, draws.ndim):
    first = np.take(draws, range(draws.shape[axis] - 1), axis=axis)
    second = np.take(draws, range(1, draws.shape[axis]), axis=axis)
    assert abs((first == second).mean() - independent) < 5 * sd * 2, axis
  assert abs((draws[:-1] == draws[1:]).mean() - independent) < 5 * sd * 2  # two steps
  # Columns 2c and 2c + 1 take the low and the high 16 bits of one draw: they must agree as
  # often as independent elements (the neighbours above mix these pairs with others).
  pair_sd = np.sqrt(independent * (1 - independent) / (draws.size / 2))
  assert abs((draws[..., 0::2] == draws[..., 1::2]).mean() - independent) < 5 * pair_sd
  # An element's word is a row's word xor a column pair's: the four of a rectangle xor to zero.
  # Its four draws must still be independent: an odd number dropped as often as independent
  # elements at the draws' rate would have it (a mix that kept xor's structure gives none).
  p = 1 - draws.mean()
  odd = (1 - (1 - 2 * p) ** 4) / 2
  dropped = ~draws.astype(bool)
  for rows, cols in ((1, 1), (101, 3)):
    corners = (dropped[..., :-rows, :-cols] ^ dropped[..., rows:, :-cols]
               ^ dropped[..., :-rows, cols:] ^ dropped[..., rows:, cols:])
    assert abs(corners.mean() - odd) < 5 * np.sqrt(odd * (1 - odd) / corners.size), (rows, cols)


def test_identity_when_deterministic_or_rate_zero_and_zeros_at_rate_one():
  x = jnp.arange(12.0).reshape(3, 4)
  module = dropout.Dropout(0.3)
  np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
  np.testing.assert_array_equal(
      dropout.Dropout(0.0).apply({}, x, deterministic=False, rngs={'dropout': jax.random.key(0)}),
      x)
  np.testing.assert_array_equal(dropout.dropout(x, 1.0, jax.random.key(0)), 0.0)
  assert dropout.dropout(jnp.float32(2.0), 0.5, jax.random.key(0)).shape == ()


def test_a_batch_sharded_input_gets_the_same_mask_as_an_unsharded_one():
  mesh = jax.make_mesh((8,), ('data',))
  x = jnp.ones((16, 6, 10), jnp.bfloat16)
  drop = jax.jit(lambda x, k: dropout.dropout(x, 0.1, k))
  want = np.asarray(drop(x, jax.random.key(3)), np.float32)
  sharded = jax.device_put(x, NamedSharding(mesh, P('data')))
  got = drop(sharded, jax.random.key(3))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  # Each device draws the keys of its own rows (2 of the 16) and counts its own elements'
  # draws: nothing of the mask crosses devices.
  hlo = drop.lower(sharded, jax.random.key(3)).compile().as_text()
  assert 'u32[2,6,10]' in hlo and 'u32[16' not in hlo
  assert 'all-gather' not in hlo and 'all-reduce' not in hlo
