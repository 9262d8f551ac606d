"""Where a checkpoint read that fails leaves its noise: the console gets one line (checkpoints.py),
the workdir's restore log gets the full error and what the reads orbax abandons print later."""

import contextlib
import inspect
import logging
import os
import re
import sys
import tempfile
import traceback

import jax


def path(workdir: str) -> str:
  """Where a failed restore's full error goes (this host's file): the console gets one line."""
  index = jax.process_index()
  return os.path.join(os.path.abspath(workdir),
                      'restore_errors.log' if index == 0 else f'restore_errors.process_{index}.log')


class AbandonedReadsFilter(logging.Filter):
  """Sends asyncio's '<Task, Future, ...> exception was never retrieved' records to a log file
  instead."""

  def __init__(self, log: str):
    super().__init__()
    self.log = log

  def filter(self, record: logging.LogRecord) -> bool:
    if not re.match(r'\w+ exception was never retrieved', record.getMessage()):
      return True
    with open(self.log, 'a', encoding='utf-8') as f:
      f.write(record.getMessage() + '\n')
      if record.exc_info:
        f.write(''.join(traceback.format_exception(*record.exc_info)))
    return False


def log_abandoned_reads(log: str) -> None:
  """From now on, what the reads orbax abandons when one array of a checkpoint cannot be read
  print when they are collected (at any later moment) goes to `log`: the errors of coroutines
  dropped unfinished, and asyncio's 'Task (or Future) exception was never retrieved' with each
  one's traceback. Every other unraisable error or asyncio record is printed as before."""
  asyncio_logger = logging.getLogger('asyncio')
  installed = [f for f in asyncio_logger.filters if isinstance(f, AbandonedReadsFilter)]
  if installed:  # a restore failed before (in a notebook, another workdir's maybe)
    installed[0].log = log
  else:
    asyncio_logger.addFilter(AbandonedReadsFilter(log))
  if hasattr(sys.unraisablehook, 'abandoned_reads_log'):
    sys.unraisablehook.abandoned_reads_log = log
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not inspect.iscoroutine(unraisable.object):
      previous(unraisable)
      return
    with open(hook.abandoned_reads_log, 'a', encoding='utf-8') as f:
      f.write(f'{unraisable.err_msg or "Exception ignored in"}: {unraisable.object!r}\n')
      f.write(''.join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                 unraisable.exc_traceback)))

  hook.abandoned_reads_log = log
  sys.unraisablehook = hook


@contextlib.contextmanager
def held_stderr(log: str):
  """What is written to stderr (file descriptor 2) inside is held: printed after the block if it
  succeeded, appended to `log` if it raised."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    failed = False
    try:
      yield
    except BaseException:
      failed = True
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = held.read().decode('utf-8', 'replace')
      if failed and text:
        with open(log, 'a', encoding='utf-8') as f:
          f.write(text)
      elif text:
        sys.stderr.write(text)
        sys.stderr.flush()


def named_if_grown(log: str, logged: int) -> str:
  """Where this restore's read errors are, if it had any."""
  grew = os.path.exists(log) and os.path.getsize(log) > logged
  return f' (the full error: {log})' if grew else ''
