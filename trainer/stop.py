"""Stopping a run by signal: SIGTERM (a preemption), a hangup and Ctrl-C save a checkpoint
first (trainer/loop.py asks `requested` at each step and saves inside `deferred`)."""

import contextlib
import os
import signal
import stat
import sys

import jax
from jax.experimental import multihost_utils
import numpy as np

# train.py's exit status when a signal stopped the run before train.num_steps, after saving:
# "unfinished, resume me" (sysexits.h's EX_TEMPFAIL, "try again later"), the same on every
# host. Not 0, so that no scheduler counts a stopped run as a success (SLURM's afterok would
# start the runs that start from it), and not 1, an error's, so that a job script can tell
# the two apart and requeue only this one (trainer/slurm.py).
RESUME_EXIT_STATUS = 75
# Hosts agree on a stop at least this often: SLURM warns 120 s before a time limit, and at
# log_every=100 steps of 1.5 s (BERT-large at 512 tokens) they agreed after it, unsaved.
AGREE_EVERY = 10


def signals_to_handle() -> tuple[signal.Signals, ...]:
  """SIGTERM, SIGINT, and SIGHUP (a terminal or ssh session closed) unless it is ignored, as
  under nohup: a run asked to outlive its terminal keeps doing so."""
  hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
  return (signal.SIGTERM, signal.SIGINT) + hangup


def exit_status(step: int, num_steps: int) -> int:
  """train.py's exit status for a run that returned at `step`: 0 finished, else "resume me".
  Every host returns at the same step (the hosts agree on a stop), so every host says the same."""
  return 0 if step >= num_steps else RESUME_EXIT_STATUS


class StopRequested:
  """SIGTERM (a preemption) or Ctrl-C (SIGINT, also a notebook's interrupt): the loop saves a
  checkpoint at the next step boundary and stops.

  On one host, Ctrl-C stops at once (KeyboardInterrupt) before this run's first step has
  finished, when there is nothing to save, and when pressed a second time; inside `deferred()`
  (a checkpoint's save or write, the input workers' stop) it waits for the block to end first,
  so that the newest complete checkpoint is always one to resume from. On several hosts every
  Ctrl-C is a stop request like SIGTERM: one host stopping alone would leave the others
  waiting in a collective.
  """

  def __init__(self):
    self.signal_name = None  # the first stop signal received
    self.trained = False  # set once this run's first step has finished
    self.deferring = False
    self.at_once_when_done = False

  def __call__(self, signum, frame):
    del frame
    interrupt, one_host = signum == signal.SIGINT, jax.process_count() == 1
    if interrupt and one_host and (not self.trained or self.signal_name == 'SIGINT'):
      if not self.deferring:
        # Recorded first: Python drops an exception raised while a garbage collector's callback
        # runs (jax's), and the loop then stops at its next step instead of never.
        self.signal_name = self.signal_name or 'SIGINT'
        raise KeyboardInterrupt
      if not self.at_once_when_done:
        _say('Ctrl-C: the run stops once the checkpoint being written (if any) is complete and '
             'the input workers have stopped (kill -9 would stop it at once; the previous '
             'checkpoint stays complete).')
      self.at_once_when_done = True
      return
    if signum == signal.SIGHUP:
      _leave_the_terminal()
    first = self.signal_name is None
    # Set before the notice: a second Ctrl-C may run this handler while the first one prints.
    self.signal_name = self.signal_name or signal.Signals(signum).name
    if interrupt and first:
      _say('Ctrl-C: the run saves a checkpoint after this step (and an eval under way) and stops '
           + ('(Ctrl-C again stops at once, losing the steps since the last checkpoint).'
              if one_host else 'when the hosts next agree, every train.log_every steps.'))

  @contextlib.contextmanager
  def deferred(self):
    """A Ctrl-C meant to stop at once waits until the block ends."""
    self.deferring = True
    try:
      yield
    finally:
      self.deferring = False
    if self.at_once_when_done:
      raise KeyboardInterrupt

  @property
  def flag(self) -> bool:
    return self.signal_name is not None

  def requested(self, step: int, log_every: int) -> bool:
    """Whether any host got a stop signal; hosts agree every min(log_every, AGREE_EVERY) steps
    (a collective)."""
    if jax.process_count() == 1:
      return self.flag
    if step % min(log_every, AGREE_EVERY):
      return False
    return bool(np.asarray(multihost_utils.process_allgather(np.array(self.flag))).any())

  def describe(self) -> str:
    return ('Ctrl-C' if self.signal_name == 'SIGINT' else self.signal_name or
            "Another host's stop signal")


def _leave_the_terminal() -> None:
  """stdout and stderr to /dev/null where they are a terminal (a character device): after a
  hangup every write to it fails (EIO), and the run's next progress line would end it with a
  traceback before its checkpoint. Files and pipes (a log, a sweep's) stay."""
  for fd in (1, 2):
    try:
      if stat.S_ISCHR(os.fstat(fd).st_mode) and os.path.realpath(f'/proc/self/fd/{fd}') != (
          os.devnull):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
      pass


def _say(line: str) -> None:
  """A line on stderr from a signal handler: the main thread may be inside a write to it."""
  try:
    print(line, file=sys.stderr, flush=True)
  except RuntimeError:  # a reentrant write to the buffered stream
    os.write(2, line.encode() + b'\n')
