"""BERT's sequence classification and regression loss (Devlin et al. 2018, sec. 4.1).

The task loss of objectives/gpt_finetune.py without its auxiliary LM (BERT
has none): softmax cross-entropy of the classifier over the pooled [CLS]
state, log(softmax(C W^T)), or the squared error of a single output when the
labels are floats (STS-B). `predict` gives each example's predicted class
(or value), which input_pipeline/bert_finetune.py scores with scikit-learn
and SciPy after an eval pass.
"""

from typing import Mapping

import jax
import jax.numpy as jnp

from objectives import gpt_finetune

Array = jax.Array

summarize = gpt_finetune.summarize


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  """Mean task loss over the real examples, with accuracy (or Pearson's sums) as metrics."""
  return gpt_finetune.loss_fn(outputs, batch, lm_coef=0.0)


def predict(outputs: Mapping[str, Array], batch: Mapping[str, Array]) -> dict[str, Array]:
  """The predicted class of each example, or its predicted value for regression."""
  logits_BN = outputs['logits'].astype(jnp.float32)
  regression = jnp.issubdtype(batch['labels'].dtype, jnp.floating)
  prediction_B = logits_BN[:, 0] if regression else logits_BN.argmax(-1).astype(jnp.float32)
  return {'example_index': batch['example_index'], 'prediction': prediction_B}
