"""Tests of GPT's fine-tuning loss L3 = L2 + lambda * L1, Radford et al. 2018 sec. 3.2 (eq. 5)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from objectives import gpt_finetune

# Three examples, the last one padding; one sequence of 3 positions, 4-token vocabulary.
LOGITS = np.array([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [9.0, -9.0, 3.0]], np.float32)
LABELS = np.array([0, 2, 1], np.int32)
EXAMPLE_WEIGHTS = np.array([1.0, 1.0, 0.0], np.float32)
TARGETS = np.array([[[1, 3, 0]], [[2, 0, 0]], [[3, 3, 3]]], np.int32)
WEIGHTS = np.array([[[1, 1, 0]], [[1, 0, 0]], [[1, 1, 1]]], np.float32)


def _lm_logits():
  return np.random.default_rng(0).normal(size=(3, 1, 3, 4)).astype(np.float32)


def _batch(**overrides):
  batch = {'labels': LABELS, 'example_weights': EXAMPLE_WEIGHTS, 'targets': TARGETS,
           'weights': WEIGHTS}
  batch.update(overrides)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _log_softmax(row):
  top = max(row)
  log_total = top + math.log(sum(math.exp(x - top) for x in row))
  return [x - log_total for x in row]


def _hand_l2():
  return (-_log_softmax(LOGITS[0])[0] - _log_softmax(LOGITS[1])[2]) / 2


def _hand_nll(lm_logits):
  # Real examples only: example 0 predicts 2 tokens, example 1 one.
  return [[-_log_softmax(lm_logits[0, 0, t])[TARGETS[0, 0, t]] for t in (0, 1)],
          [-_log_softmax(lm_logits[1, 0, 0])[TARGETS[1, 0, 0]]]]


def _hand_l1(lm_logits):
  # OpenAI's finetune-transformer-lm: each sequence's token mean, then the mean over sequences.
  return sum(sum(nll) / len(nll) for nll in _hand_nll(lm_logits)) / 2


def _hand_token_mean(lm_logits):
  nll = sum(_hand_nll(lm_logits), [])
  return sum(nll) / len(nll)


def test_lambda_zero_gives_exactly_l2():
  loss, metrics = gpt_finetune.loss_fn({'logits': LOGITS, 'lm_logits': _lm_logits()}, _batch(),
                                       lm_coef=0.0)
  np.testing.assert_allclose(loss, _hand_l2(), rtol=1e-6)
  task_sum, count = np.asarray(metrics['task_loss'])
  assert float(loss) == np.float32(task_sum / count)
  # No 0 * NaN: a broken LM output leaves the loss alone.
  nan = np.full((3, 1, 3, 4), np.nan, np.float32)
  nan_loss, _ = gpt_finetune.loss_fn({'logits': LOGITS, 'lm_logits': nan}, _batch(), lm_coef=0.0)
  assert float(nan_loss) == float(loss)


def test_lambda_adds_the_auxiliary_lm_loss():
  lm_logits = _lm_logits()
  loss, metrics = gpt_finetune.loss_fn({'logits': LOGITS, 'lm_logits': lm_logits}, _batch(),
                                       lm_coef=0.5)
  np.testing.assert_allclose(loss, _hand_l2() + 0.5 * _hand_l1(lm_logits), rtol=1e-6)
  np.testing.assert_allclose(metrics['lm_loss'], [3 * _hand_token_mean(lm_logits), 3], rtol=1e-6)
  np.testing.assert_allclose(metrics['task_loss'], [2 * _hand_l2(), 2], rtol=1e-6)
  np.testing.assert_allclose(metrics['loss'], [2 * float(loss), 2], rtol=1e-6)
  np.testing.assert_allclose(metrics['accuracy'], [1, 2])  # example 0 right, 1 wrong
  assert 'true_pos' not in metrics  # three classes: no binary statistics
  default, _ = gpt_finetune.loss_fn({'logits': LOGITS, 'lm_logits': lm_logits}, _batch())
  assert float(default) == float(loss)  # lambda = 0.5 is the paper's


def test_l1_is_the_mean_over_sequences_of_each_sequences_token_mean():
  # Two sequences per example (similarity): 3, 1 and 2, 2 weighted tokens; example 2 is padding.
  rng = np.random.default_rng(1)
  lm_logits = rng.normal(size=(3, 2, 4, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(3, 2, 4)).astype(np.int32)
  weights = np.array([[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 1, 0, 0], [1, 1, 0, 0]],
                      [[1, 1, 1, 1], [1, 1, 1, 1]]], np.float32)
  batch = _batch(labels=np.array([0, 1, 1], np.int32), targets=targets, weights=weights)
  logits = np.zeros((3, 2), np.float32)  # L2 = log 2 for every example
  loss, metrics = gpt_finetune.loss_fn({'logits': logits, 'lm_logits': lm_logits}, batch,
                                       lm_coef=0.5)
  sequence_means, tokens = [], []
  for b in range(2):
    for c in range(2):
      nll = [-_log_softmax(lm_logits[b, c, t])[targets[b, c, t]]
             for t in range(4) if weights[b, c, t]]
      sequence_means.append(sum(nll) / len(nll))
      tokens += nll
  np.testing.assert_allclose(loss, math.log(2) + 0.5 * sum(sequence_means) / 4, rtol=1e-6)
  # The metric stays the per-token mean, whose exp is the perplexity.
  np.testing.assert_allclose(metrics['lm_loss'], [sum(tokens), len(tokens)], rtol=1e-6)
  assert abs(sum(sequence_means) / 4 - sum(tokens) / len(tokens)) > 1e-3  # the two differ here


def test_summarized_loss_weights_each_batch_by_its_real_examples():
  # A full batch, then a padded last batch with one real example: the summary is the
  # example-weighted mean, not the mean of the two batch losses.
  lm_logits = _lm_logits()
  full = _batch(example_weights=np.ones(3, np.float32))
  padded = _batch(example_weights=np.array([1.0, 0.0, 0.0], np.float32))
  losses, totals = [], {}
  for batch in (full, padded):
    loss, metrics = gpt_finetune.loss_fn({'logits': LOGITS, 'lm_logits': lm_logits}, batch)
    losses.append(float(loss))
    for key, value in metrics.items():
      totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64)
  assert losses[0] != pytest.approx(losses[1])
  summary = gpt_finetune.summarize(totals)
  assert summary['loss'] == pytest.approx((3 * losses[0] + losses[1]) / 4, rel=1e-6)


def test_padding_examples_change_nothing():
  outputs = {'logits': LOGITS, 'lm_logits': _lm_logits()}
  loss, metrics = gpt_finetune.loss_fn(outputs, _batch(), lm_coef=0.5)
  # Whatever the padding example holds, even NaN outputs.
  logits, lm_logits = LOGITS.copy(), outputs['lm_logits'].copy()
  logits[2] = [np.nan, 1e9, -1e9]
  lm_logits[2] = -1e9
  other, other_metrics = gpt_finetune.loss_fn(
      {'logits': logits, 'lm_logits': lm_logits},
      _batch(labels=np.array([0, 2, 0], np.int32)), lm_coef=0.5)
  assert float(other) == float(loss)
  for key in metrics:
    np.testing.assert_array_equal(other_metrics[key], metrics[key])
  # The same as the two real examples alone.
  alone, _ = gpt_finetune.loss_fn(
      {'logits': LOGITS[:2], 'lm_logits': outputs['lm_logits'][:2]},
      _batch(labels=LABELS[:2], example_weights=EXAMPLE_WEIGHTS[:2], targets=TARGETS[:2],
             weights=WEIGHTS[:2]), lm_coef=0.5)
  np.testing.assert_allclose(alone, loss, rtol=1e-6)


def test_regression_uses_squared_error():
  logits = np.array([[1.5], [3.0], [100.0]], np.float32)
  labels = np.array([2.0, 0.5, 1.0], np.float32)
  loss, metrics = gpt_finetune.loss_fn({'logits': logits}, _batch(labels=labels), lm_coef=0.0)
  np.testing.assert_allclose(loss, (0.5 ** 2 + 2.5 ** 2) / 2, rtol=1e-6)
  assert 'accuracy' not in metrics and 'sum_pred' in metrics


def test_multiple_choice_is_a_softmax_over_the_choices():
  # (B, C) scores of a choice head; example 1's right answer is choice 3.
  logits = np.array([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
  batch = _batch(labels=np.array([3, 3], np.int32), example_weights=np.ones(2, np.float32),
                 targets=TARGETS[:2], weights=WEIGHTS[:2])
  loss, metrics = gpt_finetune.loss_fn({'logits': logits}, batch)
  np.testing.assert_allclose(loss, (-_log_softmax(logits[0])[3] + math.log(4)) / 2, rtol=1e-6)
  np.testing.assert_allclose(metrics['accuracy'], [1, 2])  # argmax of a tie is choice 0
  # Two choices (PIQA): no F1 or Matthews correlation of "choice 2".
  _, metrics = gpt_finetune.loss_fn({'logits': logits[:, :2]}, batch | {
      'labels': np.array([1, 0], np.int32)}, choices=True)
  assert 'true_pos' not in metrics and 'f1' not in gpt_finetune.summarize(metrics)
  _, metrics = gpt_finetune.loss_fn({'logits': logits[:, :2]}, batch | {
      'labels': np.array([1, 0], np.int32)})  # two classes: what a classifier reports
  assert 'true_pos' in metrics


def _accumulate(steps):
  totals = {}
  for outputs, batch in steps:
    _, metrics = gpt_finetune.loss_fn(outputs, batch, lm_coef=0.0)
    for key, value in metrics.items():
      totals[key] = totals.get(key, 0.0) + np.asarray(value, np.float64)
  return gpt_finetune.summarize(totals)


def test_binary_f1_and_matthews_correlation_over_steps():
  predictions = [1, 1, 0, 1, 0, 0, 1, 0, 1, 1]
  labels = [1, 0, 0, 1, 1, 0, 1, 0, 0, 1]
  weights = [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]  # the last is padding
  steps = []
  for part in (slice(0, 4), slice(4, 10)):
    logits = np.array([[0.0, 1.0] if p else [1.0, 0.0] for p in predictions[part]], np.float32)
    steps.append(({'logits': logits}, _batch(labels=np.array(labels[part], np.int32),
                                             example_weights=np.array(weights[part], np.float32))))
  summary = _accumulate(steps)
  real = [(p, y) for p, y, w in zip(predictions, labels, weights) if w]
  tp = sum(p == 1 and y == 1 for p, y in real)
  fp = sum(p == 1 and y == 0 for p, y in real)
  fn = sum(p == 0 and y == 1 for p, y in real)
  tn = sum(p == 0 and y == 0 for p, y in real)
  assert (tp, fp, fn, tn) == (3, 2, 1, 3)
  assert summary['f1'] == pytest.approx(2 * 3 / (2 * 3 + 2 + 1))
  assert summary['matthews_corr'] == pytest.approx((3 * 3 - 2 * 1) / math.sqrt(5 * 4 * 5 * 4))
  assert summary['accuracy'] == pytest.approx(6 / 9)
  assert 'pearson' not in summary and 'true_pos' not in summary
  assert list(summary)[:3] == ['loss', 'task_loss', 'accuracy']


def test_matthews_correlation_is_zero_without_positive_predictions():
  logits = np.array([[1.0, 0.0]] * 3, np.float32)
  summary = _accumulate([({'logits': logits}, _batch(labels=np.array([1, 0, 0], np.int32),
                                                     example_weights=np.ones(3, np.float32)))])
  assert summary['matthews_corr'] == 0.0 and summary['f1'] == 0.0


def test_pearson_correlation_over_steps():
  predictions = [1.0, 2.0, 4.0, 3.0, 7.0, -50.0]
  labels = [1.5, 1.0, 4.5, 2.0, 5.0, 3.0]
  weights = [1, 1, 1, 1, 1, 0]
  steps = []
  for part in (slice(0, 2), slice(2, 6)):
    steps.append(({'logits': np.array(predictions[part], np.float32)[:, None]},
                  _batch(labels=np.array(labels[part], np.float32),
                         example_weights=np.array(weights[part], np.float32))))
  summary = _accumulate(steps)
  x, y = predictions[:5], labels[:5]
  mx, my = sum(x) / 5, sum(y) / 5
  covariance = sum((a - mx) * (b - my) for a, b in zip(x, y))
  expected = covariance / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
  assert summary['pearson'] == pytest.approx(expected, rel=1e-6)
  assert summary['task_loss'] == pytest.approx(sum((a - b) ** 2 for a, b in zip(x, y)) / 5)
  assert 'f1' not in summary and 'accuracy' not in summary


def test_lm_perplexity_is_reported_with_the_lm_loss():
  lm_logits = _lm_logits()
  summary = _accumulate([({'logits': LOGITS, 'lm_logits': lm_logits}, _batch())])
  assert summary['lm_loss'] == pytest.approx(_hand_token_mean(lm_logits), rel=1e-6)
  assert summary['lm_perplexity'] == pytest.approx(math.exp(_hand_token_mean(lm_logits)), rel=1e-6)
