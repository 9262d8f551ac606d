"""Next-token language modelling loss (Radford et al. 2018, sec. 3.1, eq. 1).

L1 = -sum_i log P(u_i | u_{i-k}, ..., u_{i-1}), averaged over the weighted
targets. The pipeline sets a target's weight to 0 for padding and where the
next token belongs to another document, so packed documents never predict
each other. Shared by GPT and, later, the Transformer decoder.
"""

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models import layers

Array = jax.Array


def pair(total: Array, count: Array) -> Array:
  """A (sum, count) metric that adds up across devices, micro-batches and steps."""
  return jnp.stack([total, count]).astype(jnp.float32)


@jax.custom_vjp
def cross_entropy(logits_XV: Array, targets_X: Array) -> tuple[Array, Array]:
  """(-log softmax(logits)[target], whether the target is the argmax), both (X,) float32.

  The same values as log_softmax and take_along_axis, with a gradient of one
  elementwise pass, g * (softmax - one_hot): autodiff of the pair takes
  several passes over the (X, V) logits, the largest array of an LM's step.
  """
  return _cross_entropy_forward(logits_XV, targets_X)[0]


def _cross_entropy_forward(logits_XV, targets_X):
  logits32_XV = logits_XV.astype(jnp.float32)
  max_X = logits32_XV.max(axis=-1)
  lse_X = max_X + jnp.log(jnp.exp(logits32_XV - max_X[..., None]).sum(axis=-1))
  target_X = jnp.take_along_axis(logits32_XV, targets_X[..., None], axis=-1)[..., 0]
  # argmax == target, without argmax's slow (value, index) reduction on a CPU: no
  # class beats the target by a larger logit, or by an equal one at a lower index.
  classes_V = jnp.arange(logits_XV.shape[-1], dtype=targets_X.dtype)
  beaten_X = ((logits32_XV > target_X[..., None])
              | ((logits32_XV == target_X[..., None]) & (classes_V < targets_X[..., None]))
              ).any(axis=-1)
  outputs = (lse_X - target_X, (~beaten_X).astype(jnp.float32))
  return outputs, (logits_XV, targets_X, lse_X)


def _cross_entropy_backward(residuals, cotangents):
  logits_XV, targets_X, lse_X = residuals
  g_X = cotangents[0]  # the correct-count has no gradient
  classes_V = jnp.arange(logits_XV.shape[-1], dtype=targets_X.dtype)
  softmax_XV = jnp.exp(logits_XV.astype(jnp.float32) - lse_X[..., None])
  one_hot_XV = targets_X[..., None] == classes_V
  grad_XV = g_X[..., None] * (softmax_XV - one_hot_XV)
  return grad_XV.astype(logits_XV.dtype), None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


# The float32 logits of one chunk of output_layer_loss: 2^27 of them (512 MB); GPT-1's 64 x 512
# tokens over 40,478 words (5.3 GB whole) take 16 chunks, BERT-base's 256 x 20 masked ones 2.
CHUNK_LOGITS = 1 << 27


# Rows a chunk has at least (all of them where there are fewer): thinner chunks make small,
# slow matmuls, and many of them over a huge vocabulary made XLA's compile take 20 GB (BERT
# tiny with 40M words, tests/test_aot.py).
MIN_CHUNK_ROWS = 256


def output_layer_chunks(rows: int, vocab: int, max_logits: int) -> int:
  """How many chunks output_layer_loss cuts `rows` into: the fewest, of `max_logits` logits at
  most each and MIN_CHUNK_ROWS rows at least, that divide `rows` (else the fewest, with the
  rows padded)."""
  fewest = max(1, min(-(-rows * vocab // max_logits), rows // MIN_CHUNK_ROWS))
  dividing = [n for n in range(fewest, min(rows, 4 * fewest) + 1) if rows % n == 0]
  return dividing[0] if dividing else fewest


def output_layer_loss(x_XD: Array, table_VD: Array, bias_V: Array | None, targets_X: Array,
                      loss_weights_X: Array, max_logits: int | None = None
                      ) -> tuple[Array, Array, Array]:
  """(sum of loss_weights x NLL, NLL per token, whether the target is the argmax per token) of
  the output layer logits = x @ table.T (+ bias), in float32, without ever holding them whole.

  The rows go through in chunks of at most `max_logits` logits (a scan), and the gradient is
  made in the same pass: each chunk's g = w (softmax - one_hot) gives its rows' dx and adds
  to dtable, so neither pass writes the (X, V) logits or their gradient (GPT-1's 5.3 GB, and
  as much again for the gradient). The same values as token_stats over attend()'s logits.
  Only the first output is differentiable (to x, table and bias; the weights are data):
  differentiating the per-token outputs raises. Chunk k holds rows k, k + n, k + 2n, ... of
  the flattened x, so a batch-sharded x gives every device its share of each chunk.
  """
  lead = targets_X.shape
  rows = math.prod(lead)
  chunks = output_layer_chunks(rows, table_VD.shape[0], max_logits or CHUNK_LOGITS)
  pad = -rows % chunks

  def chunked(a):  # (X, ...) -> (chunks, rows / chunks, ...); padded rows have weight 0
    a = a.reshape((rows,) + a.shape[len(lead):])
    a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
    return jnp.swapaxes(a.reshape((-1, chunks) + a.shape[1:]), 0, 1)

  def unchunked(a_CR):
    return jnp.swapaxes(a_CR, 0, 1).reshape(-1)[:rows].reshape(lead)

  # The vocabulary padded to a multiple of 128 once, here: XLA pads an odd one (GPT-1's 40,478)
  # for its GPU matmuls, inside the loop, the table and each chunk's gradient every time.
  vocab = table_VD.shape[0]
  padded = ((0, -vocab % 128), (0, 0))
  table_VD = jnp.pad(table_VD, padded)
  bias_V = None if bias_V is None else jnp.pad(bias_V, padded[:1])
  loss, nll_CR, correct_CR = _output_layer_loss(
      vocab, chunked(x_XD), table_VD, bias_V, chunked(targets_X), chunked(loss_weights_X))
  return loss, unchunked(nll_CR), unchunked(correct_CR)


def _chunk_logits(vocab, x_RD, table_VD, bias_V):
  """A chunk's logits, float32; -inf over the padding of the vocabulary. The matmul takes its
  inputs in the compute dtype (x's, as every layer does; the callers cast the table once)."""
  logits_RV = jnp.matmul(x_RD, table_VD.T, preferred_element_type=jnp.float32)
  if bias_V is not None:
    logits_RV = logits_RV + bias_V.astype(jnp.float32)
  if vocab == table_VD.shape[0]:
    return logits_RV
  return jnp.where(jnp.arange(table_VD.shape[0]) < vocab, logits_RV, -jnp.inf)


def _target_logits(x_RD, table_VD, bias_V, targets_R):
  """Each row's logit of its target, from the target's row of the table: taken from the
  logits instead, it cost a GPU pass over all of them."""
  target_R = jnp.einsum('RD,RD->R', x_RD, table_VD[targets_R], preferred_element_type=jnp.float32)
  return target_R if bias_V is None else target_R + bias_V[targets_R].astype(jnp.float32)


def _chunk_stats(logits_RV, target_R, targets_R):
  """(NLL, correct, log-sum-exp) per row, the values of _cross_entropy_forward; the reductions
  over the vocabulary in one pass on GPUs and TPUs, in three on CPUs (_row_stats_*)."""
  classes_V = jnp.arange(logits_RV.shape[-1], dtype=targets_R.dtype)
  # The target's own logit is not compared with target_R: the matmul's sum may differ from
  # the target row's in the last bit.
  beaten_RV = (((logits_RV > target_R[:, None])
                | ((logits_RV == target_R[:, None]) & (classes_V < targets_R[:, None])))
               & (classes_V != targets_R[:, None]))
  max_R, sum_R, beaten_R = jax.lax.platform_dependent(
      logits_RV, beaten_RV, cpu=_row_stats_passes, default=_row_stats_one_pass)
  lse_R = max_R + jnp.log(sum_R)
  return lse_R - target_R, (~beaten_R).astype(jnp.float32), lse_R


def _row_stats_one_pass(logits_RV, beaten_RV):
  """Each row's (max, sum of exp(logit - max), any beaten) in one pass over the logits: a
  reduction whose elements are those triples adds up the exponentials as the maximum rises
  (the online softmax of Milakov & Gimelshein 2018), where the log-sum-exp alone took two
  passes and the argmax test a third."""
  def combine(a, b):
    (max_a, sum_a, beaten_a), (max_b, sum_b, beaten_b) = a, b
    top = jnp.maximum(max_a, max_b)
    # Where both are empty (-inf), nothing to rescale: exp(-inf - -inf) would be NaN.
    scaled = lambda m, total: jnp.where(m == top, total, total * jnp.exp(m - top))  # noqa: E731
    return top, scaled(max_a, sum_a) + scaled(max_b, sum_b), beaten_a | beaten_b

  return jax.lax.reduce((logits_RV, jnp.ones_like(logits_RV), beaten_RV),
                        (jnp.float32(-jnp.inf), jnp.float32(0.0), False), combine, (1,))


def _row_stats_passes(logits_RV, beaten_RV):
  """_row_stats_one_pass's values in three plain reductions: XLA's CPU backend runs a reduction
  of several values element by element (4 ns each: half of a micro GPT's step), and plain ones
  vectorized (the micro GPT's step 8.3 -> 5.0 ms)."""
  max_R = logits_RV.max(axis=-1)
  finite_R = jnp.where(jnp.isfinite(max_R), max_R, 0.0)  # a row of -inf only: no NaN
  return max_R, jnp.exp(logits_RV - finite_R[:, None]).sum(axis=-1), beaten_RV.any(axis=-1)


def _over_chunks(chunk, carry, xs):
  """jax.lax.scan(chunk, carry, xs), without the loop where there is one chunk (smaller
  programs: the models' small configs and the tests compile faster)."""
  if jax.tree.leaves(xs)[0].shape[0] > 1:
    return jax.lax.scan(chunk, carry, xs)
  carry, ys = chunk(carry, jax.tree.map(lambda a: a[0], xs))
  return carry, jax.tree.map(lambda a: a[None], ys)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _output_layer_loss(vocab, x_CRD, table_VD, bias_V, targets_CR, weights_CR):
  table_VD = table_VD.astype(x_CRD.dtype)

  def chunk(_, xs):
    x_RD, targets_R, weights_R = xs
    nll_R, correct_R, _ = _chunk_stats(_chunk_logits(vocab, x_RD, table_VD, bias_V),
                                       _target_logits(x_RD, table_VD, bias_V, targets_R), targets_R)
    return None, (jnp.where(weights_R != 0, nll_R * weights_R, 0.0).sum(), nll_R, correct_R)

  _, (loss_C, nll_CR, correct_CR) = _over_chunks(chunk, None, (x_CRD, targets_CR, weights_CR))
  return loss_C.sum(), nll_CR, correct_CR


def _output_layer_forward(vocab, x_CRD, table_VD, bias_V, targets_CR, weights_CR):
  x_CRD, table_VD, bias_V, targets_CR, weights_CR = (
      a if a is None else a.value for a in (x_CRD, table_VD, bias_V, targets_CR, weights_CR))
  classes_V = jnp.arange(table_VD.shape[0], dtype=targets_CR.dtype)
  table_dtype, table_VD = table_VD.dtype, table_VD.astype(x_CRD.dtype)

  def chunk(grads, xs):
    x_RD, targets_R, weights_R = xs
    # Every row's statistics from its own state, as the primal's: a row of loss weight 0 may
    # still be counted in the metrics (GPT fine-tuning's lm_loss at lm_coef=0).
    logits_RV = _chunk_logits(vocab, x_RD, table_VD, bias_V)
    nll_R, correct_R, lse_R = _chunk_stats(
        logits_RV, _target_logits(x_RD, table_VD, bias_V, targets_R), targets_R)
    counted_R = weights_R != 0
    # Selected, not multiplied: a non-finite logit at a row of weight 0 would make 0 * x NaN.
    g_RV = jnp.where(counted_R[:, None], weights_R[:, None] * (
        jnp.exp(logits_RV - lse_R[:, None]) - (targets_R[:, None] == classes_V)), 0.0)
    dtable_VD, dbias_V = grads
    dbias_V = None if dbias_V is None else dbias_V + layers.column_sum(g_RV)
    g_RV = g_RV.astype(x_RD.dtype)  # the logits' gradient in the compute dtype, as autodiff's
    # Rows of weight 0 out of dtable = g.T @ x: 0 x a non-finite state would be NaN.
    x_counted_RD = jnp.where(counted_R[:, None], x_RD, jnp.zeros((), x_RD.dtype))
    dtable_VD = dtable_VD + jnp.matmul(g_RV.T, x_counted_RD, preferred_element_type=jnp.float32)
    dx_RD = jnp.matmul(g_RV, table_VD, preferred_element_type=jnp.float32).astype(x_RD.dtype)
    loss = jnp.where(counted_R, nll_R * weights_R, 0.0).sum()
    return (dtable_VD, dbias_V), (loss, nll_R, correct_R, dx_RD)

  zeros = (jnp.zeros(table_VD.shape, jnp.float32),
           None if bias_V is None else jnp.zeros(bias_V.shape, jnp.float32))
  (dtable_VD, dbias_V), (loss_C, nll_CR, correct_CR, dx_CRD) = _over_chunks(
      chunk, zeros, (x_CRD, targets_CR, weights_CR))
  grads = (dx_CRD, dtable_VD.astype(table_dtype),
           None if bias_V is None else dbias_V.astype(bias_V.dtype))
  return (loss_C.sum(), nll_CR, correct_CR), grads


def _output_layer_backward(vocab, grads, cotangents):
  del vocab
  g, g_nll, g_correct = cotangents
  if not all(isinstance(c, jax.custom_derivatives.SymbolicZero) for c in (g_nll, g_correct)):
    raise ValueError('output_layer_loss: only its first output (the weighted loss) has a '
                     'gradient; put the weights of the loss in loss_weights.')
  if isinstance(g, jax.custom_derivatives.SymbolicZero):
    return tuple(None if a is None else jnp.zeros_like(a) for a in grads) + (None, None)
  return tuple(None if a is None else (g * a).astype(a.dtype) for a in grads) + (None, None)


_output_layer_loss.defvjp(_output_layer_forward, _output_layer_backward, symbolic_zeros=True)


def token_stats(logits_XV: Array, targets_X: Array, weights_X: Array
                ) -> tuple[Array, Array, Array]:
  """(weighted NLL sum, weight sum, weighted correct count) over any leading shape X."""
  weights_X = weights_X.astype(jnp.float32)
  nll_X, correct_X = cross_entropy(logits_XV, targets_X)
  # Selected, not multiplied: a non-finite logit at a padding position would make 0 * nll NaN.
  counted_X = weights_X != 0
  nll_sum = jnp.where(counted_X, nll_X * weights_X, 0.0).sum()
  correct_sum = jnp.where(counted_X, correct_X * weights_X, 0.0).sum()
  return nll_sum, weights_X.sum(), correct_sum


def output_stats(outputs: Mapping[str, Array], name: str, targets_X: Array, weights_X: Array,
                 loss_weights_X: Array, *also_weights: Array) -> tuple[Array, ...]:
  """(sum of loss_weights x NLL, weighted NLL sum, weight sum, weighted correct count) of the
  output layer outputs[f'{name}_output'] (chunked: output_layer_loss), or of the logits
  outputs[f'{name}_logits'] where a model gives only those. Only the first is differentiable.
  Each of `also_weights` adds its own (NLL sum, weight sum, correct count) of the same
  predictions, computed once."""
  if f'{name}_output' in outputs:
    layer = outputs[f'{name}_output']
    loss, nll_X, correct_X = output_layer_loss(layer['x'], layer['table'], layer['bias'],
                                               targets_X, loss_weights_X)
  else:
    nll_X, correct_X = cross_entropy(outputs[f'{name}_logits'], targets_X)
    loss = jnp.where(loss_weights_X != 0, nll_X * loss_weights_X, 0.0).sum()
  stats = (loss,)
  for counts_X in (weights_X,) + also_weights:
    counts_X = counts_X.astype(jnp.float32)
    counted_X = counts_X != 0  # selected, not multiplied, as in token_stats
    stats += (jax.lax.stop_gradient(jnp.where(counted_X, nll_X * counts_X, 0.0).sum()),
              counts_X.sum(), jnp.where(counted_X, correct_X * counts_X, 0.0).sum())
  return stats


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  """Mean next-token cross-entropy of the output layer against batch['targets']."""
  weights = batch['weights'].astype(jnp.float32)
  count = weights.sum()
  loss, nll, count, correct = output_stats(outputs, 'lm', batch['targets'], weights,
                                           weights / jnp.maximum(count, 1.0))
  return loss, {'lm_loss': pair(nll, count), 'lm_accuracy': pair(correct, count),
                'loss': pair(loss * count, count)}  # one mean: trainer/steps.py


_REPORT_ORDER = ('loss', 'lm_loss', 'lm_accuracy', 'lm_perplexity')


def summarize_with_perplexity(totals: Mapping[str, np.ndarray], nll: str, perplexity: str,
                              order: tuple[str, ...]) -> dict[str, float]:
  """Means of the accumulated (sum, count) pairs, plus exp(mean of `nll`) as `perplexity`;
  the names in `order` first."""
  means = {k: float(v[0] / max(v[1], 1e-9)) for k, v in totals.items()}
  if nll in means:
    means[perplexity] = float(np.exp(min(means[nll], 50.0)))
  first = [k for k in order if k in means]
  return {k: means[k] for k in first + sorted(set(means) - set(first))}


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the accumulated (sum, count) pairs, plus perplexity exp(lm_loss)."""
  return summarize_with_perplexity(totals, 'lm_loss', 'lm_perplexity', _REPORT_ORDER)
