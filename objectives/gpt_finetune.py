"""GPT's fine-tuning loss L3 = L2 + lambda * L1 (Radford et al. 2018, sec. 3.2, eq. 5).

L2 is the task loss of the linear head, averaged over the examples: softmax
cross-entropy over the classes, or over the choices of a multiple-choice
example (sec. 3.3), and the squared error of the single output when the
labels are floats (regression, e.g. STS-B). L1 is the next-token loss of
the task sequences (objectives/lm.py), the auxiliary LM that "improves
generalization of the supervised model and accelerates convergence".
Padding examples (example_weights 0) count in neither.

L1 averages as OpenAI's finetune-transformer-lm does (train.py, `model`):
the mean NLL of each sequence's weighted tokens, then the mean over the
sequences of the batch (each of the C sequences of an example is one), so
a short sequence weighs as much as a long one. The 'lm_loss' metric is the
per-token mean instead, for a perplexity.

Metrics are (sum, count) pairs that add up across devices and steps; the
'loss' pair is weighted by the batch's real examples, so a padded last eval
batch counts for what it holds. The binary confusion counts (label 1 is the
positive class) and the sums of the Pearson correlation are sufficient
statistics, so `summarize` gives the F1, Matthews correlation and Pearson
correlation of a whole eval pass.
"""

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from objectives import lm

Array = jax.Array

_CONFUSION = ('true_pos', 'false_pos', 'false_neg', 'true_neg')
_PEARSON = ('sum_pred', 'sum_label', 'sum_pred_sq', 'sum_label_sq', 'sum_pred_label')


def _weighted_sum(values_B: Array, weights_B: Array) -> Array:
  # where, not a product alone: a padding example's NaN must not reach the sum.
  return jnp.where(weights_B > 0, values_B * weights_B, 0.0).sum()


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array], *,
            lm_coef: float = 0.5, choices: bool = False) -> tuple[Array, dict[str, Array]]:
  """L2 + lm_coef * L1 and its metrics; lm_coef = 0 gives L2 alone (sec. 3.2). `choices`:
  the logits score an example's choices (the choice head), whose F1 of class 1 would be that
  of "choice 2", not a metric of the task."""
  logits_BN = outputs['logits'].astype(jnp.float32)
  labels_B = batch['labels']
  weights_B = batch['example_weights'].astype(jnp.float32)
  num_examples = weights_B.sum()
  metrics = {}
  if jnp.issubdtype(labels_B.dtype, jnp.floating):
    prediction_B = logits_BN[:, 0]
    label_B = labels_B.astype(jnp.float32)
    task_loss_B = jnp.square(prediction_B - label_B)
    for name, value_B in zip(_PEARSON, (prediction_B, label_B, prediction_B ** 2, label_B ** 2,
                                        prediction_B * label_B)):
      metrics[name] = lm.pair(_weighted_sum(value_B, weights_B), num_examples)
  else:
    logp_BN = jax.nn.log_softmax(logits_BN, axis=-1)
    task_loss_B = -jnp.take_along_axis(logp_BN, labels_B[:, None], axis=-1)[:, 0]
    predicted_B = logits_BN.argmax(-1)
    metrics['accuracy'] = lm.pair(
        _weighted_sum((predicted_B == labels_B).astype(jnp.float32), weights_B), num_examples)
    if logits_BN.shape[-1] == 2 and not choices:
      predicted_B, positive_B = predicted_B == 1, labels_B == 1
      for name, value_B in zip(_CONFUSION, (predicted_B & positive_B, predicted_B & ~positive_B,
                                            ~predicted_B & positive_B,
                                            ~predicted_B & ~positive_B)):
        metrics[name] = lm.pair(_weighted_sum(value_B.astype(jnp.float32), weights_B),
                                num_examples)
  task_sum = _weighted_sum(task_loss_B, weights_B)
  task_loss = task_sum / jnp.maximum(num_examples, 1e-6)
  metrics['task_loss'] = lm.pair(task_sum, num_examples)
  loss = task_loss

  if 'lm_logits' in outputs or 'lm_output' in outputs:
    # The padding examples' tokens are out of the LM too.
    lm_weights = batch['weights'] * weights_B.reshape((-1,) + (1,) * (batch['weights'].ndim - 1))
    # One row per sequence S = B * C; L1 is the mean over sequences of each one's mean NLL.
    length = batch['targets'].shape[-1]
    weights_SL = lm_weights.reshape(-1, length).astype(jnp.float32)
    count_S = weights_SL.sum(axis=1)
    # Padding examples' sequences have no weighted token and are not counted.
    num_sequences = jnp.maximum((count_S > 0).sum(), 1)
    loss_weights_SL = lm_coef * weights_SL / jnp.maximum(count_S, 1e-6)[:, None] / num_sequences
    lm_loss, nll, count, _ = lm.output_stats(outputs, 'lm', batch['targets'],
                                             lm_weights, loss_weights_SL.reshape(lm_weights.shape))
    metrics['lm_loss'] = lm.pair(nll, count)
    if lm_coef:  # a Python float: lm_coef = 0 leaves L1 out of the graph of the loss
      loss = loss + lm_loss
  metrics['loss'] = lm.pair(loss * num_examples, num_examples)
  return loss, metrics


def predict(outputs: Mapping[str, Array], batch: Mapping[str, Array]) -> dict[str, Array]:
  """The predicted class (or choice) of each example, or its value for regression."""
  logits_BN = outputs['logits'].astype(jnp.float32)
  if jnp.issubdtype(batch['labels'].dtype, jnp.floating):
    prediction_B = logits_BN[:, 0]
  else:
    prediction_B = logits_BN.argmax(-1).astype(jnp.float32)
  return {'example_index': batch['example_index'], 'prediction': prediction_B}


def _ratio(numerator: float, denominator: float) -> float:
  return numerator / denominator if denominator > 0 else 0.0


_REPORT_ORDER = ('loss', 'task_loss', 'lm_loss', 'lm_perplexity', 'accuracy', 'f1',
                 'matthews_corr', 'pearson')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the pairs, plus F1, Matthews and Pearson correlation from their statistics."""
  totals = {k: np.asarray(v, np.float64) for k, v in totals.items()}
  summary = {k: float(_ratio(v[0], v[1])) for k, v in totals.items()
             if k not in _CONFUSION + _PEARSON}
  if 'lm_loss' in summary:
    summary['lm_perplexity'] = float(np.exp(min(summary['lm_loss'], 50.0)))
  if all(k in totals for k in _CONFUSION):
    tp, fp, fn, tn = (totals[k][0] for k in _CONFUSION)
    summary['f1'] = float(_ratio(2 * tp, 2 * tp + fp + fn))
    # 0 when a row or column of the confusion matrix is empty, as sklearn does.
    summary['matthews_corr'] = float(_ratio(tp * tn - fp * fn,
                                            np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))))
  if all(k in totals for k in _PEARSON):
    n = totals[_PEARSON[0]][1]
    sx, sy, sxx, syy, sxy = (totals[k][0] for k in _PEARSON)
    covariance, var_x, var_y = n * sxy - sx * sy, n * sxx - sx ** 2, n * syy - sy ** 2
    summary['pearson'] = float(_ratio(covariance, np.sqrt(max(var_x * var_y, 0.0))))
  first = [k for k in _REPORT_ORDER if k in summary]
  return {k: summary[k] for k in first + sorted(set(summary) - set(first))}
