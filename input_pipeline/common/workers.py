"""A pipeline's units (chunks of examples, or batches) made ahead by grain worker processes.

A resumable iterator here is a cursor that cuts batches from a sequence of
units; `maker(u)` makes the u-th unit after the position the cursor was set
to, a pure function of u. With W workers, grain's mp_prefetch gives unit u to
worker u mod W and reads the workers back in turn, so the units arrive in the
order one process makes them, whatever W is; the cursor's position (not a
worker's) is what a checkpoint keeps, so a run resumes with any number of
workers. W = 0 makes the units in a thread of this process.

A worker that dies (killed, out of memory) is replaced: the stream starts
again at the first unit it has not handed out. An error that a unit raises
is re-raised here as it was.
"""

import contextlib
import multiprocessing
from multiprocessing import resource_tracker
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator
import warnings

from absl import flags
from absl import logging
import grain

# Units each worker makes ahead of the consumer (a unit is a chunk of up to data.docs_per_chunk
# documents' examples, or one batch).
UNITS_AHEAD = 2
# Restarts after a worker death without a unit handed out in between before the run stops.
MAX_RESTARTS = 3
# How often a worker looks whether the training process that started it is still there.
PARENT_POLL_SECONDS = 1.0
# grain's words for a worker that exited without an error of its own.
_WORKER_DIED = 'terminated unexpectedly'


def default_workers(platform: str, local_devices: int) -> int:
  """data.workers=-1: none on a CPU run (the step wants the cores), else up to 4 per local
  accelerator, leaving two cores to the training process."""
  if platform == 'cpu':
    return 0
  return max(1, min((os.cpu_count() or 1) - 2, 4 * local_devices))


def configured(data_cfg: Any) -> int:
  """data.workers of a pipeline built directly (a test, a program); -1 (auto, which
  input_pipeline.num_workers resolves for a training host) makes the units in this process."""
  return max(0, data_cfg.get('workers', 0))


class WorkersDied(RuntimeError):
  """The workers died MAX_RESTARTS + 1 times in a row."""


class UnitStream:
  """maker(0), maker(1), ... made ahead by `workers` processes (0: one thread here)."""

  def __init__(self, maker: Callable[[int], Any], workers: int):
    self._maker, self._workers = maker, workers
    self._handed_out, self._restarts = 0, 0
    self._iterator = None
    self._tracker = 0  # _tracker_starts when the workers started
    self._processes: list[multiprocessing.Process] = []  # the running workers
    self._before: set[multiprocessing.Process] = set()  # processes of this one before they started

  def __iter__(self) -> 'UnitStream':
    return self

  def __next__(self) -> Any:
    while True:
      if self._iterator is not None and self._workers and self._tracker != _tracker_starts:
        # The resource tracker died and was started again: new workers, which register their
        # shared memory with the new one, go on from the next unit.
        self.close()
      if self._iterator is None:
        self._before = set(multiprocessing.active_children())
        self._tracker = _tracker_starts
        self._iterator = self._start(self._handed_out)
      try:
        unit = next(self._iterator)
      except Exception as error:
        self._processes = []  # a death is reported here, not again by close()
        self.close()  # an error ends the stream: no worker stays behind
        if not isinstance(error, RuntimeError) or _WORKER_DIED not in str(error):
          raise
        if self._restarts >= MAX_RESTARTS:
          raise WorkersDied(f'The data workers died {MAX_RESTARTS + 1} times in a row ({error}): '
                            'find the cause above (memory?), lower config.data.workers (0: '
                            'none), and run the same command to resume.') from None
        self._restarts += 1
        logging.warning('A data worker died (%s); starting the workers again at unit %d.',
                        error, self._handed_out)
        continue
      if self._workers and not self._processes:  # grain starts them at the first unit
        self._processes = [p for p in multiprocessing.active_children()
                           if p not in self._before and p.name.startswith('grain-')]
      self._handed_out += 1
      self._restarts = 0
      return unit

  def close(self) -> None:
    """Stops the workers (or the thread) and drops the units made ahead; a worker that died
    unnoticed (no unit of it was wanted since) is reported in one line."""
    dead = [p.exitcode for p in self._processes if p.exitcode not in (None, 0)]
    if dead:
      logging.warning('A data worker died (exit code %d) after making the last unit the run '
                      'took from it, so nothing was lost.', dead[0])
    self._processes = []
    if self._iterator is not None:
      iterator, self._iterator = self._iterator, None
      close = getattr(iterator, 'close', None)
      if close is not None:
        close()

  def _start(self, first: int) -> Iterator[Any]:
    # grain reads its settings from absl flags, unparsed in a notebook or under pytest.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    units = grain.MapDataset.range(first, first + 2**62).map(self._maker)
    if self._workers == 0:  # one unit ahead: an eval or a test that stops early wastes little
      return iter(units.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                          prefetch_buffer_size=1)))
    quiet_resource_tracker()
    # In a worker, units are made one after another (a unit's maker reads forward).
    in_order = units.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return iter(in_order.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=self._workers, per_worker_buffer_size=UNITS_AHEAD),
        worker_init_fn=_set_up_worker))


def _set_up_worker(worker_index: int, worker_count: int) -> None:
  """A worker's tokenizers stay on one core: the workers are the parallelism (HF tokenizers
  would otherwise start a thread per core in every worker). A terminal's Ctrl-C or hangup and a
  cluster's SIGTERM before its time limit (SLURM's --signal reaches every process of the job)
  are the training process's to handle: it saves, then stops the workers (grain's stop event,
  SIGKILL after 25 s), which would otherwise die, be said to, and be started again."""
  del worker_index, worker_count
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)
  # So a training process killed outright (kill -9, the OOM killer) leaves no worker behind
  # that only kill -9 would end: its workers exit within a second of it.
  threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
  _use_tracker_while_it_lives()


def _exit_with_parent(parent: int) -> None:
  while os.getppid() == parent:
    time.sleep(PARENT_POLL_SECONDS)
  os._exit(0)  # pylint: disable=protected-access


def quiet_resource_tracker() -> None:
  """Starts Python's resource tracker, which the workers' queues and shared memory blocks
  register with, with its output discarded, unless it runs already (another library's keeps
  its output); a tracker that dies later is started again the same way, with one line.

  A worker killed with units under way leaves their blocks to the tracker: it removes them
  when the training process exits, and would warn of 'leaked shared_memory objects' (the stream
  reports the dead worker itself). A new tracker knows nothing of what the dead one held: it
  would print a KeyError traceback for each of them that is given back.
  """
  tracker = resource_tracker._resource_tracker  # pylint: disable=protected-access
  if getattr(tracker, '_fd', 0) is not None:  # started (or a Python that names it otherwise)
    return
  with _quiet_stderr():
    tracker.ensure_running()
  if hasattr(tracker, '_check_alive') and not hasattr(tracker, '_ensure_running_loudly'):
    tracker._ensure_running_loudly = tracker.ensure_running
    tracker.ensure_running = _ensure_running_quietly


# How many times the training process started a new resource tracker after its last one died.
_tracker_starts = 0
_tracker_lock = threading.RLock()  # re-entered if a finalizer that unregisters runs inside


def _ensure_running_quietly() -> None:
  """The tracker's ensure_running(), for every register and unregister: a dead tracker is
  started again with one line, instead of multiprocessing's warning and a new tracker that
  writes to the terminal."""
  global _tracker_starts
  tracker = resource_tracker._resource_tracker  # pylint: disable=protected-access
  with _tracker_lock:
    if tracker._fd is not None and not tracker._check_alive():
      _tracker_starts += 1
      logging.warning('The multiprocessing resource tracker died (killed?); started a new one '
                      'and new data workers, which use it.')
      with warnings.catch_warnings(), _quiet_stderr():
        warnings.simplefilter('ignore')
        tracker._ensure_running_loudly()
      return
  tracker._ensure_running_loudly()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
  """File descriptor 2 on /dev/null: a tracker started meanwhile writes there for good."""
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, 'wb') as devnull:
      os.dup2(devnull.fileno(), 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


def _use_tracker_while_it_lives() -> None:
  """In a worker: its blocks are registered with the training process's tracker while that
  lives, and with none after it died. multiprocessing would start a tracker of the worker's
  own, which removes every block the worker made when the worker stops, blocks the training
  process still reads (the run then fails on 'No such file or directory: /psm_...')."""
  tracker = resource_tracker._resource_tracker  # pylint: disable=protected-access
  fd = getattr(tracker, '_fd', None)
  if fd is None or not hasattr(tracker, '_send'):
    return
  alive = [True]

  def send(command: str, name: str, rtype: str) -> None:
    if alive[0]:
      try:
        os.write(fd, f'{command}:{name}:{rtype}\n'.encode('ascii'))
      except OSError:  # the pipe's reader, the tracker, is gone
        alive[0] = False

  tracker._send = send
