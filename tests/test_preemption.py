"""SIGTERM (a preemption) saves a checkpoint before train.py exits; the same command resumes."""

import os
import signal
import subprocess
import sys
import time

import pytest

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
  """With 2 input workers: SIGTERM saves, exits 0 and leaves no worker; the resumed run (one
  worker) starts from the saved step."""
  proc, stderr = signal_a_running_run(tmp_path, signal.SIGTERM, 2)
  assert proc.returncode == 0, stderr[-3000:]
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
  assert proc.returncode == 0


@pytest.mark.slow
def test_ctrl_c_leaves_no_input_worker(tmp_path):
  signal_a_running_run(tmp_path, signal.SIGINT, 1)
