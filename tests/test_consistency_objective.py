"""CVT's losses and span F1, against hand counts (Clark et al. 2018, sec. 2; conlleval)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from input_pipeline import tagging
from objectives import consistency

NAMES = tagging.TASKS['offline_names']  # O B-PER I-PER B-LOC I-LOC
SPANS = tagging.span_tags(NAMES)
BIG = 20.0


def _labeled(gold, predicted, num_labels=5, task_ids=None):
  gold, predicted = np.array(gold), np.array(predicted)
  B, L = gold.shape
  logits = np.full((B, L, num_labels), -BIG, np.float32)
  np.put_along_axis(logits, predicted[..., None], BIG, axis=-1)
  batch = {'labels': jnp.asarray(gold, jnp.int32), 'label_weights': jnp.ones((B, L)),
           'example_weights': jnp.ones(B),
           'task_ids': jnp.asarray(task_ids if task_ids is not None else np.zeros(B), jnp.int32)}
  return jnp.asarray(logits), batch


def test_span_f1_matches_a_hand_count():
  # gold: PER(1-2), LOC(4), PER(6) | LOC(0-1), PER(3)
  gold = [[0, 1, 2, 0, 3, 0, 1], [3, 4, 0, 1, 0, 0, 0]]
  # predicted: PER(1-2) right; LOC(4) right; PER(6) missed as LOC(6) | LOC(0) too short; PER(3)
  # right; an I-PER after O at 5 starts a spurious PER chunk (5).
  predicted = [[0, 1, 2, 0, 3, 0, 3], [3, 0, 0, 1, 0, 2, 0]]
  logits, batch = _labeled(gold, predicted)
  _, metrics = consistency.loss_fn({'primary_logits': (logits,)}, batch, tasks=('names',),
                                   span_tags=(SPANS,))
  summary = consistency.summarize(jax.device_get(metrics))
  gold_chunks, predicted_chunks, correct = 5, 6, 3
  assert summary['names_span_precision'] == pytest.approx(correct / predicted_chunks)
  assert summary['names_span_recall'] == pytest.approx(correct / gold_chunks)
  f1 = 2 * correct / (gold_chunks + predicted_chunks)
  assert summary['names_span_f1'] == pytest.approx(f1)
  assert summary['names_accuracy'] == pytest.approx(11 / 14)


def test_bioes_predictions_are_scored_as_their_bio_chunks():
  gold_bio = [[0, 1, 2, 2, 0, 3, 1]]
  gold = [tagging.bio_to_bioes(gold_bio[0], NAMES)]
  names = tagging.label_names(NAMES, 'BIOES')
  assert [names[i] for i in gold[0]] == ['O', 'B-PER', 'I-PER', 'E-PER', 'O', 'S-LOC', 'S-PER']
  # Predicted: the PER chunk cut short (B-PER E-PER, then S-PER), LOC right, the last PER right.
  ids = {n: i for i, n in enumerate(names)}
  predicted = [[ids[n] for n in ('O', 'B-PER', 'E-PER', 'S-PER', 'O', 'S-LOC', 'S-PER')]]
  logits, batch = _labeled(gold, predicted, num_labels=len(names))
  _, metrics = consistency.loss_fn({'primary_logits': (logits,)}, batch, tasks=('names',),
                                   span_tags=(SPANS,), to_bio=(tagging.to_bio_ids(NAMES, 'BIOES'),))
  summary = consistency.summarize(jax.device_get(metrics))
  # gold 3 chunks, predicted 4, correct 2 (LOC and the last PER).
  assert summary['names_span_precision'] == pytest.approx(2 / 4)
  assert summary['names_span_recall'] == pytest.approx(2 / 3)


def test_label_smoothing_by_hand_and_rows_of_other_tasks_count_nothing():
  logits = jnp.array([[[1.0, 2.0, 0.0]]])
  batch = {'labels': jnp.array([[1]]), 'label_weights': jnp.ones((1, 1)),
           'example_weights': jnp.ones(1), 'task_ids': jnp.array([0])}
  logp = jax.nn.log_softmax(logits[0, 0])
  eps = 0.1
  expected = -((1 - eps) * logp[1] + eps / 3 * logp.sum())
  loss, metrics = consistency.loss_fn({'primary_logits': (logits,)}, batch, label_smoothing=eps)
  assert float(loss) == pytest.approx(float(expected), rel=1e-6)
  # The task's reported loss is its plain NLL (cvt_text evaluates with smoothing 0); the
  # smoothed one is the objective's.
  summary = consistency.summarize(jax.device_get(metrics))
  assert summary['task_loss'] == pytest.approx(-float(logp[1]), rel=1e-6)
  assert summary['supervised_loss'] == pytest.approx(float(expected), rel=1e-6)
  # Two tasks: rows of task 1 add nothing to task 0's loss or counts, and vice versa.
  logits0, batch = _labeled([[1, 2], [0, 0]], [[1, 2], [1, 1]], task_ids=[0, 1])
  logits1 = jnp.zeros((2, 2, 3))
  _, metrics = consistency.loss_fn({'primary_logits': (logits0, logits1)}, batch,
                                   tasks=('names', 'pos'), span_tags=(SPANS, ()))
  summary = consistency.summarize(jax.device_get(metrics))
  assert summary['names_accuracy'] == 1.0 and metrics['names_accuracy'][1] == 2
  assert metrics['pos_accuracy'][1] == 2
  assert summary['names_span_f1'] == 1.0
  assert not any(k.startswith('pos_span') for k in summary)  # accuracy-only task


def test_a_task_not_drawn_is_left_out_and_a_padded_batch_weighs_its_real_rows():
  # A log window whose labeled steps all drew task 0: task 1 has no rows, so no scores (0.0
  # would read as a perfect loss and an F1 of nothing).
  logits0, batch = _labeled([[1, 2], [0, 0]], [[1, 2], [0, 0]], task_ids=[0, 0])
  logits1 = jnp.zeros((2, 2, 5))
  outputs = {'primary_logits': (logits0, logits1)}
  _, metrics = consistency.loss_fn(outputs, batch, tasks=('names', 'other'),
                                   span_tags=(SPANS, SPANS))
  summary = consistency.summarize(jax.device_get(metrics))
  assert summary['names_span_f1'] == 1.0 and 'names_loss' in summary
  assert not any(k.startswith('other_') for k in summary), summary
  # An eval's last batch, one real row of two: its mean weighs half a full batch's.
  full_loss, full = consistency.loss_fn(outputs, batch, tasks=('names', 'other'))
  padded = dict(batch, example_weights=jnp.array([1.0, 0.0]))
  half_loss, half = consistency.loss_fn({'primary_logits': (logits1, logits1)}, padded,
                                        tasks=('names', 'other'))
  totals = jax.tree.map(lambda a, b: a + b, jax.device_get(full), jax.device_get(half))
  expected = (float(full_loss) + 0.5 * float(half_loss)) / 1.5
  assert consistency.summarize(totals)['loss'] == pytest.approx(expected, rel=1e-6)
  assert float(half_loss) == pytest.approx(np.log(5), rel=1e-6)


def test_consistency_loss_by_hand():
  teacher = jnp.array([[[0.0, 1.0], [2.0, 0.0], [0.0, 0.0], [5.0, 5.0]]])
  student = jnp.array([[[1.0, 0.0], [0.0, 0.0], [3.0, 1.0], [9.0, 9.0]]])
  batch = {'token_ids': jnp.zeros((1, 4), jnp.int32), 'lengths': jnp.array([4]),
           'example_weights': jnp.ones(1)}
  outputs = {'primary_logits': (teacher,),
             'aux_logits': ({'forward': student, 'past': student},)}
  loss, metrics = consistency.loss_fn(outputs, batch)
  # Words are positions 1 and 2 (0 is <S>, 3 is </S>). The past view reads the state after a
  # word, </S>'s at the last word, which cvt_text's rolled mask leaves out: position 1 only.
  p = jax.nn.softmax(teacher[0])
  ce = -(p * jax.nn.log_softmax(student[0])).sum(-1)
  expected = float(ce[1:3].mean() + ce[1])
  assert float(loss) == pytest.approx(expected, rel=1e-6)
  assert float(metrics['consistency_loss'][0]) == pytest.approx(expected, rel=1e-6)
  # The future view reads the state before a word, <S>'s at the first: position 2 only.
  outputs = {'primary_logits': (teacher,), 'aux_logits': ({'future': student},)}
  assert float(consistency.loss_fn(outputs, batch)[0]) == pytest.approx(float(ce[2]), rel=1e-6)
  # Label smoothing is for gold labels only: the soft targets stay as the teacher made them.
  student = student[:, ::-1]  # at position 1 both are far from uniform, so smoothing would show
  outputs = {'primary_logits': (teacher,), 'aux_logits': ({'past': student},)}
  smoothed, _ = consistency.loss_fn(outputs, batch, label_smoothing=0.1)
  ce = -(p * jax.nn.log_softmax(student[0])).sum(-1)
  assert float(smoothed) == pytest.approx(float(ce[1]), rel=1e-6)


@pytest.mark.parametrize('task', ['conll2003', 'conll2003_chunk'])
def test_span_scores_equal_seqeval_on_random_tag_sequences(task):
  # seqeval (a maintained port of conlleval; requirements.txt) in its default mode.
  from seqeval import metrics as seqeval  # pylint: disable=g-import-not-at-top
  spec = tagging.TASKS[task]
  rng = np.random.default_rng(0)
  gold = rng.integers(0, spec.num_labels, (64, 12))
  predicted = np.where(rng.random(gold.shape) < 0.6, gold,
                       rng.integers(0, spec.num_labels, gold.shape))
  logits, batch = _labeled(gold, predicted, num_labels=spec.num_labels)
  _, metrics = consistency.loss_fn({'primary_logits': (logits,)}, batch, tasks=('t',),
                                   span_tags=(tagging.span_tags(spec),))
  summary = consistency.summarize(jax.device_get(metrics))
  as_names = lambda rows: [[spec.label_names[i] for i in row] for row in rows]  # noqa: E731
  y_true, y_pred = as_names(gold), as_names(predicted)
  assert summary['t_span_precision'] == pytest.approx(seqeval.precision_score(y_true, y_pred))
  assert summary['t_span_recall'] == pytest.approx(seqeval.recall_score(y_true, y_pred))
  assert summary['t_span_f1'] == pytest.approx(seqeval.f1_score(y_true, y_pred))
