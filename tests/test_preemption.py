"""SIGTERM (a preemption) and Ctrl-C save a checkpoint before train.py exits (or a notebook's
call returns); the same command resumes, bitwise as if never stopped."""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from test_faults import ENV, assert_same_arrays, saved_state
from test_faults import command as run_command
from test_train import micro_config
import trainer.loop
import trainer.stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(tmp_path, workers=0):
  return [sys.executable, 'train.py', '--config=configs/bert_base.py:tiny',
          f'--config.data.workers={workers}',
          f'--workdir={tmp_path / "run"}', f'--config.data.data_dir={tmp_path / "data"}',
          '--config.model.num_layers=1', '--config.train.num_steps=100000',
          '--config.train.log_every=5', '--config.train.checkpoint_every=100000',
          '--config.train.eval_every=100000']


def children(pid):
  """The processes `pid` started (its input workers), from /proc."""
  found = set()
  for task in os.listdir(f'/proc/{pid}/task'):
    with open(f'/proc/{pid}/task/{task}/children', encoding='ascii') as f:
      found |= {int(child) for child in f.read().split()}
  return found


def alive(pid):
  try:
    with open(f'/proc/{pid}/stat', encoding='ascii') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def signal_a_running_run(tmp_path, sig, metric_lines):
  """Starts train.py with 2 input workers, sends `sig` once metrics.jsonl has `metric_lines`
  lines; returns the process (ended) and its stderr, after checking no worker outlived it."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.Popen(command(tmp_path, workers=2), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  deadline = time.time() + 240
  while not (metrics.exists() and metrics.read_text().count('\n') >= metric_lines):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.5)
  workers = children(proc.pid)
  assert len(workers) >= 2, workers  # grain's workers (and multiprocessing's resource tracker)
  proc.send_signal(sig)
  _, stderr = proc.communicate(timeout=120)
  deadline = time.time() + 10
  while any(alive(pid) for pid in workers) and time.time() < deadline:
    time.sleep(0.2)
  assert not any(alive(pid) for pid in workers)
  return proc, stderr


@pytest.mark.slow
def test_sigterm_checkpoints_and_resumes(tmp_path):
  """With 2 input workers: SIGTERM saves, exits 75 ("unfinished, resume me") and leaves no
  worker; the resumed run (one worker) starts from the saved step."""
  proc, stderr = signal_a_running_run(tmp_path, signal.SIGTERM, 2)
  assert proc.returncode == trainer.stop.RESUME_EXIT_STATUS == 75, stderr[-3000:]
  assert 'SIGTERM' in stderr
  saved = [int(s) for s in os.listdir(tmp_path / 'run' / 'checkpoints') if s.isdigit()]
  assert len(saved) == 1 and saved[0] >= 10, saved

  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.Popen(command(tmp_path, workers=1), cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = ''
  while f'Resuming from step {saved[0]}' not in line:
    line = proc.stdout.readline()
    assert line, proc.communicate()[1][-3000:]
  proc.send_signal(signal.SIGTERM)
  proc.communicate(timeout=120)
  assert proc.returncode == 75


def test_ctrl_c_asks_to_stop_after_the_first_step_and_stops_at_once_when_pressed_again():
  early = trainer.stop.StopRequested()
  with pytest.raises(KeyboardInterrupt):  # compiling, before any step: nothing to save
    early(signal.SIGINT, None)
  # Recorded too: a raise inside a garbage collector's callback (jax's) is dropped by Python,
  # and the loop must still stop, at its next step (it trained on before, the Ctrl-C lost).
  assert early.flag and early.describe() == 'Ctrl-C'
  stop = trainer.stop.StopRequested()
  stop.trained = True
  stop(signal.SIGINT, None)
  assert stop.flag and stop.describe() == 'Ctrl-C'
  with pytest.raises(KeyboardInterrupt):
    stop(signal.SIGINT, None)
  term = trainer.stop.StopRequested()
  term(signal.SIGTERM, None)
  term(signal.SIGTERM, None)  # a preemption's repeated SIGTERM waits for the save
  assert term.flag and term.describe() == 'SIGTERM'


def test_hosts_agree_on_a_stop_at_least_every_ten_steps(monkeypatch):
  # At log_every=100 a step of 1.5 s put the agreement past SLURM's 120 s warning.
  gathers = []
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(trainer.stop.multihost_utils, 'process_allgather',
                      lambda x: gathers.append(x) or np.stack([x, np.array(True)]))
  stop = trainer.stop.StopRequested()
  asked = [step for step in range(1, 31) if stop.requested(step, 100)]
  assert asked == [10, 20, 30] and len(gathers) == 3
  assert [step for step in range(1, 9) if stop.requested(step, 4)] == [4, 8]


def test_a_hangup_stops_as_a_preemption_does_unless_nohup_ignores_it():
  hangup = trainer.stop.StopRequested()
  hangup(signal.SIGHUP, None)  # an ssh session dropped: save, then exit 75
  assert hangup.flag and hangup.describe() == 'SIGHUP'
  before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
  try:
    assert trainer.stop.signals_to_handle() == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
    assert trainer.stop.signals_to_handle() == (signal.SIGTERM, signal.SIGINT)
  finally:
    signal.signal(signal.SIGHUP, before)


_HUNG_UP = '''
import signal, sys, time
import trainer.stop
stop = trainer.stop.StopRequested()
signal.signal(signal.SIGHUP, stop)
print('ready', flush=True)
while not stop.flag:
  time.sleep(0.01)
time.sleep(0.2)
for _ in range(3):  # the loop's progress and checkpoint lines, to a terminal that is gone
  print('saved a checkpoint; stopping', flush=True)
sys.exit(75)
'''


def test_a_run_whose_terminal_hangs_up_still_saves_and_exits_75():
  """After a hangup every write to the terminal fails (EIO): the run's lines go nowhere
  instead of ending it with a traceback before its checkpoint."""
  import pty  # pylint: disable=g-import-not-at-top
  pid, terminal = pty.fork()
  if pid == 0:  # the child: a run on the terminal
    os.execve(sys.executable, [sys.executable, '-c', _HUNG_UP],
              dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  output = b''
  deadline = time.time() + 60
  while b'ready' not in output and time.time() < deadline:
    output += os.read(terminal, 1024)
  os.close(terminal)  # the terminal closes: the kernel sends SIGHUP
  _, status = os.waitpid(pid, 0)
  assert os.waitstatus_to_exitcode(status) == 75


def test_a_second_ctrl_c_while_saving_waits_for_the_save(capfd):
  stop = trainer.stop.StopRequested()
  stop.trained = True
  stop(signal.SIGINT, None)
  finished = False
  with pytest.raises(KeyboardInterrupt):
    with stop.deferred():
      stop(signal.SIGINT, None)  # neither raises inside: the save goes on
      stop(signal.SIGINT, None)
      finished = True
  assert finished
  err = capfd.readouterr().err
  assert err.count('Ctrl-C: the run stops once the checkpoint being written') == 1, err
  fresh = trainer.stop.StopRequested()
  with fresh.deferred():  # nothing pending: the block ends as it would without the handler
    fresh(signal.SIGTERM, None)
  assert fresh.flag


def start_in_own_group(args):
  """train.py in a process group of its own, as a terminal starts a command: Ctrl-C there
  signals the whole group (the training process and its input workers)."""
  return subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(predicate, proc, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.002)


@pytest.fixture(scope='module')
def straight_run(tmp_path_factory, shared_data_dir):
  """The workdir of the interrupted runs' command (24 steps) run without a stop."""
  workdir = tmp_path_factory.mktemp('straight') / 'run'
  subprocess.run(run_command(workdir, shared_data_dir, num_steps=24), cwd=ROOT, env=ENV,
                 check=True, capture_output=True)
  return workdir


def finishes_as_never_stopped(args, step, workdir, straight):
  """The same command resumes from `step` and ends with the state of the run never stopped."""
  resumed = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, check=True)
  assert f'Resuming from step {step}' in resumed.stdout, resumed.stdout[-3000:]
  assert_same_arrays(saved_state(workdir, 24), saved_state(straight, 24))


@pytest.mark.slow
def test_ctrl_c_saves_then_the_same_command_finishes_bitwise_equal(tmp_path, shared_data_dir,
                                                                   straight_run):
  """A terminal's Ctrl-C (SIGINT to the process group) with 2 input workers: the run saves at
  the step it is in, says so, exits 75, and no worker died of it or outlives it; the same command
  then finishes with the parameters and optimizer state of a run never stopped."""
  args = run_command(tmp_path / 'run', shared_data_dir, num_steps=24) + [
      '--config.data.workers=2']
  proc = start_in_own_group(args)
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  wait_for(lambda: metrics.exists() and metrics.read_text().count('\n') >= 2, proc)
  workers = children(proc.pid)
  os.killpg(proc.pid, signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 75, stderr[-3000:]
  saved = re.search(r'Ctrl-C: saved the checkpoint of step (\d+) in .*; the same command', stderr)
  assert saved and 4 <= int(saved.group(1)) < 24, stderr[-3000:]
  assert os.path.isdir(tmp_path / 'run' / 'checkpoints' / saved.group(1))
  assert 'A data worker died' not in stderr and 'Traceback' not in stderr, stderr[-3000:]
  deadline = time.time() + 10
  while any(alive(pid) for pid in workers) and time.time() < deadline:
    time.sleep(0.2)
  assert not any(alive(pid) for pid in workers)

  finishes_as_never_stopped(args, int(saved.group(1)), tmp_path / 'run', straight_run)


@pytest.mark.slow
def test_a_second_ctrl_c_while_saving_stops_at_once_and_keeps_a_checkpoint_to_resume(
    tmp_path, shared_data_dir, straight_run):
  """Two Ctrl-C while a checkpoint is being written (checkpoints at every step): train.py stops
  with one line naming the newest complete checkpoint (the write under way is finished first),
  exit status 130; the same command resumes from it and finishes bitwise equal.

  The second Ctrl-C is sent once the first one's notice is out (two signals before Python runs
  its handler would count as one); a run that stops on the first before the second arrives is
  tried again in a new workdir, up to three times."""
  for attempt in range(3):
    workdir = tmp_path / f'run{attempt}'
    args = run_command(workdir, shared_data_dir, num_steps=24) + [
        '--config.train.checkpoint_every=1']
    proc = start_in_own_group(args)
    directory = workdir / 'checkpoints'
    wait_for(lambda: directory.exists() and any('tmp' in n for n in os.listdir(directory)), proc)
    os.killpg(proc.pid, signal.SIGINT)
    seen = []
    while not seen or not seen[-1].startswith('Ctrl-C: the run saves a checkpoint'):
      seen.append(proc.stderr.readline())
      assert seen[-1], ''.join(seen)[-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    stderr = ''.join(seen) + stderr
    if proc.returncode == 75 and 'Ctrl-C: saved the checkpoint' in stderr:
      continue  # stopped on the first Ctrl-C before the second arrived
    break
  assert proc.returncode == 130, stderr[-3000:]
  lines = [l for l in stderr.splitlines() if l.startswith('train.py:')]
  newest = max(int(n) for n in os.listdir(directory) if n.isdigit())
  assert lines == [f'train.py: stopped at once by Ctrl-C: the newest complete checkpoint is step '
                   f'{newest} in {workdir}, and the same command resumes from it.'], (
                       stderr[-3000:])
  assert 'Traceback' not in stderr, stderr[-3000:]
  assert newest < 24

  finishes_as_never_stopped(args, newest, workdir, straight_run)


@pytest.fixture(scope='module')
def micro_straight(shared_data_dir, tmp_path_factory):
  """The micro BERT (tests/test_train.py) trained 6 steps in one call: params, opt_state."""
  state = trainer.loop.train_and_evaluate(micro_config(shared_data_dir),
                                          str(tmp_path_factory.mktemp('micro') / 'straight'))
  return jax.device_get((state.params, state.opt_state))


def interrupt_after_step(monkeypatch, stop_step):
  """A Ctrl-C at the end of step `stop_step`, as a notebook's interrupt arrives: SIGINT to
  this process while train_and_evaluate runs in its main thread."""
  add = trainer.loop.Progress.add

  def add_then_interrupt(self, step, metrics):
    add(self, step, metrics)
    if step == stop_step:
      os.kill(os.getpid(), signal.SIGINT)  # handled before the next step starts
  monkeypatch.setattr(trainer.loop.Progress, 'add', add_then_interrupt)


def resumes_as_never_stopped(config, workdir, straight):
  resumed = trainer.loop.train_and_evaluate(config, str(workdir))
  assert int(resumed.step) == 6
  jax.tree.map(np.testing.assert_array_equal, jax.device_get((resumed.params, resumed.opt_state)),
               straight)


@pytest.mark.slow
def test_an_interrupted_notebook_call_saves_and_returns_the_state(shared_data_dir, tmp_path,
                                                                 monkeypatch, capfd,
                                                                 micro_straight):
  """A notebook's interrupt: train_and_evaluate saves at the step it is in and returns the
  state; calling it again finishes bitwise equal to a call never interrupted."""
  config = micro_config(shared_data_dir)
  interrupt_after_step(monkeypatch, 4)  # between checkpoints (every 3 steps)
  handler = signal.getsignal(signal.SIGINT)
  state = trainer.loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert signal.getsignal(signal.SIGINT) is handler  # the notebook's own handler is back
  assert int(state.step) == 4
  assert f'Ctrl-C: saved the checkpoint of step 4 in {tmp_path / "run"}' in capfd.readouterr().err
  monkeypatch.undo()
  resumes_as_never_stopped(config, tmp_path / 'run', micro_straight)


@pytest.mark.slow
def test_a_second_ctrl_c_inside_the_save_finishes_it_then_stops(shared_data_dir, tmp_path,
                                                                monkeypatch, capfd,
                                                                micro_straight):
  """The second Ctrl-C arrives while the stop's checkpoint is being saved: the save and its
  write finish, then KeyboardInterrupt; the checkpoint is complete and resumes bitwise."""
  config = micro_config(shared_data_dir)
  interrupt_after_step(monkeypatch, 4)
  save = trainer.loop.checkpoints.save

  def interrupted_save(mngr, step, *args, **kwargs):
    if step == 4:  # the stop's save (step 3's is a regular one)
      os.kill(os.getpid(), signal.SIGINT)
    save(mngr, step, *args, **kwargs)
  monkeypatch.setattr(trainer.loop.checkpoints, 'save', interrupted_save)
  with pytest.raises(KeyboardInterrupt):
    trainer.loop.train_and_evaluate(config, str(tmp_path / 'run'))
  assert 'Ctrl-C: the run stops once the checkpoint being written' in capfd.readouterr().err
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['3', '4']
  monkeypatch.undo()
  resumes_as_never_stopped(config, tmp_path / 'run', micro_straight)
