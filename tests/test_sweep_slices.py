"""sweep.py --parallel and --slurm without training: the slices, the scheduler (with a stand-in
for train.py), the mesh checks and the SLURM scripts (with a stand-in for sbatch)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import pytest

import forked  # tests/
import sweep
from trainer import cli
from trainer import runner
from trainer import slices
from trainer import slurm

TWO_STAGES = '''
def get_sweep(arg=''):
  return dict(
      stages=(('pretrain', 'configs/gpt.py:tiny', {{'train.num_steps': 10}}),
              ('finetune', 'configs/gpt_finetune.py', {{'train.num_steps': 4}})),
      variants=(('slow', {{'pretrain.train.log_every': {slow}}}),
                ('quick', {{'pretrain.train.log_every': {quick}}}),
                ('broken', {{'pretrain.train.log_every': 13}})),
      seeds=(0,), metrics=('eval_loss',))
'''

# Stands in for train.py: sleeps log_every / 10 seconds (13: fails; 75: stops unfinished, as
# train.py on a signal the sweep did not send), notes when it ran and what its slice gave it,
# then writes what runner.finished() reads. SIGTERM: notes it and exits 75, as train.py does.
FAKE_TRAIN = r'''
import ast, json, os, signal, sys, time
args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if a.startswith('--') and '=' in a)
workdir = args['workdir']
os.makedirs(workdir, exist_ok=True)
def note(**kw):
  with open(os.path.join(workdir, 'fake.jsonl'), 'a') as f:
    f.write(json.dumps(kw) + '\n')
def stop(signum, frame):
  note(signal='SIGTERM', time=time.time())
  sys.exit(1 if every == 140 else 75)  # 140: fails while it stops
every = int(args.get('config.train.log_every', '1'))
if every != 150:  # 150: killed by the SIGTERM, as train.py before it sets its handler
  signal.signal(signal.SIGTERM, stop)
note(start=time.time(), cuda=os.environ.get('CUDA_VISIBLE_DEVICES'),
     cores=sorted(os.sched_getaffinity(0)), init_from=args.get('config.init_from'))
if every == 13:
  sys.exit('train.py: error: broken on purpose')
if every == 75:
  sys.exit(75)
time.sleep(every / 10)
steps = int(args.get('config.train.num_steps', '1'))
config = {}  # every --config.<field> it was given, as train.py's config.json holds them
for key, text in args.items():
  if key.startswith('config.'):
    *parents, name = key.split('.')[1:]
    node = config
    for part in parents:
      node = node.setdefault(part, {})
    try:
      node[name] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      node[name] = text
with open(os.path.join(workdir, 'config.json'), 'w') as f:
  json.dump(config, f)
with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
  f.write(json.dumps({'step': steps, 'results': {'eval_loss': every / 10}}) + '\n')
note(end=time.time())
'''


def _notes(workdir):
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(workdir, 'fake.jsonl')) as f:
    merged = {}
    for line in f:
      merged.update(json.loads(line))
  return merged


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
  """A sweep's runs with train.py replaced by FAKE_TRAIN (same arguments)."""
  fake = tmp_path / 'fake_train.py'
  fake.write_text(FAKE_TRAIN)
  original = sweep.Run.argv
  monkeypatch.setattr(sweep.Run, 'argv', lambda self: ['python', str(fake)] + original(self)[2:])

  def runs(slow=20, quick=2):
    path = tmp_path / 'sweep_file.py'
    path.write_text(TWO_STAGES.format(slow=slow, quick=quick))
    return sweep.unique_runs(sweep.expand(sweep.load_sweep(str(path)), str(tmp_path / 'w')))
  return runs


def test_gpus_are_cut_into_equal_slices_by_cuda_visible_devices():
  cut = slices.cut(4, 'gpu', devices=tuple(range(8)))
  assert [dict(s.env)['CUDA_VISIBLE_DEVICES'] for s in cut] == ['0,1', '2,3', '4,5', '6,7']
  assert [s.num_devices for s in cut] == [2] * 4
  assert cut[1].describe() == 'slice 2/4 (GPUs 2,3)'
  with pytest.raises(ValueError) as error:
    slices.cut(3, 'gpu', devices=tuple(range(8)))
  assert str(error.value) == ('--parallel=3 does not divide the 8 GPUs of this machine into '
                              'equal slices: pass one of [1, 2, 4, 8].')


def test_visible_gpus_are_the_ones_handed_out(monkeypatch):
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '3,5')
  assert [dict(s.env)['CUDA_VISIBLE_DEVICES'] for s in slices.cut(2, 'gpu')] == ['3', '5']


def test_tpu_chips_get_libtpus_process_variables_and_their_own_port():
  cut = slices.cut(2, 'tpu', devices=tuple(range(8)))
  first, second = (dict(s.env) for s in cut)
  assert first['TPU_VISIBLE_CHIPS'] == '0,1,2,3' and second['TPU_VISIBLE_CHIPS'] == '4,5,6,7'
  assert first['TPU_CHIPS_PER_PROCESS_BOUNDS'] == '2,2,1' == second['TPU_CHIPS_PER_HOST_BOUNDS']
  assert first['TPU_PROCESS_BOUNDS'] == '1,1,1' == first['TPU_HOST_BOUNDS']
  assert (first['TPU_MESH_CONTROLLER_PORT'], second['TPU_MESH_CONTROLLER_PORT']) == ('8476',
                                                                                     '8477')
  assert dict(slices.cut(4, 'tpu', devices=tuple(range(4)))[3].env)[
      'TPU_CHIPS_PER_PROCESS_BOUNDS'] == '1,1,1'
  assert [s.num_devices for s in cut] == [4, 4]


def test_tpu_v2_and_v3_chips_are_two_devices_each(monkeypatch):
  monkeypatch.setenv('TPU_ACCELERATOR_TYPE', 'v3-8')
  assert [s.num_devices for s in slices.cut(2, 'tpu', devices=(0, 1, 2, 3))] == [4, 4]
  monkeypatch.setenv('TPU_ACCELERATOR_TYPE', 'v5litepod-8')
  assert [s.num_devices for s in slices.cut(2, 'tpu', devices=(0, 1, 2, 3))] == [2, 2]


def test_cpu_slices_are_cores_with_the_device_count_kept(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_foo=1 --xla_force_host_platform_device_count=8')
  cut = slices.cut(2, 'cpu', devices=(0, 1, 2, 3))
  assert [s.devices for s in cut] == [(0, 1), (2, 3)]
  assert [s.num_devices for s in cut] == [8, 8]
  assert dict(cut[0].env)['XLA_FLAGS'] == ('--xla_cpu_foo=1 '
                                           '--xla_force_host_platform_device_count=8')
  assert cut[0].describe() == 'slice 1/2 (cores 0,1, 8 CPU devices)'
  monkeypatch.delenv('XLA_FLAGS')
  assert slices.cut(1, 'cpu', devices=(0,))[0].num_devices == 1


@pytest.mark.parametrize('mesh,devices,refused', [
    ((('data', -1), ('fsdp', 1), ('tensor', 1)), 1, False),
    ((('data', -1), ('fsdp', 2), ('tensor', 1)), 4, False),
    ((('data', -1), ('fsdp', 2), ('tensor', 1)), 1, True),
    ((('data', 2), ('fsdp', 2), ('tensor', 1)), 2, True),
    ((('data', 2), ('fsdp', 2), ('tensor', 1)), 4, False)])
def test_a_mesh_fits_a_slice_when_its_fixed_axes_divide_it(mesh, devices, refused):
  assert (slices.mesh_refusal(mesh, devices) is not None) == refused


def test_a_run_whose_mesh_needs_more_than_a_slice_is_refused_in_one_line(fake_runs):
  runs = fake_runs()
  tensor = sweep.Run(runs[0].stage, runs[0].config,
                     runs[0].overrides + (('mesh', (('data', -1), ('tensor', 2))),),
                     0, runs[0].workdir, None)
  runner.check_slices(runs, slices.cut(2, 'gpu', devices=(0, 1)))
  with pytest.raises(ValueError) as error:
    runner.check_slices([tensor], slices.cut(2, 'gpu', devices=(0, 1)))
  assert str(error.value) == (
      "--parallel=2: pretrain log_every=20,seed=0: config.mesh (('data', -1), ('tensor', 2)) "
      'needs a multiple of 2 devices, and a slice has 1: pass a smaller --parallel, or change '
      'the mesh.')


def test_a_later_stage_starts_when_its_own_run_ends_and_a_failure_stops_only_its_own(
    fake_runs, tmp_path, capsys):
  # 5 s and 0.2 s: the quick one's fine-tuning starts after more process starts and the
  # runner's polls (every 0.2 s); in a fast-tier run on a loaded core it started 0.1 s after
  # a 2 s pretraining had ended, and the test failed.
  runs = fake_runs(slow=50, quick=2)
  failed = runner.run_all(runs, str(tmp_path / 'w'), slices.cut(2, 'gpu', devices=(6, 7)))
  out = capsys.readouterr().out
  by_name = {f'{r.stage}/{os.path.basename(r.workdir)}': r for r in runs}
  notes = {name: _notes(run.workdir) for name, run in by_name.items()
           if os.path.exists(os.path.join(run.workdir, 'fake.jsonl'))}
  slow, quick = notes['pretrain/log_every=50,seed=0'], notes['pretrain/log_every=2,seed=0']
  quick_finetune = notes['finetune/log_every=2,seed=0']
  # The quick pretraining's fine-tuning ran while the slow pretraining was still running.
  assert quick['end'] <= quick_finetune['start'] < slow['end']
  assert quick_finetune['init_from'] == by_name['pretrain/log_every=2,seed=0'].workdir
  assert notes['finetune/log_every=50,seed=0']['start'] >= slow['end']
  # Each ran on one GPU of its own, and said so.
  assert {slow['cuda'], quick['cuda']} == {'6', '7'}
  assert re.search(r'\] pretrain log_every=50,seed=0: running on slice \d/2 \(GPUs [67]\)', out)
  log = open(runner.log_path(runs[0], str(tmp_path / 'w'))).read()
  assert log.startswith('sweep.py: pretrain log_every=50,seed=0 on slice 1/2 (GPUs 6): '
                        'CUDA_VISIBLE_DEVICES=6\n')
  # The broken pretraining failed; only its fine-tuning was skipped.
  assert [f'{r.stage}/{os.path.basename(r.workdir)}' for r in failed] == [
      'pretrain/log_every=13,seed=0', 'finetune/log_every=13,seed=0']
  assert 'finetune log_every=13,seed=0: skipped, its' in out
  assert 'FAILED (exit 1) (on slice' in out and 'broken on purpose' in out
  assert all(runner.finished(r) for r in runs if r not in failed)


def test_a_run_stopped_unfinished_is_no_success_and_its_fine_tuning_waits(
    fake_runs, tmp_path, capsys):
  runs = fake_runs(slow=75, quick=1)  # the 'slow' pretraining exits 75 at once
  failed = runner.run_all(runs, str(tmp_path / 'w'))
  out = capsys.readouterr().out
  assert sorted(f'{r.stage}/{os.path.basename(r.workdir)}' for r in failed) == [
      'finetune/log_every=13,seed=0', 'finetune/log_every=75,seed=0',
      'pretrain/log_every=13,seed=0', 'pretrain/log_every=75,seed=0']
  assert ('pretrain log_every=75,seed=0: STOPPED before its last step (exit 75): the same sweep '
          'command resumes it; the runs that start from it wait for that.') in out
  assert 'finetune log_every=75,seed=0: skipped, its' in out
  assert not os.path.exists(os.path.join(runs[3].workdir, 'fake.jsonl'))  # never started


def test_cpu_slices_pin_their_cores(fake_runs, tmp_path):
  core = sorted(os.sched_getaffinity(0))[-1]
  runs = fake_runs(slow=1, quick=1)[:1]
  assert runner.run_all(runs, str(tmp_path / 'w'), slices.cut(1, 'cpu', devices=(core,))) == []
  assert _notes(runs[0].workdir)['cores'] == [core]


# A hangup (an ssh session dropped) too: the runs are in sessions of their own and would
# train on alone, and the same sweep command would start a second train.py in their workdirs.
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_reaches_every_running_run_and_the_sweep_stops(fake_runs, tmp_path, signum):
  runs = fake_runs(slow=300, quick=290)  # 30 s: stopped long before
  handler = signal.getsignal(signal.SIGTERM)
  timer = threading.Timer(1.5, os.kill, (os.getpid(), signum))
  timer.start()
  with pytest.raises(runner.Interrupted) as stopped:
    runner.run_all(runs, str(tmp_path / 'w'), slices.cut(2, 'gpu', devices=(0, 1)))
  timer.cancel()
  running = [r for r in runs if os.path.exists(os.path.join(r.workdir, 'fake.jsonl'))]
  assert len(running) == 2 and all(_notes(r.workdir)['signal'] == 'SIGTERM' for r in running)
  assert str(stopped.value).startswith('stopped during ')
  assert all(r.workdir in str(stopped.value) for r in running)
  assert str(stopped.value).endswith('each saved a checkpoint, and the same sweep command goes '
                                     'on from there.')
  assert signal.getsignal(signal.SIGTERM) == handler  # the sweep's own handler is gone


# 140: exits 1 on the SIGTERM instead of 75 (a failure, said as such); 150: killed by it before
# train.py set its handler (nothing saved, not said to have saved).
@pytest.mark.parametrize('quick', [140, 150])
def test_a_run_that_fails_or_is_killed_while_the_sweep_stops_is_said_so(fake_runs, tmp_path,
                                                                         capsys, quick):
  runs = fake_runs(slow=300, quick=quick)
  timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
  timer.start()
  with pytest.raises(runner.Interrupted) as stopped:
    runner.run_all(runs, str(tmp_path / 'w'), slices.cut(2, 'gpu', devices=(0, 1)))
  timer.cancel()
  slow, killed = (next(r for r in runs if r.workdir.endswith(f'log_every={n},seed=0'))
                  for n in (300, quick))
  early = (f'{killed.workdir} stopped before saving (as it started; it resumes from its previous '
           'checkpoint, if any), and ' if quick == 150 else '')
  assert str(stopped.value) == (f'stopped during {slow.workdir}; it saved a checkpoint, and '
                                f'{early}the same sweep command goes on from there.')
  failed = f'pretrain log_every={quick},seed=0: FAILED (exit 1)' in capsys.readouterr().out
  assert failed == (quick == 140)


# ---------------------------------------------------------------- SLURM

FAKE_SBATCH = r'''#!/bin/bash
# Stands in for sbatch: notes its arguments, answers the next job id as --parsable does.
n=$(( $(wc -l < "$SBATCH_LOG" 2>/dev/null || echo 0) + 100 ))
echo "$n $*" >> "$SBATCH_LOG"
echo "$n;cluster"
'''


def test_slurm_resources_follow_the_mesh_and_fill_whole_nodes(fake_runs):
  runs = fake_runs()
  assert runner.slurm_resources(runs, None, 8).lines() == [
      '--nodes=1', '--ntasks-per-node=1', '--gpus-per-node=1']
  assert slurm.Resources(16, 8).lines() == ['--nodes=2', '--ntasks-per-node=1',
                                            '--gpus-per-node=8']
  assert slurm.Resources(0, 8, ('--partition=cpu',)).lines() == [
      '--nodes=1', '--ntasks-per-node=1', '--partition=cpu']
  fixed = [sweep.Run(r.stage, r.config, r.overrides + (('mesh', (('data', 2), ('fsdp', 2))),),
                     0, r.workdir, r.init_from) for r in runs]
  assert runner.slurm_resources(fixed, None, 8).gpus == 4
  for gpus, per_node, options, message in (
      (12, 8, (), '--gpus_per_run=12 does not fill whole nodes of 8 GPUs (--gpus_per_node): '
                  'pass a multiple of 8, or at most 8.'),
      (2, 8, ('partition=gpu',), '--slurm_option=partition=gpu: pass sbatch options as sbatch '
                                 'spells them, e.g. --slurm_option=--partition=gpu.')):
    with pytest.raises(ValueError) as error:
      runner.slurm_resources(runs, gpus, per_node, options)
    assert str(error.value) == message
  with pytest.raises(ValueError, match=r'^--gpus_per_run=2: pretrain .*needs 4 devices, and a '
                                       r'job has 2: pass --gpus_per_run to fit it\.$'):
    runner.slurm_resources(fixed, 2, 8)


def test_slurm_scripts_run_the_printed_commands_and_chain_the_stages(
    fake_runs, tmp_path, monkeypatch, capsys):
  runs = fake_runs()
  workdir = str(tmp_path / 'w')
  monkeypatch.chdir(tmp_path)
  summary = ['python', 'sweep.py', '--summarize', f'--workdir={workdir}']
  runner.to_slurm(runs, workdir, slurm.Resources(16, 8, ('--time=1:00:00',)), False, summary)
  out = capsys.readouterr().out
  assert 'Submit them with: bash ' + os.path.join(workdir, 'slurm', 'submit.sh') in out
  scripts = sorted(p for p in os.listdir(os.path.join(workdir, 'slurm')) if p[0].isdigit())
  assert len(scripts) == len(runs) == 6
  for path, run in zip(scripts, runs):
    text = open(os.path.join(workdir, 'slurm', path)).read()
    assert f'#SBATCH --output={os.path.abspath(runner.log_path(run, workdir))}\n' in text
    for line in ('--nodes=2', '--gpus-per-node=8', '--ntasks-per-node=1', '--time=1:00:00',
                 '--signal=TERM@120', '--open-mode=append', '--kill-on-invalid-dep=yes'):
      assert f'#SBATCH {line}\n' in text
    assert f'\ncd {shlex.quote(str(tmp_path))}\n' in text
    assert f'\nsrun --kill-on-bad-exit=0 --wait=120 {shlex.join(run.argv())}\n' in text
    assert text == slurm.script(f'{run.stage}__{os.path.basename(run.workdir)}', run.argv(),
                                os.path.abspath(runner.log_path(run, workdir)), str(tmp_path),
                                slurm.Resources(16, 8, ('--time=1:00:00',)))
  submit = os.path.join(workdir, 'slurm', 'submit.sh')
  subprocess.run(['bash', '-n', submit], check=True)  # it parses

  # submit.sh with a stand-in sbatch: every fine-tuning after its own pretraining's job.
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'sbatch').write_text(FAKE_SBATCH)
  (bin_dir / 'sbatch').chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('SBATCH_LOG', str(tmp_path / 'sbatch.log'))
  subprocess.run(['bash', submit], check=True, capture_output=True)
  calls = open(tmp_path / 'sbatch.log').read().splitlines()
  assert len(calls) == 7
  ids = {call.split()[-1]: call.split()[0] for call in calls}
  for path, run in zip(scripts, runs):
    call = next(c for c in calls if c.endswith(path))
    if run.init_from:
      upstream = next(p for p, r in zip(scripts, runs) if r.workdir == run.init_from)
      assert f'--dependency=afterok:{ids[os.path.join(workdir, "slurm", upstream)]} ' in call
    else:
      assert '--dependency' not in call
  assert calls[-1].split()[2] == '--dependency=afterany:' + ':'.join(
      c.split()[0] for c in calls[:-1])
  assert f'\nsrun --kill-on-bad-exit=0 --wait=120 {shlex.join(summary)}\n' in open(
      os.path.join(workdir, 'slurm', 'summarize.sbatch')).read()

  # --slurm=submit from Python: a finished run is not submitted, its fine-tuning has no wait.
  os.remove(tmp_path / 'sbatch.log')
  done = runs[0]
  os.makedirs(done.workdir, exist_ok=True)
  config = {'seed': 0, 'train': {'num_steps': 10, 'log_every': 20}}  # as the sweep asks
  assert {f'train.{k}' for k in config['train']} | {'seed'} <= set(runner.requested(done))
  assert runner.changes(done, config) == []  # the fields it lacks are not asked by the sweep
  with open(os.path.join(done.workdir, 'config.json'), 'w') as f:
    json.dump(config, f)
  with open(os.path.join(done.workdir, 'metrics.jsonl'), 'w') as f:
    f.write('{"step": 10, "results": {"eval_loss": 1.0}}\n')
  runner.to_slurm(runs, workdir, slurm.Resources(1, 8), True, summary)
  out = capsys.readouterr().out
  calls = open(tmp_path / 'sbatch.log').read().splitlines()
  assert len(calls) == 6 and not any(c.endswith(scripts[0]) for c in calls)
  assert '[1/6] pretrain log_every=20,seed=0: finished before, not submitted.' in out
  downstream = next(c for c in calls if c.endswith(scripts[3]))
  assert runs[3].init_from == done.workdir and '--dependency' not in downstream
  assert re.search(r'\[5/6\] finetune log_every=2,seed=0: job \d+, after job \d+', out)


# Stand in for srun (exits with $STATUS) and scontrol (notes its arguments).
FAKE_SRUN = '#!/bin/bash\nexit "$STATUS"\n'
FAKE_SCONTROL = '#!/bin/bash\necho "$*" >> "$SCONTROL_LOG"\n'


@pytest.mark.parametrize('status,restarts,requeued,exit_status', [
    (75, 0, True, 0),  # train.py stopped unfinished (a time limit, a preemption)
    (143, 1, True, 0),  # SIGTERM before train.py had set its handler
    (75, 2, False, 75),  # --max_requeues=2 reached
    (1, 0, False, 1),  # an error
    (0, 0, False, 0)])  # finished
def test_a_job_requeues_itself_only_when_its_run_stopped_unfinished(
    tmp_path, status, restarts, requeued, exit_status):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  for name, text in (('srun', FAKE_SRUN), ('scontrol', FAKE_SCONTROL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  path = tmp_path / 'job.sbatch'
  path.write_text(slurm.script('lm', ['python', 'train.py', '--workdir=runs/lm'], 'lm.log',
                               str(tmp_path), slurm.Resources(0, 8, max_requeues=2)))
  env = dict(os.environ, PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', STATUS=str(status),
             SLURM_JOB_ID='7', SLURM_RESTART_COUNT=str(restarts),
             SCONTROL_LOG=str(tmp_path / 'scontrol.log'))
  done = subprocess.run(['bash', str(path)], env=env, capture_output=True, text=True, check=False)
  assert done.returncode == exit_status, done.stdout + done.stderr
  log = tmp_path / 'scontrol.log'
  assert (log.read_text() if log.exists() else '') == ('requeue 7\n' if requeued else '')
  if requeued:
    assert done.stdout == (f'sbatch script: stopped unfinished (exit {status}); requeueing job 7 '
                           f'(requeue {restarts + 1} of at most 2) to resume from its '
                           'checkpoint.\n')
  elif status == 75:
    assert done.stdout == ('sbatch script: stopped unfinished (exit 75) after 2 requeues '
                           '(--max_requeues): not requeued again; submit this script again to '
                           'go on.\n')


def test_one_runs_script_is_printed_by_the_same_code_and_shown_in_the_docs():
  """python -m trainer.slurm prints slurm.script's text for one train.py command; docs/sweeps.md
  shows it for one node and for two (with this directory as /home/you/lm_lineage)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  docs = open(os.path.join(root, 'docs', 'sweeps.md'), encoding='utf-8').read()
  command = ['python', 'train.py', '--config=configs/bert_base.py', '--workdir=runs/bert']
  for gpus, options in ((8, ['--time=24:00:00']), (16, ['--time=24:00:00', '--partition=gpu'])):
    printed = subprocess.run(
        [sys.executable, '-m', 'trainer.slurm', f'--gpus_per_run={gpus}'] +
        [f'--slurm_option={o}' for o in options] + ['--'] + command,
        cwd=root, capture_output=True, text=True, check=True).stdout
    assert printed == slurm.script('bert', command, os.path.join(root, 'bert.slurm.log'), root,
                                   slurm.Resources(gpus, 8, tuple(options)))
    shown = printed.replace(root, '/home/you/lm_lineage')
    assert '\n'.join('    ' + line for line in shown.splitlines()) in docs, shown


def test_sbatch_refusing_a_job_is_one_line(tmp_path, monkeypatch):
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'sbatch').write_text('#!/bin/bash\necho "sbatch: error: Batch job submission '
                                  'failed: Invalid partition name specified" >&2\nexit 1\n')
  (bin_dir / 'sbatch').chmod(0o755)
  monkeypatch.setenv('PATH', str(bin_dir))
  with pytest.raises(ValueError) as error:
    slurm.sbatch('job.sbatch', [])
  assert str(error.value) == ('sbatch refused job.sbatch: sbatch: error: Batch job submission '
                              'failed: Invalid partition name specified')
  monkeypatch.setenv('PATH', str(tmp_path / 'nothing'))
  with pytest.raises(ValueError, match='sbatch is not on this machine'):
    slurm.sbatch('job.sbatch', [])


def test_jobs_are_not_sent_the_cpu_platform_chosen_for_a_login_node(tmp_path, monkeypatch):
  # A login node without GPUs runs sweep.py on the CPU (cli.skip_absent_accelerators); sbatch
  # passes the environment on, so its jobs ran on their nodes' CPUs too.
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'sbatch').write_text('#!/bin/bash\nenv > "$SBATCH_ENV"\necho "7;cluster"\n')
  (bin_dir / 'sbatch').chmod(0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('SBATCH_ENV', str(tmp_path / 'env'))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv(cli._CHOSE_CPU, '1')  # as skip_absent_accelerators leaves it
  assert slurm.sbatch('job.sbatch', []) == '7'
  assert 'JAX_PLATFORMS=' not in (tmp_path / 'env').read_text()
  monkeypatch.delenv(cli._CHOSE_CPU)  # the user's own choice goes with the jobs
  slurm.sbatch('job.sbatch', [])
  assert 'JAX_PLATFORMS=cpu' in (tmp_path / 'env').read_text()


def test_parallel_that_does_not_divide_is_refused_before_anything_runs(tmp_path):
  path = tmp_path / 'sweep_file.py'
  path.write_text(TWO_STAGES.format(slow=1, quick=1))
  cores = len(os.sched_getaffinity(0))
  done = forked.run(  # sweep.py's process, forked from tests/forked.py's imports
      [sys.executable, sweep.__file__, f'--sweep={path}', f'--workdir={tmp_path / "w"}',
       f'--parallel={cores + 1}'], cwd=os.path.dirname(sweep.__file__),
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
      f'sweep.py: error: --parallel={cores + 1} does not divide the {cores} CPU cores of this '
      'machine into equal slices: pass one of '
      f'{[n for n in range(1, cores + 1) if cores % n == 0]}.']
  assert not os.path.exists(tmp_path / 'w' / 'logs')
