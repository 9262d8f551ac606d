"""Shared layers of models/layers.py that the model tests do not single out."""

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
