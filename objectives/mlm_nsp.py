"""BERT's pretraining loss: mean masked-LM cross-entropy + mean NSP cross-entropy (Devlin et al. 2018, sec. 3.1).

Metrics are (sum, count) pairs so they add up across devices, micro-batches
and steps; `summarize` turns accumulated pairs into the reported numbers.
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


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  weights_BP = batch['masked_lm_weights'].astype(jnp.float32)
  loss, mlm_sum, mlm_count, mlm_correct = lm.output_stats(
      outputs, 'mlm', batch['masked_lm_ids'], weights_BP,
      weights_BP / jnp.maximum(weights_BP.sum(), 1.0))
  metrics = {'mlm_loss': _pair(mlm_sum, mlm_count),
             'mlm_accuracy': _pair(mlm_correct, mlm_count)}

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
                 'nsp_accuracy')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the accumulated (sum, count) pairs, plus MLM perplexity."""
  means = {k: float(v[0] / max(v[1], 1e-9)) for k, v in totals.items()}
  means['mlm_perplexity'] = float(np.exp(min(means['mlm_loss'], 50.0)))
  first = [k for k in _REPORT_ORDER if k in means]
  return {k: means[k] for k in first + sorted(set(means) - set(first))}
