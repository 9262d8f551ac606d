"""Dropout (Srivastava et al. 2014) on 16 random bits per element, for every model.

flax.linen.Dropout draws a float32 uniform per element from 32 threefry bits;
on a CPU those bits cost more than the rest of a BERT step's elementwise work.
Here one 32-bit draw gives two elements their 16-bit draws, which halves the
random bits and skips the float conversion. The rate is the nearest multiple
of 2^-16 (0.1 -> 0.1000061) and the kept values are scaled by one over the
exact keep probability, so every element's expectation is unchanged.

The bits are drawn with the input's leading axes, so a batch-sharded input
draws its bits on its own shard.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

_LEVELS = 1 << 16


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...],
              pairs: str = 'adjacent') -> tuple[Array, float]:
  """(boolean mask of the kept elements, the scale of kept values 1 / P(keep)).

  Word i of the 32-bit draws gives its low 16 bits to one element of the last axis and its
  high 16 bits to another: elements 2i and 2i + 1 (`pairs='adjacent'`), or i and i + n/2 of
  the last axis' n (rounded up; 'halves'). The two are the same distribution; they differ in
  what XLA's GPU compiler fuses (aot.py --topology=h100:1, docs/benchmarks.md): activations
  (B, L, D) take 'adjacent', whose comparison fuses into the kernel that draws the bits (a
  1-byte mask is written instead of the 2 bytes of bits); attention probabilities (B, H, L, S)
  take 'halves', with which the draw fuses into the softmax's kernels (GPT-1's step at 64 x 512:
  87.9 ms against 105.7 with 'adjacent').
  """
  dropped = round(rate * _LEVELS)  # an element is dropped when its 16 bits are below this
  if dropped >= _LEVELS:
    return jnp.zeros(shape, jnp.bool_), 0.0
  if not dropped:
    return jnp.ones(shape, jnp.bool_), 1.0
  shape = tuple(shape) or (1,)
  *lead, last = shape
  bits = jax.random.bits(rng, (*lead, (last + 1) // 2), jnp.uint32)
  low, high = bits & 0xFFFF, bits >> 16
  if pairs == 'halves':
    keep = jnp.concatenate([low, high], axis=-1) >= dropped
  elif pairs == 'adjacent':
    keep = (jnp.stack([low, high], axis=-1) >= dropped).reshape(*lead, -1)
  else:
    raise ValueError(f"pairs={pairs!r}: use 'adjacent' or 'halves'.")
  return keep[..., :last], _LEVELS / (_LEVELS - dropped)


def dropout(x: Array, rate: float, rng: Array, pairs: str = 'adjacent') -> Array:
  """x with each element zeroed with probability `rate`, the others scaled to keep the mean."""
  keep, scale = keep_mask(rng, rate, x.shape, pairs)
  return jnp.where(keep.reshape(x.shape), x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
  """flax.linen.Dropout's interface: Dropout(rate)(x, deterministic=...), rngs 'dropout'."""
  rate: float
  rng_collection: str = 'dropout'

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng(self.rng_collection))
