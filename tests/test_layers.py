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
