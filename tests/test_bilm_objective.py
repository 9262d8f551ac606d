"""Tests of the biLM loss and its sampled softmax (Peters et al. 2018, sec. 3.1; Jean et al. 2015)."""

import jax
import jax.numpy as jnp
import numpy as np

from models import elmo
from objectives import bilm

B, L, V, D = 3, 5, 7, 4
LENGTHS = np.array([5, 3, 1], np.int32)
loss_fn = jax.jit(bilm.loss_fn)  # one compile per shape instead of op-by-op dispatch


def draw(seed, vocab_size, num_sampled, unique, draws):
  """(draws, K) samples from models/elmo.py's log-uniform sampler and the (V,) log expected counts."""
  sample = jax.vmap(elmo.sample_candidates, in_axes=(0, None, None, None))
  keys = jax.random.split(jax.random.key(seed), draws)
  ids, log_counts = jax.jit(sample, static_argnums=(1, 2, 3))(keys, vocab_size, num_sampled, unique)
  return np.asarray(ids), np.asarray(log_counts[0])


def example(seed=0, garbage=np.nan):
  """Outputs and batch of B rows with LENGTHS; padding states hold `garbage`, padding ids are random."""
  rng = np.random.default_rng(seed)
  token_ids = rng.integers(0, V, (B, L)).astype(np.int32)
  forward = rng.normal(size=(B, L, D)).astype(np.float32)
  backward = rng.normal(size=(B, L, D)).astype(np.float32)
  padding = np.arange(L)[None, :] >= LENGTHS[:, None]
  forward[padding] = garbage
  backward[padding] = -garbage
  outputs = {'forward_states': jnp.asarray(forward), 'backward_states': jnp.asarray(backward),
             'softmax_kernel': jnp.asarray(rng.normal(size=(V, D)).astype(np.float32)),
             'softmax_bias': jnp.asarray(rng.normal(size=(V,)).astype(np.float32))}
  return outputs, {'token_ids': token_ids, 'lengths': LENGTHS}


def numpy_direction(states, kernel, bias, token_ids, lengths, step):
  """(NLL sum, count, correct) predicting token t + step from the state at t, within each row."""
  total, count, correct = 0.0, 0, 0
  for b, length in enumerate(lengths):
    for t in range(length):
      if not 0 <= t + step < length:
        continue
      logits = states[b, t].astype(np.float64) @ kernel.T.astype(np.float64) + bias
      target = token_ids[b, t + step]
      total += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[target]
      count += 1
      correct += int(logits.argmax() == target)
  return total, count, correct


def test_full_softmax_loss_matches_numpy_and_ignores_padding():
  """Forward predicts token_ids[t+1] for t < length-1, backward token_ids[t-1] for 1 <= t < length."""
  outputs, batch = example()
  loss, metrics = loss_fn(outputs, batch)
  want = {}
  for direction, step in (('forward', 1), ('backward', -1)):
    total, count, correct = numpy_direction(
        np.asarray(outputs[f'{direction}_states']), np.asarray(outputs['softmax_kernel']),
        np.asarray(outputs['softmax_bias']), batch['token_ids'], LENGTHS, step)
    assert count == 4 + 2 + 0  # length - 1 targets per row
    np.testing.assert_allclose(np.asarray(metrics[f'{direction}_loss']), [total, count], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics[f'{direction}_accuracy']), [correct, count])
    want[direction] = total / count
  # bilm-tf's total loss is the mean of the two directions' mean losses.
  np.testing.assert_allclose(float(loss), 0.5 * (want['forward'] + want['backward']), rtol=1e-5)
  np.testing.assert_allclose(np.divide(*np.asarray(metrics['loss'])), float(loss), rtol=1e-6)

  grads = jax.jit(jax.grad(lambda o: bilm.loss_fn(o, batch)[0]))(outputs)
  padding = np.arange(L)[None, :] >= LENGTHS[:, None]
  for name in ('forward_states', 'backward_states', 'softmax_kernel', 'softmax_bias'):
    assert np.isfinite(np.asarray(grads[name])).all(), name
  np.testing.assert_array_equal(np.asarray(grads['forward_states'])[padding], 0.0)
  # The last position of a row has no next token, the first no previous one.
  assert not np.asarray(grads['forward_states'])[0, L - 1].any()
  assert not np.asarray(grads['backward_states'])[0, 0].any()


def test_every_class_sampled_once_is_the_full_softmax():
  """num_sampled == V, unique: all classes in the sample with log expected count 0, the target's hit removed."""
  outputs, batch = example(seed=1, garbage=np.inf)
  ids, log_counts = draw(1, V, V, True, 1)
  assert sorted(ids[0]) == list(range(V)) and not log_counts.any()
  states = outputs['forward_states'][:2, :2].reshape(-1, D)
  targets = jnp.asarray(batch['token_ids'][:2, :2].reshape(-1))
  args = (states, outputs['softmax_kernel'], outputs['softmax_bias'], targets)
  np.testing.assert_allclose(np.asarray(bilm.sampled_softmax_nll(*args, ids[0], log_counts)),
                             np.asarray(bilm.full_softmax_nll(*args)), atol=1e-5)

  full_loss, full = loss_fn(outputs, batch)
  sampled_loss, sampled = loss_fn(
      {**outputs, 'sampled_ids': jnp.asarray(ids[0]), 'log_expected_counts': log_counts}, batch)
  np.testing.assert_allclose(float(sampled_loss), float(full_loss), atol=1e-5)
  for name in ('loss', 'forward_loss', 'backward_loss'):
    np.testing.assert_allclose(np.asarray(sampled[name]), np.asarray(full[name]), atol=1e-5)
  assert 'forward_accuracy' not in sampled


def test_sampled_path_never_forms_a_vocabulary_wide_matrix():
  vocab, rows, num_sampled = 1009, 6, 8
  args = (jnp.ones((rows, D)), jnp.ones((vocab, D)), jnp.zeros(vocab), jnp.zeros(rows, jnp.int32),
          jnp.arange(num_sampled), jnp.zeros(vocab))
  jaxpr = jax.make_jaxpr(bilm.sampled_softmax_nll)(*args).jaxpr
  sizes = [np.prod(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars]
  assert max(sizes) < rows * vocab, sizes


def sampled_nll_draws(num_sampled, unique, draws, seed):
  """Sampled NLL of N fixed rows under `draws` independent samples, (draws, N), and the setup."""
  rng = np.random.default_rng(seed)
  vocab, rows = 50, 6
  states = rng.normal(size=(rows, D)).astype(np.float32)
  kernel = rng.normal(size=(vocab, D)).astype(np.float32)
  bias = rng.normal(size=(vocab,)).astype(np.float32)
  targets = rng.integers(0, vocab, rows).astype(np.int32)
  ids, log_counts = draw(seed, vocab, num_sampled, unique, draws)
  nll = jax.jit(jax.vmap(bilm.sampled_softmax_nll, in_axes=(None,) * 4 + (0, None)))(
      states, kernel, bias, targets, ids, log_counts)
  logits = states @ kernel.T + bias
  return np.asarray(nll, np.float64), logits.astype(np.float64), targets, ids, log_counts


def test_partition_function_estimate_is_unbiased():
  """Sampling WITH replacement, expected counts K q(c): sum_k exp(logit_{s_k}) / (K q(s_k)) is unbiased for Z.

  Checked twice: directly from the sample, and recovered from sampled_softmax_nll,
  where exp(nll + a_t) - exp(a_t) (a_t the target's corrected logit) is the
  estimate over the non-target samples, unbiased for Z - exp(logit_t). What is
  NOT unbiased is the sampled NLL itself (a log of the estimate; see the next test).
  """
  draws, num_sampled = 20000, 10
  nll, logits, targets, ids, log_counts = sampled_nll_draws(num_sampled, False, draws, seed=3)
  z = np.exp(logits).sum(-1)
  direct = (np.exp(logits[:, ids] - log_counts[ids])).sum(-1).T  # (draws, N)
  a_t = logits[np.arange(len(targets)), targets] - log_counts[targets]
  from_nll = np.exp(nll + a_t) - np.exp(a_t) + np.exp(logits[np.arange(len(targets)), targets])
  for estimate in (direct, from_nll):
    standard_error = estimate.std(0) / np.sqrt(draws)
    assert (np.abs(estimate.mean(0) - z) < 4 * standard_error).all(), (estimate.mean(0), z)
  # The test can fail: without the correction the same sample misses Z by far.
  uncorrected = np.exp(logits[:, ids]).sum(-1).T * len(z) / num_sampled
  assert (np.abs(uncorrected.mean(0) - z) > 4 * uncorrected.std(0) / np.sqrt(draws)).any()


def test_sampled_nll_approaches_full_nll_as_the_sample_grows():
  """Unique sampling: the sampled NLL is a biased estimate whose mean tends to the full NLL as K -> V.

  (With replacement it is not even consistent: the target's correction
  log(K q_t) grows without bound; bilm-tf samples unique classes.)
  """
  errors = []
  for num_sampled in (10, 40):
    nll, logits, targets, _, _ = sampled_nll_draws(num_sampled, True, 2000, seed=4)
    full = jax.nn.logsumexp(logits, -1) - logits[np.arange(len(targets)), targets]
    errors.append(np.abs(nll.mean(0) - np.asarray(full)).mean())
  assert errors[1] < 0.5 * errors[0], errors


def test_summarize_and_metrics_add_across_half_batches():
  outputs, batch = example(seed=5, garbage=1e30)
  loss, whole = loss_fn(outputs, batch)
  halves = [loss_fn({k: v[rows] if v.ndim == 3 else v for k, v in outputs.items()},
                         {k: v[rows] for k, v in batch.items()})[1]
            for rows in (slice(0, 1), slice(1, B))]
  for name in whole:
    np.testing.assert_allclose(np.asarray(halves[0][name]) + np.asarray(halves[1][name]),
                               np.asarray(whole[name]), rtol=1e-6, err_msg=name)
  summary = bilm.summarize({k: np.asarray(v) for k, v in whole.items()})
  np.testing.assert_allclose(summary['loss'], float(loss), rtol=1e-6)
  for direction in ('forward', 'backward'):
    np.testing.assert_allclose(summary[f'{direction}_perplexity'],
                               np.exp(summary[f'{direction}_loss']), rtol=1e-6)
  np.testing.assert_allclose(
      summary['perplexity'],
      np.exp(0.5 * (summary['forward_loss'] + summary['backward_loss'])), rtol=1e-6)
  assert list(summary)[:2] == ['loss', 'perplexity']


def test_blocked_full_softmax_equals_one_block(monkeypatch):
  """Eval's full softmax in blocks of rows (the paper's vocabulary cannot take all rows at once)."""
  outputs, batch = example(garbage=0.0)
  whole = jax.device_get(bilm.loss_fn(outputs, batch)[1])
  monkeypatch.setattr(bilm, '_FULL_SOFTMAX_BLOCK_ELEMENTS', 2 * V)  # 2 rows per block, padded
  blocked = jax.device_get(bilm.loss_fn(outputs, batch)[1])
  for name, value in whole.items():
    np.testing.assert_allclose(blocked[name], value, rtol=1e-5, err_msg=name)


def test_full_softmax_at_the_papers_size_fits_in_memory():
  """Eval at configs/elmo.py's size (384 x 20 tokens, V = 793,471) compiles to under 4 GB of temporaries."""
  rows, vocab, width = 384 * 20, 793_471, 512
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  outputs = {'forward_states': f32(384, 20, width), 'backward_states': f32(384, 20, width),
             'softmax_kernel': f32(vocab, width), 'softmax_bias': f32(vocab)}
  batch = {'token_ids': jax.ShapeDtypeStruct((384, 20), jnp.int32),
           'lengths': jax.ShapeDtypeStruct((384,), jnp.int32)}
  compiled = jax.jit(lambda o, b: bilm.loss_fn(o, b)[1]).lower(outputs, batch).compile()
  temporaries = compiled.memory_analysis().temp_size_in_bytes
  print(f'full-softmax eval temporaries: {temporaries / 2**30:.2f} GiB for {rows} rows')
  assert temporaries < 4 * 2**30
