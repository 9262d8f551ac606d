"""Tests of the biLM loss and its sampled softmax (Peters et al. 2018, sec. 3.1; Jean et al. 2015)."""

import re
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from configs import elmo as elmo_config
import input_pipeline.bilm
from models import elmo
from objectives import bilm
from objectives import lm
from trainer import sharding

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
  token_ids = rng.integers(3, V, (B, L)).astype(np.int32)  # words: no sentence boundary (below)
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


def test_no_target_across_a_sentence_boundary():
  # bilm-tf's batcher never feeds a sentence's last token: <S> a b </S> has the forward targets
  # a b </S> and the backward ones (reversed stream) <S> a b; n + 1 each. Which token follows a
  # </S>, or comes before a <S>, is no target: in a stream of framed sentences it is certain.
  S, E = 0, 1  # <S>, </S>
  ids = np.array([[S, 3, 4, E, S, 5, E]], np.int32)
  targets = bilm.direction_targets(jnp.asarray(ids), jnp.array([7]))
  forward, valid = (np.asarray(x)[0] for x in targets['forward'])
  backward, back_valid = (np.asarray(x)[0] for x in targets['backward'])
  assert forward[valid].tolist() == [3, 4, E, 5, E] and not valid[3]
  assert backward[back_valid].tolist() == [S, 3, 4, S, 5] and not back_valid[4]


def test_targets_run_across_the_rows_ends_as_bilm_tfs_run_into_the_next_batch():
  """<S> a b c d e </S> cut into rows of 4 has 6 targets a direction, as bilm-tf's stream: the
  row's last token predicts the next row's first (forward), its first the row before's last."""
  S, E = 0, 1
  rows = input_pipeline.bilm.stream_rows(np.array([S, 5, 6, 7, 8, 9, E], np.int32),
                                         np.zeros((7, 3), np.int32), 4)
  targets = bilm.direction_targets(*(jnp.asarray(rows[k]) for k in (
      'token_ids', 'lengths', 'next_ids', 'prev_ids')))
  forward, backward = (np.asarray(t)[np.asarray(v)].tolist() for t, v in targets.values())
  assert sorted(forward) == sorted([5, 6, 7, 8, 9, E]) and sorted(backward) == [S, 5, 6, 7, 8, 9]
  # Without the neighbours (another pipeline's rows), targets stay inside the row: 5 each.
  inside = bilm.direction_targets(jnp.asarray(rows['token_ids']), jnp.asarray(rows['lengths']))
  assert [int(np.asarray(v).sum()) for _, v in inside.values()] == [5, 5]


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


def test_each_direction_reads_its_own_sample():
  # sampled_ids (2, K): the forward loss over row 0's classes, the backward one over row 1's.
  outputs, batch = example(garbage=0.0)
  ids, log_counts = draw(0, V, 3, True, 2)
  both = {**outputs, 'sampled_ids': jnp.asarray(ids), 'log_expected_counts': log_counts}
  _, metrics = loss_fn(both, batch)
  for index, direction in enumerate(('forward', 'backward')):
    _, alone = loss_fn({**both, 'sampled_ids': jnp.asarray(ids[index])}, batch)
    np.testing.assert_allclose(metrics[f'{direction}_loss'], alone[f'{direction}_loss'], rtol=1e-6)
  assert not np.array_equal(ids[0], ids[1])


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
  """The full softmax in chunks of rows (the paper's vocabulary cannot take all rows at once)."""
  outputs, batch = example(garbage=0.0)
  whole = jax.device_get(bilm.loss_fn(outputs, batch)[1])
  monkeypatch.setattr(lm, 'CHUNK_LOGITS', 2 * V)  # 2 rows per chunk
  monkeypatch.setattr(lm, 'MIN_CHUNK_ROWS', 1)
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


def _sampled_training(mesh_cfg, take_rows):
  """A softmax table of 8,192 x 32 trained 3 Adagrad steps by the sampled softmax over batch-
  sharded states on 8 devices (a target twice, a sample equal to a target); returns (the table
  and Adagrad's accumulators, the ids of every target and sample, the step's HLO)."""
  vocab, dim, num_sampled = 8192, 32, 64
  mesh = sharding.make_mesh(mesh_cfg, jax.devices())
  rules = elmo_config.get_config('tiny').logical_axis_rules
  keys = jax.random.split(jax.random.key(0), 4)
  states_ND = jax.random.normal(keys[0], (64, dim))
  targets_N = jax.random.randint(keys[1], (64,), 0, vocab).at[1].set(7).at[2].set(7)
  params = {'kernel': jax.random.normal(keys[2], (vocab, dim)) * 0.1, 'bias': jnp.zeros(vocab)}
  tx = optax.adagrad(0.2, initial_accumulator_value=1.0, eps=1e-7)

  def step(params, opt_state, states_ND, targets_N, sampled_ids_K):
    def loss(params):  # the rules only here: take_rows must read them in the forward pass
      with nn.logical_axis_rules(rules):
        nll_N = bilm.sampled_softmax_nll(states_ND, params['kernel'], params['bias'], targets_N,
                                         sampled_ids_K, jnp.zeros(vocab))
      return nll_N.mean()
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  with jax.set_mesh(mesh), mock.patch.object(bilm, 'take_rows', take_rows):
    batch = jax.sharding.NamedSharding(mesh, P(sharding.BATCH_AXES))
    touched = set(np.asarray(targets_N).tolist())
    states_ND, targets_N = jax.device_put(states_ND, batch), jax.device_put(targets_N, batch)
    with nn.logical_axis_rules(rules):
      table = nn.logical_to_mesh_sharding(P('vocab', 'embed'), mesh, rules)
      params = {'kernel': jax.device_put(params['kernel'], table),
                'bias': jax.device_put(params['bias'], nn.logical_to_mesh_sharding(
                    P('vocab'), mesh, rules))}
    opt_state = tx.init(params)
    jitted = jax.jit(step)
    hlo = jitted.lower(params, opt_state, states_ND, targets_N,
                       jnp.arange(num_sampled)).compile().as_text()
    for i in range(3):
      sampled = jax.random.choice(jax.random.key(i), vocab, (num_sampled,), replace=False)
      sampled = sampled.at[0].set(7)  # a sample that is a target: its logit is removed
      touched |= set(np.asarray(sampled).tolist())
      params, opt_state = jitted(params, opt_state, states_ND, targets_N, sampled)
  return jax.device_get((params, opt_state)), touched, hlo


def _table_collectives(hlo):
  """The collectives of the HLO whose result holds a whole table, or a block of it on the mesh's
  tensor axis (8,192 or 4,096 rows; the batch's rows are 64 targets and 64 samples)."""
  found = []
  for line in hlo.splitlines():
    match = re.search(r'=(.*?) (all-reduce|all-gather|reduce-scatter|collective-permute|'
                      r'all-to-all)(-start)?\(', line)
    if match and re.search(r'\[(8192|4096)[,\]]', match.group(1)):
      found.append(line)
  return found


@pytest.mark.parametrize('mesh_cfg', [(('data', 8), ('fsdp', 1), ('tensor', 1)),
                                      (('data', 2), ('fsdp', 2), ('tensor', 2))],
                         ids=['data', 'data_fsdp_tensor'])
def test_sampled_softmax_trains_the_table_as_the_dense_gradient_without_moving_it(mesh_cfg):
  """take_rows adds the rows' summed gradients into each device's block of the table; a plain
  gather (whose gradient XLA makes a whole table per device, then all-reduces) trains alike."""
  got, touched, hlo = _sampled_training(mesh_cfg, bilm.take_rows)
  expected, _, dense_hlo = _sampled_training(mesh_cfg, lambda table, ids_R, axes: table[ids_R])
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # Adagrad's accumulators (from 1.0) grew on exactly the rows of the targets and samples.
  grew = np.flatnonzero(got[1][0].sum_of_squares['kernel'].max(axis=1) > 1.0)
  assert set(grew.tolist()) == touched
  assert not _table_collectives(hlo), _table_collectives(hlo)
  assert _table_collectives(dense_hlo)  # the plain gather's gradient moves the table
