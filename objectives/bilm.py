"""biLM pretraining loss: forward and backward LM NLL through a shared softmax (Peters et al. 2018, sec. 3.1).

The paper maximizes the sum of the forward and backward log likelihoods;
bilm-tf's LanguageModel._build_loss (bilm/training.py) trains on their MEAN,
0.5 * (forward mean NLL + backward mean NLL), and reports exp of it as the
perplexity. We follow bilm-tf (the sum only doubles the gradient). Each
direction's NLL is averaged over its targets, taken from the batch: the
forward target at t is token_ids[t+1] for t < length - 1, the backward target
at t is token_ids[t-1] for 1 <= t < length, and at the row's ends the
stream's neighbours of the row (batch['next_ids'] and batch['prev_ids'] of
input_pipeline/bilm.py), as bilm-tf's targets run on into its next batch.
Across a sentence boundary of the stream (</S> <S>) there is no target: the
forward LM is not asked for the <S> after a </S>, nor the backward LM for the
</S> before a <S>. bilm-tf never feeds a sentence's last token (its batcher
moves to the next sentence there), so a sentence of n words has n + 1 targets
a direction, </S> (forward) and <S> (backward) among them; one more, a
certain one, would lower the perplexity.

In training the model may hand over a sample of classes for each direction
('sampled_ids' (2, K), as bilm-tf draws one per direction; (K,) serves both)
and 'log_expected_counts'; the loss is then the sampled softmax of Jean et al.
(2015) as TensorFlow's sampled_softmax_loss computes it (bilm-tf's choice):
the softmax over [target, samples], every logit minus the log of its class's
expected count in the sample, samples equal to the target removed. Without
samples (always in eval) it is the full softmax over the vocabulary.
Metrics are (sum, count) pairs, as in objectives/lm.py.
"""

import math
from typing import Mapping

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import optax

from input_pipeline.common import words
from objectives import lm

Array = jax.Array

# TF pushes accidental hits down by -FLOAT_MAX; selecting a finite value instead of adding one
# keeps the logit finite whatever it was, so the softmax never sees inf - inf.
_REMOVED_LOGIT = float(np.finfo(np.float32).min)


def full_softmax_logits(states_ND: Array, kernel_VD: Array, bias_V: Array) -> Array:
  """Logits over the whole vocabulary, (N, V) float32."""
  states_ND = states_ND.astype(jnp.float32)
  return states_ND @ kernel_VD.astype(jnp.float32).T + bias_V.astype(jnp.float32)


def full_softmax_nll(states_ND: Array, kernel_VD: Array, bias_V: Array, targets_N: Array
                     ) -> Array:
  """-log softmax(states @ kernel.T + bias)[target] per row, (N,) float32."""
  logits_NV = full_softmax_logits(states_ND, kernel_VD, bias_V)
  return optax.softmax_cross_entropy_with_integer_labels(logits_NV, targets_N)


def sampled_softmax_nll(states_ND: Array, kernel_VD: Array, bias_V: Array, targets_N: Array,
                        sampled_ids_K: Array, log_expected_counts_V: Array) -> Array:
  """Sampled softmax NLL per row (Jean et al. 2015, sec. 3; TF's sampled_softmax_loss), (N,) float32.

  Only the target's and the K sampled rows of the kernel are used, so no
  (N, V) array is formed. With every class sampled once (log expected count
  0) it equals full_softmax_nll. Otherwise its value is biased (mostly low):
  the sample's sum of exp(logit) / expected count estimates the partition
  function without bias, its log does not, and the target's own correction
  makes the value grow like log K for K >> V when sampling with replacement.
  It is a training objective; report the full softmax in eval.
  """
  N = targets_N.shape[0]
  ids_R = jnp.concatenate([targets_N, sampled_ids_K])
  rows_RD = take_rows(kernel_VD, ids_R, ('vocab', 'embed')).astype(jnp.float32)
  bias_R = (take_rows(bias_V, ids_R, ('vocab',)).astype(jnp.float32)
            - log_expected_counts_V[ids_R].astype(jnp.float32))
  states_ND = states_ND.astype(jnp.float32)
  true_N = jnp.einsum('nd,nd->n', states_ND, rows_RD[:N]) + bias_R[:N]
  sampled_NK = states_ND @ rows_RD[N:].T + bias_R[N:][None, :]
  hit_NK = sampled_ids_K[None, :] == targets_N[:, None]
  sampled_NK = jnp.where(hit_NK, _REMOVED_LOGIT, sampled_NK)
  logits_NK1 = jnp.concatenate([true_N[:, None], sampled_NK], axis=1)
  return jax.nn.logsumexp(logits_NK1, axis=1) - true_N


def take_rows(table: Array, ids_R: Array, logical_axes: tuple[str, ...]) -> Array:
  """table[ids_R], each device gathering from, and adding the gradient into, its own block.

  Left to XLA, the gradient of the gather (a scatter-add) was made whole on each chip and
  summed over them: ELMo's 793,471 x 512 table, 1.7 GiB of all-reduce per step. Here only the
  rows' gradients and ids travel. `logical_axes` name the table's sharding.
  """
  mesh = jax.sharding.get_abstract_mesh()
  # Read now: the gradient is traced after the caller's axis rules may have been left.
  spec = None if mesh.empty else nn.logical_to_mesh_axes(logical_axes)
  rows_spec = None if spec is None else P(None, *spec[1:])

  def gather(table, ids_R):
    return _blockwise(_gather_block, mesh, spec, rows_spec, table, ids_R)

  def backward(ids_R, grad_R):
    zeros = jnp.zeros(table.shape, grad_R.dtype)  # made block by block, in the table's sharding
    return _blockwise(_scatter_block, mesh, spec, spec, zeros, ids_R, grad_R), None

  take = jax.custom_vjp(gather)
  take.defvjp(lambda table, ids_R: (gather(table, ids_R), ids_R), backward)
  return take(table, ids_R)


def _gather_block(table_block, local_R, in_block_R, row_axes):
  rows_R = jnp.where(in_block_R.reshape(-1, *(1,) * (table_block.ndim - 1)),
                     table_block[jnp.where(in_block_R, local_R, 0)], 0)
  return jax.lax.psum(rows_R, row_axes) if row_axes else rows_R


def _scatter_block(zeros_block, local_R, in_block_R, row_axes, grad_R):
  del row_axes
  out_of_block = zeros_block.shape[0]  # dropped by the scatter
  return zeros_block.at[jnp.where(in_block_R, local_R, out_of_block)].add(grad_R, mode='drop')


def _blockwise(fn, mesh, spec, out_spec, table, ids_R, *rows):
  """fn(block, ids_R in block coordinates, which are in it, row axes, *rows) on each block."""
  if spec is None:  # one device, or outside a mesh
    return fn(table, ids_R, jnp.ones(ids_R.shape, bool), (), *rows)
  row_axes = () if spec[0] is None else (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
  block_rows = table.shape[0] // math.prod(mesh.shape[a] for a in row_axes)

  def block(table_block, ids_R, *rows):  # rows arrive with the block's columns
    first = jax.lax.axis_index(row_axes) * block_rows if row_axes else 0
    local_R = ids_R - first
    return fn(table_block, local_R, (local_R >= 0) & (local_R < block_rows), row_axes, *rows)

  return jax.shard_map(block, mesh=mesh, in_specs=(spec, P()) + (P(None, *spec[1:]),) * len(rows),
                       out_specs=out_spec, check_vma=False)(table, ids_R, *rows)


def direction_targets(token_ids_BL: Array, lengths_B: Array, next_B: Array | None = None,
                      prev_B: Array | None = None) -> dict[str, tuple[Array, Array]]:
  """{'forward': (targets_BL, valid_BL), 'backward': (...)}: the next / previous token, within
  the row and, given the stream's neighbours of the rows (next_B, prev_B; -1: none), across
  its ends, as bilm-tf's targets run on into the next batch."""
  length = token_ids_BL.shape[1]
  lengths_B1 = jnp.clip(lengths_B, 0, length)[:, None]
  t_1L = jnp.arange(length)[None, :]
  none_B1 = jnp.full_like(token_ids_BL[:, :1], -1)
  next_B1 = none_B1 if next_B is None else next_B.astype(token_ids_BL.dtype)[:, None]
  prev_B1 = none_B1 if prev_B is None else prev_B.astype(token_ids_BL.dtype)[:, None]
  last_BL, first_BL = t_1L == lengths_B1 - 1, (t_1L == 0) & (lengths_B1 > 0)
  forward_BL = jnp.where(last_BL, next_B1,
                         jnp.concatenate([token_ids_BL[:, 1:], none_B1], axis=1))
  backward_BL = jnp.where(first_BL, prev_B1,
                          jnp.concatenate([none_B1, token_ids_BL[:, :-1]], axis=1))
  # No target across a sentence boundary: after </S> (forward) or before <S> (backward).
  forward_valid_BL = ((t_1L < lengths_B1 - 1) | (last_BL & (next_B1 >= 0))) & (
      token_ids_BL != words.EOS_ID)
  backward_valid_BL = (((t_1L >= 1) & (t_1L < lengths_B1)) | (first_BL & (prev_B1 >= 0))) & (
      token_ids_BL != words.BOS_ID)
  # Padding ids are never read as labels, but keep them in range for the gathers.
  return {'forward': (jnp.where(forward_valid_BL, forward_BL, 0), forward_valid_BL),
          'backward': (jnp.where(backward_valid_BL, backward_BL, 0), backward_valid_BL)}


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array], *,
            gradient_scale: float = 1.0) -> tuple[Array, dict[str, Array]]:
  """0.5 * (forward mean NLL + backward mean NLL), as bilm-tf trains; sampled softmax when given samples.

  The returned loss is multiplied by `gradient_scale`, the metrics are not:
  bilm-tf differentiates the loss times unroll_steps (the window length),
  which matters to Adagrad's first steps (its accumulators start at 1.0).
  """
  sampled = 'sampled_ids' in outputs
  metrics, sums, counts, losses = {}, {}, {}, {}
  targets = direction_targets(batch['token_ids'], batch['lengths'], batch.get('next_ids'),
                              batch.get('prev_ids'))
  for index, (direction, (targets_BL, valid_BL)) in enumerate(targets.items()):
    states_BLD = outputs[f'{direction}_states']
    targets_N, valid_N = targets_BL.reshape(-1), valid_BL.reshape(-1)
    # Zeroed rather than masked afterwards: garbage states at padding would still give NaN gradients.
    states_ND = jnp.where(valid_N[:, None],
                          states_BLD.reshape(valid_N.shape[0], -1).astype(jnp.float32), 0.0)
    if sampled:
      # A sample per direction ((2, K), the model's), or one (K,) for both.
      sampled_ids = outputs['sampled_ids']
      nll_N = sampled_softmax_nll(states_ND, outputs['softmax_kernel'], outputs['softmax_bias'],
                                  targets_N,
                                  sampled_ids[index] if sampled_ids.ndim == 2 else sampled_ids,
                                  outputs['log_expected_counts'])
      sums[direction] = jnp.where(valid_N, nll_N, 0.0).sum()
      counts[direction] = valid_N.sum().astype(jnp.float32)
      losses[direction] = 0.5 * sums[direction] / jnp.maximum(counts[direction], 1.0)
    else:
      # In chunks of rows: at the paper's size (384 x 20 rows per direction, V = 793,471) the
      # (N, V) logits would need tens of GB; bilm-tf evaluates one sentence at a time for the
      # same reason.
      weights_N = valid_N.astype(jnp.float32)
      layer = {'x': states_ND, 'table': outputs['softmax_kernel'], 'bias': outputs['softmax_bias']}
      losses[direction], sums[direction], counts[direction], correct = lm.output_stats(
          {'softmax_output': layer}, 'softmax', targets_N, weights_N,
          0.5 * weights_N / jnp.maximum(weights_N.sum(), 1.0))
      metrics[f'{direction}_accuracy'] = lm.pair(correct, counts[direction])
    metrics[f'{direction}_loss'] = lm.pair(sums[direction], counts[direction])
  loss = sum(losses.values())
  # The directions have nearly the same targets (max(length - 1, 0) a row, and one more at
  # a row's end where its neighbour is a target), so this pooled pair's mean is the loss above
  # to within that, and unlike the loss it adds up across micro-batches, devices and steps.
  metrics['loss'] = lm.pair(sum(sums.values()), sum(counts.values()))
  return gradient_scale * loss, metrics


_REPORT_ORDER = ('loss', 'perplexity', 'forward_loss', 'forward_perplexity', 'forward_accuracy',
                 'backward_loss', 'backward_perplexity', 'backward_accuracy')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the accumulated (sum, count) pairs, plus the perplexities bilm-tf reports."""
  means = {k: float(v[0] / max(v[1], 1e-9)) for k, v in totals.items()}
  directions = [d for d in ('forward', 'backward') if f'{d}_loss' in means]
  for d in directions:
    means[f'{d}_perplexity'] = float(np.exp(min(means[f'{d}_loss'], 50.0)))
  if directions:
    mean_loss = np.mean([means[f'{d}_loss'] for d in directions])
    means['perplexity'] = float(np.exp(min(mean_loss, 50.0)))
  first = [k for k in _REPORT_ORDER if k in means]
  return {k: means[k] for k in first + sorted(set(means) - set(first))}
