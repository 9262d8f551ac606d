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


def token_stats(logits_XV: Array, targets_X: Array, weights_X: Array
                ) -> tuple[Array, Array, Array]:
  """(weighted NLL sum, weight sum, weighted correct count) over any leading shape X."""
  logits_XV = logits_XV.astype(jnp.float32)
  weights_X = weights_X.astype(jnp.float32)
  logp_XV = jax.nn.log_softmax(logits_XV, axis=-1)
  nll_X = -jnp.take_along_axis(logp_XV, targets_X[..., None], axis=-1)[..., 0]
  correct_X = (logits_XV.argmax(-1) == targets_X).astype(jnp.float32)
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
