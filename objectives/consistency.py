"""Cross-View Training's losses (Clark et al. 2018, sec. 2 and 3.3).

Labeled batch ('labels' in the batch; one task per batch, batch['task_ids']):
the cross-entropy of that task's primary module, with cvt_text's label
smoothing (targets (1 - eps) one-hot + eps / N). Unlabeled batch
('aux_logits' in the outputs): the primary module's predictions, made
without dropout and held fixed, are the soft targets (not smoothed: cvt_text
feeds label_smoothing 0 on unlabeled batches), and each auxiliary
module of each task is trained towards them:
L = sum over tasks and views of the mean over words of CE(targets, aux)
(the future view has no target at the first word, the past view none at the
last: their states there are <S>'s and </S>'s, as cvt_text's rolled masks),
which moves the encoder and the auxiliary modules but not the primary module.

Span metrics per task follow conlleval on BIO ids (objectives/tagging.py):
`to_bio[t]` maps each label id of the task's encoding (BIOES: S-X -> B-X,
E-X -> I-X) to its BIO id and `span_tags[t]` lists (B-X, I-X) per type, ()
for accuracy-only tasks such as part of speech. Metrics are (sum, count)
pairs; 'loss' is the mean per batch of either kind (the padded last batch of
an eval weighs its share of real rows); a task's `{task}_loss` is its
cross-entropy without smoothing (cvt_text evaluates with smoothing 0), its
smoothed one the objective's `supervised_loss`.
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from objectives import lm
from objectives import tagging

Array = jax.Array

_SPAN_COUNTS = ('gold_spans', 'predicted_spans', 'correct_spans')


def smoothed_cross_entropy(logits_BLN: Array, targets_BLN: Array, eps: float) -> Array:
  """Per-token CE against target distributions mixed with eps of the uniform one."""
  num_labels = logits_BLN.shape[-1]
  targets_BLN = (1.0 - eps) * targets_BLN + eps / num_labels
  return -(targets_BLN * jax.nn.log_softmax(logits_BLN.astype(jnp.float32), axis=-1)).sum(-1)


def word_weights(batch: Mapping[str, Array]) -> Array:
  """1 at the words of real rows (between <S> and </S>), else 0."""
  lengths_B = batch['lengths']
  t_L = jnp.arange(batch['token_ids'].shape[1])
  words_BL = (t_L[None] >= 1) & (t_L[None] < lengths_B[:, None] - 1)
  return words_BL.astype(jnp.float32) * batch['example_weights'].astype(jnp.float32)[:, None]


def view_weights(batch: Mapping[str, Array], view: str) -> Array:
  """word_weights less the word a view has no word's state for: 'future' reads the state before
  a word, which at the first word is <S>'s, and 'past' the state after it, at the last word
  </S>'s. cvt_text's masked_ce_loss rolls its mask with the labels the same way."""
  weights_BL = word_weights(batch)
  t_1L = jnp.arange(weights_BL.shape[1])[None]
  if view == 'future':
    return jnp.where(t_1L == 1, 0.0, weights_BL)
  if view == 'past':
    return jnp.where(t_1L == batch['lengths'][:, None] - 2, 0.0, weights_BL)
  return weights_BL


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array], *,
            tasks: Sequence[str] = ('task',), span_tags: Sequence[Sequence] = (),
            to_bio: Sequence[Sequence[int]] = (), label_smoothing: float = 0.0
            ) -> tuple[Array, dict[str, Array]]:
  """The supervised loss of a labeled batch or the consistency loss of an unlabeled one."""
  if len(tasks) != len(outputs['primary_logits']):
    raise ValueError(f'loss.tasks={tuple(tasks)} but the model has '
                     f'{len(outputs["primary_logits"])} tasks: list one name per task.')
  if 'aux_logits' in outputs and 'labels' not in batch:
    return _consistency(outputs, batch, tasks)
  return _supervised(outputs, batch, tasks, span_tags, to_bio, label_smoothing)


def _supervised(outputs, batch, tasks, span_tags, to_bio, eps):
  labels_BL = batch['labels']
  weights_BL = (batch['label_weights'].astype(jnp.float32) *
                batch['example_weights'].astype(jnp.float32)[:, None])
  total_ce, total_count, metrics = 0.0, 0.0, {}
  for t, (name, logits_BLN) in enumerate(zip(tasks, outputs['primary_logits'])):
    task_weights_BL = weights_BL * (batch['task_ids'] == t)[:, None]
    counted_BL = task_weights_BL != 0
    # Labels of other tasks may be out of this task's range: clipped, then not counted.
    task_labels_BL = jnp.clip(labels_BL, 0, logits_BLN.shape[-1] - 1)
    one_hot_BLN = jax.nn.one_hot(task_labels_BL, logits_BLN.shape[-1])
    ce_BL = smoothed_cross_entropy(logits_BLN, one_hot_BLN, eps)
    ce = jnp.where(counted_BL, ce_BL * task_weights_BL, 0.0).sum()
    plain_BL = smoothed_cross_entropy(logits_BLN, one_hot_BLN, 0.0) if eps else ce_BL
    nll = jnp.where(counted_BL, plain_BL * task_weights_BL, 0.0).sum()
    count = task_weights_BL.sum()
    predicted_BL = logits_BLN.argmax(-1)
    correct = jnp.where(counted_BL, (predicted_BL == task_labels_BL) * task_weights_BL, 0.0).sum()
    metrics[f'{name}_loss'] = lm.pair(nll, count)  # unsmoothed, as cvt_text evaluates
    metrics[f'{name}_accuracy'] = lm.pair(correct, count)
    if span_tags and span_tags[t]:
      bio = jnp.asarray(to_bio[t] if to_bio and to_bio[t] else np.arange(logits_BLN.shape[-1]))
      gold, predicted, hit = tagging.span_counts(
          bio[task_labels_BL], bio[predicted_BL], task_weights_BL, span_tags[t], len(bio))
      rows = (batch['example_weights'] * (batch['task_ids'] == t)).sum()
      for key, value in zip(_SPAN_COUNTS, (gold, predicted, hit)):
        metrics[f'{name}_{key}'] = lm.pair(value, rows)
    total_ce, total_count = total_ce + ce, total_count + count
  loss = total_ce / jnp.maximum(total_count, 1e-6)
  metrics['supervised_loss'] = lm.pair(total_ce, total_count)
  # A batch's mean, weighed by its share of real rows, though one mean: a window of labeled and
  # unlabeled steps logs the mean of their losses, whose units differ (a token's cross-entropy;
  # a sum over the views), so each full batch weighs 1, as do micro-batches (trainer/steps.py),
  # and the padded last batch of an eval only its share.
  real = batch['example_weights'].astype(jnp.float32).mean()
  metrics['loss'] = lm.pair(loss * real, real)
  return loss, metrics


def _consistency(outputs, batch, tasks):
  loss, metrics = 0.0, {}
  for name, teacher_BLN, students in zip(tasks, outputs['primary_logits'], outputs['aux_logits']):
    targets_BLN = jax.nn.softmax(jax.lax.stop_gradient(teacher_BLN).astype(jnp.float32), axis=-1)
    for view, logits_BLN in students.items():
      weights_BL = view_weights(batch, view)
      view_loss = ((smoothed_cross_entropy(logits_BLN, targets_BLN, 0.0) * weights_BL).sum()
                   / jnp.maximum(weights_BL.sum(), 1e-6))
      metrics[f'{name}_{view}_loss'] = lm.pair(view_loss, 1.0)
      loss = loss + view_loss
  metrics['consistency_loss'] = lm.pair(loss, 1.0)
  metrics['loss'] = lm.pair(loss, 1.0)  # a sum of means over other tokens: trainer/steps.py
  return loss, metrics


def _ratio(numerator: float, denominator: float) -> float:
  return float(numerator / denominator) if denominator > 0 else 0.0


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the pairs, and conlleval's span precision, recall and F1 per span task; a
  task with no rows in `totals` (not drawn in a log window) is left out, not logged as 0."""
  totals = {k: np.asarray(v, np.float64) for k, v in totals.items()}
  summary = {k: float(v[0] / v[1]) for k, v in totals.items()
             if not k.endswith(_SPAN_COUNTS) and v[1] > 0}
  for key in [k for k in totals if k.endswith('_gold_spans') and totals[k][1] > 0]:
    name = key[:-len('_gold_spans')]
    gold, predicted, hit = (totals[f'{name}_{k}'][0] for k in _SPAN_COUNTS)
    precision, recall = _ratio(hit, predicted), _ratio(hit, gold)
    summary[f'{name}_span_precision'], summary[f'{name}_span_recall'] = precision, recall
    summary[f'{name}_span_f1'] = _ratio(2 * precision * recall, precision + recall)
  first = [k for k in ('loss', 'supervised_loss', 'consistency_loss') if k in summary]
  return {k: summary[k] for k in first + sorted(set(summary) - set(first))}
