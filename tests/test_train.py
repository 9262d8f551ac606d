"""The training system: learning on the embedded corpus, sharding parity, exact resume, NaN stop."""

import functools
import importlib.util
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import common
from configs import cove as cove_configs
from configs import cvt as cvt_configs
from configs import gpt_finetune as finetune_configs
import input_pipeline
from trainer import checkpoints
from trainer import sharding
import trainer.checks
import trainer.evaluation
import trainer.loop
import trainer.optimizer
import trainer.stop
import trainer.state
import trainer.steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bert_config(variant='tiny'):
  spec = importlib.util.spec_from_file_location('bert_base', f'{ROOT}/configs/bert_base.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


@pytest.fixture(scope='session')
def data_dir(shared_data_dir):
  return shared_data_dir


def micro_config(data_dir, **train_overrides):
  config = bert_config()
  config.data.data_dir = data_dir
  config.model.update(hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64)
  # One phase: tests/test_phases.py runs two.
  config.data.update(max_seq_length=32, max_predictions_per_seq=5, docs_per_chunk=50,
                     later_phases=())
  config.train.update(batch_size=8, num_steps=6, log_every=2, eval_every=1000, eval_steps=2,
                      checkpoint_every=3)
  config.train.update(**train_overrides)
  config.optimizer.warmup_steps = 2
  return config


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [m for m in map(json.loads, f) if 'results' not in m]  # the per-step lines


def _three_steps(config, devices, gradients=False):
  """The losses and gradient norms of three train steps, the final state, and with `gradients`
  those of the initial parameters (the objective's loss on the same batch, without dropout)."""
  mesh = sharding.make_mesh(config.mesh, devices)
  objective, _, state, step, _ = trainer.state.build(config, mesh)
  model = importlib.import_module(f'models.{config.model_name}').Model(
      trainer.checks.model_config(config))
  local = input_pipeline.example_batch(config.data, config.model.vocab_size,
                                       batch_size=config.train.batch_size)

  def loss(params, batch):
    with nn.logical_axis_rules(config.logical_axis_rules):
      return objective.loss_fn(model.apply({'params': params}, batch), batch)[0]
  losses, grad_norms, initial_grads = [], [], None
  with jax.set_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    if gradients:  # before the steps, which take the state's buffers
      initial_grads = jax.device_get(jax.jit(jax.grad(loss))(state.params, batch))
    for _ in range(3):  # the first step has learning rate 0 (warmup)
      state, metrics = step(state, batch)
      losses.append(float(metrics['loss'][0] / metrics['loss'][1]))
      grad_norms.append(float(metrics['grad_norm'][0]))
  return losses, grad_norms, state, initial_grads


def _shrunk(config, data_dir, **train_overrides):
  """A one-layer, 32-wide model on 8 x 32-token batches, 6 steps."""
  config.data.data_dir = data_dir
  config.model.update(hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64)
  config.data.max_seq_length = 32
  config.train.update(batch_size=8, num_steps=6, log_every=2, eval_every=1000, eval_steps=2,
                      checkpoint_every=3)
  config.train.update(**train_overrides)
  config.optimizer.warmup_steps = 2
  return config


def finetune_micro_config(data_dir, **train_overrides):
  """GPT fine-tuning on the 4-way offline cloze task: (B, C=4, L) batches."""
  config = finetune_configs.get_config('offline_cloze,tiny')
  config.data.max_examples = 200
  return _shrunk(config, data_dir, **{'eval_steps': 0, **train_overrides})


def cvt_micro_config(data_dir, **train_overrides):
  """CVT on the synthetic names task: labeled and unlabeled batches alternate."""
  config = cvt_configs.get_config('tiny')
  config.data.data_dir = data_dir
  config.model.update(word_dim=8, char_dim=4, filters=((2, 4), (3, 4)), first_lstm_dim=8,
                      second_lstm_dim=8, projection_dim=8)
  config.data.update(max_train_examples=40, max_eval_examples=8, max_seq_length=16)
  config.train.update(batch_size=8, num_steps=6, log_every=2, eval_every=1000, eval_steps=0,
                      checkpoint_every=3)
  config.train.update(**train_overrides)
  config.optimizer.warmup_steps = 2
  return config


def cove_micro_config(data_dir, **train_overrides):
  """CoVe on the offline translation task: word sources, BPE targets, two vocabularies, BLEU."""
  config = cove_configs.get_config('tiny')
  config.data.update(data_dir=data_dir, max_seq_length=16, source_vocab_size=500)
  config.model.update(vocab_size=300, word_dim=8, hidden_size=8, target_embed_dim=8)
  config.train.update(batch_size=8, num_steps=6, log_every=2, eval_every=1000, eval_steps=1,
                      checkpoint_every=3)
  config.train.update(**train_overrides)
  config.decode.update(bleu_examples=4, batch_size=4, max_extra_length=4)
  return config


# GPT pretraining's sharded step is checked in tests/test_gpt_model.py and its
# data resume in tests/test_packed_lm.py; fine-tuning runs the same model.
# CVT (labeled and unlabeled batches, two iterators in the data state) and CoVe (a source
# and a target vocabulary read back from the workdir) resume exactly too,
# on the 8-device data mesh; their steps are left out of the 1-vs-8 device parity test, whose
# 8-device LSTM compile took 140 s here.
# The fast tier checks BERT's step; the other families' cases run in the slow tier.
MICRO_CONFIGS = [pytest.param(micro_config, id='bert'),
                 pytest.param(finetune_micro_config, id='gpt_finetune', marks=pytest.mark.slow)]
RESUME_CONFIGS = MICRO_CONFIGS + [pytest.param(cvt_micro_config, id='cvt', marks=pytest.mark.slow),
                                  pytest.param(cove_micro_config, id='cove', marks=pytest.mark.slow)]


# The tied output layer's table is gathered over `embed` first only where the mesh splits it
# both ways (layers.Embed.attend): both cases are checked.
# The fast tier checks the mesh that splits all three ways; the slow tier the other as well.
EIGHT_DEVICE_MESHES = {'data_fsdp_tensor': (('data', 2), ('fsdp', 2), ('tensor', 2)),
                       'data_fsdp': (('data', 2), ('fsdp', 4), ('tensor', 1))}


@pytest.mark.parametrize('mesh', ['data_fsdp_tensor',
                                  pytest.param('data_fsdp', marks=pytest.mark.slow)])
@pytest.mark.parametrize('make_config', MICRO_CONFIGS)
def test_one_device_and_eight_devices_agree(data_dir, make_config, mesh):
  assert len(jax.devices()) == 8
  config = make_config(data_dir)
  config.model.update(num_heads=4, mlp_dim=64, vocab_size=256)
  one_losses, one_norms, _, one_grads = _three_steps(config, jax.devices()[:1], gradients=True)
  config.mesh = EIGHT_DEVICE_MESHES[mesh]
  eight_losses, eight_norms, state, eight_grads = _three_steps(config, jax.devices(),
                                                              gradients=True)
  kernel = state.params['layer_0']['attention']['query']['kernel']
  assert len(kernel.sharding.device_set) == 8
  assert not kernel.sharding.is_fully_replicated
  # Same math, different reduction order across shards: float32 round-off only.
  # (Parameters after Adam steps are not compared: Adam's first update is about
  # lr * sign(grad), which round-off flips for gradients near zero.)
  np.testing.assert_allclose(eight_losses, one_losses, rtol=1e-5)
  np.testing.assert_allclose(eight_norms, one_norms, rtol=1e-4)
  # The key bias has an exactly zero gradient (softmax is shift-invariant): atol.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6),
               eight_grads, one_grads)


def test_gradient_accumulation_matches_full_batch(data_dir):
  config = micro_config(data_dir)
  config.model.update(dropout_rate=0.0, attention_dropout_rate=0.0, vocab_size=256)
  full_losses, full_norms, _, _ = _three_steps(config, jax.devices()[:2])
  config.train.grad_accum_steps = 2
  accum_losses, accum_norms, _, _ = _three_steps(config, jax.devices()[:2])
  # MLM counts differ between micro-batches, so the mean of means differs slightly.
  np.testing.assert_allclose(accum_losses, full_losses, rtol=2e-2)
  np.testing.assert_allclose(accum_norms, full_norms, rtol=5e-2)


class _TokenModel(nn.Module):
  """Logits of each target position from a table row of its token: a loss with a gradient."""
  config: object = None

  @nn.compact
  def __call__(self, batch, deterministic=True):
    del deterministic
    table = self.param('table', nn.initializers.normal(1.0), (8, 8))
    return {'logits': table[batch['target_ids']]}


def test_micro_batches_of_different_token_counts_give_the_whole_batchs_gradient():
  """train.grad_accum_steps is a memory setting: a loss that is one mean over tokens (the
  Transformer's, a tagger's) weighs each micro-batch by its tokens, as the whole batch's mean
  (and tensor2tensor's sum over shards over their token count) does."""
  from objectives import seq2seq  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict({'seed': 0, 'train': {'grad_accum_steps': 1}})
  common.set_mesh_and_rules(config)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  # The strided split puts rows 0 and 2 (13 tokens) in one micro-batch, 1 and 3 (3) in the other.
  lengths = np.array([7, 1, 6, 2])
  ids = np.where(np.arange(8)[None] < lengths[:, None],
                 np.arange(1, 33).reshape(4, 8) % 7 + 1, 0).astype(np.int32)
  batch = {'target_ids': ids}
  model, tx = _TokenModel(), optax.sgd(1.0)
  loss_fn = functools.partial(seq2seq.loss_fn, label_smoothing=0.1)
  params = {}
  for accum in (1, 2):
    config.train.grad_accum_steps = accum
    state, shardings = trainer.state.create_state(model, tx, batch, 0, mesh,
                                                  config.logical_axis_rules)
    step = trainer.steps.make_train_step(model, loss_fn, tx, config, mesh, shardings)
    with jax.set_mesh(mesh):
      state, metrics = step(state, sharding.global_batch(batch, mesh))
    params[accum] = np.asarray(state.params['table'])
    assert float(metrics['loss'][1]) == lengths.sum()  # the tokens of both micro-batches
  before = np.asarray(trainer.state.create_state(model, tx, batch, 0, mesh,
                                                 config.logical_axis_rules)[0].params['table'])
  assert not np.allclose(params[1], before)
  np.testing.assert_allclose(params[2], params[1], rtol=1e-5, atol=1e-6)


# In the fast tier, tests/test_phases.py resumes BERT exactly at a phase change and
# test_workers.py its batches through input workers; this one, a run of its own, is slow.
@pytest.mark.slow
@pytest.mark.parametrize('make_config', RESUME_CONFIGS)
def test_resume_is_exact(data_dir, tmp_path, make_config):
  config = make_config(data_dir)
  config.data.docs_per_chunk = 3  # the 6 steps cross many chunk boundaries
  straight = trainer.loop.train_and_evaluate(config, str(tmp_path / 'straight'))
  trainer.loop.train_and_evaluate(config, str(tmp_path / 'resumed'), stop_after_steps=3)
  resumed = trainer.loop.train_and_evaluate(config, str(tmp_path / 'resumed'))
  assert int(straight.step) == int(resumed.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
               jax.device_get(straight.params))
  # Steps 2 and 6 close the same logging windows in both runs.
  losses = lambda d: {m['step']: m['loss'] for m in read_metrics(tmp_path / d) if 'loss' in m}
  assert [losses('resumed')[s] for s in (2, 6)] == [losses('straight')[s] for s in (2, 6)]


@pytest.mark.slow  # fault injection (a NaN loss)
def test_nan_loss_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path):
  config = micro_config(data_dir, num_steps=8, checkpoint_every=2)
  trainer.loop.train_and_evaluate(config, str(tmp_path), stop_after_steps=4)
  config.optimizer.learning_rate = 1e30
  with pytest.raises(FloatingPointError, match=r'at step \d+; the last good checkpoint is step 4'):
    trainer.loop.train_and_evaluate(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']


def test_a_bad_eval_split_stops_the_run_before_it_compiles_its_init(data_dir, tmp_path):
  config = finetune_micro_config(data_dir)
  config.data.eval_holdout = 10**6  # no example is held out
  lowered = []

  def listener(event, duration, fun_name=None, **kwargs):
    del duration, kwargs
    if event.endswith('jaxpr_to_mlir_module_duration'):  # also where the compile is cached
      lowered.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    with pytest.raises(ValueError, match="'eval' split .* lower data.eval_holdout"):
      trainer.loop.train_and_evaluate(config, str(tmp_path))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  # trainer/state.py's init program (what was lowered is jax's eager ops: the seed's key).
  assert not [name for name in lowered if 'initialize' in name], lowered
  assert not os.path.exists(tmp_path / 'metrics.jsonl')


@pytest.mark.slow  # an interrupted run, as the fault suite's
def test_a_run_stopped_in_its_final_eval_evaluates_when_run_again(data_dir, tmp_path):
  config = finetune_micro_config(data_dir, num_steps=4, checkpoint_every=4)
  trainer.loop.train_and_evaluate(config, str(tmp_path))
  path = tmp_path / 'metrics.jsonl'
  lines = path.read_text().splitlines()
  results = [json.loads(line) for line in lines if '"results"' in line]
  assert len(results) == 1 and 'eval_accuracy' in results[0]['results']
  # As if stopped after the last checkpoint, before the eval and results lines were written.
  path.write_text('\n'.join(line for line in lines if 'eval_' not in line) + '\n')
  trainer.loop.train_and_evaluate(config, str(tmp_path))
  again = [json.loads(line) for line in path.read_text().splitlines() if '"results"' in line]
  assert len(again) == 1 and again[0]['results'] == results[0]['results']
  trainer.loop.train_and_evaluate(config, str(tmp_path))  # finished: nothing more is written
  assert len(path.read_text().splitlines()) == len(lines)
  # Extended to 6 steps and stopped in that final eval: step 4's results are not step 6's.
  config.train.update(num_steps=6, checkpoint_every=2)
  trainer.loop.train_and_evaluate(config, str(tmp_path))
  lines = path.read_text().splitlines()
  assert [json.loads(line)['step'] for line in lines if '"results"' in line] == [4, 6]
  path.write_text('\n'.join(line for line in lines
                            if not ('eval_' in line and json.loads(line)['step'] == 6)) + '\n')
  trainer.loop.train_and_evaluate(config, str(tmp_path))
  again = [json.loads(line) for line in path.read_text().splitlines() if '"results"' in line]
  assert [r['step'] for r in again] == [4, 6]


@pytest.mark.slow  # an interrupted run, as the fault suite's
def test_a_run_killed_in_an_eval_before_its_end_evaluates_that_step_and_logs_each_step_once(
    data_dir, tmp_path):
  config = finetune_micro_config(data_dir, num_steps=4, checkpoint_every=2, eval_every=2,
                                 log_every=1)
  trainer.loop.train_and_evaluate(config, str(tmp_path), stop_after_steps=2)
  path = tmp_path / 'metrics.jsonl'
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  evals = [line for line in lines if 'eval_accuracy' in line]
  assert [line['step'] for line in evals] == [2]
  # As if killed during step 2's eval (its checkpoint complete) by a run that had logged step
  # 3 before: the eval line lost, step 3's line written but never saved.
  kept = [line for line in lines if 'eval_accuracy' not in line]
  path.write_text(''.join(json.dumps(line) + '\n'
                          for line in kept + [{'step': 3, 'loss': 99.0}]))
  trainer.loop.train_and_evaluate(config, str(tmp_path))
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  again = [line for line in lines if 'eval_accuracy' in line]
  assert [line['step'] for line in again] == [2, 4]
  assert again[0]['eval_accuracy'] == evals[0]['eval_accuracy']
  train_steps = [line['step'] for line in lines if 'loss' in line]
  assert train_steps == [1, 2, 3, 4] and 99.0 not in [line['loss'] for line in lines
                                                      if 'loss' in line]


def test_each_host_holds_batch_shards_of_its_own():
  mesh_cfg = (('tensor', 2), ('data', -1), ('fsdp', 1))
  mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:4])
  assert sharding.batch_shards_by_process(mesh) == {0: {0, 1}}  # one process: all of them
  sharding.check_processes_split_the_batch({0: {0, 1}}, mesh_cfg)
  sharding.check_processes_split_the_batch({0: {0}, 1: {1}}, mesh_cfg)
  # Two hosts of two devices, tensor across the hosts first: each holds both shards (seen on
  # two processes over gloo: a global batch of 4 rows, not 8, each host's own 4 in it).
  for held in ({0: {0, 1}, 1: {0, 1}}, {0: {0, 1}, 1: {1}}):
    with pytest.raises(ValueError, match=r"gives the 2 hosts the same shards of the batch .*: "
                       r"put data \(or fsdp\) first in config.mesh"):
      sharding.check_processes_split_the_batch(held, mesh_cfg)


def test_schedule_and_weight_decay_follow_bert():
  # run_pretraining.py: linear warmup, then lr * (1 - step / num_steps); no decay
  # of LayerNorm parameters and biases.
  opt = bert_config('tiny').optimizer
  opt.update(learning_rate=1e-4, warmup_steps=100)
  schedule = trainer.optimizer.learning_rate_schedule(opt, 1000)
  np.testing.assert_allclose([float(schedule(s)) for s in (0, 50, 100, 550, 1000)],
                             [0.0, 5e-5, 9e-5, 4.5e-5, 0.0], rtol=1e-6, atol=1e-12)
  params = {'embed_ln': {'scale': 1.0, 'bias': 1.0}, 'layer_0': {'mlp': {'wi': {
      'kernel': 1.0, 'bias': 1.0}}}, 'mlm_output_bias': 1.0, 'token_embed': {'embedding': 1.0}}
  assert trainer.optimizer.decay_mask(params) == {
      'embed_ln': {'scale': False, 'bias': False},
      'layer_0': {'mlp': {'wi': {'kernel': True, 'bias': False}}},
      'mlm_output_bias': False, 'token_embed': {'embedding': True}}


def test_cvt_schedule_and_momentum_follow_cvt_text():
  # multitask_model.py: lr * min(step, warmup) / warmup / (1 + decay * sqrt(step)).
  opt = ml_collections.ConfigDict(dict(learning_rate=0.5, warmup_steps=100,
                                       schedule='inverse_sqrt', decay_rate=0.005))
  schedule = trainer.optimizer.learning_rate_schedule(opt, 1000)
  steps = np.array([0, 50, 100, 400, 10_000])
  expected = 0.5 * np.minimum(steps / 100, 1) / (1 + 0.005 * np.sqrt(steps))
  np.testing.assert_allclose([float(schedule(s)) for s in steps], expected, rtol=1e-6)
  # TF's MomentumOptimizer: v = 0.9 v + g, param -= lr v.
  opt.update(name='sgd', momentum=0.9, clip_norm=1e9, warmup_steps=0)
  tx = trainer.optimizer.make_optimizer(opt, lambda step: 0.1)
  params = {'w': np.float32(1.0)}
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update({'w': np.float32(1.0)}, state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(params['w'], 1.0 - 0.1 * 1.0 - 0.1 * 1.9, rtol=1e-6)


def test_a_cvt_module_outside_the_steps_loss_keeps_its_weights_and_momentum():
  """cvt_text's variables outside a step's loss get no gradient, which TF's apply_gradients
  skips: neither they nor their momentum slots change (optax's trace would move and decay)."""
  opt = cvt_configs.get_config('tiny').optimizer
  assert opt.skip_without_gradient
  opt.update(clip_norm=1e9, frozen=())
  tx = trainer.optimizer.make_optimizer(opt, lambda step: 0.1)
  params = {'primary': np.ones(3, np.float32), 'auxiliary': np.ones(2, np.float32)}
  state = tx.init(params)
  labeled = {'primary': np.ones(3, np.float32), 'auxiliary': np.zeros(2, np.float32)}
  unlabeled = {'primary': np.zeros(3, np.float32), 'auxiliary': np.ones(2, np.float32)}
  trace = lambda state: [s for s in jax.tree.leaves(state) if np.shape(s) == (3,)][0]  # noqa: E731
  for batch, moved, kept in ((labeled, 'primary', 'auxiliary'), (unlabeled, 'auxiliary', 'primary'),
                             (labeled, 'primary', 'auxiliary')):
    before = params
    updates, state = tx.update(batch, state, params)
    params = optax.apply_updates(params, updates)
    assert (params[moved] != before[moved]).all()
    np.testing.assert_array_equal(params[kept], before[kept])
  # The primary's momentum at its second step: 0.9 * 1 + 1, not decayed by the unlabeled step.
  np.testing.assert_allclose(trace(state), 1.9, rtol=1e-6)
  np.testing.assert_allclose(params['primary'], 1.0 - 0.1 * 1.0 - 0.1 * 1.9, rtol=1e-6)


def test_a_cvt_table_row_outside_the_batch_keeps_its_value_and_momentum():
  """cvt_text reads its word and char tables by embedding_lookup: TF's momentum updates the
  rows in the batch alone (SparseApplyMomentum), a dense variable whole."""
  opt = cvt_configs.get_config('tiny').optimizer
  opt.update(clip_norm=1e9)
  word, char = opt.sparse_rows
  assert (word, char) == ('encoder/word_embed/embedding', 'encoder/char_cnn/char_embed')
  tx = trainer.optimizer.make_optimizer(opt, lambda step: 0.1)
  params = {'encoder': {'word_embed': {'embedding': np.ones((3, 2), np.float32)},
                        'char_cnn': {'char_embed': np.ones((2, 2), np.float32)}},
            'dense': np.ones((3, 2), np.float32)}
  trainer.optimizer.check_sparse_rows(opt.sparse_rows, params)
  with pytest.raises(ValueError, match='sparse_rows') as error:
    trainer.optimizer.check_sparse_rows(('encoder/word_embed',), params)
  assert '\n' not in str(error.value)

  def grads(row):
    g = np.zeros((3, 2), np.float32)
    g[row] = 1.0
    return {'encoder': {'word_embed': {'embedding': g}, 'char_cnn': {'char_embed': g[:2]}},
            'dense': g}
  state = tx.init(params)
  for row in (0, 1, 0):
    updates, state = tx.update(grads(row), state, params)
    params = optax.apply_updates(params, updates)
  table = params['encoder']['word_embed']['embedding']
  # Row 0: steps 1 and 3 (momentum 0.9 * 1 + 1 at step 3, not decayed at step 2); row 1: step
  # 2; row 2 never. The dense variable's rows move on every step once they have momentum.
  np.testing.assert_allclose(table[:, 0], [1 - 0.1 - 0.19, 1 - 0.1, 1.0], rtol=1e-6)
  np.testing.assert_allclose(params['encoder']['char_cnn']['char_embed'][:, 0],
                             [1 - 0.1 - 0.19, 1 - 0.1], rtol=1e-6)
  np.testing.assert_allclose(params['dense'][:, 0],
                             [1 - 0.1 - 0.09 - 0.1 * 1.81, 1 - 0.1 - 0.09, 1.0], rtol=1e-6)


def test_transformer_schedule_is_the_papers_and_clip_norm_zero_clips_nothing():
  # Vaswani et al. 2017, eq. 3: d^-0.5 min(step^-0.5, step warmup^-1.5), d = 512, warmup 4000.
  opt = ml_collections.ConfigDict(dict(learning_rate=512 ** -0.5 * 4000 ** -0.5,
                                       warmup_steps=4000, schedule='rsqrt'))
  schedule = trainer.optimizer.learning_rate_schedule(opt, 100_000)
  steps = np.array([1, 1000, 4000, 16_000, 100_000])
  expected = 512 ** -0.5 * np.minimum(steps ** -0.5, steps * 4000 ** -1.5)
  # The schedule reads optax's count, 0 at the first update, which is eq. 3's step_num 1.
  np.testing.assert_allclose([float(schedule(s - 1)) for s in steps], expected, rtol=1e-5)
  # The first update moves the weights (tensor2tensor's noam rate at step_num 0 + 1).
  from configs import transformer_wmt  # pylint: disable=import-outside-toplevel
  config = transformer_wmt.get_config('tiny')
  tx = trainer.optimizer.make_optimizer(
      config.optimizer,
      trainer.optimizer.learning_rate_schedule(config.optimizer, config.train.num_steps))
  params = {'w': np.ones(3, np.float32)}
  updates, _ = tx.update({'w': np.ones(3, np.float32)}, tx.init(params), params)
  assert (np.asarray(updates['w']) < 0).all()
  opt.update(name='sgd', momentum=0.0, clip_norm=0.0)
  tx = trainer.optimizer.make_optimizer(opt, lambda step: 1.0)
  updates, _ = tx.update({'w': np.float32(50.0)}, tx.init({'w': np.float32(0.0)}))
  np.testing.assert_allclose(updates['w'], -50.0)


def test_step_metrics_are_summed_on_the_device_even_when_their_names_change():
  """CVT's labeled and unlabeled steps report different metrics; the first non-finite step
  and its loss and gradient norm are kept until the host reads the window."""
  nan, inf = float('nan'), float('inf')
  steps = [{'loss': [1.0, 1.0], 'grad_norm': [2.0, 1.0], 'a': [3.0, 1.0]},
           {'loss': [nan, 1.0], 'grad_norm': [1.0, 1.0], 'b': [5.0, 2.0]},
           {'loss': [1.0, 1.0], 'grad_norm': [inf, 1.0], 'a': [1.0, 1.0]}]
  window = None
  for step, metrics in enumerate(steps, start=1):
    window = trainer.loop._add_on_device(
        window, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}, step)
  window = jax.device_get(window)
  assert int(window['bad_step']) == 2
  assert np.isnan(window['bad_values'][0]) and window['bad_values'][1] == 1.0
  np.testing.assert_array_equal(window['sums']['a'], [4.0, 2.0])
  np.testing.assert_array_equal(window['sums']['b'], [5.0, 2.0])
  np.testing.assert_array_equal(window['sums']['grad_norm'], [inf, 3.0])


def test_a_pretraining_eval_has_the_same_examples_on_any_number_of_hosts(data_dir, monkeypatch):
  """train.eval_steps batches of the eval split, read on 1 host and on 2: each host's rows are
  its part of the same global batches (documents and masks as one host draws them)."""
  config = micro_config(data_dir, eval_steps=2)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  B = config.train.batch_size
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size)

  def batches(hosts, host):
    monkeypatch.setattr(jax, 'process_count', lambda: hosts)
    monkeypatch.setattr(jax, 'process_index', lambda: host)
    monkeypatch.setattr(sharding, 'process_rows', lambda mesh, size, p: [
        (p * size // hosts, (p + 1) * size // hosts)])
    stream, _ = trainer.evaluation.eval_batches(config, tokenizer, mesh)
    try:
      return [next(stream) for _ in range(config.train.eval_steps)]
    finally:
      stream.close()

  one = batches(1, 0)
  two = [batches(2, host) for host in (0, 1)]
  for step, whole in enumerate(one):
    for key, value in whole.items():
      np.testing.assert_array_equal(
          np.concatenate([two[0][step][key], two[1][step][key]]), value, err_msg=key)
  assert len(one[0]['input_ids']) == B


def test_a_run_stopped_between_log_steps_logs_the_steps_since_the_last_row(data_dir, tmp_path,
                                                                           monkeypatch):
  # A signal at step 3 (log_every=2): step 3's loss is logged with its checkpoint, where the
  # resumed run's step-4 row then covered step 4 alone and step 3 was in no row.
  monkeypatch.setattr(trainer.stop.StopRequested, 'requested',
                      lambda self, step, every: step >= 3)
  trainer.loop.train_and_evaluate(micro_config(data_dir, num_steps=6), str(tmp_path))
  rows = [(m['step'], 'loss' in m) for m in read_metrics(tmp_path)]
  assert rows == [(2, True), (3, True)], rows
  assert checkpoints.newest_step(str(tmp_path)) == 3
