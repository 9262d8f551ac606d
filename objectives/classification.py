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

from objectives import gpt_finetune

Array = jax.Array

summarize = gpt_finetune.summarize
predict = gpt_finetune.predict


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array]
            ) -> tuple[Array, dict[str, Array]]:
  """Mean task loss over the real examples, with accuracy (or Pearson's sums) as metrics."""
  return gpt_finetune.loss_fn(outputs, batch, lm_coef=0.0)


