"""Next-token language modelling loss (Radford et al. 2018, sec. 3.1, eq. 1).

L1 = -sum_i log P(u_i | u_{i-k}, ..., u_{i-1}), averaged over the weighted
targets. The pipeline sets a target's weight to 0 for padding and where the
next token belongs to another document, so packed documents never predict
each other. Shared by GPT and, later, the Transformer decoder.
"""

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

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


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  """Mean next-token cross-entropy of outputs['lm_logits'] against batch['targets']."""
  nll, count, correct = token_stats(outputs['lm_logits'], batch['targets'], batch['weights'])
  loss = nll / jnp.maximum(count, 1.0)
  return loss, {'lm_loss': pair(nll, count), 'lm_accuracy': pair(correct, count),
                'loss': pair(loss, 1.0)}


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
