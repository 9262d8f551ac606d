"""Dropout on 16 random bits per element (models/dropout.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import dropout


PAIRS = ('adjacent', 'halves')


@pytest.mark.parametrize('pairs', PAIRS)
@pytest.mark.parametrize('shape', [(64, 1001), (8, 4, 32, 32), (7,)])
def test_drops_the_rate_and_scales_the_rest_to_keep_the_mean(shape, pairs):
  x = jnp.full(shape, 3.0)
  y = np.asarray(dropout.dropout(x, 0.1, jax.random.key(0), pairs))
  n, dropped = y.size, int((y == 0).sum())
  # Binomial(n, 0.1000061): within 5 standard deviations.
  assert abs(dropped - 0.1 * n) < 5 * np.sqrt(n * 0.1 * 0.9) + 1
  kept = y[y != 0]
  np.testing.assert_allclose(kept, 3.0 * 65536 / (65536 - 6554), rtol=1e-6)


@pytest.mark.parametrize('pairs', PAIRS)
def test_the_mask_follows_the_key_and_differs_between_halves_of_a_draw(pairs):
  x = jnp.ones((16, 256))
  a, b = (np.asarray(dropout.dropout(x, 0.5, jax.random.key(k), pairs)) for k in (0, 1))
  np.testing.assert_array_equal(a, np.asarray(dropout.dropout(x, 0.5, jax.random.key(0), pairs)))
  assert (a != b).mean() > 0.4
  # The two 16-bit halves of one 32-bit draw decide two elements: they must not agree.
  low, high = (a[:, 0::2], a[:, 1::2]) if pairs == 'adjacent' else (a[:, :128], a[:, 128:])
  assert (low != high).mean() > 0.4


@pytest.mark.parametrize('last', [6, 7])
def test_each_element_takes_its_16_bits_of_the_draw(last):
  # 'adjacent' gives the masks of the bitcast form it replaced (runs resume across the
  # change); 'halves' the low halves to the first ceil(n/2) elements, the high to the rest.
  key, rate = jax.random.key(5), 0.3
  keep = {p: np.asarray(dropout.keep_mask(key, rate, (40, last), p)[0]) for p in PAIRS}
  bits = jax.random.bits(key, (40, (last + 1) // 2), jnp.uint32)
  halves = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.uint16))  # (40, words, 2)
  dropped = round(rate * 65536)
  np.testing.assert_array_equal(keep['adjacent'], halves.reshape(40, -1)[:, :last] >= dropped)
  split = np.concatenate([halves[..., 0], halves[..., 1]], axis=-1)[:, :last]
  np.testing.assert_array_equal(keep['halves'], split >= dropped)
  with pytest.raises(ValueError, match="pairs='odd'"):
    dropout.keep_mask(key, rate, (4, 6), 'odd')


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
  # Each device draws its own rows' bits: 2 of the 16 rows, 5 words for 10 elements.
  hlo = drop.lower(sharded, jax.random.key(3)).compile().as_text()
  assert 'u32[2,6,5]' in hlo and 'all-gather' not in hlo and 'all-reduce' not in hlo
