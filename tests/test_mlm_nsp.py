"""The MLM + NSP objective against a hand-computed example (Devlin et al. 2018, sec. 3.1)."""

import math

import jax.numpy as jnp
import numpy as np

from objectives import mlm_nsp


def test_loss_matches_hand_computation():
  # One example, two predictions (the second is padding), vocabulary of 3.
  outputs = {
      'mlm_logits': jnp.array([[[2.0, 0.0, 0.0], [0.0, 5.0, 0.0]]]),
      'nsp_logits': jnp.array([[0.0, math.log(3.0)]]),
  }
  batch = {
      'masked_lm_ids': jnp.array([[1, 1]]),
      'masked_lm_weights': jnp.array([[1.0, 0.0]]),
      'next_sentence_labels': jnp.array([0]),
  }
  loss, metrics = mlm_nsp.loss_fn(outputs, batch)
  mlm = -math.log(1.0 / (math.exp(2.0) + 2.0))  # label 1 has logit 0
  nsp = -math.log(1.0 / (1.0 + 3.0))           # p(IsNext) = 1 / (1 + 3)
  np.testing.assert_allclose(float(loss), mlm + nsp, rtol=1e-6)
  np.testing.assert_allclose(metrics['mlm_loss'], [mlm, 1.0], rtol=1e-6)
  np.testing.assert_allclose(metrics['mlm_accuracy'], [0.0, 1.0])
  np.testing.assert_allclose(metrics['nsp_accuracy'], [0.0, 1.0])
  summary = mlm_nsp.summarize({k: np.asarray(v) for k, v in metrics.items()})
  np.testing.assert_allclose(summary['mlm_perplexity'], math.exp(mlm), rtol=1e-5)


def test_mean_over_masked_positions_and_no_nsp():
  logits = np.zeros((2, 3, 4), np.float32)
  logits[0, 0, 2] = 10.0  # confident and right
  outputs = {'mlm_logits': jnp.asarray(logits)}
  batch = {
      'masked_lm_ids': jnp.array([[2, 0, 0], [1, 3, 0]]),
      'masked_lm_weights': jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]),
  }
  loss, metrics = mlm_nsp.loss_fn(outputs, batch)
  right = -math.log(math.exp(10.0) / (math.exp(10.0) + 3.0))
  uniform = math.log(4.0)
  np.testing.assert_allclose(float(loss), (right + 2 * uniform) / 3, rtol=1e-6)
  assert 'nsp_loss' not in metrics
  # Ties pick index 0: only the first prediction is right.
  np.testing.assert_allclose(metrics["mlm_accuracy"], [1.0, 3.0])


def test_hidden_figures_leave_out_the_predictions_whose_input_shows_the_answer():
  """Of three predictions, the second's input token is its answer (kept as it is, 10% in the
  paper): mlm_hidden_* count the first ([MASK], id 4) and the third (a random other token)."""
  logits = np.zeros((1, 4, 6), np.float32)
  logits[0, 0, 2] = 3.0  # [MASK] shown, answer 2: right
  logits[0, 1, 1] = 3.0  # answer 1 shown at position 2: right, and left out
  # The third (answer 3, token 5 shown) stays uniform: wrong (ties pick 0); the fourth is padding.
  batch = {
      'input_ids': jnp.array([[0, 4, 1, 5, 3, 0]]),
      'masked_lm_positions': jnp.array([[1, 2, 3, 0]]),
      'masked_lm_ids': jnp.array([[2, 1, 3, 0]]),
      'masked_lm_weights': jnp.array([[1.0, 1.0, 1.0, 0.0]]),
  }
  _, metrics = mlm_nsp.loss_fn({'mlm_logits': jnp.asarray(logits)}, batch)
  confident = -math.log(math.exp(3.0) / (math.exp(3.0) + 5.0))
  uniform = math.log(6.0)
  np.testing.assert_allclose(metrics['mlm_accuracy'], [2.0, 3.0])
  np.testing.assert_allclose(metrics['mlm_hidden_accuracy'], [1.0, 2.0])
  np.testing.assert_allclose(metrics['mlm_hidden_loss'], [confident + uniform, 2.0], rtol=1e-6)
  summary = mlm_nsp.summarize({k: np.asarray(v) for k, v in metrics.items()})
  np.testing.assert_allclose(summary['mlm_hidden_perplexity'],
                             math.exp((confident + uniform) / 2), rtol=1e-5)
  assert summary['mlm_hidden_accuracy'] == 0.5
  assert 'mlm_hidden_loss' not in mlm_nsp.loss_fn({'mlm_logits': jnp.asarray(logits)}, {
      k: v for k, v in batch.items() if k != 'input_ids'})[1]
