"""Writes metrics to the console, to workdir/metrics.jsonl and to TensorBoard (host 0 only).

Not clu's metric_writers or periodic_actions (what the Flax examples use): clu 0.0.12
imports TensorFlow with them (through its TensorBoard writer; 3.2 s and TF's memory in
every run here), where tensorboardX writes the same event files without it; and
metrics.jsonl needs a writer of its own either way.
"""

import json
import math
import os
import sys
import time

import jax


def _format(value: float) -> str:
  if value == 0 or 1e-3 <= abs(value) < 1e5:
    return f'{value:.4g}'
  return f'{value:.3e}'


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  h, m, s = seconds // 3600, seconds % 3600 // 60, seconds % 60
  return f'{h}h{m:02d}m' if h else f'{m}m{s:02d}s'


def has_results(workdir: str, step: int) -> bool:
  """Whether the run's metrics.jsonl holds a results line (written after the final eval) at
  `step`: a run extended to more steps has its earlier run's results, which are not these."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return False
  with open(path, encoding='utf-8') as f:
    lines = (json.loads(line) for line in f if '"results"' in line)
    return any('results' in line and line.get('step') == step for line in lines)


def has_eval(workdir: str, step: int) -> bool:
  """Whether the run's metrics.jsonl holds an eval line at `step`."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return False
  with open(path, encoding='utf-8') as f:
    lines = (json.loads(line) for line in f if '"eval_' in line and line.endswith('\n'))
    return any(line.get('step') == step and 'results' not in line for line in lines)


def _drop_unfinished_line(path: str) -> None:
  """Cuts a last line that a killed run left half-written, so that appended lines stay JSON."""
  if not os.path.exists(path):
    return
  with open(path, 'rb+') as f:
    data = f.read()
    if data and not data.endswith(b'\n'):
      f.truncate(data.rfind(b'\n') + 1)


def _drop_lines_after(path: str, step: int) -> None:
  """Cuts the lines of steps after `step`, the checkpoint a run resumes from: a run killed
  later logged them, and logs them again (one line per logged step)."""
  if not os.path.exists(path):
    return
  with open(path, 'rb+') as f:
    lines = f.read().splitlines(keepends=True)
    keep = 0
    for keep, line in enumerate(lines):
      if not line.strip():
        continue  # a blank line (an editor's) holds no step
      try:
        logged = json.loads(line).get('step', 0)
      except ValueError as e:
        raise ValueError(f'{path}: line {keep + 1} is not JSON ({e}): fix or delete that line '
                         'to resume the run.') from None
      if logged > step:
        break
    else:
      return
    f.seek(sum(len(line) for line in lines[:keep]))
    f.truncate()


def _summary_writer(directory: str, purge_step: int | None):
  """tensorboardX's SummaryWriter, imported without torch. Its writer module imports torch
  wherever torch is installed, only to accept torch tensors, which this writer never passes
  (floats only): 1.3 s of every run's start and torch's memory here. A process that has
  imported torch already keeps it. TensorBoard hides the events of a killed run's steps from
  `purge_step` on."""
  blocked = 'torch' not in sys.modules
  if blocked:
    sys.modules['torch'] = None  # `import torch` raises ImportError, which tensorboardX expects
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    if blocked:
      del sys.modules['torch']
  return SummaryWriter(directory, purge_step=purge_step)


class MetricWriter:
  """One JSON object per logged step; TensorBoard scalars; one console line."""

  def __init__(self, workdir: str, total_steps: int, resumed_step: int | None = None):
    self.total_steps = total_steps
    self.active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if self.active:
      path = os.path.join(workdir, 'metrics.jsonl')
      _drop_unfinished_line(path)
      if resumed_step is not None:
        _drop_lines_after(path, resumed_step)
      self._jsonl = open(path, 'a', encoding='utf-8')
      self._tb = _summary_writer(os.path.join(workdir, 'tensorboard'),
                                 None if resumed_step is None else resumed_step + 1)

  def write(self, step: int, metrics: dict[str, float], *, prefix: str = '',
            steps_per_sec: float | None = None, fields: dict[str, int] | None = None) -> None:
    """A row of `metrics` (names prefixed), with `fields` that say what they were measured on
    (the phase's max_seq_length): not metrics, so neither prefixed nor in TensorBoard."""
    if not self.active:
      return
    named = {prefix + k: float(v) for k, v in metrics.items()}
    fields = fields or {}
    self._jsonl.write(json.dumps({'step': step, 'time': time.time(), **fields, **named}) + '\n')
    self._jsonl.flush()
    for k, v in named.items():
      if math.isfinite(v):
        self._tb.add_scalar(k, v, step)
    self._tb.flush()
    shown = ' | '.join([f'{k} {v}' for k, v in fields.items()] +
                       [f'{k} {_format(v)}' for k, v in named.items()])
    eta = ''
    if steps_per_sec:
      eta = f' | ETA {_duration((self.total_steps - step) / steps_per_sec)}'
    print(f'step {step}/{self.total_steps} | {shown}{eta}', flush=True)

  def results(self, step: int, metrics: dict[str, float], workdir: str, *,
              fields: dict[str, int] | None = None) -> None:
    """The run's final eval metrics: one 'results' line in metrics.jsonl and a console summary."""
    if not self.active:
      return
    final = {k: float(v) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({'step': step, 'time': time.time(), **(fields or {}),
                                  'results': final}) + '\n')
    self._jsonl.flush()
    shown = '\n'.join(f'  {k:<24} {_format(v)}' for k, v in final.items())
    print(f'Results of {workdir} at step {step} (eval split):\n{shown}', flush=True)

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tb.close()
