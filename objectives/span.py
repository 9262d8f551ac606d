"""BERT's SQuAD span loss (Devlin et al. 2018, sec. 4.2).

The probability of token i starting the answer is a softmax of S . T_i over
the window's tokens, likewise for the end with E; the loss is the mean of
the start and end cross-entropies (run_squad.py's (start_loss + end_loss) / 2),
averaged over the windows. A window without the whole answer points both at
[CLS] (position 0), as the reference does for SQuAD v1.1. Padding positions
take no probability; padding rows (example_weights 0) count in nothing.

The metrics are the loss and how often the start and end are exactly right;
exact match and F1 over the answers' text are computed on the host, from the
logits `predict` returns (input_pipeline/squad.py scores them).
"""

from typing import Mapping

import jax
import jax.numpy as jnp

from objectives import lm

Array = jax.Array


def _masked(logits_BL: Array, input_mask_BL: Array) -> Array:
  return jnp.where(input_mask_BL > 0, logits_BL.astype(jnp.float32), -1e9)


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  """(start cross-entropy + end cross-entropy) / 2, and start/end accuracy."""
  weights_B = batch['example_weights'].astype(jnp.float32)
  num_windows = weights_B.sum()
  metrics, losses = {}, []
  for name in ('start', 'end'):
    logits_BL = _masked(outputs[f'{name}_logits'], batch['input_mask'])
    target_B = batch[f'{name}_positions']
    nll, _, correct = lm.token_stats(logits_BL, target_B, weights_B)
    losses.append(nll)
    metrics[f'{name}_accuracy'] = lm.pair(correct, num_windows)
  loss_sum = (losses[0] + losses[1]) / 2
  metrics['loss'] = lm.pair(loss_sum, num_windows)
  return loss_sum / jnp.maximum(num_windows, 1e-6), metrics


def predict(outputs: Mapping[str, Array], batch: Mapping[str, Array]) -> dict[str, Array]:
  """Each window's start and end logits, for the host-side n-best search."""
  return {'example_index': batch['example_index'],
          'start_logits': _masked(outputs['start_logits'], batch['input_mask']),
          'end_logits': _masked(outputs['end_logits'], batch['input_mask'])}


def summarize(totals: Mapping[str, Array]) -> dict[str, float]:
  """Means of the (sum, count) pairs."""
  return lm.summarize_with_perplexity(totals, '', '', ('loss', 'start_accuracy', 'end_accuracy'))
