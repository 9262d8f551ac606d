"""The input made by grain worker processes: the same batches with any number of workers, after
a resume with another number, after a worker is killed; no worker outlives its stream."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import bert_base
from configs import cvt as cvt_configs
from configs import elmo
from configs import gpt
from configs import transformer_wmt
import input_pipeline
from input_pipeline.common import example_iterator
from input_pipeline.common import workers
from trainer import ranges

# (config, the fields that make its chunks small, so that a few batches cross several chunks)
TEXT_PIPELINES = {
    'bert_pretraining': (bert_base.get_config, 'tiny', dict(docs_per_chunk=20)),
    'packed_lm': (gpt.get_config, 'tiny', dict(docs_per_chunk=10)),
    'bilm': (elmo.get_config, 'tiny', dict(docs_per_chunk=10)),
    'translation': (transformer_wmt.get_config, 'tiny', dict(docs_per_chunk=200)),
    'cvt': (cvt_configs.get_config, 'tiny', dict(docs_per_chunk=5, max_train_examples=50)),
}
BATCHES = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(stream, count):
  return [next(stream) for _ in range(count)]


def _assert_equal(want, got):
  assert len(want) == len(got)
  for a, b in zip(want, got):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _no_workers_left(timeout=10.0):
  deadline = time.time() + timeout
  while multiprocessing.active_children() and time.time() < deadline:
    time.sleep(0.1)
  return not multiprocessing.active_children()


def _stream_maker(name, data_dir):
  """stream(workers, state=None): the pipeline's training stream of 2 data shards on one host
  (the host's workers divide among them)."""
  get_config, arg, fields = TEXT_PIPELINES[name]
  config = get_config(arg)
  config.data.data_dir = data_dir
  config.data.update(fields)
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size)

  def stream(workers_count, state=None):
    train = input_pipeline.get_train_stream(config.data, tokenizer=tokenizer, global_batch=8,
                                            seed=3, num_shards=2, workers=workers_count)
    if state is not None:
      train.set_state(state)
    return train
  return stream


# BERT's in the fast tier, every pipeline in the slow tier (a worker's start-up is ~1.5 s).
@pytest.fixture(scope='module', params=[
    name if name == 'bert_pretraining' else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(TEXT_PIPELINES)])
def pipeline(request, shared_data_dir):
  stream = _stream_maker(request.param, shared_data_dir)
  reference = stream(0)
  batches, states = [], [reference.get_state()]
  for _ in range(BATCHES):
    batches.append(next(reference))
    states.append(reference.get_state())
  reference.close()
  return stream, batches, states


def test_same_batches_with_two_workers_and_after_a_resume_with_another_number(pipeline, request):
  """As in one process, with 2 workers (1: the fine-tuning test below); the position the
  2-worker stream saved halfway, resumed with 0 (in this process) and, for the slow tier's
  pipelines, with 1 too. BERT's, the fast tier's, starts no more workers after the two: each
  one a stream starts imports jax through grain (about 4 s of a core), and a resume into
  workers is the fine-tuning test's (and the slow tier's pipelines')."""
  stream, batches, states = pipeline
  slow = request.node.get_closest_marker('slow') is not None
  half = BATCHES // 2
  two = stream(2)
  _assert_equal(batches[:half], _batches(two, half))
  saved = two.get_state()
  assert saved == states[half]
  _assert_equal(batches[half:], _batches(two, BATCHES - half))  # saving moved nothing
  assert two.get_state() == states[-1]
  two.close()
  assert _no_workers_left()
  for count in ((1, 0) if slow else (0,)):
    resumed = stream(count, saved)
    _assert_equal(batches[half:], _batches(resumed, BATCHES - half))
    resumed.close()
  assert _no_workers_left()


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_the_batches_stay_exact(shared_data_dir):
  stream = _stream_maker('bert_pretraining', shared_data_dir)
  reference = stream(0)
  batches = _batches(reference, 30)  # enough to need units the killed worker was to make
  reference.close()
  parallel = stream(2)
  got = _batches(parallel, 2)
  victim = multiprocessing.active_children()[0]
  os.kill(victim.pid, signal.SIGKILL)
  got += _batches(parallel, 28)
  _assert_equal(batches, got)
  assert victim.pid not in [p.pid for p in multiprocessing.active_children()]  # replaced
  parallel.close()
  assert _no_workers_left()


def _batch_of(indices, weights):
  return {'indices': indices, 'weights': weights, 'squares': indices.astype(np.int64) ** 2}


@pytest.mark.parametrize('count', [1, pytest.param(2, marks=pytest.mark.slow)])
def test_fine_tuning_batches_through_epochs_with_workers(count):
  """ExampleIterator (every fine-tuning pipeline): 13 examples, batches of 5, several epochs."""
  def make(workers_count, state=None):
    iterator = example_iterator.ExampleIterator(13, _batch_of, split='train', batch_size=5,
                                                seed=1, workers=workers_count)
    if state is not None:
      iterator.set_state(state)
    return iterator

  reference = make(0)
  batches, states = [], []
  for _ in range(9):
    batches.append(next(reference))
    states.append(reference.get_state())
  reference.close()
  assert {s['epoch'] for s in states} == {0, 1, 2, 3}
  epoch_0 = np.concatenate([b['indices'] for b in batches])[:13]
  assert sorted(epoch_0) == list(range(13))  # each example once an epoch
  if count > 1:  # from the start with 2 workers (the slow tier's)
    parallel = make(count)
    _assert_equal(batches, _batches(parallel, 9))
    parallel.close()
  # Resumed in the second epoch with `count` workers from the in-process reference's position
  # (another number); in the fast tier the one worker it starts (each imports jax through
  # grain, about 4 s of a core).
  resumed = make(count, states[3])
  _assert_equal(batches[4:], _batches(resumed, 5))
  resumed.close()
  assert _no_workers_left()


class _Raises:
  def __call__(self, u):
    if u == 3:
      raise ValueError('unit 3 is bad')
    return np.full(2, u)


class _Dies:
  def __call__(self, u):
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # fault injection: workers that raise and die, restarted 3 times (12 s)
def test_errors_reach_the_consumer_and_no_worker_is_left():
  units = workers.UnitStream(_Raises(), 2)
  assert [int(next(units)[0]) for _ in range(3)] == [0, 1, 2]
  with pytest.raises(ValueError, match='unit 3 is bad'):
    next(units)
  assert _no_workers_left()
  dying = workers.UnitStream(_Dies(), 1)
  with pytest.raises(workers.WorkersDied, match='died 4 times in a row.*config.data.workers'):
    next(dying)
  assert _no_workers_left()


class _Units:
  def __call__(self, u):
    return np.full(2, u)


@pytest.mark.slow  # fault injection: a worker killed (4 s)
def test_a_worker_that_died_unnoticed_is_reported_in_one_line_when_the_stream_closes(caplog):
  # The units it was to make were never wanted, so the stream did not meet its death.
  units = workers.UnitStream(_Units(), 2)
  assert int(next(units)[0]) == 0
  victim = [p for p in multiprocessing.active_children() if p.name.startswith('grain-')][0]
  os.kill(victim.pid, signal.SIGKILL)
  victim.join(timeout=30)
  with caplog.at_level('WARNING'):
    units.close()
  died = [r.getMessage() for r in caplog.records if 'A data worker died' in r.getMessage()]
  assert died == ['A data worker died (exit code -9) after making the last unit the run took '
                  'from it, so nothing was lost.']
  assert _no_workers_left()


@pytest.mark.slow  # fault injection: signals sent to the workers (4 s)
def test_the_workers_leave_a_clusters_sigterm_and_a_hangup_to_the_training_process(caplog):
  # SLURM's warning before a time limit reaches every process of the job: the training process
  # saves and stops the workers; a worker that died of it would be restarted, and said to die.
  units = workers.UnitStream(_Units(), 2)
  assert [int(next(units)[0]) for _ in range(2)] == [0, 1]  # each worker made one: it is set up
  alive = [p for p in multiprocessing.active_children() if p.name.startswith('grain-')]
  assert alive
  for process in alive:
    os.kill(process.pid, signal.SIGTERM)
    os.kill(process.pid, signal.SIGHUP)
  time.sleep(1.0)
  assert all(p.exitcode is None for p in alive)
  assert [int(next(units)[0]) for _ in range(6)] == [2, 3, 4, 5, 6, 7]
  with caplog.at_level('WARNING'):
    units.close()
  assert not [r for r in caplog.records if 'died' in r.getMessage()]
  assert _no_workers_left()


def test_a_block_a_killed_worker_left_is_removed_without_a_word():
  """In a process of its own: a shared memory block registered and never unlinked, as a worker
  killed with a unit under way leaves it. The tracker removes it at exit, and its warning of
  'leaked shared_memory objects' is not printed."""
  program = """
from multiprocessing import shared_memory
from input_pipeline.common import workers
workers.quiet_resource_tracker()
block = shared_memory.SharedMemory(create=True, size=4096)
block.close()
print(block.name)
"""
  result = subprocess.run([sys.executable, '-c', program], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0 and result.stderr == '', result.stderr[-3000:]
  path = os.path.join('/dev/shm', result.stdout.strip().lstrip('/'))
  deadline = time.time() + 10
  while os.path.exists(path) and time.time() < deadline:  # the tracker ends after the process
    time.sleep(0.1)
  assert not os.path.exists(path)


@pytest.mark.slow  # fault injection: the resource tracker killed (5 s)
def test_a_killed_resource_tracker_is_one_line_and_the_units_go_on_exactly():
  """In a process of its own (its resource tracker is killed): multiprocessing would warn,
  start a tracker in every worker too (whose clean-up at the worker's exit removes blocks the
  consumer still reads: 'No such file or directory: /psm_...'), and the new trackers would
  print a KeyError traceback for each semaphore and block the old one held."""
  program = """
import os, signal, time
from multiprocessing import resource_tracker
from absl import logging
from input_pipeline.common import workers
logging.use_absl_handler()
stream = workers.UnitStream(str, 2)
taken = [next(stream) for _ in range(5)]
os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
time.sleep(0.5)
taken += [next(stream) for _ in range(40)]
stream.close()
print(' '.join(taken), workers._tracker_starts)
"""
  result = subprocess.run([sys.executable, '-c', program], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == [str(u) for u in range(45)] + ['1']
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].endswith(
      'The multiprocessing resource tracker died (killed?); started a new one and new data '
      'workers, which use it.'), result.stderr[-3000:]


def _gone(pid: int) -> bool:
  """Exited: no such process, or a zombie that nobody reaps (a container's first process)."""
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return f.read().rsplit(')', 1)[1].split()[0] in ('Z', 'X')
  except FileNotFoundError:
    return True


@pytest.mark.slow  # fault injection: the training process killed outright (4 s)
def test_the_workers_of_a_training_process_killed_outright_exit_with_it(tmp_path):
  # They ignore SIGTERM and SIGHUP, so nothing but kill -9 would end them otherwise.
  program = """
import multiprocessing, os, signal
from input_pipeline.common import workers
stream = workers.UnitStream(str, 2)
taken = [next(stream) for _ in range(4)]
print(' '.join(str(p.pid) for p in multiprocessing.active_children()
               if p.name.startswith('grain-')), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
  out = tmp_path / 'out.txt'  # not a pipe, which a worker left behind would hold open
  with open(out, 'w', encoding='utf-8') as f:
    code = subprocess.run([sys.executable, '-c', program], cwd=ROOT, stdout=f,
                          stderr=subprocess.STDOUT, timeout=300).returncode
  assert code == -signal.SIGKILL, out.read_text()[-3000:]
  pids = [int(pid) for pid in out.read_text().split()]
  assert pids
  deadline = time.time() + 5 * workers.PARENT_POLL_SECONDS
  while not all(map(_gone, pids)) and time.time() < deadline:
    time.sleep(0.1)
  left = [pid for pid in pids if not _gone(pid)]
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  assert not left


def test_auto_workers():
  assert workers.default_workers('cpu', 8) == 0
  assert 1 <= workers.default_workers('tpu', 4) <= 16
  config = bert_base.get_config('tiny')
  assert config.data.workers == -1
  assert input_pipeline.num_workers(config.data, 'cpu', 8) == 0
  config.data.workers = 3
  assert input_pipeline.num_workers(config.data, 'gpu', 8) == 3
  config.data.workers = -2
  with pytest.raises(ValueError, match=r'data.workers=-2 is outside \[-1, inf\)'):
    ranges.check(config)


@pytest.mark.slow
def test_the_tfdata_peer_makes_the_same_units(shared_data_dir):
  """peers/input_tfdata.py (docs/bert.md's grain-or-tf.data comparison) runs and prints its rate."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, 'peers/input_tfdata.py', '--config=configs/bert_base.py:tiny',
       f'--config.data.data_dir={shared_data_dir}', '--calls=2', '--seconds=1'],
      cwd=root, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TOKENIZERS_PARALLELISM='false'))
  assert done.returncode == 0, done.stderr[-2000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result['tfdata_parallel_calls'] == 2 and result['input_examples_per_sec'] > 0
