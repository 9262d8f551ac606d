"""Tests of the next-token LM objective (Radford et al. 2018, sec. 3.1, eq. 1)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from objectives import lm

# Softmax of log([1, 2, 5]) is [1/8, 2/8, 5/8].
LOGITS = np.log(np.array([1.0, 2.0, 5.0], np.float32))


def tiny_batch():
  """One row of 4 positions: targets 2, 0, 1 weighted, the last is padding."""
  logits = np.stack([LOGITS, LOGITS, LOGITS, np.zeros(3, np.float32)])[None]  # (1, 4, 3)
  batch = {'targets': np.array([[2, 0, 1, 0]], np.int32),
           'weights': np.array([[1, 1, 1, 0]], np.float32)}
  return {'lm_logits': jnp.asarray(logits)}, batch


def test_hand_computed_loss_and_accuracy():
  outputs, batch = tiny_batch()
  loss, metrics = lm.loss_fn(outputs, batch)
  want = -(math.log(5 / 8) + math.log(1 / 8) + math.log(2 / 8)) / 3
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics['lm_loss']), [3 * want, 3], rtol=1e-6)
  # argmax is class 2 everywhere: only the first target is right.
  np.testing.assert_allclose(np.asarray(metrics['lm_accuracy']), [1, 3])
  # One mean over 3 tokens: the pair micro-batches weigh by (objectives/__init__.py).
  np.testing.assert_allclose(np.asarray(metrics['loss']), [3 * want, 3], rtol=1e-6)


@pytest.mark.parametrize('garbage', [1e30, -1e30, np.inf, np.nan])
def test_padding_changes_nothing_even_with_garbage_logits(garbage):
  outputs, batch = tiny_batch()
  clean_loss, clean = lm.loss_fn(outputs, batch)
  logits = outputs['lm_logits'].at[0, 3].set(jnp.array([garbage, -garbage, 0.0]))
  targets = batch['targets'].copy()
  targets[0, 3] = 1  # a target there too: its weight alone must keep it out
  loss, metrics = lm.loss_fn({'lm_logits': logits}, {**batch, 'targets': targets})
  assert float(loss) == float(clean_loss)
  for name in metrics:
    np.testing.assert_array_equal(np.asarray(metrics[name]), np.asarray(clean[name]), name)


def test_padding_gets_no_gradient():
  outputs, batch = tiny_batch()
  logits = outputs['lm_logits'].at[0, 3].set(jnp.array([1e4, -1e4, 3.0]))
  grad = jax.grad(lambda x: lm.loss_fn({'lm_logits': x}, batch)[0])(logits)
  assert np.isfinite(np.asarray(grad)).all()
  np.testing.assert_array_equal(np.asarray(grad[0, 3]), 0.0)
  # d loss / d logits = (softmax - onehot) / count at the weighted positions.
  want = (np.array([1, 2, 5]) / 8 - np.eye(3)[[2, 0, 1]]) / 3
  np.testing.assert_allclose(np.asarray(grad[0, :3]), want, atol=1e-6)


def test_weights_scale_their_targets():
  outputs, batch = tiny_batch()
  batch['weights'] = np.array([[2, 1, 0, 0]], np.float32)  # the first counts twice
  loss, metrics = lm.loss_fn(outputs, batch)
  want = -(2 * math.log(5 / 8) + math.log(1 / 8)) / 3
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics['lm_accuracy']), [2, 3])


def test_summarize_gives_means_and_perplexity_exp_loss():
  """Totals over steps: per-token means, and perplexity = exp(mean token NLL)."""
  outputs, batch = tiny_batch()
  _, step1 = lm.loss_fn(outputs, batch)
  batch2 = {'targets': np.array([[2, 2, 2, 2]], np.int32), 'weights': np.ones((1, 4), np.float32)}
  _, step2 = lm.loss_fn(outputs, batch2)
  totals = {k: np.asarray(step1[k]) + np.asarray(step2[k]) for k in step1}
  summary = lm.summarize(totals)
  nll = -(math.log(5 / 8) + math.log(1 / 8) + math.log(2 / 8) + 3 * math.log(5 / 8)
          + math.log(1 / 3))
  np.testing.assert_allclose(summary['lm_loss'], nll / 7, rtol=1e-6)
  np.testing.assert_allclose(summary['lm_perplexity'], math.exp(nll / 7), rtol=1e-6)
  np.testing.assert_allclose(summary['lm_accuracy'], 4 / 7, rtol=1e-6)
  assert list(summary)[:4] == ['loss', 'lm_loss', 'lm_accuracy', 'lm_perplexity']


def test_loss_is_jittable_over_any_leading_shape():
  """(B, C, L, V) logits, as GPT's multiple-choice inputs give, reduce like (B*C*L, V)."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 3, 5)).astype(np.int32)
  weights = (rng.random((2, 3, 5)) < 0.7).astype(np.float32)
  loss = jax.jit(lm.loss_fn)({'lm_logits': logits}, {'targets': targets, 'weights': weights})[0]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (nll * weights).sum() / weights.sum(), rtol=1e-5)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_cross_entropy_matches_autodiff_of_log_softmax(dtype):
  """The fused gradient equals autodiff's of log_softmax + take_along_axis, in the logits' dtype."""
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 37)) * 4, dtype)
  targets = jnp.asarray(np.random.default_rng(1).integers(0, 37, (3, 5)), jnp.int32)
  g = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)), jnp.float32)

  def reference(x):
    logp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

  nll, correct = lm.cross_entropy(logits, targets)
  np.testing.assert_allclose(np.asarray(nll), np.asarray(reference(logits)), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(correct),
                                np.asarray(logits.argmax(-1) == targets, np.float32))
  # Ties everywhere: only the first of the top classes counts, as argmax's.
  tied = jnp.asarray(np.random.default_rng(3).integers(0, 3, (3, 5, 37)), dtype)
  top = tied.argmax(-1)
  for t in (targets, top, jnp.where(top > 0, top - 1, top + 1)):
    np.testing.assert_array_equal(np.asarray(lm.cross_entropy(tied, t)[1]),
                                  np.asarray(top == t, np.float32))
  fused = jax.grad(lambda x: (lm.cross_entropy(x, targets)[0] * g).sum())(logits)
  want = jax.grad(lambda x: (reference(x) * g).sum())(logits)
  assert fused.dtype == dtype
  tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(want, np.float32),
                             atol=tolerance)


def _output_layer_case(rows=(3, 10), width=16, vocab=37, dtype=jnp.float32, bias=True):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=rows + (width,)), dtype)
  table = jnp.asarray(rng.normal(size=(vocab, width)) * 0.3, jnp.float32)
  bias_v = jnp.asarray(rng.normal(size=vocab), jnp.float32) if bias else None
  targets = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
  weights = jnp.asarray(rng.random(rows) < 0.7, jnp.float32) * jnp.asarray(
      rng.integers(1, 3, rows), jnp.float32)
  return x, table, bias_v, targets, weights


def _whole_logits(x, table, bias_v, targets, weights):
  """token_stats over the whole (X, V) logits, as attend() makes them: the path it replaces."""
  logits = x.astype(jnp.float32) @ table.T + (0.0 if bias_v is None else bias_v)
  return lm.token_stats(logits, targets, weights)


# (rows, the largest chunk's logits, chunks): 30 rows x 37 words in 1 chunk, 10 of 3 rows, 30
# of 1 row; 97 rows (a prime) in 2 chunks of 49, one row of padding.
CHUNKINGS = [((3, 10), 1 << 20, 1), ((3, 10), 37 * 3, 10), ((3, 10), 37, 30), ((97,), 37 * 49, 2)]


@pytest.fixture(params=['cpu_passes', 'gpu_one_pass'])
def row_stats(request, monkeypatch):
  """The reductions over the vocabulary as CPUs run them, and as GPUs and TPUs do (the one-pass
  reduction, run here in the CPU's place): both are checked on this CPU."""
  if request.param == 'gpu_one_pass':
    monkeypatch.setattr(lm, '_row_stats_passes', lm._row_stats_one_pass)
  return request.param


@pytest.mark.parametrize('rows,max_logits,chunks', CHUNKINGS)
@pytest.mark.parametrize('bias', [True, False])
def test_output_layer_loss_in_chunks_equals_the_whole_logits_path(rows, max_logits, chunks, bias,
                                                                  row_stats, monkeypatch):
  """Loss, per-token NLL and accuracy, and the gradients of x, table and bias, within 1e-5 in
  float32, for one chunk, several, and rows that do not divide into chunks."""
  del row_stats
  monkeypatch.setattr(lm, 'MIN_CHUNK_ROWS', 1)
  assert lm.output_layer_chunks(math.prod(rows), 37, max_logits) == chunks
  x, table, bias_v, targets, weights = _output_layer_case(rows=rows, bias=bias)
  nll_sum, count, correct = _whole_logits(x, table, bias_v, targets, weights)

  def chunked(x, table, bias_v):
    return lm.output_layer_loss(x, table, bias_v, targets, weights / count, max_logits)

  loss, nll, right = jax.jit(chunked)(x, table, bias_v)
  np.testing.assert_allclose(float(loss), float(nll_sum / count), rtol=1e-5)
  np.testing.assert_allclose(float(jnp.where(weights != 0, nll * weights, 0).sum()),
                             float(nll_sum), rtol=1e-5)
  assert float((right * weights).sum()) == float(correct)
  argnums = (0, 1, 2) if bias else (0, 1)
  got = jax.grad(lambda *a: chunked(*a)[0], argnums)(x, table, bias_v)
  want = jax.grad(lambda *a: _whole_logits(*a, targets, weights)[0] / count, argnums)(
      x, table, bias_v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * np.abs(w).max())


def test_output_layer_loss_in_bfloat16_within_the_bfloat16_tolerance(monkeypatch):
  monkeypatch.setattr(lm, 'MIN_CHUNK_ROWS', 1)
  x, table, _, targets, weights = _output_layer_case(rows=(4, 32), dtype=jnp.bfloat16, bias=False)
  got = jax.grad(lambda x, t: lm.output_layer_loss(x, t, None, targets, weights, 37 * 16)[0],
                 (0, 1))(x, table)
  want = jax.grad(lambda x, t: _whole_logits(x, t, None, targets, weights)[0], (0, 1))(x, table)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
  for g, w in zip(got, want):
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=1e-2 * np.abs(w).max())


def test_output_layer_accuracy_counts_ties_as_argmax_does(row_stats, monkeypatch):
  del row_stats
  monkeypatch.setattr(lm, 'MIN_CHUNK_ROWS', 1)
  table = jnp.asarray(np.random.default_rng(1).integers(0, 2, (37, 16)), jnp.float32)
  x = jnp.ones((4, 6, 16))  # many words tie for the top logit
  targets = jnp.asarray(np.random.default_rng(2).integers(0, 37, (4, 6)), jnp.int32)
  targets = targets.at[0].set(int((x[0, 0] @ table.T).argmax()))  # the first of the top ones
  _, _, right = lm.output_layer_loss(x, table, None, targets, jnp.ones((4, 6)), 37 * 5)
  np.testing.assert_array_equal(np.asarray(right),
                                np.asarray((x @ table.T).argmax(-1) == targets, np.float32))
  assert np.asarray(right)[0].all() and not np.asarray(right).all()


def test_both_forms_of_the_row_reductions_agree_on_padded_vocabularies():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(6, 40)) * 4, jnp.float32).at[:, 37:].set(-jnp.inf)
  logits = logits.at[2, :5].set(logits[2].max())  # a tie for the top
  beaten = jnp.asarray(rng.random((6, 40)) < 0.05)
  one_max, one_sum, one_beaten = lm._row_stats_one_pass(logits, beaten)
  max_, sum_, beaten_ = lm._row_stats_passes(logits, beaten)
  np.testing.assert_array_equal(np.asarray(one_max), np.asarray(max_))
  np.testing.assert_allclose(np.asarray(one_sum), np.asarray(sum_), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(one_beaten), np.asarray(beaten_))
  np.testing.assert_allclose(np.asarray(max_ + jnp.log(sum_)),
                             np.asarray(jax.nn.logsumexp(logits, axis=-1)), rtol=1e-6)


def test_output_layer_per_token_outputs_refuse_a_gradient():
  x, table, bias_v, targets, weights = _output_layer_case()
  with pytest.raises(ValueError, match='only its first output'):
    jax.grad(lambda x: lm.output_layer_loss(x, table, bias_v, targets, weights)[1].sum())(x)


def test_rows_of_weight_zero_get_no_gradient_even_when_not_finite(monkeypatch):
  monkeypatch.setattr(lm, 'MIN_CHUNK_ROWS', 1)
  x, table, bias_v, targets, weights = _output_layer_case()
  x = x.at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
  weights = weights.at[0, 1].set(0.0).at[1, 2].set(0.0)
  grads = jax.grad(lambda x, t, b: lm.output_layer_loss(x, t, b, targets, weights, 37 * 4)[0],
                   (0, 1, 2))(x, table, bias_v)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
  np.testing.assert_array_equal(np.asarray(grads[0][0, 1]), 0.0)


def test_rows_of_weight_zero_keep_their_statistics_under_the_gradient():
  # GPT fine-tuning at lm_coef=0 weights every LM row 0 in the loss but counts them in lm_loss:
  # under value_and_grad they read as states of zeros (log V at no bias) where the loss ran.
  x, table, bias_v, targets, weights = _output_layer_case()
  zero = jnp.zeros_like(weights)
  primal = lm.output_layer_loss(x, table, None, targets, zero)
  def loss(x):
    out = lm.output_layer_loss(x, table, None, targets, zero)
    return out[0], out[1:]
  (_, under_grad), _ = jax.value_and_grad(loss, has_aux=True)(x)
  np.testing.assert_allclose(under_grad[0], primal[1], rtol=1e-6)  # per-token NLL
  np.testing.assert_array_equal(under_grad[1], primal[2])  # correct
  assert not np.allclose(primal[1], np.log(table.shape[0]))


def test_the_compiled_gradient_never_holds_the_whole_logits():
  """No array of the step is as large as the (X, V) logits: 4,096 rows x 1,000 words in 8
  chunks, forward and backward."""
  rows, vocab, width = 4096, 1000, 64
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  step = jax.jit(jax.grad(lambda x, t, targets, w: lm.output_layer_loss(
      x, t, None, targets, w, rows * vocab // 8)[0], (0, 1)))
  text = step.lower(spec(8, rows // 8, width), spec(vocab, width),
                    jax.ShapeDtypeStruct((8, rows // 8), jnp.int32), spec(8, rows // 8)
                    ).compile().as_text()
  sizes = [math.prod(int(d) for d in dims.split(',') if d)
           for dims in re.findall(r'\b(?:f32|bf16)\[([\d,]*)\]', text)]
  assert max(sizes) < rows * vocab // 4
  assert lm.output_layer_chunks(rows, vocab, rows * vocab // 8) == 8


def test_chunks_have_enough_rows():
  """GPT-1's 64 x 512 tokens in 16 chunks, BERT-base's 5,120 masked ones in 2, ELMo's 7,680 rows
  over 793,471 words in 30; a few rows over a huge vocabulary stay one chunk."""
  assert [lm.output_layer_chunks(rows, vocab, lm.CHUNK_LOGITS) for rows, vocab in [
      (32768, 40478), (5120, 30522), (7680, 793471), (160, 40_000_000)]] == [16, 2, 30, 1]
