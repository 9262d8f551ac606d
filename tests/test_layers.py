"""Shared layers of models/layers.py that the model tests do not single out."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_add_bias_has_the_gradients_of_a_plain_add(dtype):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5, 33)), dtype)
  bias = jnp.asarray(np.random.default_rng(1).normal(size=(33,)), jnp.float32)
  g = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5, 33)), jnp.float32)
  fused = jax.vjp(layers.add_bias, x, bias)
  plain = jax.vjp(lambda x, b: x + b, x, bias)
  np.testing.assert_array_equal(np.asarray(fused[0]), np.asarray(plain[0]))
  for got, want in zip(fused[1](g), plain[1](g)):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-5, atol=1e-5)


def test_exact_gelu_is_the_erf_form_and_matches_jax_within_float_rounding():
  x = jnp.linspace(-30.0, 30.0, 6001)
  exact = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  np.testing.assert_allclose(np.asarray(layers.gelu(x)), np.asarray(exact(x)), atol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(layers.gelu))(x)),
                             np.asarray(jax.vmap(jax.grad(exact))(x)), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(layers.gelu(x, approximate=True)),
                                np.asarray(jax.nn.gelu(x, approximate=True)))


def _gelu_slope(x: np.ndarray, approximate: bool) -> np.ndarray:
  """GELU's derivative in float64."""
  if approximate:
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x ** 2)
  erf = np.vectorize(math.erf)
  return 0.5 * (1 + erf(x / np.sqrt(2))) + x * np.exp(-x ** 2 / 2) / np.sqrt(2 * np.pi)


@pytest.mark.parametrize('approximate', [False, True])
def test_gelus_gradient_keeps_x_alone_and_is_the_formulas(approximate):
  """The backward keeps the input alone (differentiated through its formula, the tanh form
  kept four arrays of x's size besides it: on a GPU another array written and read) and gives
  the formula's derivative (float64 here) to float32's rounding, and in bfloat16 to bfloat16's.
  The formula's own gradients were off by up to 2 (exact) and 4 (tanh) times more in bfloat16,
  and by 3.5e-6 in float32 (tanh)."""
  from jax._src import ad_checkpoint  # pylint: disable=g-import-not-at-top (saved_residuals)
  x = jnp.linspace(-8.0, 8.0, 4001)
  saved = ad_checkpoint.saved_residuals(lambda x: layers.gelu(x, approximate).sum(), x)
  assert [shape_and_dtype.shape for shape_and_dtype, _ in saved] == [x.shape], saved
  # Forward over reverse (a Hessian's diagonal) differentiates the backward's own formula
  # (between -4 and 4: further out, the formula's float32 second derivative is its rounding).
  x4 = jnp.linspace(-4.0, 4.0, 17)
  second = jnp.diag(jax.hessian(lambda x: layers.gelu(x, approximate).sum())(x4))
  np.testing.assert_allclose(second, jax.vmap(jax.grad(jax.grad(
      lambda x: jax.nn.gelu(x, approximate=approximate))))(x4), rtol=1e-4, atol=1e-5)
  for dtype, rtol, atol in ((jnp.float32, 2 ** -20, 2 ** -22), (jnp.bfloat16, 2 ** -8, 2 ** -8)):
    x_in = x.astype(dtype)
    got = jax.vmap(jax.grad(lambda x: layers.gelu(x, approximate)))(x_in)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float64),
                               _gelu_slope(np.asarray(x_in, np.float64), approximate),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize('equation,shape,axes', [
    ('BLD,DHK->BLHK', (16, 2, 4), ('embed', 'heads', 'kv')),
    ('BLD,DF->BLF', (16, 8), ('embed', 'mlp'))])
def test_bias_in_matmul_is_the_projection_plus_bias_with_its_gradients(equation, shape, axes):
  x = jax.random.normal(jax.random.key(0), (3, 5, 16))
  plain = layers.Einsum(equation, shape, axes)
  folded = layers.Einsum(equation, shape, axes, bias_in_matmul=True)
  params = plain.init(jax.random.key(1), x)  # the same tree: kernel and bias
  assert jax.tree.structure(params) == jax.tree.structure(folded.init(jax.random.key(1), x))
  params = jax.tree.map(lambda a: a + jax.random.normal(jax.random.key(2), a.shape), params)
  loss = lambda m: lambda p, x: (jnp.sin(m.apply(p, x)) ** 2).sum()  # noqa: E731
  np.testing.assert_allclose(folded.apply(params, x), plain.apply(params, x), atol=1e-5)
  got, want = (jax.grad(loss(m), argnums=(0, 1))(params, x) for m in (folded, plain))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
  with pytest.raises(ValueError, match="bias_in_matmul needs x's last axis alone"):
    layers.Einsum('BLHK,HKD->BLD', (2, 4, 16), ('heads', 'kv', 'embed'),
                  bias_in_matmul=True).init(jax.random.key(0), jnp.ones((3, 5, 2, 4)))
