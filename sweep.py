"""Ablation sweeps: every variant of a sweep file run with train.py, then a table and plots.

    python sweep.py --sweep=configs/sweeps/bert_masking.py --workdir=runs/sweep_masking
    python sweep.py --sweep=configs/sweeps/bert_masking.py --workdir=DIR --parallel=8
    python sweep.py --sweep=configs/sweeps/bert_masking.py --workdir=DIR --slurm=submit
    python sweep.py --sweep=configs/sweeps/bert_masking.py --workdir=DIR --print_commands
    python sweep.py --summarize --workdir=runs/sweep_masking

A sweep file is a Python file with `get_sweep(arg)` returning a dict:

    stages    ((name, 'configs/<file>.py[:variant]', {override: value}), ...): one train.py
              run per stage, in order; a later stage starts from the one before it
              (--config.init_from), e.g. ('pretrain', ...), ('finetune', ...).
    variants  ((name, {override: value}), ...): the override sets compared; at least one.
    axes      ((override, (value, ...)), ...): optional; every variant is crossed with the
              product of these values.
    seeds     (0, 1, ...): --config.seed of every stage; the table averages over them.
    metrics   ('eval_accuracy', ...): keys of the last stage's eval lines in metrics.jsonl; the
              first one is the bar chart's. Loss, perplexity and error are lower-is-better.

An override key is `<stage>.<config field>`, e.g. 'pretrain.data.masked_lm_prob'; a sweep with
one stage may leave the stage out. Runs whose overrides up to a stage are the same share that
stage's run, so a pretraining shared by every variant runs once per seed.

Each run is WORKDIR/<stage>/<its overrides and seed>, made by exactly the command that
--print_commands prints. A finished run (its results line at train.num_steps) is skipped, an
unfinished one resumes from its checkpoint: after an interruption the same command goes on.
A run whose config.json differs from what the sweep now asks (an override, its seed, or a
field of its config file changed since) is not finished, and --summarize says why; a change
other than more train.num_steps (or fewer, for a run with no checkpoint yet: it starts afresh)
stops the sweep in one line before anything runs. Fields of how a run runs, not what it
computes (its input workers, logging, checkpoints and mesh: runner.OPERATIONAL), are not
compared.
Runs go one at a time on the whole machine, or with --parallel=N up to N at once, each on 1/N
of its GPUs, TPU chips or CPU cores (trainer/slices.py), a run starting as soon as the run it
starts from has finished (trainer/runner.py); --slurm writes (and submits) one SLURM job per
run instead (trainer/slurm.py), each requeueing itself after a time limit or preemption until
its run has finished. A run counts in the table when it and every run it started from have
finished.
The summary writes WORKDIR/results.md and results.csv (mean +- sample std over seeds of each
metric's final and best value), learning_curves.png and final_<metric>.png.
"""

import collections
import csv
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import shlex
import sys

from absl import app
from absl import flags

from trainer import cli
from trainer import runner
from trainer import slices
from trainer import slurm
from trainer import stop as stop_lib

FLAGS = flags.FLAGS
flags.DEFINE_string('sweep', None, 'Sweep file: configs/sweeps/<name>.py[:arg].')
flags.DEFINE_string('workdir', None, 'Directory of the sweep: one workdir per run under it.')
flags.DEFINE_bool('print_commands', False, 'Print one train.py command per run and exit.')
flags.DEFINE_bool('summarize', False, 'Only write the table and plots from the runs in workdir.')
flags.DEFINE_enum('slurm', None, ['scripts', 'submit'], 'Instead of running here, write one '
                  'SLURM sbatch script per run under WORKDIR/slurm (scripts), and submit them '
                  'with their dependencies (submit).')
slurm.define_flags()  # --gpus_per_run, --gpus_per_node, --slurm_option, --max_requeues
flags.DEFINE_integer('parallel', 0, 'Run up to N runs at once, each on its own 1/N of the '
                     "machine's GPUs, TPU chips or CPU cores (0: one at a time, each on all).")

ROOT = os.path.dirname(os.path.abspath(__file__))
SWEEP_FILE = 'sweep.json'  # the resolved sweep, so that --summarize needs only the workdir
LOWER_IS_BETTER = ('loss', 'perplexity', 'error', 'nll')


@dataclasses.dataclass(frozen=True)
class Run:
  """One train.py run: a stage of one variant for one seed."""
  stage: str
  config: str  # configs/<file>.py[:variant], relative to the project
  overrides: tuple[tuple[str, object], ...]  # this stage's own, in order
  seed: int
  workdir: str
  init_from: str | None

  def argv(self) -> list[str]:
    """The command, with paths as seen from the current directory."""
    path, sep, variant = self.config.partition(':')
    args = ['python', _relative(os.path.join(ROOT, 'train.py')),
            f'--config={_relative(os.path.join(ROOT, path))}{sep}{variant}',
            f'--workdir={self.workdir}', f'--config.seed={self.seed}']
    if self.init_from:
      args.append(f'--config.init_from={self.init_from}')
    args += [f'--config.{key}={_flag_value(value)}' for key, value in self.overrides]
    return args


def _relative(path: str) -> str:
  relative = os.path.relpath(path)
  return path if relative.startswith('..' + os.sep + '..') else relative


def _flag_value(value) -> str:
  """A value as ml_collections parses it from the command line (tuples as Python literals)."""
  return repr(value) if isinstance(value, (tuple, list)) else str(value)


def _slug(items: list[tuple[str, object]], seed: int, clashes: bool = False) -> str:
  """A run's directory name: its overrides (last field name = value) and seed; with a digest of
  the overrides where the short names alone would not tell its runs apart (`clashes`: another
  run's overrides give the same name)."""
  parts = [f'{key.rsplit(".", 1)[-1]}={_flag_value(value)}' for key, value in items]
  name = re.sub(r'[^A-Za-z0-9_.,=+-]', '_', ','.join(parts + [f'seed={seed}']))
  if (clashes or len(name) > 120
      or len(set(k.rsplit('.', 1)[-1] for k, _ in items)) < len(items)):
    digest = hashlib.sha1(repr(items).encode()).hexdigest()[:10]
    name = f'{name[:100]}-{digest}'
  return name


# ---------------------------------------------------------------- the sweep file


def load_sweep(spec: str) -> dict:
  """get_sweep(arg) of a sweep file, checked; every mistake is one line naming the fix."""
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ValueError(f'--sweep={spec}: no such file; pass configs/sweeps/<name>.py[:arg].')
  module_spec = importlib.util.spec_from_file_location('_sweep', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise ValueError(f'{path} has no get_sweep(arg): a sweep file defines one (see sweep.py).')
  sweep = dict(module.get_sweep(arg) if arg else module.get_sweep())
  unknown = set(sweep) - {'stages', 'variants', 'axes', 'seeds', 'metrics'}
  if unknown:
    raise ValueError(f'{path}: unknown sweep field(s) {sorted(unknown)}; the fields are stages, '
                     'variants, axes, seeds and metrics.')
  stages = [tuple(s) for s in sweep.get('stages', ())]
  if not stages or any(len(s) != 3 for s in stages):
    raise ValueError(f'{path}: stages must be ((name, "configs/<file>.py[:variant]", '
                     '{override: value}), ...), at least one.')
  names = [s[0] for s in stages]
  if len(set(names)) != len(names):
    raise ValueError(f'{path}: stage names {names} repeat; give each stage its own name.')
  for _, config, _ in stages:
    if not os.path.isfile(os.path.join(ROOT, config.partition(':')[0])):
      raise ValueError(f'{path}: stage config {config} does not exist; configs are given '
                       'relative to the project, e.g. configs/bert_base.py:tiny.')
  variants = [(str(n), dict(o)) for n, o in sweep.get('variants', ())]
  if not variants:
    raise ValueError(f'{path}: variants is empty; give at least one (name, {{override: value}}).')
  axes = [(key, tuple(values)) for key, values in sweep.get('axes', ())]
  seeds = tuple(int(s) for s in sweep.get('seeds', (0,)))
  metrics = tuple(sweep.get('metrics', ()))
  if not seeds or not metrics:
    raise ValueError(f'{path}: seeds and metrics must each name at least one.')
  # One row per variant and axis point, one run per seed: a repeat would merge two into one.
  for what, values in ([('variant names', [n for n, _ in variants]), ('seeds', seeds)] +
                       [(f'values of axis {key}', vs) for key, vs in axes]):
    repeated = sorted({repr(v) for v in values if values.count(v) > 1})
    if repeated:
      raise ValueError(f'{path}: {what} repeat ({", ".join(repeated)}); give each its own.')
  per_stage = {name: set(dict(base)) for name, _, base in stages}
  for key in [k for _, o in variants for k in o] + [k for k, _ in axes]:
    stage, field = _stage_of(key, names, path)
    per_stage[stage].add(field)
  for name, config, _ in stages:  # every override names a field of its stage's config
    config_path, sep, variant = config.partition(':')
    argv = [f'--config={os.path.join(ROOT, config_path)}{sep}{variant}']
    bad = cli.bad_override(argv + [f'--config.{field}=0' for field in sorted(per_stage[name])])
    if bad:
      raise ValueError(f'{path}, stage {name}: {bad}')
  return dict(file=spec, stages=stages, variants=variants, axes=axes, seeds=seeds,
              metrics=metrics)


def _stage_of(key: str, stage_names: list[str], where: str) -> tuple[str, str]:
  head, _, rest = key.partition('.')
  if head in stage_names and rest:
    return head, rest
  if len(stage_names) == 1:
    return stage_names[0], key
  raise ValueError(f'{where}: override {key!r} names no stage; start it with one of '
                   f'{stage_names}, e.g. {stage_names[-1]}.{key}.')


def expand(sweep: dict, workdir: str) -> list[tuple[str, int, list[Run]]]:
  """(variant name, seed, its runs stage by stage) for every variant, axes point and seed."""
  names = [s[0] for s in sweep['stages']]
  points = [()] if not sweep['axes'] else itertools.product(
      *[[(key, v) for v in values] for key, values in sweep['axes']])
  combos = []
  for (variant, overrides), point in itertools.product(sweep['variants'], list(points)):
    label = ','.join([variant] + [f'{k.rsplit(".", 1)[-1]}={_flag_value(v)}' for k, v in point])
    combos.append((label, list(overrides.items()) + list(point)))
  chains = []  # (label, seed, [(stage, config, its own overrides, every stage's so far, slug)])
  for label, items in combos:
    per_stage = {name: [] for name in names}
    for key, value in items:
      stage, field = _stage_of(key, names, sweep['file'])
      per_stage[stage].append((field, value))
    for seed in sweep['seeds']:
      chain, so_far = [], []
      for name, config, base in sweep['stages']:
        own = list({**dict(base), **dict(per_stage[name])}.items())  # a variant's value wins
        so_far = so_far + [(f'{name}.{k}', v) for k, v in per_stage[name]]
        chain.append((name, config, own, so_far, _slug(so_far, seed)))
      chains.append((label, seed, chain))
  # Runs of the same overrides share a directory (an upstream run is trained once); runs of
  # different ones must not, where the short names meet (pretrain.x=0 and finetune.x=0 are
  # both x=0: the second fine-tuning would have been skipped and reported as the first).
  claims = collections.defaultdict(set)
  for _, _, chain in chains:
    for name, _, _, so_far, slug in chain:
      claims[name, slug].add(repr(so_far))
  expanded = []
  for label, seed, chain in chains:
    runs, upstream = [], None
    for name, config, own, so_far, slug in chain:
      if len(claims[name, slug]) > 1:
        slug = _slug(so_far, seed, clashes=True)
      run = Run(name, config, tuple(own), seed, os.path.join(workdir, name, slug), upstream)
      runs.append(run)
      upstream = run.workdir
    expanded.append((label, seed, runs))
  return expanded


def unique_runs(expanded) -> list[Run]:
  """Every run once, stage by stage (a stage's runs need the ones before)."""
  seen, order = set(), []
  for stage_index in range(len(expanded[0][2])):
    for _, _, runs in expanded:
      run = runs[stage_index]
      if run.workdir not in seen:
        seen.add(run.workdir)
        order.append(run)
  return order


# ---------------------------------------------------------------- summary


def lower_is_better(metric: str) -> bool:
  return any(word in metric for word in LOWER_IS_BETTER)


def _mean_std(values: list[float]) -> tuple[float, float]:
  n = len(values)
  if n == 0:
    return math.nan, math.nan
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
  return mean, std


def summarize(workdir: str) -> list[dict]:
  """The table (results.md, results.csv) and plots of the finished runs (a run counts when it
  and every run it started from reached train.num_steps); returns the rows."""
  sweep, expanded = load_record(workdir)
  metrics = sweep['metrics']
  rows, curves, left_out = [], {}, {}  # left_out: an ordered set of 'workdir (why)'
  for label in dict.fromkeys(label for label, _, _ in expanded):
    chains = [runs for l, _, runs in expanded if l == label]
    row = {'variant': label, 'runs': f'{0}/{len(chains)}'}
    finals = {m: [] for m in metrics}
    bests = {m: [] for m in metrics}
    done = 0
    for chain in chains:
      # A fine-tuning of a pretraining stopped part of the way is no result of this variant.
      why = next(((r, b) for r in chain if (b := runner.unfinished_because(r))), None)
      if why:  # a pretraining shared by the chains of several variants is named once
        left_out[f'{why[0].workdir} ({why[1]})'] = None
        continue
      run = chain[-1]
      lines, results = runner.read_metrics(run.workdir)
      done += 1
      curves.setdefault(label, []).append(lines)
      for m in metrics:
        if m not in results:
          raise ValueError(f'{run.workdir}: its results have no {m!r} (they have '
                           f'{sorted(k for k in results if k != "step")}); fix metrics in '
                           f'{sweep["file"]}.')
        finals[m].append(results[m])
        seen = [line[m] for line in lines if m in line] or [results[m]]
        bests[m].append(min(seen) if lower_is_better(m) else max(seen))
    row['runs'] = f'{done}/{len(chains)}'
    for m in metrics:
      row[f'{m} final'] = _mean_std(finals[m])
      row[f'{m} best'] = _mean_std(bests[m])
    rows.append(row)
  _write_tables(workdir, rows, metrics)
  _plot(workdir, rows, curves, metrics[0])
  if left_out:  # a run the table does not count says why
    print(f'sweep.py: {len(left_out)} run(s) not in the table: ' + '; '.join(list(left_out)[:10])
          + (f'; and {len(left_out) - 10} more' if len(left_out) > 10 else '') + '.',
          file=sys.stderr)
  return rows


def _cell(mean_std: tuple[float, float]) -> str:
  mean, std = mean_std
  if math.isnan(mean):
    return 'n/a'
  return f'{mean:.4f}' if math.isnan(std) else f'{mean:.4f} ± {std:.4f}'


def _write_tables(workdir: str, rows: list[dict], metrics: list[str]) -> str:
  columns = [c for m in metrics for c in (f'{m} final', f'{m} best')]
  lines = ['| variant | runs | ' + ' | '.join(columns) + ' |',
           '|---|---|' + '---|' * len(columns)]
  for row in rows:
    lines.append(f'| {row["variant"]} | {row["runs"]} | ' +
                 ' | '.join(_cell(row[c]) for c in columns) + ' |')
  table = '\n'.join(lines) + '\n'
  with open(os.path.join(workdir, 'results.md'), 'w', encoding='utf-8') as f:
    f.write(table)
  with open(os.path.join(workdir, 'results.csv'), 'w', encoding='utf-8', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['variant', 'runs'] + [f'{c} {s}' for c in columns for s in ('mean', 'std')])
    for row in rows:
      writer.writerow([row['variant'], row['runs']] +
                      [f'{x:.6g}' for c in columns for x in row[c]])
  return table


def _comparable_loss(curves: dict) -> str:
  """'task_loss' where every run logs it: a fine-tuning 'loss' adds lambda x the auxiliary LM
  loss (GPT, sec. 3.2), so variants of lambda would not share a scale; else 'loss'."""
  logs = [any('task_loss' in line for line in lines)
          for runs in curves.values() for lines in runs]
  return 'task_loss' if logs and all(logs) else 'loss'


def _plot(workdir: str, rows: list[dict], curves: dict, metric: str) -> None:
  """learning_curves.png (train loss and the eval metric, mean over seeds) and a bar chart."""
  import matplotlib  # pylint: disable=g-import-not-at-top (slow; only the summary needs it)
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (loss_ax, metric_ax) = plt.subplots(1, 2, figsize=(11, 4))
  loss = _comparable_loss(curves)
  for label, runs in curves.items():
    for ax, key in ((loss_ax, loss), (metric_ax, metric)):
      by_step = {}
      for lines in runs:
        for line in lines:
          if key in line:
            by_step.setdefault(line['step'], []).append(line[key])
      steps = sorted(s for s, v in by_step.items() if len(v) == len(runs))
      if steps:
        ax.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps],
                marker='o' if key == metric else None, label=label)
  loss_ax.set(xlabel='step', ylabel=f'train {loss}', title=f'training {loss} (mean over seeds)')
  metric_ax.set(xlabel='step', ylabel=metric, title=f'{metric} (mean over seeds)')
  for ax in (loss_ax, metric_ax):
    if ax.lines:
      ax.legend(fontsize='small')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'learning_curves.png'), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows) + 2), 4))
  means = [row[f'{metric} final'][0] for row in rows]
  stds = [0 if math.isnan(row[f'{metric} final'][1]) else row[f'{metric} final'][1]
          for row in rows]
  ax.bar(range(len(rows)), means, yerr=stds, capsize=4)
  ax.set_xticks(range(len(rows)), [row['variant'] for row in rows], rotation=30, ha='right')
  ax.set(ylabel=f'{metric} (final)', title=f'final {metric}, mean ± std over seeds')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, f'final_{metric}.png'), dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------- main


def _paths(runs: list[dict], change) -> list[dict]:
  return [dict(r, workdir=change(r['workdir']), init_from=r['init_from'] and change(r['init_from']))
          for r in runs]


def load_record(workdir: str) -> tuple[dict, list[tuple[str, int, list[Run]]]]:
  """workdir/sweep.json, and its runs with their directories under `workdir` as given now
  (the record keeps them relative to it, so that any spelling of it, from any directory, finds
  them; a record of before that kept them as typed is read as it is)."""
  path = os.path.join(workdir, SWEEP_FILE)
  if not os.path.exists(path):
    raise ValueError(f'{workdir} holds no {SWEEP_FILE}: pass the --workdir of a sweep.py run.')
  with open(path, encoding='utf-8') as f:
    record = json.load(f)
  under = ((lambda p: os.path.join(workdir, p)) if record.get('paths') == 'relative'
           else (lambda p: p))
  return record, [(label, seed, [Run(**r) for r in _paths(runs, under)])
                  for label, seed, runs in record['runs']]


def check_values(spec: str, runs: list[Run]) -> None:
  """Every run's config, its overrides set, in range (trainer/ranges.py) before anything runs:
  a bad value is one line naming the run, not a failed run after the others trained."""
  from trainer import ranges  # pylint: disable=g-import-not-at-top (it imports jax)
  for run in runs:
    path, _, variant = run.config.partition(':')
    config = cli.config_from_file(os.path.join(ROOT, path), variant)
    where = f'{spec}, stage {run.stage} ({os.path.basename(run.workdir)})'
    for key, value in (('seed', run.seed),) + run.overrides:
      *parents, last = key.split('.')
      node = config
      for part in parents:
        node = node[part]
      try:
        node[last] = value
      except (TypeError, ValueError) as e:
        raise ValueError(f'{where}: {key}={value!r}: {e}') from None
    try:
      ranges.check(config)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None


def prepare(spec: str, workdir: str) -> list[tuple[str, int, list[Run]]]:
  """Expands the sweep and writes workdir/sweep.json; a workdir keeps the sweep it began with."""
  sweep = load_sweep(spec)
  expanded = expand(sweep, workdir)
  check_values(spec, unique_runs(expanded))
  relative = lambda p: os.path.relpath(p, workdir)  # noqa: E731
  record = dict(file=spec, metrics=list(sweep['metrics']), paths='relative',
                runs=[(label, seed, _paths([dataclasses.asdict(r) for r in runs], relative))
                      for label, seed, runs in expanded])
  path = os.path.join(workdir, SWEEP_FILE)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      before = json.load(f)
    if before.get('paths') != 'relative':  # kept as typed, from the directory it was typed in
      before['runs'] = [[label, seed, _paths(runs, relative)]
                        for label, seed, runs in before['runs']]
    if json.loads(json.dumps(record['runs'])) != before['runs']:  # metrics may change
      raise ValueError(f'{workdir} holds another sweep ({before["file"]}, or this file changed '
                       'since): use a new --workdir, or delete its sweep.json to adopt the change.')
  os.makedirs(workdir, exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  return expanded


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  cli.skip_absent_accelerators()
  if not FLAGS.workdir or (not FLAGS.sweep and not FLAGS.summarize):
    sys.exit('sweep.py: error: pass --sweep=configs/sweeps/<name>.py --workdir=DIR '
             '(or --summarize --workdir=DIR).')
  failed = []
  try:
    if not FLAGS.summarize:
      # One sweep in a workdir at a time: a second would rewrite sweep.json and start train.py
      # in the runs the first is running (each run's own workdir refuses it then, as FAILED).
      os.makedirs(FLAGS.workdir, exist_ok=True)
      cli.hold_directory(FLAGS.workdir)  # until this process ends
      runs = unique_runs(prepare(FLAGS.sweep, FLAGS.workdir))
      if FLAGS.print_commands:
        stage = None
        for run in runs:
          if run.stage != stage:
            stage = run.stage
            print(f'# stage {stage}' + (': after the stage above' if run.init_from else ''))
          print(shlex.join(run.argv()))
        return
      runner.check_unchanged(runs)
      if FLAGS.slurm and FLAGS.parallel:
        raise ValueError('--slurm and --parallel: pass one (SLURM places each run on its own '
                         'GPUs).')
      if FLAGS.slurm:
        resources = runner.slurm_resources(runs, FLAGS.gpus_per_run, FLAGS.gpus_per_node,
                                           tuple(FLAGS.slurm_option), FLAGS.max_requeues)
        summary = ['python', _relative(os.path.join(ROOT, 'sweep.py')), '--summarize',
                   f'--workdir={FLAGS.workdir}']
        runner.to_slurm(runs, FLAGS.workdir, resources, FLAGS.slurm == 'submit', summary)
        return
      cut = None
      if FLAGS.parallel:
        cut = slices.cut(FLAGS.parallel)
        runner.check_slices(runs, cut)
        print(f'{len(runs)} runs, up to {len(cut)} at once: ' +
              ', '.join(s.describe() for s in cut) + '.', flush=True)
      failed = runner.run_all(runs, FLAGS.workdir, cut)
    summarize(FLAGS.workdir)
  except runner.Interrupted as e:
    print(f'sweep.py: {e}', file=sys.stderr)
    sys.exit(stop_lib.RESUME_EXIT_STATUS)  # unfinished, as train.py's own stop
  except ValueError as e:
    sys.exit(f'sweep.py: error: {e}')
  with open(os.path.join(FLAGS.workdir, 'results.md'), encoding='utf-8') as f:
    print(f.read(), end='')
  print(f'Wrote results.md, results.csv and plots to {FLAGS.workdir}.')
  if failed:
    sys.exit(f'sweep.py: {len(failed)} run(s) failed or stopped: ' +
             ', '.join(r.workdir for r in failed) + f' (logs in {FLAGS.workdir}/logs).')

if __name__ == '__main__':
  app.run(main)
