"""Sequence tagging loss and span F1 for ELMo's task models (Peters et al. 2018, sec. 3.3, 5.1 NER).

The loss is the token cross-entropy of outputs['logits'] (B, L, num_labels)
against batch['labels'], averaged over the tokens weighted by
label_weights * example_weights (the pipeline gives 0 to <S>, </S>,
padding and eval padding rows), plus mix_l2_coef times the L2 penalty on
ELMo's scalar mix weights (sec. 3.3: "lambda ||w||^2").

Span metrics follow conlleval (CoNLL 2000-2003 shared tasks) on IOB tags: a
chunk starts at B-X, or at I-X after a tag that is not of type X; it ends
before a tag that does not continue it (O, B-anything, or I- of another
type); a predicted chunk is correct when a gold chunk has the same start,
end and type. Tokens of weight 0 count as O. The chunk types come in as
`span_tags`, one (begin_id, inside_id) pair per type (config.loss), so the
counting is static and runs in jnp inside the jitted step.

Metrics are (sum, count) pairs that add up across devices and steps; the
span counts are sufficient statistics, so `summarize` gives the precision,
recall and F1 of a whole eval pass.
"""

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from objectives import lm

Array = jax.Array

_SPAN_COUNTS = ('gold_spans', 'predicted_spans', 'correct_spans')


def _tag_tables(span_tags: Sequence[Sequence[int]], num_labels: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """Per label id: its chunk type (-1 = outside any chunk) and whether it begins a chunk."""
  type_of = np.full((num_labels,), -1, np.int32)
  begins = np.zeros((num_labels,), bool)
  for k, (begin_id, inside_id) in enumerate(span_tags):
    if not (0 <= begin_id < num_labels and 0 <= inside_id < num_labels):
      raise ValueError(f'loss.span_tags has the pair {(begin_id, inside_id)} outside the '
                       f'{num_labels} labels: list (begin_id, inside_id) per chunk type.')
    type_of[begin_id] = type_of[inside_id] = k
    begins[begin_id] = True
  return type_of, begins


def _chunks(tags_BL: Array, counted_BL: Array, type_of: np.ndarray, begins: np.ndarray
            ) -> tuple[Array, Array, Array]:
  """(starts, chunk type, end position of the chunk at each position) for IOB tags."""
  B, L = tags_BL.shape
  type_BL = jnp.where(counted_BL, jnp.asarray(type_of)[tags_BL], -1)
  begin_BL = counted_BL & jnp.asarray(begins)[tags_BL]
  inside_BL = type_BL >= 0
  outside_B1 = jnp.full((B, 1), -1, type_BL.dtype)
  previous_type_BL = jnp.concatenate([outside_B1, type_BL[:, :-1]], axis=1)
  next_type_BL = jnp.concatenate([type_BL[:, 1:], outside_B1], axis=1)
  next_begins_BL = jnp.concatenate([begin_BL[:, 1:], jnp.zeros((B, 1), bool)], axis=1)
  starts_BL = inside_BL & (begin_BL | (previous_type_BL != type_BL))
  ends_BL = inside_BL & (next_begins_BL | (next_type_BL != type_BL))
  # Chunks are contiguous, so the first end at or after t is the end of t's chunk.
  end_BL = jax.lax.cummin(jnp.where(ends_BL, jnp.arange(L), L), axis=1, reverse=True)
  return starts_BL, type_BL, end_BL


def span_counts(gold_BL: Array, predicted_BL: Array, weights_BL: Array,
                span_tags: Sequence[Sequence[int]], num_labels: int) -> tuple[Array, Array, Array]:
  """conlleval's (gold chunks, predicted chunks, correct chunks) of IOB tag ids."""
  type_of, begins = _tag_tables(span_tags, num_labels)
  counted_BL = weights_BL > 0
  gold_starts, gold_type, gold_end = _chunks(gold_BL, counted_BL, type_of, begins)
  pred_starts, pred_type, pred_end = _chunks(predicted_BL, counted_BL, type_of, begins)
  correct = gold_starts & pred_starts & (gold_type == pred_type) & (gold_end == pred_end)
  return gold_starts.sum(), pred_starts.sum(), correct.sum()


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array], *,
            mix_l2_coef: float = 0.0, span_tags: Sequence[Sequence[int]] = ()
            ) -> tuple[Array, dict[str, Array]]:
  """Mean token cross-entropy + mix_l2_coef * ||s||^2, with accuracy and span counts."""
  logits_BLN = outputs['logits'].astype(jnp.float32)
  labels_BL = batch['labels']
  example_weights_B = batch['example_weights'].astype(jnp.float32)
  weights_BL = batch['label_weights'].astype(jnp.float32) * example_weights_B[:, None]
  nll, count, correct = lm.token_stats(logits_BLN, labels_BL, weights_BL)
  loss = nll / jnp.maximum(count, 1e-6)
  metrics = {'token_loss': lm.pair(nll, count), 'accuracy': lm.pair(correct, count)}
  if mix_l2_coef:  # a Python float: 0 leaves the mix weights out of the loss's graph
    loss = loss + mix_l2_coef * outputs['mix_l2'].astype(jnp.float32)
  metrics['loss'] = lm.pair(loss * count, count)

  if span_tags:
    num_examples = example_weights_B.sum()
    predicted_BL = logits_BLN.argmax(-1)
    counts = span_counts(labels_BL, predicted_BL, weights_BL, span_tags, logits_BLN.shape[-1])
    for name, value in zip(_SPAN_COUNTS, counts):
      metrics[name] = lm.pair(value, num_examples)
  return loss, metrics


def predict(outputs: Mapping[str, Array], batch: Mapping[str, Array]) -> dict[str, Array]:
  """Each token's predicted tag id (BERT's tagging pipeline scores the words' first pieces)."""
  return {'example_index': batch['example_index'],
          'predicted_tags': outputs['logits'].argmax(-1).astype(jnp.int32)}


def _ratio(numerator: float, denominator: float) -> float:
  return float(numerator / denominator) if denominator > 0 else 0.0


_REPORT_ORDER = ('loss', 'token_loss', 'accuracy', 'span_f1', 'span_precision', 'span_recall')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the pairs, plus conlleval's span precision, recall and F1 from the span counts."""
  totals = {k: np.asarray(v, np.float64) for k, v in totals.items()}
  summary = {k: _ratio(v[0], v[1]) for k, v in totals.items() if k not in _SPAN_COUNTS}
  if all(k in totals for k in _SPAN_COUNTS):
    gold, predicted, correct = (totals[k][0] for k in _SPAN_COUNTS)
    precision, recall = _ratio(correct, predicted), _ratio(correct, gold)
    summary['span_precision'], summary['span_recall'] = precision, recall
    summary['span_f1'] = _ratio(2 * precision * recall, precision + recall)
  first = [k for k in _REPORT_ORDER if k in summary]
  return {k: summary[k] for k in first + sorted(set(summary) - set(first))}
