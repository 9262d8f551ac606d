"""BERT's pretraining loss: mean masked-LM cross-entropy + mean NSP cross-entropy (Devlin et al. 2018, sec. 3.1).

Metrics are (sum, count) pairs so they add up across devices, micro-batches
and steps; `summarize` turns accumulated pairs into the reported numbers.
`mlm_hidden_*` are the MLM figures at the predictions whose input token is not
the answer (`hidden_weights`): a model that copies its input scores there no
better than one that reads nothing of it.
NSP is trained only when the batch carries `next_sentence_labels` (the
pipeline leaves them out when data.next_sentence_prediction is False).
"""

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from objectives import lm

Array = jax.Array


def _pair(total: Array, count: Array) -> Array:
  return jnp.stack([total, count]).astype(jnp.float32)


def hidden_weights(batch: Mapping[str, Array]) -> Array:
  """masked_lm_weights at the predictions whose input token is not the answer: [MASK] or a
  random other token (about 90% of them, sec. 3.1). At the other 10% the input shows the
  answer, and copying it is right; here only the context can tell."""
  shown_BP = jnp.take_along_axis(batch['input_ids'], batch['masked_lm_positions'], axis=1)
  return jnp.where(shown_BP != batch['masked_lm_ids'], batch['masked_lm_weights'], 0)


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  weights_BP = batch['masked_lm_weights'].astype(jnp.float32)
  # A hand-made batch without the input (tests) has no hidden figures.
  hidden_BP = [hidden_weights(batch)] if 'input_ids' in batch else []
  loss, mlm_sum, mlm_count, mlm_correct, *hidden_stats = lm.output_stats(
      outputs, 'mlm', batch['masked_lm_ids'], weights_BP,
      weights_BP / jnp.maximum(weights_BP.sum(), 1.0), *hidden_BP)
  metrics = {'mlm_loss': _pair(mlm_sum, mlm_count),
             'mlm_accuracy': _pair(mlm_correct, mlm_count)}
  if hidden_stats:
    hidden_sum, hidden_count, hidden_correct = hidden_stats
    metrics['mlm_hidden_loss'] = _pair(hidden_sum, hidden_count)
    metrics['mlm_hidden_accuracy'] = _pair(hidden_correct, hidden_count)

  if 'next_sentence_labels' in batch:
    nsp_BT = outputs['nsp_logits'].astype(jnp.float32)
    nsp_labels_B = batch['next_sentence_labels']
    nsp_nll_B = -jnp.take_along_axis(
        jax.nn.log_softmax(nsp_BT, axis=-1), nsp_labels_B[:, None], axis=-1)[:, 0]
    num_examples = jnp.float32(nsp_nll_B.shape[0])
    loss += nsp_nll_B.mean()
    metrics['nsp_loss'] = _pair(nsp_nll_B.sum(), num_examples)
    metrics['nsp_accuracy'] = _pair((nsp_BT.argmax(-1) == nsp_labels_B).sum(), num_examples)
  # Two means over other counts (predictions, sequences): trainer/steps.py.
  metrics['loss'] = _pair(loss, 1.0)
  return loss, metrics


_REPORT_ORDER = ('loss', 'mlm_loss', 'mlm_accuracy', 'mlm_perplexity', 'nsp_loss',
                 'nsp_accuracy', 'mlm_hidden_accuracy', 'mlm_hidden_perplexity')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the accumulated (sum, count) pairs, plus MLM perplexity (of all predictions, and
  of those whose input hides the answer: `hidden_weights`)."""
  means = {k: float(v[0] / max(v[1], 1e-9)) for k, v in totals.items()}
  means['mlm_perplexity'] = float(np.exp(min(means['mlm_loss'], 50.0)))
  if 'mlm_hidden_loss' in means:
    means['mlm_hidden_perplexity'] = float(np.exp(min(means['mlm_hidden_loss'], 50.0)))
  first = [k for k in _REPORT_ORDER if k in means]
  return {k: means[k] for k in first + sorted(set(means) - set(first))}
