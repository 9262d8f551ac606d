"""Fine-tuning metrics of a whole eval pass, from maintained libraries, on the host.

GLUE's (Wang et al. 2018): accuracy; for two classes also F1 of class 1 and
Matthews correlation (scikit-learn); Pearson and Spearman correlation for
regression (SciPy). CoNLL's span precision, recall and F1 (seqeval, which
counts chunks as conlleval does), with word accuracy.

`predictions` are the objective's `predict` outputs of one eval pass, rows in
any order with 'example_index' naming each row's example (padding rows
already removed); train.evaluate gathers them and a SCORED pipeline's
iterator calls these functions with its examples.
"""

import numpy as np


# What GLUE reports per task (Wang et al. 2018, table 1), where it is not accuracy alone.
_GLUE_REPORTED = {'cola': ('matthews_corr',), 'mrpc': ('f1', 'accuracy'),
                  'qqp': ('f1', 'accuracy'), 'stsb': ('pearson', 'spearman')}


def reported(task_name: str, regression: bool) -> tuple[str, ...]:
  """The metrics of `classification` that a task's benchmark reports, first the main one: GLUE's
  per task, Pearson and Spearman for another regression, else accuracy."""
  if task_name in _GLUE_REPORTED:
    return _GLUE_REPORTED[task_name]
  return ('pearson', 'spearman') if regression else ('accuracy',)


def by_example(predictions: dict[str, np.ndarray], key: str, count: int) -> np.ndarray:
  """predictions[key] in example order; every example must have been predicted."""
  index = predictions['example_index']
  out = np.zeros((count,) + predictions[key].shape[1:], predictions[key].dtype)
  seen = np.zeros(count, bool)
  out[index], seen[index] = predictions[key], True
  if not seen.all():
    raise ValueError(f'The eval pass predicted {seen.sum()} of {count} examples: run '
                     'train.eval_steps=0 (one whole pass).')
  return out


def classification(labels: np.ndarray, predicted: np.ndarray, *, regression: bool,
                   binary: bool) -> dict[str, float]:
  """GLUE's metrics of predicted classes (or values) against the labels."""
  # Imported here: they take a second to import and only eval needs them.
  from scipy import stats  # pylint: disable=g-import-not-at-top
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  if regression:
    return {'pearson': float(stats.pearsonr(predicted, labels).statistic),
            'spearman': float(stats.spearmanr(predicted, labels).statistic)}
  predicted = predicted.astype(np.int64)
  scores = {'accuracy': metrics.accuracy_score(labels, predicted)}
  if binary:
    scores['f1'] = metrics.f1_score(labels, predicted, zero_division=0.0)
    scores['matthews_corr'] = metrics.matthews_corrcoef(labels, predicted)
  return {k: float(v) for k, v in scores.items()}


def spans(gold: list[list[str]], predicted: list[list[str]],
          chunks: bool = True) -> dict[str, float]:
  """conlleval's chunk precision, recall and F1 of IOB tag names, and word accuracy; word
  accuracy alone without `chunks` (tags that are no IOB, such as part of speech: seqeval would
  read 'NN' and 'IN' as chunk prefixes)."""
  from seqeval import metrics  # pylint: disable=g-import-not-at-top
  if not chunks:
    return {'word_accuracy': float(metrics.accuracy_score(gold, predicted))}
  return {'span_f1': float(metrics.f1_score(gold, predicted, zero_division=0)),
          'span_precision': float(metrics.precision_score(gold, predicted, zero_division=0)),
          'span_recall': float(metrics.recall_score(gold, predicted, zero_division=0)),
          'word_accuracy': float(metrics.accuracy_score(gold, predicted))}
