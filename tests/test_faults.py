"""Faults a run survives: kill -9 anywhere, unreadable or non-finite checkpoints, a changed mesh,
a NaN batch, a full disk. Each test makes the fault happen and checks what is left and what a
rerun of the same command does."""

import gc
import glob
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import aot
import end_to_end
import input_pipeline
from test_train import micro_config
from trainer import checkpoints
from trainer import metric_writer
from trainer import restore_log
from trainer import sharding
import trainer.loop
import trainer.state
import trainer.steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def data_dir(shared_data_dir):
  return shared_data_dir


def saved_state(workdir, step):
  """The arrays of checkpoint `step` as numpy, whatever mesh wrote them."""
  path = os.path.join(workdir, 'checkpoints', str(step), 'state')
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path)).tree
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      restore_args=restore_args))


def assert_same_arrays(a, b, **tolerance):
  check = (lambda x, y: np.testing.assert_allclose(x, y, **tolerance)) if tolerance else (
      np.testing.assert_array_equal)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(check, a, b)


def array_files(workdir, step):
  """The files of checkpoint `step` that hold its arrays (OCDBT's data files), smallest first."""
  directory = os.path.join(workdir, 'checkpoints', str(step), 'state', 'ocdbt.process_0', 'd')
  return sorted(glob.glob(os.path.join(directory, '*')), key=os.path.getsize)


def damage(workdir, step, how, file_index=-1):
  """Damages checkpoint `step` as a failing disk or an interrupted copy would (`file_index`:
  which of its array files, by size)."""
  directory = os.path.join(workdir, 'checkpoints', str(step))
  target = array_files(workdir, step)[file_index]
  if how == 'flipped bytes':  # one byte in every 499, the first at 64
    data = bytearray(open(target, 'rb').read())
    for i in range(min(64, len(data) // 2), len(data), 499):
      data[i] ^= 0xFF
    open(target, 'wb').write(bytes(data))
  elif how == 'truncated array file':
    with open(target, 'r+b') as f:
      f.truncate(os.path.getsize(target) // 3)
  elif how == 'missing array file':
    os.remove(target)
  elif how == 'bad metadata':  # the state's tree metadata cut in half
    metadata = os.path.join(directory, 'state', '_METADATA')
    text = open(metadata, encoding='utf-8').read()
    open(metadata, 'w', encoding='utf-8').write(text[:len(text) // 2])
  elif how == 'missing data position':
    shutil.rmtree(os.path.join(directory, 'data'))
  else:
    raise AssertionError(how)


def assert_one_quiet_line(out, err, step, resumed_from, workdir):
  """What the terminal shows of an unreadable checkpoint: one line, no traceback, no noise of
  the reads it abandoned; the full error in the workdir's restore log where a read failed."""
  text = out + err
  lines = [l for l in text.splitlines() if l.startswith(f'Checkpoint step {step}')]
  assert len(lines) == 1 and f'resuming from step {resumed_from}' in lines[0], text[-3000:]
  for noise in ('Traceback', 'Exception ignored', 'Error', 'tensorstore'):
    assert noise not in text.replace(lines[0], ''), text[-3000:]
  assert err.strip() == '', err[-3000:]
  log = restore_log.path(workdir)
  if os.path.exists(log):
    assert f'(the full error: {log})' in lines[0]


# ----------------------------------------------------------------------------
# In one process: checkpoints that cannot be resumed from, NaN, another mesh.
# ----------------------------------------------------------------------------

class SixSteps:
  """The micro BERT's 6 steps with checkpoints every 2, made once for the tests that spoil a
  checkpoint (each spoils a copy of `stopped`): the parameters of the run never stopped, and the
  workdir and state of the same run stopped after step 4."""

  def __init__(self, data_dir, root):
    self.config = micro_config(data_dir, num_steps=6, checkpoint_every=2)
    self.straight = jax.device_get(
        trainer.loop.train_and_evaluate(self.config, str(root / 'straight')).params)
    self.stopped = str(root / 'stopped')
    self.stopped_state = trainer.loop.train_and_evaluate(self.config, self.stopped,
                                                         stop_after_steps=4)

  def copy_stopped(self, path) -> str:
    shutil.copytree(self.stopped, path)
    return str(path)


@pytest.fixture(scope='module')
def six_steps(data_dir, tmp_path_factory):
  return SixSteps(data_dir, tmp_path_factory.mktemp('six_steps'))


# Fault injection: the slow tier (the standard's), every way of spoiling a checkpoint.
@pytest.mark.slow
@pytest.mark.parametrize('how', ['flipped bytes', 'truncated array file', 'missing array file',
                                 'bad metadata', 'missing data position'])
def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_run_resumes_before_it(
    six_steps, tmp_path, capfd, how):
  run = six_steps.copy_stopped(tmp_path / 'run')
  damage(run, 4, how)
  capfd.readouterr()
  resumed = trainer.loop.train_and_evaluate(six_steps.config, run)
  gc.collect()  # reads abandoned by the failed restore say nothing, even when collected late
  out, err = capfd.readouterr()
  assert_one_quiet_line(out, err, 4, 2, run)
  assert os.path.isdir(os.path.join(run, 'unreadable_checkpoints', '4'))  # kept, not deleted
  assert_same_arrays(jax.device_get(resumed.params), six_steps.straight)


@pytest.mark.slow
def test_a_read_that_fails_once_is_tried_again_and_sets_nothing_aside(
    six_steps, tmp_path, monkeypatch):
  # A network file system's timeout on the first read: the run resumes from its newest step
  # (before, step 4 went to unreadable_checkpoints/ and the run went back to step 2).
  run = six_steps.copy_stopped(tmp_path / 'run')
  read, failures = ocp.CheckpointManager.restore, []

  def flaky(self, step, *args, **kwargs):
    if not failures and 'state' in kwargs.get('args', {}):  # the state's read, not the data's
      failures.append(step)
      raise OSError('Connection timed out')
    return read(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, 'restore', flaky)
  monkeypatch.setattr(checkpoints, 'RETRY_SECONDS', 0.0, raising=False)
  resumed = trainer.loop.train_and_evaluate(six_steps.config, run)
  assert failures == [4] and not os.path.exists(os.path.join(run, 'unreadable_checkpoints'))
  assert_same_arrays(jax.device_get(resumed.params), six_steps.straight)
  lines = [json.loads(line) for line in open(os.path.join(run, 'metrics.jsonl'))]
  assert [line['step'] for line in lines if 'loss' in line] == sorted(
      {line['step'] for line in lines if 'loss' in line})  # resumed at 4: no step logged twice


@pytest.mark.slow
def test_flipped_bytes_in_any_array_file_give_one_quiet_line(six_steps, tmp_path, capfd):
  """Which reads are under way when one fails depends on the bytes hit: each file in turn. Each
  run restores and stops before its first step (stop_after_steps=0): the line and the noise of
  the abandoned reads come from the restore, and the resumed training is
  test_an_unreadable_newest_checkpoint_is_set_aside_and_the_run_resumes_before_it's."""
  config, pristine = six_steps.config, six_steps.stopped
  files = array_files(pristine, 4)
  assert len(files) >= 3
  for i in range(len(files)):
    run = six_steps.copy_stopped(tmp_path / f'run{i}')
    damage(run, 4, 'flipped bytes', file_index=i)
    capfd.readouterr()
    trainer.loop.train_and_evaluate(config, run, stop_after_steps=0)
    gc.collect()
    out, err = capfd.readouterr()
    if not os.path.isdir(os.path.join(run, 'unreadable_checkpoints', '4')):
      continue  # the bytes hit were not read back (a file's unused tail): it restored
    assert_one_quiet_line(out, err, 4, 2, run)


def test_bytes_changed_on_disk_that_still_decode_are_found_by_the_checksums(tmp_path, capfd):
  """A checkpoint whose files decode to other values than were saved (a flipped byte in a block
  that its compressed file stores as is: nothing in the format sees it) is set aside like an
  unreadable one, and the run resumes before it, instead of training on the changed values."""
  params = {'w': np.arange(12, dtype=np.float32).reshape(3, 4), 'b': np.ones(4, jnp.bfloat16)}
  mngr = checkpoints.manager(str(tmp_path / 'run'), 3)
  for step in (2, 4):
    checkpoints.save(mngr, step, {'step': step, 'params': params}, {0: {'index': step}}, 1)
  checkpoints.wait(mngr)
  # Step 4's array files swapped for those of a state one value apart: they read without error.
  other = checkpoints.manager(str(tmp_path / 'other'), 1)
  changed = {'w': params['w'].copy(), 'b': params['b']}
  changed['w'][1, 2] = 6.5
  checkpoints.save(other, 4, {'step': 4, 'params': changed}, {0: {'index': 4}}, 1)
  checkpoints.wait(other)
  state_dir = tmp_path / 'run' / 'checkpoints' / '4' / 'state'
  shutil.rmtree(state_dir)
  shutil.copytree(tmp_path / 'other' / 'checkpoints' / '4' / 'state', state_dir)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype,
                                                         sharding=device),
                          {'step': 4, 'params': params})
  # A run started from it (config.init_from) refuses it too, naming what resuming does.
  target = jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), device), params)
  with pytest.raises(ValueError, match=r'Checkpoint step 4 of .* cannot be started from '
                     r'\(params/w does not match the checksum saved with it\): resume that run'):
    checkpoints.restore_params(str(tmp_path / 'run'), target)
  capfd.readouterr()
  state, data = checkpoints.restore(checkpoints.manager(str(tmp_path / 'run'), 3), abstract,
                                    str(tmp_path / 'run'))
  out = capfd.readouterr().out
  assert ('Checkpoint step 4 cannot be resumed from (params/w does not match the checksum saved '
          'with it)') in out and 'resuming from step 2' in out, out
  assert int(state['step']) == 2 and data['shards'] == [{'index': 2}]
  assert (tmp_path / 'run' / 'unreadable_checkpoints' / '4').is_dir()
  # The sums see a byte's position too: the same bytes in another order are another array.
  sums = checkpoints.checksums(params)
  assert checkpoints.checksums({'w': params['w'][::-1], 'b': params['b']})['w'] != sums['w']


def test_reads_abandoned_by_a_failed_restore_go_to_the_log_whenever_they_are_collected(
    tmp_path, capfd, monkeypatch):
  printed = []  # what Python's own hook (the one before) is given
  monkeypatch.setattr(sys, 'unraisablehook', printed.append)
  asyncio_logger = logging.getLogger('asyncio')
  monkeypatch.setattr(asyncio_logger, 'filters', list(asyncio_logger.filters))
  log = str(tmp_path / 'restore_errors.log')

  class Pending:  # a read under way: the coroutine waits on it
    def __await__(self):
      yield

  async def read_array():  # as orbax's reads: suspended when the restore gave up on them
    try:
      await Pending()
    finally:
      raise ValueError('read of layer_1/kernel abandoned')

  def abandon():
    read = read_array()
    read.send(None)  # started, then dropped: collecting it raises in its `finally`
    return read

  restore_log.log_abandoned_reads(str(tmp_path / 'an_earlier_workdir.log'))
  restore_log.log_abandoned_reads(log)  # a second failed restore: no second hook, its log
  for _ in range(2):
    read = abandon()
    del read
    # The young generations, where these objects are: a full collection scans every object
    # of the worker (2-3 s late in the fast tier, against milliseconds).
    gc.collect(1)
  out, err = capfd.readouterr()
  assert out == '' and err == '' and printed == []
  text = open(log, encoding='utf-8').read()
  assert text.count('ValueError: read of layer_1/kernel abandoned') == 2 and 'read_array' in text
  assert not os.path.exists(tmp_path / 'an_earlier_workdir.log')
  assert len([f for f in asyncio_logger.filters
              if isinstance(f, restore_log.AbandonedReadsFilter)]) == 1
  # Any other unraisable error goes where it went before.
  class Noisy:
    def __del__(self):
      raise RuntimeError('not a read')
  Noisy()
  gc.collect(1)
  assert [str(u.exc_value) for u in printed] == ['not a read']
  assert 'not a read' not in open(log, encoding='utf-8').read()


def test_asyncio_records_of_abandoned_reads_go_to_the_log(tmp_path, caplog, monkeypatch):
  # orbax's event loop reports the futures of the reads it abandoned when they are collected.
  asyncio_logger = logging.getLogger('asyncio')
  monkeypatch.setattr(asyncio_logger, 'filters', list(asyncio_logger.filters))
  monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)
  log = str(tmp_path / 'restore_errors.log')
  restore_log.log_abandoned_reads(log)
  try:
    raise ValueError('read of layer_1/kernel abandoned')
  except ValueError:
    error = sys.exc_info()
  with caplog.at_level(logging.ERROR, logger='asyncio'):
    for what in ('Task', '_GatheringFuture'):
      asyncio_logger.error(f'{what} exception was never retrieved\nfuture: <{what} finished>',
                           exc_info=error)
    asyncio_logger.error('Unclosed client session')  # not a read: printed as before
  assert [r.getMessage() for r in caplog.records] == ['Unclosed client session']
  text = open(log, encoding='utf-8').read()
  assert text.count('ValueError: read of layer_1/kernel abandoned') == 2
  assert 'future: <_GatheringFuture finished>' in text


@pytest.mark.slow
def test_when_no_checkpoint_restores_the_run_stops_in_one_line_and_moves_nothing(
    data_dir, tmp_path):
  config = micro_config(data_dir, num_steps=6, checkpoint_every=2)
  trainer.loop.train_and_evaluate(config, str(tmp_path), stop_after_steps=4)
  damage(str(tmp_path), 4, 'flipped bytes')
  damage(str(tmp_path), 2, 'truncated array file')
  with pytest.raises(ValueError, match=r'No checkpoint in .* restores \(step 4: .*; step 2: '
                     r'.*\): .*move the directory aside') as error:
    trainer.loop.train_and_evaluate(config, str(tmp_path))
  assert '\n' not in str(error.value)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']
  assert not os.path.exists(tmp_path / 'unreadable_checkpoints')


@pytest.mark.slow
def test_a_non_finite_newest_checkpoint_is_set_aside(six_steps, tmp_path, capfd):
  run, state = six_steps.copy_stopped(tmp_path / 'run'), six_steps.stopped_state
  # What a bad disk or another program might leave: step 5 with a NaN in it, written directly.
  leaves, treedef = jax.tree.flatten(state.params)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(np.nan)
  bad = state.replace(params=jax.tree.unflatten(treedef, leaves))
  mngr = checkpoints.manager(run, 3)
  position = mngr.restore(4, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']
  mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(bad),
                                      data=ocp.args.JsonSave(position)))
  mngr.wait_until_finished()
  capfd.readouterr()
  resumed = trainer.loop.train_and_evaluate(six_steps.config, run)
  out, err = capfd.readouterr()
  assert 'Checkpoint step 5 cannot be resumed from (params/' in out and 'is not finite' in out, out
  assert_one_quiet_line(out, err, 5, 4, run)
  assert_same_arrays(jax.device_get(resumed.params), six_steps.straight)


@pytest.mark.slow  # fault injection (a NaN state), as the rest of the suite's
def test_a_state_that_is_not_finite_is_never_saved(data_dir, tmp_path, monkeypatch):
  """Parameters that overflow while the loss and gradient norm stayed finite: the checkpoint
  of that step is refused; the last good one is named and kept."""
  make_train_step = trainer.steps.make_train_step

  def spoiling(*args, **kwargs):
    step_fn = make_train_step(*args, **kwargs)

    def step(state, batch):
      state, metrics = step_fn(state, batch)
      if int(state.step) == 4:  # after the step: its loss and gradient were finite
        state = state.replace(params=jax.tree.map(lambda x: x * np.inf, state.params))
      return state, metrics
    return step

  monkeypatch.setattr(trainer.state, 'make_train_step', spoiling)  # where build() looks it up
  config = micro_config(data_dir, num_steps=6, checkpoint_every=2)
  with pytest.raises(FloatingPointError, match=r'params/.* is not finite at step 4, so it was not '
                     r'saved; the last good checkpoint is step 2'):
    trainer.loop.train_and_evaluate(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2']


@pytest.mark.slow  # fault injection (a failed write), as the rest of the suite's
def test_a_run_whose_last_checkpoint_fails_to_write_has_no_results_line(data_dir, tmp_path,
                                                                       monkeypatch):
  """The results line marks a run done for sweeps and SLURM chains (runner.finished), which
  then start the next stage from its last checkpoint: a failed last write leaves none."""
  wait = checkpoints.wait

  def failing_at_the_end(mngr):
    if mngr.latest_step() == 6:
      raise checkpoints.WriteError('A checkpoint could not be written (no space left)')
    wait(mngr)

  monkeypatch.setattr(checkpoints, 'wait', failing_at_the_end)
  config = micro_config(data_dir, num_steps=6, checkpoint_every=2, eval_every=6)
  with pytest.raises(checkpoints.WriteError, match='no space left'):
    trainer.loop.train_and_evaluate(config, str(tmp_path))
  lines = (tmp_path / 'metrics.jsonl').read_text(encoding='utf-8').splitlines()
  assert lines and not any('results' in json.loads(line) for line in lines), lines


@pytest.mark.slow
def test_a_nan_batch_stops_the_run_with_the_last_good_checkpoint_intact(data_dir, tmp_path,
                                                                       monkeypatch):
  get_train_stream = input_pipeline.get_train_stream

  class Poisoned:
    """The stream, with NaN weights in its 5th batch."""

    def __init__(self, stream):
      self.stream, self.batches = stream, 0

    def __next__(self):
      batch, self.batches = next(self.stream), self.batches + 1
      if self.batches == 5:
        batch = dict(batch, masked_lm_weights=np.full_like(batch['masked_lm_weights'], np.nan))
      return batch

    def __getattr__(self, name):
      return getattr(self.stream, name)

  config = micro_config(data_dir, num_steps=8, checkpoint_every=2)
  straight = trainer.loop.train_and_evaluate(config, str(tmp_path / 'straight'))
  monkeypatch.setattr(input_pipeline, 'get_train_stream',
                      lambda *a, **k: Poisoned(get_train_stream(*a, **k)))
  run = str(tmp_path / 'run')
  with pytest.raises(FloatingPointError, match=r'Loss is nan .* at step 5; the last good '
                     r'checkpoint is step 4'):
    trainer.loop.train_and_evaluate(config, run)
  assert sorted(os.listdir(os.path.join(run, 'checkpoints'))) == ['2', '4']
  monkeypatch.undo()  # the data is fixed; the same command resumes from step 4
  resumed = trainer.loop.train_and_evaluate(config, run)
  assert_same_arrays(jax.device_get(resumed.params), jax.device_get(straight.params))


@pytest.mark.slow
@pytest.mark.parametrize('first,then', [
    ((('data', 2), ('fsdp', 4), ('tensor', 1)), (('data', 4), ('fsdp', 1), ('tensor', 1))),
    ((('data', 1), ('fsdp', 4), ('tensor', 2)), (('data', 8), ('fsdp', 1), ('tensor', 1))),
], ids=['8 devices fsdp=4 -> 4 devices data=4', 'fsdp=4 x tensor=2 -> data=8'])
def test_a_run_resumes_on_another_mesh(data_dir, tmp_path, first, then):
  config = micro_config(data_dir, num_steps=6, checkpoint_every=3)
  config.mesh = then
  then_devices = jax.devices()[:np.prod([n for _, n in then])]
  straight = trainer.loop.train_and_evaluate(config, str(tmp_path / 'straight'),
                                             devices=then_devices)
  config.mesh = first
  trainer.loop.train_and_evaluate(config, str(tmp_path / 'run'), stop_after_steps=3)
  config.mesh = then
  resumed = trainer.loop.train_and_evaluate(config, str(tmp_path / 'run'),
                                            devices=then_devices)
  assert jax.tree.leaves(resumed.params)[0].sharding.mesh.shape == dict(then)
  # Sums over other shardings round differently; the data and the steps are the same.
  assert_same_arrays(jax.device_get(resumed.params), jax.device_get(straight.params),
                     rtol=1e-4, atol=1e-6)


class Counting:
  """Data shard s of a stream: example i of it is 1000 * s + i."""

  def __init__(self, shard, batch_size, workers):
    del workers  # made here
    self.shard, self.batch_size, self.position = shard, batch_size, 0

  def __next__(self):
    rows = 1000 * self.shard + self.position + np.arange(self.batch_size)
    self.position += self.batch_size
    return {'x': rows}

  def get_state(self):
    return {'position': self.position}

  def set_state(self, state):
    self.position = state['position']


def test_data_shards_give_the_same_global_batches_on_any_number_of_hosts():
  """Two shards read by 2 hosts, by 1 host, and split over 4 hosts: the same global batches."""

  def global_batches(hosts, steps=3, state=None):
    streams = [input_pipeline.ShardedStream(Counting, num_shards=2, global_batch=8,
                                            process_index=h, process_count=hosts)
               for h in range(hosts)]
    if state is not None:
      for stream in streams:
        stream.set_state(state)
    return [np.concatenate([next(s)['x'] for s in streams]) for _ in range(steps)], streams

  two, streams = global_batches(2)
  np.testing.assert_array_equal(two[0], [0, 1, 2, 3, 1000, 1001, 1002, 1003])
  for hosts in (1, 4):
    np.testing.assert_array_equal(global_batches(hosts)[0], two)
  # A checkpoint of the two hosts (each knows its shard) resumes on one host.
  state = {**streams[0].get_state(), **streams[1].get_state()}
  assert state == {0: {'position': 12}, 1: {'position': 12}}
  np.testing.assert_array_equal(global_batches(1, steps=1, state=state)[0][0],
                                [12, 13, 14, 15, 1012, 1013, 1014, 1015])
  with pytest.raises(ValueError, match='use a multiple of 6'):
    input_pipeline.ShardedStream(Counting, num_shards=2, global_batch=8, process_index=0,
                                 process_count=3)


def test_a_checkpoint_keeps_the_runs_data_layout(tmp_path):
  layout = {'blocks': 8, 'shards': [[0, 2, 4, 6], [1, 3, 5, 7]]}
  params = {'w': np.ones(3, np.float32)}
  mngr = checkpoints.manager(str(tmp_path), 2)
  checkpoints.save(mngr, 2, {'step': 2, 'params': params}, {0: {'i': 2}, 1: {'i': 2}}, 2,
                   layout=layout)
  checkpoints.wait(mngr)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype,
                                                         sharding=device),
                          {'step': 2, 'params': params})
  _, data = checkpoints.restore(mngr, abstract, str(tmp_path))
  assert data['layout'] == layout == checkpoints.newest_data(str(tmp_path))['layout']


def test_a_tpu_slices_hosts_feed_the_rows_their_chips_hold(monkeypatch):
  """On a TPU slice the mesh follows the chips' layout, so a host's batch shards need not be
  side by side (v4 2x2x2, data=8: host 0 holds 0, 2, 4, 6). Each host's local batch is placed
  on its devices by ascending row (make_array_from_process_local_data). The run's layout puts
  data shard p at the rows host p holds: each host reads its own shard alone, and the global
  batches are the same on one host resuming it (or any other mesh)."""
  for name, value in aot.QUIET_LIBTPU.items():
    monkeypatch.setenv(name, value)
  _, tpus = aot.topology_devices('v4:2x2x2')
  mesh_cfg = (('data', 8), ('fsdp', 1), ('tensor', 1))
  mesh = sharding.make_mesh(mesh_cfg, tpus)
  held = sharding.batch_shards_by_process(mesh)
  assert held[0] != {0, 1, 2, 3}, held  # interleaved: what this test is about
  sharding.check_processes_split_the_batch(held, mesh_cfg)
  layout = sharding.batch_layout(mesh)
  assert layout == {'blocks': 8, 'shards': [sorted(held[0]), sorted(held[1])]}
  one_device = (('data', 1), ('fsdp', 1), ('tensor', 1))
  assert sharding.batch_layout(sharding.make_mesh(one_device, jax.devices()[:1])) is None

  B, per_block = 16, 2
  shard_rows = sharding.shard_rows(layout, 2, B)
  streams = {p: input_pipeline.ShardedStream(
      Counting, num_shards=2, global_batch=B, process_index=p, process_count=2,
      rows=sharding.process_rows(mesh, B, p), shard_rows=shard_rows) for p in held}
  assert {p: list(s._shards) for p, s in streams.items()} == {0: [0], 1: [1]}  # its own alone
  local = {p: next(s)['x'] for p, s in streams.items()}
  placed = np.zeros(B, np.int64)
  for block in range(8):  # a block's rows: its place among its host's blocks, by row
    host = next(p for p, blocks in held.items() if block in blocks)
    at = sorted(held[host]).index(block) * per_block
    placed[block * per_block:(block + 1) * per_block] = local[host][at:at + per_block]
  # Data shard p's examples, in order, at the blocks host p holds.
  for p in held:
    np.testing.assert_array_equal(
        np.concatenate([placed[b * per_block:(b + 1) * per_block] for b in sorted(held[p])]),
        1000 * p + np.arange(B // 2))
  # One host resuming the run (its layout saved with the checkpoints): the same global batch.
  one_host = next(input_pipeline.ShardedStream(Counting, num_shards=2, global_batch=B,
                                               process_index=0, process_count=1,
                                               shard_rows=shard_rows))['x']
  np.testing.assert_array_equal(one_host, placed)
  # A batch size its blocks do not divide: shard after shard, as a run saved before layouts.
  assert sharding.shard_rows(layout, 2, 12) is None


# ----------------------------------------------------------------------------
# train.py in a subprocess: kill -9 anywhere, a full disk.
# ----------------------------------------------------------------------------

def command(workdir, data_dir, num_steps=48):
  return [sys.executable, os.path.join(ROOT, 'train.py'), '--config=configs/bert_base.py:tiny',
          f'--workdir={workdir}', f'--config.data.data_dir={data_dir}',
          '--config.model.num_layers=1', f'--config.train.num_steps={num_steps}',
          '--config.optimizer.warmup_steps=2', '--config.train.log_every=2',
          '--config.train.checkpoint_every=4', '--config.train.eval_every=1000',
          '--config.train.eval_steps=2']


ENV = end_to_end.env()  # one CPU device, compiled as the slow tier's end-to-end runs
# Data chunks of 20 documents: many units, so that a killed input worker is felt.
SMALL_CHUNKS = ['--config.data.docs_per_chunk=20']


@pytest.fixture(scope='module')
def straight_state(tmp_path_factory, shared_data_dir):
  """Step 48 of `command` + SMALL_CHUNKS run once, untouched: what every faulted run of the same
  command must end with (run once for the tests that kill processes or fill the disk)."""
  straight = tmp_path_factory.mktemp('straight') / 'run'
  subprocess.run(command(straight, shared_data_dir) + SMALL_CHUNKS, cwd=ROOT, env=ENV,
                 check=True, capture_output=True)
  return saved_state(straight, 48)


def wait_for(predicate, proc, log, timeout=300):
  deadline = time.time() + timeout
  while not predicate():
    assert proc.poll() is None, open(log).read()[-3000:]
    assert time.time() < deadline, open(log).read()[-3000:]
    time.sleep(0.002)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_the_same_command_finishes_bitwise_equal(
    tmp_path, shared_data_dir, straight_state):
  seed = int(os.environ.get('FAULT_SEED', time.time()))
  rng = random.Random(seed)
  run, checkpoint_dir = tmp_path / 'run', tmp_path / 'run' / 'checkpoints'
  in_write = 0
  kills = []
  for attempt in range(8):
    log = tmp_path / f'log{attempt}.txt'
    with open(log, 'w') as out:
      proc = subprocess.Popen(command(run, shared_data_dir) + SMALL_CHUNKS, cwd=ROOT, env=ENV,
                              stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: 'First step' in open(log).read(), proc, log)
    if attempt % 2:  # inside a checkpoint write: as soon as its temporary directory appears
      wait_for(lambda: any('tmp' in n for n in os.listdir(checkpoint_dir)), proc, log)
    else:
      time.sleep(rng.uniform(0, 1.5))
    if proc.poll() is not None:
      break  # finished before the kill
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = os.listdir(checkpoint_dir)
    in_write += any('tmp' in n for n in left)
    kills.append(sorted(left))
    if len(kills) == 4 and in_write:
      break
  assert in_write, f'no kill landed inside a checkpoint write (seed {seed}): {kills}'
  subprocess.run(command(run, shared_data_dir) + SMALL_CHUNKS, cwd=ROOT, env=ENV, check=True,
                 capture_output=True)
  assert_same_arrays(saved_state(run, 48), straight_state)


def children_with(pid, marker):
  """The child processes of train.py `pid` whose command line holds `marker`."""
  found = []
  for task in os.listdir(f'/proc/{pid}/task'):
    with open(f'/proc/{pid}/task/{task}/children', encoding='ascii') as f:
      for child in f.read().split():
        with open(f'/proc/{child}/cmdline', 'rb') as cmdline:
          if marker in cmdline.read():
            found.append(int(child))
  return found


def input_workers(pid):
  """The grain worker processes of train.py `pid` (multiprocessing's spawned children, not its
  resource tracker)."""
  return children_with(pid, b'--multiprocessing-fork')


@pytest.mark.slow
@pytest.mark.parametrize('victim,marker,line', [
    ('worker', b'--multiprocessing-fork', 'A data worker died'),
    ('tracker', b'resource_tracker', 'The multiprocessing resource tracker died')])
def test_a_killed_input_worker_or_tracker_leaves_one_line_and_the_run_finishes_bitwise_equal(
    tmp_path, shared_data_dir, straight_state, victim, marker, line):
  run, log = tmp_path / 'run', tmp_path / 'log.txt'
  with open(log, 'w') as out:
    proc = subprocess.Popen(command(run, shared_data_dir) + SMALL_CHUNKS +
                            ['--config.data.workers=2'], cwd=ROOT, env=ENV, stdout=out,
                            stderr=subprocess.STDOUT)
  wait_for(lambda: 'First step' in open(log).read(), proc, log)
  workers = input_workers(proc.pid)
  assert len(workers) == 2, workers
  victims = children_with(proc.pid, marker)
  assert len(victims) == (2 if victim == 'worker' else 1), victims
  os.kill(victims[0], signal.SIGKILL)
  assert proc.wait(timeout=300) == 0, open(log).read()[-3000:]  # a finished run's status
  text = open(log).read()
  assert text.count(line) == 1, text[-3000:]
  # The blocks of shared memory it held are removed without the tracker's leak warning.
  for noise in ('Traceback', 'leaked', 'UserWarning', 'resource_tracker'):
    assert noise not in text, text[-3000:]
  assert_same_arrays(saved_state(run, 48), straight_state)


@pytest.mark.slow
def test_a_full_disk_while_saving_loses_no_checkpoint(tmp_path, shared_data_dir, straight_state):
  """The workdir on a 16 MiB tmpfs (a user namespace mounts it): step 4's checkpoint fits,
  step 8's does not. The run stops in one line naming step 4, which restores; the same
  command, with space again, finishes bitwise equal to a run that never filled the disk (the
  straight run of the tests above)."""
  if subprocess.run(['unshare', '-rm', 'true'], capture_output=True).returncode:
    pytest.skip('unshare -rm (a user namespace, to mount a small tmpfs) is not permitted here')
  mount, kept = tmp_path / 'small_disk', tmp_path / 'kept'
  mount.mkdir()
  script = ('mount -t tmpfs -o size=16m none "$0" && "$@"; code=$?; '
            f'cp -a "$0/run" {kept}; exit $code')
  result = subprocess.run(['unshare', '-rm', 'sh', '-c', script, str(mount),
                           *command(mount / 'run', shared_data_dir), *SMALL_CHUNKS],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('train.py: stopped: A checkpoint could not be written (') and (
      'No space left on device' in last and 'the newest complete one' in last and
      'is step 4: free disk space' in last), last
  assert sorted(n for n in os.listdir(kept / 'checkpoints') if n.isdigit()) == ['4']
  assert checkpoints.non_finite(saved_state(kept, 4)) == []
  resumed = subprocess.run(command(kept, shared_data_dir) + SMALL_CHUNKS, cwd=ROOT, env=ENV,
                           capture_output=True, text=True)
  assert resumed.returncode == 0 and 'Resuming from step 4' in resumed.stdout, resumed.stderr
  assert_same_arrays(saved_state(kept, 48), straight_state)


def test_a_metrics_line_cut_by_a_kill_is_dropped_when_the_run_resumes(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 2, "loss": 7.5}\n{"step": 4, "lo', encoding='utf-8')
  writer = metric_writer.MetricWriter(str(tmp_path), total_steps=8)
  writer.write(4, {'loss': 7.25})
  writer.close()
  lines = [json.loads(line) for line in path.read_text(encoding='utf-8').splitlines()]
  assert [(m['step'], m['loss']) for m in lines] == [(2, 7.5), (4, 7.25)]
