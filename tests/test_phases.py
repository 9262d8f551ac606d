"""BERT's pretraining phases in one run (Devlin et al. 2018, appendix A.2): 90% of the steps at
128 tokens, then 10% at 512, with one optimizer state and one learning rate schedule."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from configs import bert_base
from configs import bert_finetune
from configs import gpt
import input_pipeline
from input_pipeline import bert_pretraining
from test_train import micro_config
from test_train import read_metrics
from trainer import checkpoints
from trainer import phases
from trainer import sharding
import trainer.checks
import trainer.loop
import trainer.optimizer

BOUNDARY = 3  # of 6 steps
ONE = jax.devices()[:1]  # a run compiles faster than on 8; tests/test_train.py covers the mesh


@pytest.fixture(scope='module')
def data_dir(shared_data_dir):
  return shared_data_dir


def two_phase_config(data_dir):
  """6 steps: 3 at 32 tokens (5 predictions), then 3 at 64 (10 predictions) with remat."""
  config = micro_config(data_dir, log_every=1, checkpoint_every=1000)
  config.data.later_phases = ((0.5, 64, 10, True),)
  config.data.docs_per_chunk = 5  # the phases cross chunk boundaries
  return config


def test_the_configs_carry_the_papers_phases():
  for variant in bert_base.VARIANTS:
    config = bert_base.get_config(variant)
    first, second = phases.of(config)
    steps = config.train.num_steps
    assert (first.start, first.end, second.start, second.end) == (
        0, round(0.9 * steps), round(0.9 * steps), steps)
    assert (first.max_seq_length, first.config.data.max_predictions_per_seq) == (128, 20)
    assert (second.max_seq_length, second.config.data.max_predictions_per_seq) == (512, 80)
    # The 512-token step of base and large fits a TPU v4-8 with remat (docs/accelerators.md, aot.py).
    assert second.config.model.remat == (variant in ('base', 'large'))
    assert not first.config.model.remat
    assert second.config.data.later_phases == () and second.config.train == config.train
  # One phase: the table emptied; fine-tuning configs have none.
  config = bert_base.get_config('tiny')
  config.data.later_phases = ()
  assert [(p.start, p.end, p.max_seq_length) for p in phases.of(config)] == [(0, 600, 128)]
  assert 'later_phases' not in bert_finetune.get_config('sst2').data


def test_the_phase_of_a_step_is_the_one_that_trains_the_next():
  runs = phases.of(bert_base.get_config('tiny'))  # steps 1-540, 541-600
  assert [phases.at(runs, s).index for s in (0, 539, 540, 541, 600)] == [0, 0, 1, 1, 1]
  assert [p.index for p in phases.chosen(bert_base.get_config('tiny'), 0)] == [0, 1]
  with pytest.raises(ValueError, match=r'--phase=3: this config has 2 phase\(s\).*use 1-2'):
    phases.chosen(bert_base.get_config('tiny'), 3)


@pytest.mark.parametrize('later,message', [
    (((1.0, 512, 80, False),), r'fractions in \(0, 1\)'),
    (((0.5, 256, 40, False), (0.4, 512, 80, False)), r'later_phases\[1\] starts at 0.4'),
    (((0.9, 512, 80),), r'\(from_fraction, max_seq_length, max_predictions_per_seq, remat\)'),
    (((0.9, 512, 80, 1),), r'later_phases\[0\]=\(0.9, 512, 80, 1\)'),
    (((0.9, 1024, 80, False),), r'In phase 2 \(data.later_phases\[0\]\): data.max_seq_length=1024 '
                                'is above model.max_position_embeddings=512'),
    (((0.9, 512, 600, False),), r'In phase 2 .*max_predictions_per_seq=600'),
    (((0.9995, 512, 80, False),), r'train.num_steps=600 \(step 600\)'),
])
def test_a_bad_table_is_one_line_naming_the_fix(later, message):
  config = bert_base.get_config('tiny')
  config.data.later_phases = later
  mesh = sharding.make_mesh(config.mesh)
  with pytest.raises(ValueError, match=message) as e:
    trainer.checks.validate(config, mesh)
  assert '\n' not in str(e.value)


def test_only_bert_pretraining_has_phases():
  config = gpt.get_config('tiny')
  config.data.later_phases = ((0.9, 512, 80, False),)
  with pytest.raises(ValueError, match='later_phases is for data.pipeline=bert_pretraining'):
    phases.check(config)


class Recorded:
  """The loop's train stream, keeping each batch's shapes and masking rate."""

  def __init__(self, stream, seen):
    self.stream, self.seen = stream, seen

  def __next__(self):
    batch = next(self.stream)
    real = batch['input_mask'].sum() - 3 * len(batch['input_mask'])  # [CLS] and two [SEP]
    self.seen.append((batch['input_ids'].shape, batch['masked_lm_ids'].shape,
                      batch['masked_lm_weights'].sum() / real))
    return batch

  def __getattr__(self, name):
    return getattr(self.stream, name)


def test_a_two_phase_run_switches_length_and_resumes_at_its_boundary(data_dir, tmp_path,
                                                                   monkeypatch, capsys):
  config = two_phase_config(data_dir)
  seen = []
  make = input_pipeline.get_train_stream
  monkeypatch.setattr(input_pipeline, 'get_train_stream',
                      lambda *a, **k: Recorded(make(*a, **k), seen))
  straight = trainer.loop.train_and_evaluate(config, str(tmp_path / 'straight'), devices=ONE)
  out = capsys.readouterr().out
  monkeypatch.undo()

  # The batches: the phase's shapes and the paper's 15% of the real tokens predicted.
  assert [s[:2] for s in seen] == [((8, 32), (8, 5))] * 3 + [((8, 64), (8, 10))] * 3
  for rates in ([s[2] for s in seen[:3]], [s[2] for s in seen[3:]]):
    assert abs(np.mean(rates) - 0.15) < 0.03, rates
  # Every metrics row and progress line says its phase's length; the boundary step is logged.
  rows = read_metrics(tmp_path / 'straight')
  assert [(r['step'], r['max_seq_length']) for r in rows if 'loss' in r] == [
      (1, 32), (2, 32), (3, 32), (4, 64), (5, 64), (6, 64)]
  # Each phase's end is evaluated at its length (train.eval_every is 1000).
  assert [(r['step'], r['max_seq_length']) for r in rows if 'eval_loss' in r] == [
      (3, 32), (6, 64)]
  assert 'step 4/6 | max_seq_length 64 | loss' in out
  assert 'Training phase 2 of 2, steps 4-6: 64 tokens, 10 predictions per sequence, remat' in out
  # Phase 2's step was compiled at the start (a step too large stops the run there).
  assert 'Compiled the step of phase 2 ahead' in out
  assert 'First step of phase 2 (compiled at the start) took' in out
  # One optimizer and one schedule across the switch: the logged rates are the schedule's
  # (a restarted warmup would give 0 at step 4), Adam counted every step, and the loss goes on.
  schedule = trainer.optimizer.learning_rate_schedule(config.optimizer, config.train.num_steps)
  np.testing.assert_allclose([r['learning_rate'] for r in rows if 'loss' in r],
                             [float(schedule(s)) for s in range(6)], rtol=1e-6)
  counts = {int(x) for x in jax.tree.leaves(jax.device_get(straight.opt_state))
            if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)}
  assert counts == {6}, counts
  losses = {r['step']: r['loss'] for r in rows if 'loss' in r}
  assert abs(losses[4] - losses[3]) < 0.1 * losses[3], losses
  # The last checkpoint says its phase and the positions trained (what fine-tuning reads).
  assert checkpoints.newest_data(str(tmp_path / 'straight'))['phase'] == 1
  assert phases.trained_positions(str(tmp_path / 'straight')) == 64

  # Stopped at the boundary, its checkpoint holding phase 1's position, then run to the end:
  # the same run (the slow tier's test below stops it before, at and after the boundary).
  resumed = str(tmp_path / 'resumed')
  trainer.loop.train_and_evaluate(config, resumed, stop_after_steps=BOUNDARY, devices=ONE)
  assert checkpoints.newest_data(resumed)['phase'] == 0
  state = trainer.loop.train_and_evaluate(config, resumed, devices=ONE)
  assert int(state.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(straight.params))


@pytest.mark.slow  # five runs, as test_train.py's resumes; the fast one resumes at the boundary
def test_a_two_phase_run_resumes_exactly_across_its_boundary(data_dir, tmp_path, monkeypatch):
  config = two_phase_config(data_dir)
  straight = trainer.loop.train_and_evaluate(config, str(tmp_path / 'straight'), devices=ONE)
  # Stopped in phase 1, exactly at the boundary, just after it, then run to the end: the
  # same run. Each resumed start reads its checkpoint into the state's shapes and shardings
  # alone: no state is initialized first.
  resumed, targets, restore = str(tmp_path / 'resumed'), [], checkpoints.restore
  monkeypatch.setattr(checkpoints, 'restore',
                      lambda mngr, target, workdir: targets.append(target) or restore(
                          mngr, target, workdir))
  for stop_after in (BOUNDARY - 1, 1, 1, None):
    state = trainer.loop.train_and_evaluate(config, resumed, stop_after_steps=stop_after,
                                            devices=ONE)
  assert len(targets) == 3 and all(isinstance(x, jax.ShapeDtypeStruct)
                                   for x in jax.tree.leaves(targets)), [
                                       type(x) for x in jax.tree.leaves(targets)][:2]
  assert int(state.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(straight.params))
  # The checkpoint at the boundary holds phase 1's position; the one after, phase 2's.
  assert checkpoints.newest_data(resumed)['phase'] == 1
  assert phases.trained_positions(resumed) == 64
  # Phases that moved (here: one phase, more steps) stop the resume in one line, and the
  # run's config.json still says how it ran.
  recorded = (tmp_path / 'resumed' / 'config.json').read_text(encoding='utf-8')
  config.data.later_phases, config.train.num_steps = (), 8
  with pytest.raises(ValueError, match=r'checkpoint of step 6 is in phase 2 of its run, and '
                     r'this config puts step 6 in phase 1: keep data.later_phases') as e:
    trainer.loop.train_and_evaluate(config, resumed, devices=ONE)
  assert '\n' not in str(e.value)
  assert (tmp_path / 'resumed' / 'config.json').read_text(encoding='utf-8') == recorded


@pytest.mark.slow  # two runs, one interrupted, as test_train.py's evals at resume
def test_an_eval_killed_at_a_phases_end_is_made_again_with_that_phases_data(data_dir, tmp_path):
  config = two_phase_config(data_dir)  # the end of phase 1 is evaluated, at 32 tokens
  workdir = tmp_path / 'run'
  trainer.loop.train_and_evaluate(config, str(workdir), stop_after_steps=BOUNDARY, devices=ONE)
  path = workdir / 'metrics.jsonl'
  lines = path.read_text().splitlines()
  evaluated = [json.loads(line) for line in lines if '"eval_loss"' in line]
  assert [(e['step'], e['max_seq_length']) for e in evaluated] == [(BOUNDARY, 32)]
  # As if killed in that eval, after the boundary's checkpoint: the resumed run (in phase 2)
  # evaluates step 3 as the killed one would have, with phase 1's eval data and step.
  path.write_text(''.join(line + '\n' for line in lines if '"eval_loss"' not in line))
  trainer.loop.train_and_evaluate(config, str(workdir), stop_after_steps=1, devices=ONE)
  again = [json.loads(line) for line in path.read_text().splitlines() if '"eval_loss"' in line]
  assert [(e['step'], e['max_seq_length']) for e in again] == [(BOUNDARY, 32)]
  assert again[0]['eval_loss'] == evaluated[0]['eval_loss']


@pytest.mark.parametrize('nsp', [True, False])
def test_the_example_batch_has_nsp_labels_only_where_the_batches_do(data_dir, nsp):
  config = two_phase_config(data_dir)
  config.data.next_sentence_prediction = nsp
  example = bert_pretraining.example_batch(config.data, 100, 2)
  assert ('next_sentence_labels' in example) == nsp


@pytest.mark.slow  # the MLM-only variant's run (test_mlm_nsp.py and test_bert_pretraining.py
# have its loss and batches in the fast tier)
def test_a_two_phase_run_without_nsp_crosses_its_boundary(data_dir, tmp_path):
  # Phase 2's step is compiled ahead from the pipeline's example batch, which had NSP labels
  # that an MLM-only run's batches lack: the run stopped at the boundary (a pytree mismatch).
  config = two_phase_config(data_dir)
  config.data.next_sentence_prediction = False
  state = trainer.loop.train_and_evaluate(config, str(tmp_path / 'run'), devices=ONE)
  assert int(state.step) == 6
  logged = read_metrics(tmp_path / 'run')
  assert [r['max_seq_length'] for r in logged if 'loss' in r][-1] == 64
  # Trained and evaluated without NSP: no NSP metric anywhere, an MLM loss in every eval.
  assert not [k for r in logged for k in r if k.startswith(('nsp', 'eval_nsp'))]
  evals = [r['eval_mlm_loss'] for r in logged if 'eval_loss' in r]
  assert evals and np.isfinite(evals).all()


def _pretraining_run(workdir, *, later_phases=(), phase=0, positions=None):
  """A workdir as BERT pretraining leaves one (config.json, a checkpoint of any params)."""
  config = bert_base.get_config('tiny')
  config.data.later_phases = later_phases
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort())
  mngr = checkpoints.manager(workdir, 1)
  checkpoints.save(mngr, 0, {'step': 0, 'params': {'w': np.zeros(2, np.float32)}}, {0: {}}, 1,
                   phase=phase, positions=positions)
  mngr.wait_until_finished()
  return workdir


def test_fine_tuning_beyond_the_trained_positions_says_so(tmp_path):
  # The checkpoints as the loop writes them (the two-phase run above checks that it does).
  later = ((0.9, 512, 80, False),)
  one_phase = _pretraining_run(str(tmp_path / 'one'), positions=128)
  stopped_in_phase_1 = _pretraining_run(str(tmp_path / 'early'), later_phases=later, phase=0,
                                        positions=128)
  both = _pretraining_run(str(tmp_path / 'both'), later_phases=later, phase=1, positions=512)
  # A checkpoint from before phases says nothing: nothing is refused.
  unknown = _pretraining_run(str(tmp_path / 'unknown'))
  assert [phases.trained_positions(w) for w in (one_phase, stopped_in_phase_1, both, unknown)
          ] == [128, 128, 512, None]

  def check(init_from, length=384, allow=False, model=(('max_position_embeddings', 512),)):
    config = ml_collections.ConfigDict({
        'init_from': init_from, 'model': dict(model), 'data': {'max_seq_length': length},
        'allow_untrained_positions': allow})
    trainer.checks._check_trained_positions(config)  # pylint: disable=protected-access

  for untrained in (one_phase, stopped_in_phase_1):
    with pytest.raises(ValueError, match=r'data.max_seq_length=384 but the run in config.init_from '
                       r'trained positions 0-127 only, so positions 128-383 are untrained.*'
                       r'--config.allow_untrained_positions=True') as e:
      check(untrained)
    assert '\n' not in str(e.value)
    check(untrained, allow=True)  # told to go on
    check(untrained, length=128)
  check(both)
  check(unknown)
  # The fine-tuning configs carry the flag; a positionless model (ELMo) is not checked.
  assert bert_finetune.get_config('squad').allow_untrained_positions is False
  check(one_phase, model=())


def test_the_progress_row_fields_are_not_metrics(tmp_path):
  writer = trainer.loop.metric_writer.MetricWriter(str(tmp_path), 10)
  writer.write(5, {'loss': 2.0}, fields={'max_seq_length': 512})
  writer.write(5, {'loss': 1.0}, prefix='eval_', fields={'max_seq_length': 512})
  writer.close()
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  assert [(r['max_seq_length'], sorted(r)) for r in rows] == [
      (512, ['loss', 'max_seq_length', 'step', 'time']),
      (512, ['eval_loss', 'max_seq_length', 'step', 'time'])]
