"""Tests of the tagging loss and conlleval span F1 (Peters et al. 2018, sec. 3.3 and 5.1 NER)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from objectives import tagging

# CoNLL 2003's 9 tags as TFDS numbers them: O, then (B-, I-) of PER, ORG, LOC, MISC.
NAMES = ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC', 'I-MISC')
SPAN_TAGS = ((1, 2), (3, 4), (5, 6), (7, 8))


def _batch(labels, label_weights, example_weights):
  return {'labels': jnp.asarray(labels, jnp.int32),
          'label_weights': jnp.asarray(label_weights, jnp.float32),
          'example_weights': jnp.asarray(example_weights, jnp.float32)}


def _numpy_token_loss(logits, labels, weights):
  logits = logits.astype(np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == labels
  return (nll * weights).sum() / weights.sum(), (correct * weights).sum() / weights.sum()


def test_token_loss_and_accuracy_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 4)).astype(np.float32)
  labels = rng.integers(0, 4, size=(3, 5))
  label_weights = np.array([[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1]], np.float32)
  example_weights = np.array([1, 1, 0], np.float32)
  loss, metrics = tagging.loss_fn({'logits': logits, 'mix_l2': jnp.float32(7.0)},
                                  _batch(labels, label_weights, example_weights))
  weights = label_weights * example_weights[:, None]
  want_loss, want_accuracy = _numpy_token_loss(logits, labels, weights)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)  # mix_l2 left out: coefficient 0
  np.testing.assert_allclose(metrics['token_loss'], [4 * want_loss, 4], rtol=1e-6)
  np.testing.assert_allclose(metrics['accuracy'], [4 * want_accuracy, 4], rtol=1e-6)
  np.testing.assert_allclose(metrics['loss'], [4 * want_loss, 4], rtol=1e-6)
  assert 'gold_spans' not in metrics  # no span_tags, no span counts

  # The zero-weight example changes nothing, whatever its logits and labels (even NaN).
  logits[2], labels[2] = np.nan, 3 - labels[2]
  other, _ = tagging.loss_fn({'logits': logits, 'mix_l2': 0.0},
                             _batch(labels, label_weights, example_weights))
  assert float(other) == float(loss)


def test_mix_l2_coef_adds_the_penalty():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 4, 3)).astype(np.float32)
  batch = _batch(rng.integers(0, 3, size=(2, 4)), np.ones((2, 4)), np.ones(2))
  outputs = {'logits': logits, 'mix_l2': jnp.float32(2.5)}
  plain, _ = tagging.loss_fn(outputs, batch)
  penalized, _ = tagging.loss_fn(outputs, batch, mix_l2_coef=0.01)
  np.testing.assert_allclose(penalized, float(plain) + 0.01 * 2.5, rtol=1e-6)
  # The penalty's gradient reaches the mix weights through mix_l2 = sum(s ** 2).
  s = jnp.array([0.5, -1.0, 2.0])
  grad = jax.grad(lambda s: tagging.loss_fn({'logits': logits, 'mix_l2': (s ** 2).sum()}, batch,
                                            mix_l2_coef=0.1)[0])(s)
  np.testing.assert_allclose(grad, 0.2 * np.asarray(s), rtol=1e-6)


def _conlleval_chunks(tags):
  """conlleval.pl's chunk boundaries, one token at a time: a set of (start, end, type)."""
  chunks, start, kind = set(), None, None
  for t, tag in enumerate(list(tags) + ['O']):
    prefix, tag_type = (tag[0], tag[2:]) if tag != 'O' else ('O', None)
    ends = start is not None and (prefix in ('B', 'O') or tag_type != kind)
    if ends:
      chunks.add((start, t - 1, kind))
      start = None
    if prefix == 'B' or (prefix == 'I' and start is None):
      start, kind = t, tag_type
  return chunks


def _reference_counts(gold, predicted, weights):
  gold_total = predicted_total = correct = 0
  for g_row, p_row, w_row in zip(gold, predicted, weights):
    as_names = lambda row: [NAMES[i] if w > 0 else 'O' for i, w in zip(row, w_row)]  # noqa: E731
    g, p = _conlleval_chunks(as_names(g_row)), _conlleval_chunks(as_names(p_row))
    gold_total, predicted_total, correct = (gold_total + len(g), predicted_total + len(p),
                                            correct + len(g & p))
  return gold_total, predicted_total, correct


def test_span_counts_match_a_conlleval_reference():
  rng = np.random.default_rng(2)
  B, L = 64, 12
  # Mostly O with many I- tags, so stray I- starts, type switches and B-B boundaries are common.
  gold = rng.choice(9, size=(B, L), p=[0.3] + [0.0875] * 8)
  # Predictions agree with gold on ~70% of tokens, so some chunks are correct.
  predicted = np.where(rng.random((B, L)) < 0.7, gold, rng.integers(0, 9, size=(B, L)))
  lengths = rng.integers(2, L + 1, size=B)
  weights = (np.arange(L)[None] < lengths[:, None]).astype(np.float32)
  weights[:, 0] = 0.0  # <S>
  weights[np.arange(B), lengths - 1] = 0.0  # </S>

  want = _reference_counts(gold, predicted, weights)
  got = tagging.span_counts(jnp.asarray(gold), jnp.asarray(predicted), jnp.asarray(weights),
                            SPAN_TAGS, 9)
  assert tuple(int(x) for x in got) == want
  assert 0 < want[2] < min(want[:2])  # the case exercises both hits and misses

  # The same counts through loss_fn, from one-hot logits, with a padding example that has spans.
  logits = np.eye(9, dtype=np.float32)[predicted] * 5.0
  example_weights = np.ones(B, np.float32)
  example_weights[-1] = 0.0
  _, metrics = tagging.loss_fn({'logits': logits, 'mix_l2': 0.0},
                               _batch(gold, weights, example_weights), span_tags=SPAN_TAGS)
  want = _reference_counts(gold[:-1], predicted[:-1], weights[:-1])
  for name, value in zip(('gold_spans', 'predicted_spans', 'correct_spans'), want):
    np.testing.assert_allclose(metrics[name], [value, B - 1])


def test_span_counts_on_hand_cases():
  tags = lambda *names: jnp.asarray([[NAMES.index(n) for n in names]])  # noqa: E731
  ones = jnp.ones((1, 4))
  count = lambda gold, predicted: tuple(int(x) for x in tagging.span_counts(  # noqa: E731
      gold, predicted, ones, SPAN_TAGS, 9))
  # A stray I-PER starts a chunk; B-PER after I-PER starts another.
  assert count(tags('I-PER', 'I-PER', 'B-PER', 'O'), tags('B-PER', 'I-PER', 'B-PER', 'I-PER')) == (
      2, 2, 1)
  # Same start, different end: wrong. Type change inside: two chunks.
  assert count(tags('B-LOC', 'I-LOC', 'O', 'O'), tags('B-LOC', 'I-ORG', 'O', 'O')) == (1, 2, 0)
  with pytest.raises(ValueError, match='span_tags'):
    tagging.span_counts(tags('O', 'O', 'O', 'O'), tags('O', 'O', 'O', 'O'), ones, ((1, 9),), 9)


def test_summarize_gives_span_f1():
  totals = {'loss': np.array([6.0, 4.0]), 'accuracy': np.array([3.0, 4.0]),
            'gold_spans': np.array([10.0, 2.0]), 'predicted_spans': np.array([8.0, 2.0]),
            'correct_spans': np.array([6.0, 2.0])}
  summary = tagging.summarize(totals)
  precision, recall = 6 / 8, 6 / 10
  assert summary['span_precision'] == pytest.approx(precision)
  assert summary['span_recall'] == pytest.approx(recall)
  assert summary['span_f1'] == pytest.approx(2 * precision * recall / (precision + recall))
  assert summary['loss'] == pytest.approx(1.5) and summary['accuracy'] == pytest.approx(0.75)
  assert list(summary)[:3] == ['loss', 'accuracy', 'span_f1']
  assert 'gold_spans' not in summary

  empty = tagging.summarize({'gold_spans': np.zeros(2), 'predicted_spans': np.zeros(2),
                             'correct_spans': np.zeros(2)})
  assert empty == {'span_f1': 0.0, 'span_precision': 0.0, 'span_recall': 0.0}
