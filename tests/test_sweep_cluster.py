"""sweep.py --parallel and --slurm with train.py itself: the same results as one run at a time,
an interruption that every running run survives, and a real single-node SLURM (munge,
slurmctld and slurmd started here, as a user's cluster runs them) whose two-minute time limit
stops each pretraining several times: each job requeues itself until its run has finished."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import sweep
from trainer import runner
from trainer import slices

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two pretrainings (learning rates) of a micro GPT, each fine-tuned on the offline pair task;
# with arg 'broken', a third whose pretraining stops at once for a real error (32 hidden units
# in 3 heads). Each pretraining is 260 steps, and the sweeps' runs sleep a while in each step
# (tests/fixtures/sweep_runs), so that their steps take wall time, not CPU time. Under SLURM a
# step takes 0.75 s more: about 200 s of steps. The SLURM test's jobs may run two minutes, and
# slurmctld (which looks every 30 s) sends --signal=TERM@25 up to 30 s early: the SIGTERM comes
# 65-95 s into an allocation, 86 s once a requeued job starts 4 s after its last stop, each less
# a start of 5-30 s (two jobs starting on one core). So every pretraining needs three or more
# allocations, and even a slow start leaves most of each to the steps. Under a one-minute limit
# (26 s allocations) a loaded CI machine's starts took nearly all of each: its pretrainings
# needed 21 allocations of about 12 steps, and the fine-tunings had not finished after 15
# minutes. Side by side, 0.1 s: the SIGTERM comes at step 100, while both are running (a run
# that got going t seconds before the other is about 10 t steps ahead). The same sweep run one
# at a time, at full speed, gives the results that both tests must reach.
STEPS, SLURM_STEP_SECONDS, SIDE_BY_SIDE_STEP_SECONDS = 260, 0.75, 0.1
MICRO = '''
def get_sweep(arg=''):
  small = {{'data.data_dir': {data_dir!r}, 'model.hidden_size': 32, 'model.num_layers': 1,
           'model.num_heads': 2, 'model.mlp_dim': 64, 'data.max_seq_length': 32,
           'train.batch_size': 8, 'train.log_every': 100}}
  variants = (('lr 1e-3', {{}}), ('lr 3e-3', {{'lm.optimizer.learning_rate': 3e-3}}))
  if arg == 'broken':
    variants += (('broken', {{'lm.model.num_heads': 3}}),)
  return dict(
      stages=(('lm', 'configs/gpt.py:tiny',
               dict(small, **{{'train.num_steps': {steps}, 'train.eval_every': {half},
                              'train.eval_steps': 2, 'train.checkpoint_every': {half},
                              'optimizer.warmup_steps': 10}})),
              ('ft', 'configs/gpt_finetune.py', dict(small, **{{'train.num_steps': 20,
                                                               'train.log_every': 10}}))),
      variants=variants, seeds=(0,), metrics=('eval_accuracy', 'eval_loss'))
'''


def _sweep(*args):
  return [sys.executable, os.path.join(ROOT, 'sweep.py')] + list(args)


def _finals(workdir):
  """Each run's final eval line and results, without the wall-clock fields (None: no eval)."""
  finals = {}
  for _, _, runs in sweep.load_record(workdir)[1]:
    for run in runs:
      lines, results = runner.read_metrics(run.workdir)
      evals = [line for line in lines if any(k.startswith('eval_') for k in line)]
      name = os.path.relpath(run.workdir, workdir)
      finals[name] = ({k: v for k, v in evals[-1].items() if k != 'time'}, results) if evals \
          else None
  return finals


def _with_sleeping_steps(env, seconds):
  """`env` for sweeps whose train.py steps each sleep `seconds` more (tests/fixtures/sweep_runs)."""
  return dict(env, LM_LINEAGE_TEST_STEP_SECONDS=str(seconds))


@pytest.fixture(scope='module')
def sweep_env(default_compile_env):
  """os.environ for the sweeps: tests/end_to_end.py's compile; one CPU device a run, on one core
  (tests/fixtures/sweep_runs). What these tests check (the schedule, the stops, requeues
  and resumes, the results against one run at a time) does not depend on the device count, and
  the suite's 8 simulated devices made each micro step 5 times as long on one core (68 ms against
  13). On one device a run's sums depend on its threads (a fine-tuning eval differed in the 8th
  digit between two cores and one), hence one core for every run, wherever the test runs."""
  runs = os.path.join(ROOT, 'tests', 'fixtures', 'sweep_runs')
  return dict(default_compile_env,
              XLA_FLAGS=slices.with_cpu_devices(default_compile_env['XLA_FLAGS'], 1),
              LM_LINEAGE_TEST_ONE_CORE='1',
              PYTHONPATH=os.pathsep.join(filter(None, [runs,
                                                       default_compile_env.get('PYTHONPATH')])))


@pytest.fixture(scope='module')
def sweep_file(tmp_path_factory, shared_data_dir):
  path = tmp_path_factory.mktemp('sweep') / 'micro.py'
  path.write_text(MICRO.format(data_dir=shared_data_dir, steps=STEPS, half=STEPS // 2))
  return str(path)


@pytest.fixture(scope='module')
def one_at_a_time(sweep_file, tmp_path_factory, sweep_env):
  """Each run's final eval line and results after the sweep ran one run at a time, at full
  speed."""
  workdir = str(tmp_path_factory.mktemp('sequential') / 'w')
  subprocess.run(_sweep(f'--sweep={sweep_file}', f'--workdir={workdir}'), check=True,
                 capture_output=True, text=True, env=sweep_env)
  finals = _finals(workdir)
  assert len(finals) == 4 and all(results for _, results in finals.values())
  return finals


@pytest.mark.usefixtures('all_cores')  # --parallel=2 cuts the machine's cores into two slices
def test_side_by_side_gives_the_same_results_and_survives_a_sigterm(
    sweep_file, one_at_a_time, tmp_path, sweep_env):
  workdir = str(tmp_path / 'w')
  env = _with_sleeping_steps(sweep_env, SIDE_BY_SIDE_STEP_SECONDS)
  process = subprocess.Popen(_sweep(f'--sweep={sweep_file}', f'--workdir={workdir}',
                                    '--parallel=2'),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  logs = [os.path.join(workdir, 'logs', name) for name in
          ('lm__seed=0.log', 'lm__learning_rate=0.003,seed=0.log')]
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if all(os.path.exists(log) and f'step 100/{STEPS}' in open(log).read() for log in logs):
      process.send_signal(signal.SIGTERM)  # both pretrainings are running
      break
    time.sleep(0.05)
  output = process.communicate(timeout=300)[0]
  assert process.returncode != 0, output
  assert 'each saved a checkpoint, and the same sweep command goes on from there.' in output
  for log in logs:
    stopped_at = [json.loads(line)['step'] for line in
                  open(log.replace('logs/lm__', 'lm/').replace('.log', '/metrics.jsonl'))]
    assert 100 <= max(stopped_at) < STEPS, stopped_at

  again = subprocess.run(_sweep(f'--sweep={sweep_file}', f'--workdir={workdir}', '--parallel=2'),
                         capture_output=True, text=True, check=False, env=env)
  assert again.returncode == 0, again.stdout + again.stderr
  assert again.stdout.startswith('4 runs, up to 2 at once: slice 1/2 (cores ')
  assert 'running on slice 1/2' in again.stdout and 'running on slice 2/2' in again.stdout
  for log in logs:
    text = open(log).read()
    assert 'Resuming from step' in text and text.count('sweep.py: lm ') == 2  # once a start
  assert _finals(workdir) == one_at_a_time


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture
def slurm_cluster(tmp_path, sweep_env):
  """A one-node SLURM cluster of this machine; yields its environment (SLURM_CONF)."""
  if not shutil.which('slurmctld'):
    if os.geteuid() != 0 or not shutil.which('apt-get'):
      pytest.skip('SLURM is not installed and this user cannot install it (Debian: apt-get '
                  'install slurm-wlm munge, as root)')
    installed = subprocess.run(['apt-get', 'install', '-y', '--no-install-recommends',
                                'slurm-wlm', 'munge'], capture_output=True, text=True,
                               check=False, env=dict(os.environ, DEBIAN_FRONTEND='noninteractive'))
    if installed.returncode != 0:
      pytest.skip(f'apt-get could not install slurm-wlm: {installed.stderr.strip()[-300:]}')
  if os.geteuid() != 0:
    pytest.skip('slurmd runs jobs as their users only as root; this test is not root')
  base = tmp_path / 'slurm'
  for sub in ('state', 'spool', 'log'):
    (base / sub).mkdir(parents=True)
  key = base / 'munge.key'
  key.write_bytes(os.urandom(1024))
  key.chmod(0o400)
  socket_path = base / 'munge.sock'
  subprocess.run(['munged', '--force', f'--socket={socket_path}', f'--key-file={key}',
                  f'--log-file={base}/log/munged.log', f'--pid-file={base}/munged.pid',
                  f'--seed-file={base}/munged.seed'], check=True)
  host = socket.gethostname().split('.')[0]
  memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 2**20
  conf = base / 'slurm.conf'
  conf.write_text('\n'.join([
      # A requeued job may start again cred_expire + 1 s later (120 s by default), and the
      # scheduler looks every 2 s; ended jobs stay in `scontrol show job` for an hour.
      'ClusterName=sweeptest', f'SlurmctldHost={host}', 'AuthType=auth/munge',
      f'AuthInfo=socket={socket_path},cred_expire=5', 'CredType=cred/munge', 'SlurmUser=root',
      'SlurmdUser=root', f'SlurmctldPort={_free_port()}', f'SlurmdPort={_free_port()}',
      f'StateSaveLocation={base}/state', f'SlurmdSpoolDir={base}/spool',
      f'SlurmctldPidFile={base}/slurmctld.pid', f'SlurmdPidFile={base}/slurmd.pid',
      f'SlurmctldLogFile={base}/log/slurmctld.log', f'SlurmdLogFile={base}/log/slurmd.log',
      'ProctrackType=proctrack/linuxproc', 'TaskPlugin=task/none',
      'JobAcctGatherType=jobacct_gather/none', 'SchedulerType=sched/backfill',
      'SelectType=select/cons_tres', 'SelectTypeParameters=CR_Core', 'ReturnToService=2',
      'MpiDefault=none', 'AccountingStorageType=accounting_storage/none',
      'JobCompType=jobcomp/none', 'MinJobAge=3600',
      'SchedulerParameters=sched_interval=2,bf_interval=2',
      f'NodeName={host} CPUs={os.cpu_count()} RealMemory={memory} State=UNKNOWN',
      'PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP', '']))
  # The jobs train as users' runs do, each step SLURM_STEP_SECONDS longer.
  env = _with_sleeping_steps(dict(sweep_env, SLURM_CONF=str(conf)), SLURM_STEP_SECONDS)
  subprocess.run(['slurmctld', '-i'], check=True, env=env)
  subprocess.run(['slurmd'], check=True, env=env)
  deadline = time.time() + 60
  while time.time() < deadline:
    state = subprocess.run(['sinfo', '-h', '-o', '%t'], capture_output=True, text=True,
                           env=env, check=False).stdout.strip()
    if state == 'idle':
      break
    time.sleep(0.5)
  else:
    logs = (base / 'log' / 'slurmctld.log').read_text()[-2000:]
    pytest.fail(f'the test cluster did not come up (sinfo: {state!r}):\n{logs}')
  try:
    yield env
  finally:
    subprocess.run(['scancel', '--user=root'], env=env, check=False)
    for pid_file in ('slurmd.pid', 'slurmctld.pid', 'munged.pid'):
      try:
        os.kill(int((base / pid_file).read_text()), signal.SIGTERM)
      except (OSError, ValueError):
        pass


def _jobs(env):
  """Every job the cluster knows, ended ones too: {name: {field: value}} from scontrol."""
  shown = subprocess.run(['scontrol', '-o', 'show', 'job'], capture_output=True, text=True,
                         env=env, check=True).stdout
  jobs = {}
  for line in shown.splitlines():
    fields = dict(f.split('=', 1) for f in line.split() if '=' in f)
    jobs[fields['JobName']] = fields
  return jobs


def _log_tails(workdir, names):
  """The last lines of these jobs' logs, for a failure's message."""
  tails = []
  for name in names:
    try:
      with open(os.path.join(workdir, 'logs', f'{name}.log')) as f:
        tails.append(f'--- {name}.log:\n' + ''.join(f.readlines()[-8:]))
    except OSError as e:
      tails.append(f'--- {name}.log: {e}')
  return '\n'.join(tails)


def test_a_sweep_through_slurm_outlives_a_two_minute_time_limit_and_a_failure_stops_its_own(
    sweep_file, one_at_a_time, slurm_cluster, tmp_path):
  """Each job may run two minutes, and SIGTERM comes 25 s before the limit (65-95 s into each
  allocation, as the comment on STEPS says): every pretraining needs three or more allocations,
  and requeues itself after each stop until it has finished; its fine-tuning waits for that.
  The 'broken' variant's pretraining fails for a real error: it is not requeued, and SLURM
  cancels its fine-tuning only. This test and its jobs stay on this worker's core: the jobs are
  mostly asleep."""
  workdir = str(tmp_path / 'w')
  submitted = subprocess.run(_sweep(f'--sweep={sweep_file}:broken', f'--workdir={workdir}',
                                    '--slurm=submit', '--gpus_per_run=0',
                                    '--slurm_option=--time=2',
                                    '--slurm_option=--signal=TERM@25'),
                             capture_output=True, text=True, check=False, env=slurm_cluster)
  assert submitted.returncode == 0, submitted.stdout + submitted.stderr
  seen = {}  # job name -> [(time, state)] while any job has not ended
  # 5-6.5 minutes here (three or four allocations of each pretraining, then the fine-tunings;
  # docs/testing.md): the limit only ends a test whose jobs would never end.
  deadline = time.time() + 1800
  while time.time() < deadline:
    queue = subprocess.run(['squeue', '-h', '-t', 'all', '-o', '%j|%T'], capture_output=True,
                           text=True, env=slurm_cluster, check=True).stdout.split()
    now = time.time()
    for name, state in (line.split('|') for line in queue):
      seen.setdefault(name, []).append((now, state))
    if queue and all(line.split('|')[1] in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT')
                     for line in queue):
      break
    time.sleep(1)
  jobs = _jobs(slurm_cluster)
  states = {name: (job['JobState'], int(job['Restarts'])) for name, job in jobs.items()}
  queued = [name for name, (state, _) in states.items() if state in ('PENDING', 'RUNNING')]
  assert not queued, (f'jobs still queued after 30 minutes: {states}\n'
                      + _log_tails(workdir, queued))

  good = ['seed=0', 'learning_rate=0.003,seed=0']
  for run in good:
    assert states[f'lm__{run}'][0] == 'COMPLETED' and states[f'lm__{run}'][1] >= 2, states
    assert states[f'ft__{run}'][0] == 'COMPLETED', states
    log = open(os.path.join(workdir, 'logs', f'lm__{run}.log')).read()
    assert log.count('requeueing job') == states[f'lm__{run}'][1], log[-3000:]
    assert 1 <= log.count('Resuming from step') <= states[f'lm__{run}'][1], log[-3000:]
    # The fine-tuning ran only once its own pretraining had ended.
    pretraining_ended = max(t for t, state in seen[f'lm__{run}'] if state != 'COMPLETED')
    fine_tuning_ran = min(t for t, state in seen[f'ft__{run}'] if state == 'RUNNING')
    assert pretraining_ended < fine_tuning_ran
  assert states['lm__num_heads=3,seed=0'] == ('FAILED', 0), states
  log = open(os.path.join(workdir, 'logs', 'lm__num_heads=3,seed=0.log')).read()
  assert ('train.py: error: model.hidden_size=32 is not divisible by model.num_heads=3' in log
          and 'requeueing' not in log), log[-3000:]
  assert states['ft__num_heads=3,seed=0'][0] == 'CANCELLED', states
  assert jobs['ft__num_heads=3,seed=0']['Reason'] == 'DependencyNeverSatisfied', states
  assert [name for name, (state, _) in states.items() if state == 'CANCELLED'] == [
      'ft__num_heads=3,seed=0']
  assert states['summarize'][0] == 'COMPLETED', states

  finals = _finals(workdir)
  assert {name: finals[name] for name in one_at_a_time} == one_at_a_time
  with open(os.path.join(workdir, 'results.md')) as f:
    table = f.read()
  assert '| lr 1e-3 | 1/1 |' in table and '| lr 3e-3 | 1/1 |' in table
  assert '| broken | 0/1 |' in table
  summary = subprocess.run(_sweep('--summarize', f'--workdir={workdir}'), capture_output=True,
                           text=True, check=True)
  assert summary.stdout.startswith(table)
