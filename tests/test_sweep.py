"""sweep.py: expanding a sweep file, running it (with an interruption), its table and commands."""

import glob
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from input_pipeline import tagging
import sweep
from trainer import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TWO_STAGES = '''
def get_sweep(arg=''):
  return dict(
      stages=(('pretrain', 'configs/bert_base.py:tiny', {'train.num_steps': 10}),
              ('finetune', 'configs/bert_finetune.py:offline_next', {})),
      variants=(('base', {}), ('no nsp', {'pretrain.data.next_sentence_prediction': False})),
      axes=(('finetune.optimizer.learning_rate', (1e-4, 3e-4)),),
      seeds=(0, 1),
      metrics=('eval_accuracy', 'eval_loss'))
'''


def _write(tmp_path, text, name='sweep_file.py'):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_variants_axes_and_seeds_expand_and_upstream_runs_are_shared(tmp_path):
  spec = sweep.load_sweep(_write(tmp_path, TWO_STAGES))
  expanded = sweep.expand(spec, 'W')
  assert [(label, seed) for label, seed, _ in expanded] == [
      ('base,learning_rate=0.0001', 0), ('base,learning_rate=0.0001', 1),
      ('base,learning_rate=0.0003', 0), ('base,learning_rate=0.0003', 1),
      ('no nsp,learning_rate=0.0001', 0), ('no nsp,learning_rate=0.0001', 1),
      ('no nsp,learning_rate=0.0003', 0), ('no nsp,learning_rate=0.0003', 1)]
  runs = sweep.unique_runs(expanded)
  pretrain = [r for r in runs if r.stage == 'pretrain']
  finetune = [r for r in runs if r.stage == 'finetune']
  # One pretraining per (NSP setting, seed), shared by both learning rates; every fine-tuning
  # starts from the pretraining of its own variant and seed.
  assert sorted(r.workdir for r in pretrain) == sorted([
      'W/pretrain/seed=0', 'W/pretrain/seed=1', 'W/pretrain/next_sentence_prediction=False,seed=0',
      'W/pretrain/next_sentence_prediction=False,seed=1'])
  assert len(finetune) == 8 and runs[:4] == pretrain
  by_dir = {r.workdir: r for r in finetune}
  run = by_dir['W/finetune/next_sentence_prediction=False,learning_rate=0.0003,seed=1']
  assert run.init_from == 'W/pretrain/next_sentence_prediction=False,seed=1'
  argv = run.argv()
  assert argv[2] == '--config=' + os.path.relpath(os.path.join(ROOT, 'configs/bert_finetune.py')) \
      + ':offline_next'
  assert argv[3:] == ['--workdir=W/finetune/next_sentence_prediction=False,learning_rate=0.0003,'
                      'seed=1', '--config.seed=1',
                      '--config.init_from=W/pretrain/next_sentence_prediction=False,seed=1',
                      '--config.optimizer.learning_rate=0.0003']
  assert pretrain[2].argv()[-2:] == ['--config.train.num_steps=10',
                                     '--config.data.next_sentence_prediction=False']


def test_a_variant_overrides_its_stages_own_setting_once(tmp_path):
  # Given twice on the command line, a tuple field took both values (ml_collections): the
  # masking sweep's later_phases had two phases at 0.9 and its rate variants failed to start.
  text = TWO_STAGES.replace("{'train.num_steps': 10}",
                            "{'train.num_steps': 10, 'data.later_phases': ((0.9, 128, 20, False),)}")
  text = text.replace("{'pretrain.data.next_sentence_prediction': False}",
                      "{'pretrain.data.later_phases': ((0.8, 128, 13, False),)}")
  runs = sweep.unique_runs(sweep.expand(sweep.load_sweep(_write(tmp_path, text)), 'W'))
  phases = [[a for a in run.argv() if a.startswith('--config.data.later_phases=')]
            for run in runs if run.stage == 'pretrain']
  assert sorted(phases) == [['--config.data.later_phases=((0.8, 128, 13, False),)']] * 2 + [
      ['--config.data.later_phases=((0.9, 128, 20, False),)']] * 2


def test_runs_whose_short_names_meet_get_directories_of_their_own(tmp_path):
  # pretrain.model.dropout_rate=0.0 and finetune.model.dropout_rate=0.0 are both dropout_rate=0.0:
  # in one directory, the second variant's fine-tuning was skipped and the table showed the first's.
  text = TWO_STAGES.replace("axes=(('finetune.optimizer.learning_rate', (1e-4, 3e-4)),),", '')
  text = text.replace("('no nsp', {'pretrain.data.next_sentence_prediction': False})",
                      "('pre', {'pretrain.model.dropout_rate': 0.0}), "
                      "('fine', {'finetune.model.dropout_rate': 0.0})")
  expanded = sweep.expand(sweep.load_sweep(_write(tmp_path, text)), 'W')
  finetune = {(label, seed): runs[-1] for label, seed, runs in expanded}
  assert len({run.workdir for run in finetune.values()}) == len(finetune) == 6
  assert finetune['pre', 0].init_from != finetune['fine', 0].init_from
  assert finetune['fine', 0].init_from == finetune['base', 0].init_from == 'W/pretrain/seed=0'
  # Names that meet no other keep their short form (a sweep's existing directories still resume).
  assert finetune['base', 1].workdir == 'W/finetune/seed=1'
  assert [run.workdir.rsplit('-', 1)[0] for run in (finetune['pre', 0], finetune['fine', 0])] == [
      'W/finetune/dropout_rate=0.0,seed=0'] * 2
  assert len(sweep.unique_runs(expanded)) == 4 + 6


SHIPPED = sorted(glob.glob(os.path.join(ROOT, 'configs', 'sweeps', '*.py')))


@pytest.mark.parametrize('path', SHIPPED, ids=os.path.basename)
def test_each_shipped_sweep_loads_and_gives_every_variant_and_seed_its_own_run(path, tmp_path):
  # load_sweep checks every override against its stage's config (a misspelled field fails).
  loaded = sweep.load_sweep(path)
  expanded = sweep.expand(loaded, str(tmp_path))
  points = math.prod(len(values) for _, values in loaded['axes'])
  assert len(expanded) == len(loaded['variants']) * points * len(loaded['seeds'])
  last_stage = [runs[-1].workdir for _, _, runs in expanded]
  assert len(set(last_stage)) == len(last_stage)
  assert len({label for label, _, _ in expanded}) == len(expanded) // len(loaded['seeds'])


@pytest.mark.parametrize('task', ['cola', 'stsb', 'mrpc', 'qqp', 'sst2', 'mnli', 'offline_next',
                                  'offline_capitalized', 'offline_replaced', 'conll2003',
                                  'squad', 'offline_span'])
def test_the_shipped_sweeps_tabulate_what_each_task_reports(task):
  """The metrics a sweep tabulates are among those its task's eval writes (a missing one
  stopped the summary after the whole sweep had trained), its benchmark's main one first."""
  from configs import bert_finetune  # pylint: disable=g-import-not-at-top
  from input_pipeline.tasks import task_metrics  # pylint: disable=g-import-not-at-top
  spec = bert_finetune._task(task)  # pylint: disable=protected-access
  labels = np.array([0, 1, 1, 0, 1])
  if spec is None:
    written = {'f1', 'exact_match'}  # squad.evaluate's
  elif hasattr(spec, 'label_names'):
    tags = [[spec.label_names[0], spec.label_names[-1]]]
    written = set(task_metrics.spans(tags, tags, chunks=bool(tagging.span_tags(spec))))
  else:
    written = set(task_metrics.classification(labels, labels, regression=spec.regression,
                                              binary=spec.num_labels == 2))
  metrics = bert_finetune.eval_metrics(task)
  assert {m.removeprefix('eval_') for m in metrics} <= written, (metrics, written)
  main = {'cola': 'eval_matthews_corr', 'stsb': 'eval_spearman', 'mrpc': 'eval_f1',
          'offline_capitalized': 'eval_span_f1', 'squad': 'eval_f1'}
  assert metrics[0] == main.get(task, metrics[0])
  loaded = sweep.load_sweep(f'{ROOT}/configs/sweeps/bert_masking.py:tiny,{task}')
  assert loaded['metrics'] == metrics + ('eval_loss',)
  if task in ('cola', 'stsb', 'mrpc', 'sst2'):
    from configs import gpt_finetune  # pylint: disable=g-import-not-at-top
    gpt_metrics = gpt_finetune.eval_metrics(task)
    assert sweep.load_sweep(f'{ROOT}/configs/sweeps/gpt_aux_lm.py:tiny,{task}')['metrics'][:-2] \
        == gpt_metrics
    # GPT's Table 3 reports STS-B's Pearson correlation, BERT's Table 1 its Spearman's.
    assert gpt_metrics == (metrics[::-1] if task == 'stsb' else metrics)


@pytest.mark.parametrize('text,message', [
    ("def get_sweep(arg=''):\n  return dict(stages=(), variants=(('a', {}),), metrics=('m',))",
     'stages must be'),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/nope.py', {}),), "
     "variants=(('a', {}),), metrics=('m',))", 'configs/nope.py does not exist'),
    ("def get_sweep(arg=''):\n  return dict(stages=(('a', 'configs/gpt.py:tiny', {}), "
     "('b', 'configs/gpt_finetune.py', {})), variants=(('x', {'model.dropout': 0.0}),), "
     "metrics=('m',))", "override 'model.dropout' names no stage"),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(), metrics=('m',))", 'variants is empty'),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(('a', {}),), metric=('m',))", "unknown sweep field(s) ['metric']"),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(('a', {'optimizer.learning_rat': 1.0}),), metrics=('m',))",
     "stage s: --config.optimizer.learning_rat: the config has no field 'learning_rat'"),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(('a', {}), ('a', {'train.num_steps': 5})), metrics=('m',))",
     "variant names repeat ('a'); give each its own"),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(('a', {}),), seeds=(0, 0, 1), metrics=('m',))", 'seeds repeat (0)'),
    ("def get_sweep(arg=''):\n  return dict(stages=(('s', 'configs/gpt.py:tiny', {}),), "
     "variants=(('a', {}),), axes=(('optimizer.learning_rate', (1e-3, 1e-3)),), "
     "metrics=('m',))", 'values of axis optimizer.learning_rate repeat (0.001)'),
])
def test_a_bad_sweep_file_is_one_line(tmp_path, text, message):
  with pytest.raises(ValueError) as error:
    sweep.load_sweep(_write(tmp_path, text))
  assert message in str(error.value) and '\n' not in str(error.value)


def test_a_value_out_of_range_is_one_line_before_anything_runs(tmp_path):
  """docs/sweeps.md: every override is checked before anything runs; a bad value used to
  fail its run after the others had trained."""
  text = TWO_STAGES.replace("('no nsp', {'pretrain.data.next_sentence_prediction': False})",
                            "('bad', {'finetune.optimizer.learning_rate': -5e-4})")
  text = text.replace("axes=(('finetune.optimizer.learning_rate', (1e-4, 3e-4)),),", '')
  workdir = str(tmp_path / 'w')
  with pytest.raises(ValueError, match=r'stage finetune .*learning_rate=-0.0005') as error:
    sweep.prepare(_write(tmp_path, text), workdir)
  assert '\n' not in str(error.value) and not os.path.exists(workdir)


def _fake_run(run, evals, final, finished=True):
  """A run's files as train.py writes them: config.json (the fields the sweep sets) and
  metrics.jsonl (with its results line once finished)."""
  workdir = run.workdir
  os.makedirs(workdir, exist_ok=True)
  config = {}
  for field, value in runner.requested(run).items():
    *parents, name = field.split('.')
    node = config
    for part in parents:
      node = node.setdefault(part, {})
    node[name] = value
  num_steps = config['train']['num_steps']
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(config, f)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step, value in evals:
      f.write(json.dumps({'step': step, 'loss': 1.0 / step}) + '\n')
      f.write(json.dumps({'step': step, 'eval_accuracy': value}) + '\n')
    if finished:
      f.write(json.dumps({'step': num_steps, 'results': {'eval_accuracy': final}}) + '\n')


def test_summary_is_mean_and_sample_std_of_each_runs_final_and_best(tmp_path):
  text = TWO_STAGES.replace("axes=(('finetune.optimizer.learning_rate', (1e-4, 3e-4)),),", '')
  text = text.replace("'eval_accuracy', 'eval_loss'", "'eval_accuracy',")
  workdir = str(tmp_path / 'w')
  expanded = sweep.prepare(_write(tmp_path, text), workdir)
  # One 'no nsp' fine-tuning finished from a pretraining stopped part of the way: not counted.
  finals = {'base': (0.6, 0.7), 'no nsp': (0.5, 0.9)}
  for label, seed, runs in expanded:
    final = finals[label][seed]
    _fake_run(runs[-1], [(2, final + 0.1), (4, final)], final)
    _fake_run(runs[0], [(2, 0.5)], 0.5, finished=final != 0.9)
  rows = sweep.summarize(workdir)
  assert [(r['variant'], r['runs']) for r in rows] == [('base', '2/2'), ('no nsp', '1/2')]
  mean, std = rows[0]['eval_accuracy final']
  assert math.isclose(mean, 0.65) and math.isclose(std, math.sqrt(2 * 0.05 ** 2))
  best_mean, _ = rows[0]['eval_accuracy best']  # the best of each run is its step-2 value
  assert math.isclose(best_mean, 0.75)
  mean, std = rows[1]['eval_accuracy final']
  assert math.isclose(mean, 0.5) and math.isnan(std)
  table = (tmp_path / 'w' / 'results.md').read_text().splitlines()
  assert table[2] == '| base | 2/2 | 0.6500 ± 0.0707 | 0.7500 ± 0.0707 |'
  assert table[3] == '| no nsp | 1/2 | 0.5000 | 0.6000 |'
  csv_lines = (tmp_path / 'w' / 'results.csv').read_text().splitlines()
  assert csv_lines[1].startswith('base,2/2,0.65,0.0707107,0.75,0.0707107')
  for png in ('learning_curves.png', 'final_eval_accuracy.png'):
    assert (tmp_path / 'w' / png).read_bytes()[:4] == b'\x89PNG'
  # The same workdir refuses another sweep.
  with pytest.raises(ValueError, match='holds another sweep'):
    sweep.prepare(_write(tmp_path, TWO_STAGES, 'other.py'), workdir)


def test_the_curves_set_task_losses_side_by_side_when_lambda_scales_the_aux_lm():
  # GPT fine-tuning's 'loss' is task + lambda x LM (sec. 3.2): variants of lambda plot the task's.
  tuned = {'lm_coef 0': [[{'step': 2, 'loss': 0.7, 'task_loss': 0.7}]],
           'lm_coef 0.5': [[{'step': 2, 'loss': 2.7, 'task_loss': 0.6}]]}
  assert sweep._comparable_loss(tuned) == 'task_loss'
  pretrained = {'a': [[{'step': 2, 'loss': 3.1}]], 'b': [[{'step': 2, 'loss': 3.0}]]}
  assert sweep._comparable_loss(pretrained) == 'loss'
  assert sweep._comparable_loss(dict(pretrained, **tuned)) == 'loss'


STALE = '''
def get_sweep(arg=''):
  return dict(stages=(('lm', 'configs/gpt.py:tiny', {{'train.num_steps': {steps},
                                                      'optimizer.learning_rate': {lr}}}),),
              variants=(('a', {{}}), ('b', {{'model.dropout_rate': 0.0}})),
              seeds=(0, 1), metrics=('eval_accuracy',))
'''


def test_runs_of_other_settings_are_not_the_sweeps_results(tmp_path, capsys):
  """A config, sweep file or base override changed since the runs ran (sweep.json deleted, as
  prepare's message says to adopt a change): their old results are not the new sweep's."""
  workdir = str(tmp_path / 'w')

  def prepared(**fields):
    if os.path.exists(os.path.join(workdir, sweep.SWEEP_FILE)):
      os.remove(os.path.join(workdir, sweep.SWEEP_FILE))
    text = STALE.format(**{'steps': 10, 'lr': 1e-3, **fields})
    return sweep.unique_runs(sweep.prepare(_write(tmp_path, text), workdir))

  runs = prepared()
  for run in runs:
    _fake_run(run, [(5, 0.5)], 0.5)
  assert all(map(runner.finished, runs))
  assert [r['runs'] for r in sweep.summarize(workdir)] == ['2/2', '2/2']
  # How a run ran (its workers, logs, checkpoints, mesh) is no other result: a default of
  # those edited since leaves it finished.
  path = os.path.join(runs[0].workdir, 'config.json')
  with open(path, encoding='utf-8') as f:
    saved = json.load(f)
  saved['data']['workers'], saved['train']['checkpoint_every'] = 3, 7
  saved['train']['log_every'], saved['mesh'] = 1, [['data', 1], ['fsdp', -1], ['tensor', 1]]
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(saved, f)
  assert runner.changes(runs[0]) == [] and runner.finished(runs[0])
  runner.check_unchanged(runs)
  # More steps: unfinished (train.py goes on from its checkpoint), and allowed; the summary
  # says why each run is left out.
  runs = prepared(steps=20)
  assert runner.changes(runs[0]) == [('train.num_steps', 10, 20)]
  assert not any(map(runner.finished, runs))
  runner.check_unchanged(runs)
  assert [r['runs'] for r in sweep.summarize(workdir)] == ['0/2', '0/2']
  assert capsys.readouterr().err.splitlines()[-1].startswith(
      f'sweep.py: 4 run(s) not in the table: {runs[0].workdir} (it ran with '
      'train.num_steps=10 and the sweep asks train.num_steps=20); ')
  os.remove(os.path.join(runs[0].workdir, 'metrics.jsonl'))
  assert runner.unfinished_because(runs[0]) == 'it has no results line (logged up to step 0 of 10)'
  # Fewer steps: train.py refuses a run with a checkpoint (it would be finished early), so the
  # sweep does before anything runs; one without a checkpoint starts afresh.
  runs = prepared(steps=5)
  runner.check_unchanged(runs)
  os.makedirs(os.path.join(runs[0].workdir, 'checkpoints', '10'))
  with pytest.raises(ValueError, match=r'lm/seed=0 ran with train.num_steps=10 but the sweep now '
                     r'asks train.num_steps=5: undo the change'):
    runner.check_unchanged(runs)
  # Another setting: refused in one line before anything runs.
  runs = prepared(lr=3e-3)
  assert not any(map(runner.finished, runs))
  with pytest.raises(ValueError, match=r'lm/seed=0 ran with optimizer.learning_rate=0.001 but '
                     r'the sweep now asks optimizer.learning_rate=0.003: undo the change'):
    runner.check_unchanged(runs)


def test_a_stage_config_file_edited_since_its_runs_is_a_change(tmp_path):
  """Not only its train.num_steps: a learning rate edited in the config file would leave the
  old runs standing for the new sweep."""
  stage = tmp_path / 'my_gpt.py'
  original = open(os.path.join(ROOT, 'configs', 'gpt.py'), encoding='utf-8').read()
  stage.write_text(original)
  text = STALE.format(steps=10, lr=1e-3).replace("'optimizer.learning_rate': 0.001",
                                                 "'model.dropout_rate': 0.1")
  text = text.replace('configs/gpt.py:tiny', f'{stage}:tiny')
  workdir = str(tmp_path / 'w')
  runs = sweep.unique_runs(sweep.prepare(_write(tmp_path, text), workdir))
  for run in runs:
    _fake_run(run, [(5, 0.5)], 0.5)
  assert all(map(runner.finished, runs))
  runner.check_unchanged(runs)
  edited = original.replace('learning_rate=1e-3),', 'learning_rate=3e-3),', 1)
  assert edited != original
  stage.write_text(edited)
  runner._requested.cache_clear()  # a new sweep.py process reads the file again
  runner._config.cache_clear()
  assert not any(map(runner.finished, runs))
  with pytest.raises(ValueError, match=r'ran with optimizer.learning_rate=0.001 but the sweep '
                     r'now asks optimizer.learning_rate=0.003: undo the change'):
    runner.check_unchanged(runs)


CHAIN = '''
def get_sweep(arg=''):
  return dict(stages=(('lm', 'configs/gpt.py:tiny', {{'train.num_steps': {steps}}}),
                      ('tune', 'configs/gpt_finetune.py:offline_next', {{}})),
              variants=(('a', {{}}),), seeds=(0,), metrics=('eval_accuracy',))
'''


def test_a_fine_tuning_of_a_pretraining_since_extended_is_not_the_sweeps_result(tmp_path):
  """The fine-tuning's own settings did not change, but the pretraining it started from
  trains further now: its results are of the old pretraining."""
  workdir = str(tmp_path / 'w')

  def prepared(steps):
    if os.path.exists(os.path.join(workdir, sweep.SWEEP_FILE)):
      os.remove(os.path.join(workdir, sweep.SWEEP_FILE))
    return sweep.unique_runs(sweep.prepare(_write(tmp_path, CHAIN.format(steps=steps)), workdir))

  pretrain, tune = prepared(10)
  _fake_run(pretrain, [(5, 0.5)], 0.5)
  _fake_run(tune, [(5, 0.7)], 0.7)
  with open(os.path.join(tune.workdir, runner.STARTED_FROM), 'w') as f:
    json.dump({'init_from': pretrain.workdir, 'step': 10}, f)
  assert runner.finished(tune) and runner.started_from(tune) == 10
  runner.check_unchanged([pretrain, tune])
  # Its pretraining moved aside to train again: unfinished until it is trained and tuned anew.
  os.rename(pretrain.workdir, pretrain.workdir + '.old')
  assert not runner.finished(tune)
  os.rename(pretrain.workdir + '.old', pretrain.workdir)
  pretrain, tune = prepared(20)
  with pytest.raises(ValueError, match=r'tune/.* started from step 10 of .*lm.*, which the sweep '
                     'now trains to step 20: undo the change'):
    runner.check_unchanged([pretrain, tune])
  _fake_run(pretrain, [(5, 0.5)], 0.4)  # the pretraining, resumed to its 20 steps
  assert runner.finished(pretrain) and not runner.finished(tune)
  assert [r['runs'] for r in sweep.summarize(workdir)] == ['0/1']


def test_a_metrics_line_cut_by_a_kill_is_not_a_result_and_a_bad_one_is_named(tmp_path):
  # The run's resume drops a cut last line (metric_writer); until then the sweep reads past it.
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 2, "loss": 7.5}\n{"step": 4, "results": {"lo', encoding='utf-8')
  lines, results = runner.read_metrics(str(tmp_path))
  assert [m['step'] for m in lines] == [2] and results is None
  path.write_text('{"step": 2, "lo\n{"step": 4, "loss": 7.5}\n', encoding='utf-8')
  with pytest.raises(ValueError, match=r'metrics.jsonl: line 1 is not JSON .*move the run '):
    runner.read_metrics(str(tmp_path))


def test_a_sweep_is_found_from_any_directory_by_any_spelling_of_its_workdir(tmp_path,
                                                                           monkeypatch):
  monkeypatch.chdir(tmp_path)
  spec = _write(tmp_path, STALE.format(steps=10, lr=1e-3))
  for run in sweep.unique_runs(sweep.prepare(spec, 'w')):
    _fake_run(run, [(5, 0.5)], 0.5)
  sweep.prepare(spec, './w/')  # the same sweep
  (tmp_path / 'elsewhere').mkdir()
  monkeypatch.chdir(tmp_path / 'elsewhere')
  for workdir in ('../w', str(tmp_path / 'w')):
    assert [r['runs'] for r in sweep.summarize(workdir)] == ['2/2', '2/2']
  # A record of before, its run directories as typed in tmp_path, still reads there.
  monkeypatch.chdir(tmp_path)
  record = json.loads((tmp_path / 'w' / sweep.SWEEP_FILE).read_text())
  del record['paths']
  for _, _, runs in record['runs']:
    for run in runs:
      run['workdir'] = os.path.join('w', run['workdir'])
  (tmp_path / 'w' / sweep.SWEEP_FILE).write_text(json.dumps(record))
  assert [r['runs'] for r in sweep.summarize('w')] == ['2/2', '2/2']
  sweep.prepare(spec, 'w')
  assert json.loads((tmp_path / 'w' / sweep.SWEEP_FILE).read_text())['paths'] == 'relative'


MICRO = '''
def get_sweep(arg=''):
  base = {{'data.data_dir': {data_dir!r}, 'model.hidden_size': 32, 'model.num_layers': 1,
          'model.num_heads': 2, 'model.mlp_dim': 64, 'data.max_seq_length': 32,
          'train.batch_size': 8, 'train.num_steps': 120, 'train.log_every': 10,
          'train.eval_every': 60, 'train.eval_steps': 2, 'train.checkpoint_every': 60,
          'optimizer.warmup_steps': 10}}
  return dict(stages=(('lm', 'configs/gpt.py:tiny', base),),
              variants=(('lr 1e-3', {{}}), ('lr 3e-3', {{'optimizer.learning_rate': 3e-3}})),
              seeds=(0, 1), metrics=('eval_loss',))
'''


def _sweep(*args):
  return [sys.executable, os.path.join(ROOT, 'sweep.py')] + list(args)


def _results(workdir):
  lines, results = runner.read_metrics(workdir)
  return lines, results


@pytest.mark.slow
def test_a_sweep_runs_resumes_after_an_interruption_and_prints_its_commands(
    tmp_path, shared_data_dir, monkeypatch):
  monkeypatch.chdir(tmp_path)
  spec = _write(tmp_path, MICRO.format(data_dir=shared_data_dir))
  workdir = 'runs'
  # Interrupted (SIGTERM, as a scheduler's preemption) once the second run has taken steps.
  process = subprocess.Popen(_sweep(f'--sweep={spec}', f'--workdir={workdir}'),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  second_log = 'runs/logs/lm__seed=1.log'
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if os.path.exists(second_log) and 'step 10/120' in open(second_log).read():
      process.send_signal(signal.SIGTERM)
      break
    time.sleep(0.05)
  output = process.communicate(timeout=300)[0]
  assert process.returncode != 0, output
  assert 'the same sweep command goes on from there' in output, output
  first = sweep.unique_runs(sweep.expand(sweep.load_sweep(spec), workdir))[0]
  assert first.workdir == 'runs/lm/seed=0' and runner.finished(first)
  stopped_at = [json.loads(line)['step'] for line in open('runs/lm/seed=1/metrics.jsonl')]
  assert 10 <= max(stopped_at) < 120

  again = subprocess.run(_sweep(f'--sweep={spec}', f'--workdir={workdir}'), capture_output=True,
                         text=True, check=False)
  assert again.returncode == 0, again.stdout + again.stderr
  assert '[1/4] lm seed=0: finished before, skipped.' in again.stdout
  assert 'Resuming from step' in open(second_log).read()
  first_log = open('runs/logs/lm__seed=0.log').read()
  assert first_log.count('starting at step') == 1  # the finished run was not run again

  # The table's figures are the runs' own final eval losses.
  rows = sweep.summarize(workdir)
  assert [(r['variant'], r['runs']) for r in rows] == [('lr 1e-3', '2/2'), ('lr 3e-3', '2/2')]
  for row, prefix in zip(rows, ('runs/lm/', 'runs/lm/learning_rate=0.003,')):
    finals = [_results(f'{prefix}seed={s}')[1]['eval_loss'] for s in (0, 1)]
    mean = sum(finals) / 2
    std = math.sqrt(sum((f - mean) ** 2 for f in finals))
    assert math.isclose(row['eval_loss final'][0], mean, rel_tol=1e-9)
    assert math.isclose(row['eval_loss final'][1], std, rel_tol=1e-9)
    assert finals[0] != finals[1]  # the seeds differ
  assert f'| lr 1e-3 | 2/2 | {rows[0]["eval_loss final"][0]:.4f} ± ' in again.stdout
  summary = subprocess.run(_sweep('--summarize', f'--workdir={workdir}'), capture_output=True,
                           text=True, check=True)
  assert summary.stdout.splitlines()[:4] == again.stdout.splitlines()[-5:-1]

  # --print_commands: each line, run by hand, makes the same run.
  printed = subprocess.run(_sweep(f'--sweep={spec}', '--workdir=by_hand', '--print_commands'),
                           capture_output=True, text=True, check=True).stdout.splitlines()
  commands = [line for line in printed if not line.startswith('#')]
  assert len(commands) == 4 and all(c.startswith('python ') for c in commands)
  command = next(c for c in commands if 'learning_rate=0.003,seed=1' in c)
  argv = shlex.split(command)
  subprocess.run([sys.executable] + argv[1:], check=True, capture_output=True)
  by_hand, _ = _results('by_hand/lm/learning_rate=0.003,seed=1')
  swept, _ = _results('runs/lm/learning_rate=0.003,seed=1')
  strip = lambda lines: [{k: v for k, v in line.items() if k not in ('time', 'tokens_per_sec')}
                         for line in lines]
  assert strip(by_hand) == strip(swept)
