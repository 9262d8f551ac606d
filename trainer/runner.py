"""A sweep's runs (sweep.py's Run: a train.py command, its workdir and the run it starts from),
run: one at a time on the whole machine, side by side on slices of it (trainer/slices.py), or
as SLURM jobs (trainer/slurm.py); and whether a run has finished.

A run starts only once the run it starts from has finished; a run that fails or stops
unfinished stops only the runs that start from it.
"""

import functools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from trainer import checkpoints
from trainer import cli
from trainer import slices
from trainer import slurm
from trainer import stop as stop_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's


def read_metrics(workdir: str) -> tuple[list[dict], dict | None]:
  """The run's logged lines (a step logged again after a resume keeps its last line) and
  its results, if the run finished."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return [], None
  by_key, results = {}, None
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if not line.endswith('\n'):  # a last line cut by a kill: the run's resume drops it
          continue
        raise ValueError(f'{path}: line {number} is not JSON ({e}): fix or delete that line '
                         '(or move the run directory aside to run it again).') from None
      if 'results' in record:
        results = dict(record['results'], step=record['step'])
        continue
      kind = 'eval' if any(k.startswith('eval_') for k in record) else 'train'
      by_key[(kind, record['step'])] = record
  return [by_key[k] for k in sorted(by_key, key=lambda k: (k[1], k[0]))], results


def requested(run: Any) -> dict[str, Any]:
  """What the sweep asks of the run, as its config.json holds it (tuples as lists; dotted field
  -> value): the seed, each override, and every other field of its config file (with the
  overrides set, as train.py sets them) but those left unset (None: taken from init_from) and
  config.init_from (the sweep's to give, by a path of any spelling: started_from checks it)."""
  return json.loads(_requested(run.config, run.seed, json.dumps(run.overrides)))


@functools.lru_cache(maxsize=None)
def _requested(config_arg: str, seed: int, overrides: str) -> str:
  path, _, variant = config_arg.partition(':')
  config = cli.config_from_file(os.path.join(ROOT, path), variant)  # a fresh one: set below
  for key, value in [('seed', seed)] + json.loads(overrides):
    *parents, last = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[last] = tuple(value) if isinstance(node[last], tuple) else value
  fields = {k: v for k, v in _leaves(json.loads(config.to_json_best_effort())).items()
            if v is not None and k != 'init_from'}
  return json.dumps({**fields, 'seed': seed, **dict(json.loads(overrides))})


def _leaves(tree: dict, prefix: str = '') -> dict[str, Any]:
  found = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      found.update(_leaves(value, f'{prefix}{key}.'))
    else:
      found[prefix + key] = value
  return found


_ABSENT = '(absent)'
# Fields that change how a run runs, not what it computes (its input workers, logging and
# checkpoints, its mesh: a resume on another one is exact): a default edited since does not
# set a run's results aside.
OPERATIONAL = ('data.workers', 'data.data_dir', 'train.log_every', 'train.checkpoint_every',
               'train.keep_checkpoints', 'mesh', 'logical_axis_rules')


def _saved_config(run: Any) -> dict | None:
  path = os.path.join(run.workdir, 'config.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def changes(run: Any, saved: dict | None = None) -> list[tuple[str, Any, Any]]:
  """(field, value in the run's config.json (`saved`, else read), value the sweep asks) where
  they differ; none for a run that has not started. A sweep file, a stage's config file or a
  base override changed since the run ran would otherwise count its old results as the new
  sweep's."""
  saved = saved or _saved_config(run)
  if saved is None:
    return []
  found, asked = [], {key for key, _ in run.overrides} | {'seed', 'train.num_steps'}
  for field, value in requested(run).items():
    if field in OPERATIONAL:
      continue
    node = saved
    for part in field.split('.'):
      node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
    # A field the run's code had not yet (absent from its config.json) counts only if asked.
    if node != value and (node != _ABSENT or field in asked):
      found.append((field, node, value))
  return found


# A run started from config.init_from writes here which step of it (trainer/loop.py).
STARTED_FROM = 'started_from.json'


def started_from(run: Any) -> int | None:
  """The step of run.init_from's checkpoint the run started from; None if it says nothing
  (not started, or started before runs wrote it)."""
  path = os.path.join(run.workdir, STARTED_FROM)
  if not run.init_from or not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return int(json.load(f)['step'])


def check_unchanged(runs: list[Any]) -> None:
  """One line naming the fix for a run that ran with other settings than the sweep now asks
  (more train.num_steps are the run's to catch up on: it is then unfinished; fewer, once it
  has a checkpoint, train.py refuses: trainer.checks.check_workdir), or that started from a
  state of its init_from run other than the one the sweep now trains that run to (the
  fine-tuning of a pretraining since extended)."""
  by_workdir = {run.workdir: run for run in runs}
  for run in runs:
    changed = [c for c in changes(run) if c[0] != 'train.num_steps' or (
        c[1] != _ABSENT and c[2] < c[1] and checkpoints.exist(run.workdir))]
    if changed:
      field, saved, value = changed[0]
      raise ValueError(f'{run.workdir} ran with {field}={json.dumps(saved)} but the sweep now '
                       f'asks {field}={json.dumps(value)}: undo the change, use a new '
                       '--workdir, or delete that run\'s directory to run it again.')
    step, upstream = started_from(run), by_workdir.get(run.init_from)
    if step is not None and upstream is not None:
      target = requested(upstream)['train.num_steps']
      if step != target:
        raise ValueError(f'{run.workdir} started from step {step} of {run.init_from}, which the '
                         f'sweep now trains to step {target}: undo the change, use a new '
                         '--workdir, or delete that run\'s directory to run it again.')


def finished(run: Any) -> bool:
  """Its results line is at train.num_steps, it ran with the settings the sweep asks, and
  it started from the state its init_from run has its results at."""
  return unfinished_because(run) is None


def unfinished_because(run: Any) -> str | None:
  """Why the run is not one of the sweep's results (None when it is): see finished."""
  saved = _saved_config(run)
  if saved is None:
    return 'it has not started'
  lines, results = read_metrics(run.workdir)
  if results is None:
    step = max((line['step'] for line in lines), default=0)
    return f'it has no results line (logged up to step {step} of {saved["train"]["num_steps"]})'
  if results['step'] != saved['train']['num_steps']:
    return f'its results are at step {results["step"]} of {saved["train"]["num_steps"]}'
  changed = changes(run, saved)
  if changed:
    field, theirs, ours = changed[0]
    return (f'it ran with {field}={json.dumps(theirs)} and the sweep asks '
            f'{field}={json.dumps(ours)}')
  step = started_from(run)
  if step is None:
    return None
  # Its pretraining unfinished (deleted to train again, say): not the sweep's result either.
  upstream = read_metrics(run.init_from)[1]
  if upstream is None or upstream['step'] != step:
    return (f'it started from step {step} of {run.init_from}, which has '
            + ('no results' if upstream is None else f'its results at step {upstream["step"]}'))
  return None


class Interrupted(Exception):
  pass


def run_mesh(run: Any):
  """config.mesh of the run: its override, else its config file's."""
  overrides = dict(run.overrides)
  if 'mesh' in overrides:
    return overrides['mesh']
  path, _, variant = run.config.partition(':')
  return _config(path, variant).mesh


@functools.lru_cache(maxsize=None)
def _config(path: str, variant: str):
  return cli.config_from_file(os.path.join(ROOT, path), variant)


def check_slices(runs: list[Any], cut: list[slices.Slice]) -> None:
  """One line naming the fix if a run's mesh does not fit a slice's devices."""
  for run in runs:
    reason = slices.mesh_refusal(run_mesh(run), cut[0].num_devices)
    if reason:
      raise ValueError(f'--parallel={len(cut)}: {run.stage} {os.path.basename(run.workdir)}: '
                       f'{reason}, and a slice has {cut[0].num_devices}: pass a smaller '
                       '--parallel, or change the mesh.')


def run_all(runs: list[Any], workdir: str,
            cut: list[slices.Slice] | None = None) -> list[Any]:
  """Runs what is not finished, each on a free slice of `cut` (None: one at a time, on the
  whole machine); a run starts as soon as the run it starts from has finished. Returns the
  runs that failed or stopped unfinished (train.py's exit status 75 for a signal that was not
  the sweep's), and the runs that start from them (not run).

  SIGINT, SIGTERM and SIGHUP (unless ignored, as under nohup) are passed on to every running
  train.py as SIGTERM, so that each saves a checkpoint before the sweep stops."""
  os.makedirs(os.path.join(workdir, 'logs'), exist_ok=True)
  free = list(cut) if cut else [None]
  waiting = list(enumerate(runs, 1))
  running = {}  # Popen -> (run, its slice, head, log path)
  failed, stopping, stopped, stopped_early = [], [], [], []

  def stop(signum, frame):
    del signum, frame
    stopping.append(True)
    for child in running:
      if child.poll() is None:
        child.send_signal(signal.SIGTERM)

  def head(index, run):
    return f'[{index}/{len(runs)}] {run.stage} {os.path.basename(run.workdir)}'

  def start(index, run, where):
    path = log_path(run, workdir)
    on = f' on {where.describe()}' if where else ''
    print(f'{head(index, run)}: running{on}; log {path}\n  {shlex.join(run.argv())}',
          flush=True)
    with open(path, 'a', encoding='utf-8') as log:
      if where:
        log.write(f'sweep.py: {run.stage} {os.path.basename(run.workdir)} on '
                  f'{where.describe()}: {" ".join(f"{k}={v}" for k, v in where.env)}\n')
        log.flush()
      # Its own session: a Ctrl-C reaches the sweep only, which passes on a SIGTERM.
      child = subprocess.Popen(
          [sys.executable] + run.argv()[1:], stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True, env=where.environment(os.environ) if where else None,
          preexec_fn=where.pin if where else None)
    running[child] = (run, where, head(index, run), path)
    if stopping:  # the signal came while it started
      child.send_signal(signal.SIGTERM)

  def finish(child):
    run, where, title, path = running.pop(child)
    free.append(where)
    free.sort(key=lambda s: s.index if s else 0)
    code = child.returncode
    on = f' (on {where.describe()})' if where else ''
    # The sweep's SIGTERM: 75 after a checkpoint (a run killed by it before train.py set its
    # handler has none to lose); any other exit is the run's own, said as such.
    if stopping and code == stop_lib.RESUME_EXIT_STATUS:
      stopped.append(run.workdir)
      return
    if stopping and code == -signal.SIGTERM:
      stopped_early.append(run.workdir)
      return
    if code == stop_lib.RESUME_EXIT_STATUS:  # a signal that was not the sweep's own
      print(f'{title}: STOPPED before its last step (exit {code}){on}: the same sweep command '
            'resumes it; the runs that start from it wait for that.', flush=True)
      failed.append(run)
    elif code != 0 or not finished(run):
      print(f'{title}: FAILED (exit {code}){on}: {_last_line(path)}', flush=True)
      failed.append(run)
    else:
      _, results = read_metrics(run.workdir)
      shown = ', '.join(f'{k} {v:.4g}' for k, v in results.items()
                        if k != 'step' and isinstance(v, (int, float)))
      print(f'{title}: done{on}: {shown}', flush=True)

  previous = {s: signal.signal(s, stop) for s in stop_lib.signals_to_handle()}
  try:
    while waiting or running:
      if stopping:
        if not running:
          raise Interrupted(f'stopped before {waiting[0][1].workdir}; the same sweep command '
                            'goes on from there.')
      else:
        pending = {r.workdir for _, r in waiting} | {r.workdir for r, *_ in running.values()}
        for item in list(waiting):
          index, run = item
          if run.init_from in {r.workdir for r in failed}:
            print(f'{head(index, run)}: skipped, its {run.init_from} failed.', flush=True)
            failed.append(run)
            waiting.remove(item)
          elif run.init_from in pending or not free:
            continue  # the run it starts from has not finished yet, or no slice is free
          elif finished(run):
            print(f'{head(index, run)}: finished before, skipped.', flush=True)
            waiting.remove(item)
          else:
            waiting.remove(item)
            start(index, run, free.pop(0))
          pending = {r.workdir for _, r in waiting} | {r.workdir for r, *_ in running.values()}
      if not running:
        continue
      exited = [child for child in running if child.poll() is not None]
      if not exited:
        time.sleep(0.2)
        continue
      for child in exited:
        finish(child)
      if stopping and not running:
        during = (f'stopped during {", ".join(stopped)}; {"it" if len(stopped) == 1 else "each"}'
                  ' saved a checkpoint, and ' if stopped else 'stopped; ')
        if stopped_early:  # stopped as it started, before train.py could save anything
          during += (f'{", ".join(stopped_early)} stopped before saving (as it started; it '
                     'resumes from its previous checkpoint, if any), and ')
        raise Interrupted(f'{during}the same sweep command goes on from there.')
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return failed


def log_path(run: Any, workdir: str) -> str:
  return os.path.join(workdir, 'logs', f'{run.stage}__{os.path.basename(run.workdir)}.log')


def slurm_resources(runs: list[Any], gpus: int | None, gpus_per_node: int,
                    options: tuple[str, ...] = (),
                    max_requeues: int = slurm.MAX_REQUEUES) -> slurm.Resources:
  """What each job asks for: `gpus` (None: the devices the runs' meshes fix, at least 1);
  one line naming the fix if a run's mesh cannot be laid out on them."""
  if gpus is None:
    gpus = max(max(1, _fixed_devices(run_mesh(run))) for run in runs)
  resources = slurm.Resources(gpus, gpus_per_node, tuple(options), max_requeues)
  resources.check()
  devices = gpus or slices.cpu_device_count()
  for run in runs:
    reason = slices.mesh_refusal(run_mesh(run), devices)
    if reason:
      raise ValueError(f'--gpus_per_run={gpus}: {run.stage} {os.path.basename(run.workdir)}: '
                       f'{reason}, and a job has {devices}: pass --gpus_per_run to fit it.')
  return resources


def to_slurm(runs: list[Any], workdir: str, resources: slurm.Resources, submit: bool,
             summary: list[str]) -> None:
  """WORKDIR/slurm/: a script per run, the `summary` command's (the table) and submit.sh; with
  submit, the unfinished runs' jobs submitted, each after the job of the run it starts from,
  and the summary's after all of them."""
  os.makedirs(os.path.join(workdir, 'logs'), exist_ok=True)
  name = lambda run: f'{run.stage}__{os.path.basename(run.workdir)}'
  by_dir = {run.workdir: run for run in runs}
  jobs = [(name(run), run.argv(), os.path.abspath(log_path(run, workdir)),
           name(by_dir[run.init_from]) if run.init_from else None) for run in runs]
  paths = slurm.write(jobs, summary, workdir, resources)
  folder = os.path.join(workdir, 'slurm')
  print(f'Wrote {len(paths)} sbatch scripts ({", ".join(resources.lines())} each) and '
        f'{slurm.SUBMIT_SCRIPT} to {folder}.', flush=True)
  if not submit:
    print(f'Submit them with: bash {os.path.join(folder, slurm.SUBMIT_SCRIPT)}')
    return
  ids = {}
  for index, (run, path) in enumerate(zip(runs, paths), 1):
    head = f'[{index}/{len(runs)}] {run.stage} {os.path.basename(run.workdir)}'
    if finished(run):
      print(f'{head}: finished before, not submitted.', flush=True)
      continue
    after = [ids[run.init_from]] if run.init_from in ids else []
    ids[run.workdir] = slurm.sbatch(path, after)
    print(f'{head}: job {ids[run.workdir]}' + (f', after job {after[0]}' if after else ''),
          flush=True)
  if ids:
    job = slurm.sbatch(os.path.join(folder, slurm.SUMMARY_SCRIPT), list(ids.values()),
                       'afterany')
    print(f'summary: job {job}, after every job above; the table will be in '
          f'{workdir}/results.md.', flush=True)


def _fixed_devices(mesh) -> int:
  return math.prod(int(size) for _, size in mesh if int(size) != -1)


def _last_line(path: str) -> str:
  with open(path, encoding='utf-8', errors='replace') as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[-1] if lines else '(no output)'
