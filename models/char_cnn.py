"""ELMo's character-CNN token encoder (Peters et al. 2018, sec. 3.1 and 3.4; Kim et al. 2016).

Characters are embedded, convolved with filters of several widths, max-pooled
over the word, passed through highway layers (Srivastava et al. 2015) and
projected to the biLM's width. Initializers follow bilm-tf's training graph.

Shape letters: B batch, L tokens, X = B * L, W characters per token, T
convolution positions, E char embedding, N filters (all widths), G the highway's
two halves (gate, transform), D output width.
"""

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.lstm import symmetric_uniform

Array = jax.Array

ELMO_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {'relu': jax.nn.relu, 'tanh': jnp.tanh}
HIGHWAY_GATE_BIAS = -2.0  # bilm-tf: the gates start mostly closed, passing the input through


class CharCNN(nn.Module):
  """Char ids (B, L, W) -> token vectors (B, L, D); char id 0 (no token) embeds to zeros."""
  num_chars: int = 262
  char_dim: int = 16
  filters: tuple[tuple[int, int], ...] = ELMO_FILTERS  # (width, count) per convolution
  num_highway: int = 2
  output_dim: int = 512  # 0: no projection, the N pooled (and highway) filters
  activation: str = 'relu'
  dtype: Any = jnp.float32

  def _param(self, name, init, shape, axes):
    return self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)

  @nn.compact
  def __call__(self, char_ids_BLW: Array) -> Array:
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'activation={self.activation!r} is unknown: use one of '
                       f'{tuple(ACTIVATIONS)}.')
    act = ACTIVATIONS[self.activation]
    B, L, W = char_ids_BLW.shape
    E, N = self.char_dim, sum(n for _, n in self.filters)
    table_CE = self._param('char_embed', symmetric_uniform(1.0), (self.num_chars, E), (None, None))
    e_XWE = jnp.take(table_CE, char_ids_BLW.reshape(B * L, W), axis=0)
    e_XWE = jnp.where((char_ids_BLW.reshape(B * L, W) > 0)[..., None], e_XWE, 0.0)
    e_XWE = e_XWE.astype(self.dtype)

    pooled = []
    for i, (width, count) in enumerate(self.filters):
      # bilm-tf's: Kim et al. 2016's +-0.05 with relu, normal(0, 1 / sqrt(width E)) with tanh.
      init = (nn.initializers.normal((width * E) ** -0.5) if self.activation == 'tanh'
              else symmetric_uniform(0.05))
      kernel = self._param(f'conv_{i}_kernel', init, (width, E, count), (None, None, 'filters'))
      bias = self._param(f'conv_{i}_bias', nn.initializers.zeros_init(), (count,), ('filters',))
      y_XTN = jax.lax.conv_general_dilated(
          e_XWE, kernel.astype(self.dtype), (1,), 'VALID',
          dimension_numbers=('NWC', 'WIO', 'NWC'))
      # Pooled before the bias and activation, as bilm-tf (the same for a monotone activation).
      pooled.append(act(y_XTN.max(axis=1) + bias.astype(self.dtype)))
    x_BLN = jnp.concatenate(pooled, axis=-1).reshape(B, L, N)

    fan_in_init = nn.initializers.normal(N ** -0.5)
    for i in range(self.num_highway):
      # One matmul for both halves, the gate (g = 0) and the transform (g = 1).
      # Its input axis is FSDP's ('embed'): 2 x 2048^2 floats each at the paper's size.
      kernel = self._param(f'highway_{i}_kernel', fan_in_init, (N, 2, N), ('embed', None, 'filters'))
      bias = self._param(f'highway_{i}_bias', _highway_bias_init, (2, N), (None, 'filters'))
      z_BLGN = jnp.einsum('BLN,NGM->BLGM', x_BLN, kernel.astype(self.dtype))
      z_BLGN = z_BLGN + bias.astype(self.dtype)
      gate_BLN = jax.nn.sigmoid(z_BLGN[:, :, 0])
      x_BLN = gate_BLN * jax.nn.relu(z_BLGN[:, :, 1]) + (1.0 - gate_BLN) * x_BLN

    if not self.output_dim:  # CVT concatenates the pooled filters to the word vector
      return x_BLN
    kernel = self._param('projection_kernel', fan_in_init, (N, self.output_dim),
                         ('filters', 'embed'))
    bias = self._param('projection_bias', nn.initializers.zeros_init(), (self.output_dim,),
                       ('embed',))
    return jnp.einsum('BLN,ND->BLD', x_BLN, kernel.astype(self.dtype)) + bias.astype(self.dtype)


def _highway_bias_init(key, shape, dtype=jnp.float32):
  del key
  return jnp.zeros(shape, dtype).at[0].set(HIGHWAY_GATE_BIAS)
