"""One LSTM layer with an optional projection (Hochreiter & Schmidhuber 1997; Sak et al. 2014).

Used by ELMo's biLM (Peters et al. 2018, sec. 3.1), its task models, CoVe and
CVT. The input projection of all steps is one einsum before the time loop;
the loop (`jax.lax.scan`) does one (B, P) x (P, 4, S) matmul, the projection
and the cell's elementwise ops per step, with the cell and the state in float32.

Shape letters: B batch, L length, D input width, G gates (4: i, f, g, o),
S cells, P output width (the projection, or S without one).
"""

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Initializer = Callable[..., Array]


def reverse_within_lengths(x_BL: Array, lengths_B: Array) -> Array:
  """Reverses each row's first `length` entries along axis 1; the padding after them stays put."""
  L = x_BL.shape[1]
  t_L = jnp.arange(L)
  source_BL = jnp.where(t_L[None, :] < lengths_B[:, None], lengths_B[:, None] - 1 - t_L[None, :],
                        t_L[None, :])
  source_BL = source_BL.reshape(source_BL.shape + (1,) * (x_BL.ndim - 2))
  return jnp.take_along_axis(x_BL, source_BL, axis=1)


def symmetric_uniform(limit: float) -> Initializer:
  """Uniform on [-limit, limit] (flax's `uniform` is [0, scale))."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -limit, limit)
  return init


class LSTM(nn.Module):
  """One LSTM layer over (B, L, D) -> (B, L, P), zeros at t >= length.

  Gates as TF's LSTMCell (which bilm-tf trains): c = f * c + i * g with
  forget_bias added to f's pre-activation, c clipped to +-cell_clip, h = o *
  tanh(c) projected to P and clipped to +-proj_clip; the projected h is the
  recurrent input. Steps at t >= length leave the state unchanged. With
  `reverse`, each row runs from position length-1 down to 0 and its outputs
  stay at their positions, so output t has seen inputs t..length-1.
  `kernel_init`, when given, is called with the full-rank kernel shapes;
  None means TF's default, Glorot-uniform over the concatenated
  [input; recurrent] (D + P, 4S) kernel and over the (S, P) projection.
  """
  cells: int
  projection: int = 0  # 0 = no projection: the output width is `cells`
  cell_clip: float = 0.0  # 0 = no clipping
  proj_clip: float = 0.0
  forget_bias: float = 1.0
  reverse: bool = False
  kernel_init: Initializer | None = None
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BLD: Array, lengths_B: Array, final: bool = False
               ) -> Array | tuple[Array, tuple[Array, Array]]:
    """The outputs (B, L, P); with `final`, also the state after each row's last step, (c (B, S),
    h (B, P)): for `reverse`, after position 0 (PyTorch's h_n, c_n)."""
    D, S = x_BLD.shape[-1], self.cells
    P = self.projection or S
    gate_init = self.kernel_init or symmetric_uniform(math.sqrt(6.0 / (D + P + 4 * S)))
    param = lambda name, init, shape, axes: self.param(  # noqa: E731
        name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)
    input_kernel = param('input_kernel', gate_init, (D, 4, S), ('embed', None, 'cell'))
    recurrent_kernel = param('recurrent_kernel', gate_init, (P, 4, S), ('embed', None, 'cell'))
    bias = param('bias', nn.initializers.zeros_init(), (4, S), (None, 'cell'))
    projection_kernel = None
    if self.projection:
      projection_kernel = param('projection_kernel',
                                self.kernel_init or nn.initializers.glorot_uniform(),
                                (S, P), ('cell', 'embed'))
      projection_kernel = projection_kernel.astype(self.dtype)

    x_BLD = nn.with_logical_constraint(x_BLD, ('batch', 'length', 'act_embed'))
    if self.reverse:
      x_BLD = reverse_within_lengths(x_BLD, lengths_B)
    # Time-major for the scan; the input half of every gate is computed for all steps at once.
    z_LBGS = jnp.einsum('BLD,DGS->LBGS', x_BLD.astype(self.dtype), input_kernel.astype(self.dtype))
    z_LBGS = z_LBGS + bias.astype(self.dtype)
    valid_LB = jnp.arange(x_BLD.shape[1])[:, None] < lengths_B[None, :]
    # The kernels the loop uses whole along FSDP's axis before it: left sharded, XLA gathers
    # them inside the loop, once per time step (ELMo at fsdp=16: 1.3 GiB per step, not 64 MiB).
    recurrent_kernel = nn.with_logical_constraint(recurrent_kernel.astype(self.dtype),
                                                  (None, None, 'cell'))
    if projection_kernel is not None:
      projection_kernel = nn.with_logical_constraint(projection_kernel, ('cell', None))
    h_LBP, final_state = _recurrence(z_LBGS, valid_LB, recurrent_kernel, projection_kernel,
                                     self.forget_bias, self.cell_clip, self.proj_clip)
    h_BLP = nn.with_logical_constraint(h_LBP.transpose(1, 0, 2), ('batch', 'length', 'act_embed'))
    if self.reverse:
      h_BLP = reverse_within_lengths(h_BLP, lengths_B)
    return (h_BLP, final_state) if final else h_BLP


# The time loop. Its gradient is written by hand so that the kernels' gradients
# are two matmuls over all steps after the loop: differentiating the scan
# would accumulate them step by step inside it (about 20% slower on CPU).
# The cell runs in float32, the matmuls in the kernels' dtype.


def _scan(z_LBGS, valid_LB, recurrent_PGS, projection_SP, forget_bias, cell_clip, proj_clip):
  """Outputs (L, B, P), the final state (c (B, S), h (B, P)) and, per step, what the gradient
  needs: h, c before and gates, c, p after."""
  dtype = recurrent_PGS.dtype

  def step(carry, inputs):
    c_BS, h_BP = carry
    z_BGS, valid_B = inputs
    z_BGS = z_BGS.astype(jnp.float32) + jnp.einsum(
        'BP,PGS->BGS', h_BP.astype(dtype), recurrent_PGS).astype(jnp.float32)
    gates_BGS = jnp.stack([jax.nn.sigmoid(z_BGS[:, 0]), jax.nn.sigmoid(z_BGS[:, 1] + forget_bias),
                           jnp.tanh(z_BGS[:, 2]), jax.nn.sigmoid(z_BGS[:, 3])], axis=1)
    new_c_BS = gates_BGS[:, 1] * c_BS + gates_BGS[:, 0] * gates_BGS[:, 2]
    if cell_clip:
      new_c_BS = jnp.clip(new_c_BS, -cell_clip, cell_clip)
    p_BP = gates_BGS[:, 3] * jnp.tanh(new_c_BS)
    new_h_BP = p_BP
    if projection_SP is not None:
      p_BP = jnp.einsum('BS,SP->BP', p_BP.astype(dtype), projection_SP).astype(jnp.float32)
      # As TF's LSTMCell, only a projection is clipped.
      new_h_BP = jnp.clip(p_BP, -proj_clip, proj_clip) if proj_clip else p_BP
    keep_B1 = valid_B[:, None]
    carry = (jnp.where(keep_B1, new_c_BS, c_BS), jnp.where(keep_B1, new_h_BP, h_BP))
    output_BP = jnp.where(keep_B1, new_h_BP, 0.0).astype(dtype)
    return carry, (output_BP, (h_BP, c_BS, gates_BGS, new_c_BS, p_BP))

  _, B, _, S = z_LBGS.shape
  carry = (jnp.zeros((B, S), jnp.float32), jnp.zeros((B, recurrent_PGS.shape[0]), jnp.float32))
  final, (h_LBP, saved) = jax.lax.scan(step, carry, (z_LBGS, valid_LB))
  return h_LBP, final, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _recurrence(z_LBGS, valid_LB, recurrent_PGS, projection_SP, forget_bias, cell_clip, proj_clip):
  return _scan(z_LBGS, valid_LB, recurrent_PGS, projection_SP, forget_bias, cell_clip,
               proj_clip)[:2]


def _recurrence_fwd(z_LBGS, valid_LB, recurrent_PGS, projection_SP, forget_bias, cell_clip,
                    proj_clip):
  h_LBP, final, saved = _scan(z_LBGS, valid_LB, recurrent_PGS, projection_SP, forget_bias,
                              cell_clip, proj_clip)
  return (h_LBP, final), (saved, valid_LB, recurrent_PGS, projection_SP)


def _recurrence_bwd(forget_bias, cell_clip, proj_clip, residuals, cotangents):
  del forget_bias  # in the saved gates already
  dout_LBP, (dc_final_BS, dh_final_BP) = cotangents
  (h_LBP, c_LBS, gates_LBGS, new_c_LBS, p_LBP), valid_LB, recurrent_PGS, projection_SP = residuals
  dtype = recurrent_PGS.dtype

  def step(carry, inputs):
    dc_BS, dh_BP = carry  # from the later steps, into this step's new state
    dout_BP, valid_B, c_BS, gates_BGS, new_c_BS, p_BP = inputs
    keep_B1 = valid_B[:, None].astype(jnp.float32)
    dnew_h_BP = keep_B1 * (dout_BP.astype(jnp.float32) + dh_BP)
    i_BS, f_BS, g_BS, o_BS = (gates_BGS[:, k] for k in range(4))
    tanh_c_BS = jnp.tanh(new_c_BS)
    dp_BP = dnew_h_BP
    if projection_SP is not None:
      if proj_clip:
        dp_BP = jnp.where(jnp.abs(p_BP) < proj_clip, dp_BP, 0.0)
      dm_BS = jnp.einsum('BP,SP->BS', dp_BP.astype(dtype), projection_SP).astype(jnp.float32)
    else:
      dm_BS = dp_BP
    dnew_c_BS = keep_B1 * dc_BS + dm_BS * o_BS * (1.0 - tanh_c_BS ** 2)
    if cell_clip:
      dnew_c_BS = jnp.where(jnp.abs(new_c_BS) < cell_clip, dnew_c_BS, 0.0)
    dz_BGS = jnp.stack([dnew_c_BS * g_BS * i_BS * (1.0 - i_BS),
                        dnew_c_BS * c_BS * f_BS * (1.0 - f_BS),
                        dnew_c_BS * i_BS * (1.0 - g_BS ** 2),
                        dm_BS * tanh_c_BS * o_BS * (1.0 - o_BS)], axis=1).astype(dtype)
    dc_BS = dnew_c_BS * f_BS + (1.0 - keep_B1) * dc_BS
    dh_BP = (jnp.einsum('BGS,PGS->BP', dz_BGS, recurrent_PGS).astype(jnp.float32)
             + (1.0 - keep_B1) * dh_BP)
    # The projection's input, o * tanh(c), again instead of one more saved array.
    m_BS = None if projection_SP is None else (o_BS * tanh_c_BS).astype(dtype)
    return (dc_BS, dh_BP), (dz_BGS, dp_BP.astype(dtype), m_BS)

  # The final state's gradient enters after the last step; steps past a row's length pass it on.
  carry = (dc_final_BS.astype(jnp.float32), dh_final_BP.astype(jnp.float32))
  inputs = (dout_LBP, valid_LB, c_LBS, gates_LBGS, new_c_LBS, p_LBP)
  _, (dz_LBGS, dp_LBP, m_LBS) = jax.lax.scan(step, carry, inputs, reverse=True)
  drecurrent_PGS = jnp.einsum('LBP,LBGS->PGS', h_LBP.astype(dtype), dz_LBGS)
  dprojection_SP = None
  if projection_SP is not None:
    dprojection_SP = jnp.einsum('LBS,LBP->SP', m_LBS, dp_LBP).astype(projection_SP.dtype)
  return dz_LBGS, None, drecurrent_PGS.astype(dtype), dprojection_SP


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)
