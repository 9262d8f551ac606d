"""A sweep's runs as SLURM batch jobs: sweep.py --slurm.

Each run gets one sbatch script, WORKDIR/slurm/NNN_<stage>__<run>.sbatch, that
runs exactly the train.py command of --print_commands under `srun`, from the
directory the sweep was written in, with the nodes and GPUs the run needs. A
run that starts from another (config.init_from) is submitted with
`--dependency=afterok:<that run's job>`, so a stage starts as soon as the run
it reads has finished, and never after it failed. A last job, after all of
them whatever their ends, writes the sweep's table (sweep.py --summarize).

A job outlives its time limit and preemptions: SLURM sends SIGTERM to train.py
two minutes before the limit (`--signal`), and a preemption does too; train.py
saves a checkpoint and exits 75 ("unfinished, resume me", trainer/stop.py),
and the script then requeues its own job (`scontrol requeue`). The job keeps
its id, so the jobs waiting on it (afterok) keep waiting, and it resumes from
the checkpoint when it starts again; its log is appended to, not replaced. An
error (any other exit status) is not requeued: the job fails, and SLURM
cancels the jobs that wait on it. A job requeued `max_requeues` times already
(SLURM_RESTART_COUNT) fails instead, so that a run that makes no progress
between limits stops.

`python -m trainer.slurm [--gpus_per_run=N ...] -- python train.py ...` prints the
same script for one train.py run (docs/sweeps.md).

WORKDIR/slurm/submit.sh submits the scripts with their dependencies from a
shell; `sweep.py --slurm=submit` does the same from Python and skips the runs
that have finished.
"""

import dataclasses
import os
import shlex
import signal
import subprocess
import sys

from absl import app
from absl import flags

from trainer import cli
from trainer import stop

SUBMIT_SCRIPT = 'submit.sh'
SUMMARY_SCRIPT = 'summarize.sbatch'


# A job stopped unfinished this many times is not requeued again: with 24-hour limits, three
# weeks of one run. A run longer than that passes a larger --max_requeues.
MAX_REQUEUES = 20
# SIGTERM this long before the time limit (SLURM looks every 30 s or so): time to save.
SIGNAL = '--signal=TERM@120'
# train.py's exit statuses after which the job requeues itself: its own "resume me", and
# death by SIGTERM, which comes before Python has set its handler (a preemption or a time
# limit while it starts), when there is nothing to save and the last checkpoint is the run's.
RESUMABLE = (stop.RESUME_EXIT_STATUS, 128 + signal.SIGTERM)


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one run asks SLURM for."""
  gpus: int  # per run; 0 for a CPU-only job
  gpus_per_node: int
  options: tuple[str, ...] = ()  # more sbatch options, e.g. --partition=gpu, --time=4:00:00
  max_requeues: int = MAX_REQUEUES

  @property
  def nodes(self) -> int:
    return max(1, self.gpus // self.gpus_per_node) if self.gpus else 1

  def check(self) -> None:
    """One line naming the fix if the GPUs do not fill whole nodes."""
    if self.gpus < 0 or self.gpus_per_node < 1:
      raise ValueError(f'--gpus_per_run={self.gpus} and --gpus_per_node={self.gpus_per_node}: '
                       'pass 0 or more GPUs a run, and 1 or more a node.')
    if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
      raise ValueError(f'--gpus_per_run={self.gpus} does not fill whole nodes of '
                       f'{self.gpus_per_node} GPUs (--gpus_per_node): pass a multiple of '
                       f'{self.gpus_per_node}, or at most {self.gpus_per_node}.')
    for option in self.options:
      if not option.startswith('--'):
        raise ValueError(f'--slurm_option={option}: pass sbatch options as sbatch spells them, '
                         'e.g. --slurm_option=--partition=gpu.')
    if self.max_requeues < 0:
      raise ValueError(f'--max_requeues={self.max_requeues}: pass 0 or more (0: a job stopped '
                       'unfinished is never requeued).')

  def lines(self) -> list[str]:
    lines = [f'--nodes={self.nodes}', '--ntasks-per-node=1']
    if self.gpus:
      lines.append(f'--gpus-per-node={min(self.gpus, self.gpus_per_node)}')
    return lines + list(self.options)


def script(name: str, argv: list[str], log_path: str, directory: str,
           resources: Resources) -> str:
  """The sbatch script of one run: its resources and log, its command under srun, then a
  requeue of its own job if the command stopped unfinished."""
  own_signal = any(o.startswith('--signal=') for o in resources.options)
  options = ([f'--job-name={name}', f'--output={log_path}', '--open-mode=append'] +
             ([] if own_signal else [SIGNAL]) + ['--requeue', '--kill-on-invalid-dep=yes'] +
             resources.lines())
  cap, resumable = resources.max_requeues, ' '.join(map(str, RESUMABLE))
  return '\n'.join(['#!/bin/bash'] + [f'#SBATCH {o}' for o in options] + [
      '# One train.py per node (jax.distributed reads the nodes from SLURM). SIGTERM (--signal,',
      '# before the time limit; a preemption) makes it save a checkpoint and exit 75: then this',
      '# job requeues itself, keeping its id, so that the jobs after it keep waiting. Any other',
      '# failure ends the job. Each host\'s exit status reaches srun\'s (no --kill-on-bad-exit,',
      '# which would kill the hosts still saving); hosts that an error on one leaves waiting in',
      '# a collective are ended 120 s after it (--wait).',
      'trap \'echo "sbatch script: SIGTERM; waiting for the command to stop"\' TERM',
      f'cd {shlex.quote(directory)}',
      f'srun --kill-on-bad-exit=0 --wait=120 {shlex.join(argv)}',
      'status=$?',
      'restarts=${SLURM_RESTART_COUNT:-0}',
      f'case " {resumable} " in *" $status "*)',
      f'  if [ "$restarts" -lt {cap} ]; then',
      '    echo "sbatch script: stopped unfinished (exit $status); requeueing job $SLURM_JOB_ID'
      f' (requeue $((restarts + 1)) of at most {cap}) to resume from its checkpoint."',
      '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
      '  else',
      f'    echo "sbatch script: stopped unfinished (exit $status) after {cap} requeues'
      ' (--max_requeues): not requeued again; submit this script again to go on."',
      '  fi;;',
      'esac',
      'exit "$status"', ''])


def write(jobs: list[tuple[str, list[str], str, str | None]], summary_argv: list[str],
          workdir: str, resources: Resources) -> list[str]:
  """Writes WORKDIR/slurm/: a script per job (name, argv, log path, the job it starts from),
  the summary's script and submit.sh; returns the jobs' script paths, in order."""
  folder = os.path.join(workdir, 'slurm')
  os.makedirs(folder, exist_ok=True)
  directory = os.getcwd()
  paths, variable = [], {}
  submit = ['#!/bin/bash', '# Submits the sweep\'s jobs, each after the one it starts from.',
            'set -euo pipefail', f'cd {shlex.quote(directory)}']
  for number, (name, argv, log_path, after) in enumerate(jobs, 1):
    path = os.path.join(folder, f'{number:03d}_{name}.sbatch')
    with open(path, 'w', encoding='utf-8') as f:
      f.write(script(name, argv, log_path, directory, resources))
    paths.append(path)
    variable[name] = f'job{number}'
    depends = f'--dependency=afterok:${{{variable[after]}}} ' if after else ''
    submit.append(f'{variable[name]}=$(sbatch --parsable {depends}{shlex.quote(path)} '
                  '| cut -d";" -f1)')
  summary = os.path.join(folder, SUMMARY_SCRIPT)
  with open(summary, 'w', encoding='utf-8') as f:
    f.write(script('summarize', summary_argv, os.path.join(workdir, 'logs', 'summarize.log'),
                   directory, Resources(0, 1, resources.options)))
  every = ':'.join(f'${{{v}}}' for v in variable.values())
  submit.append(f'sbatch --parsable --dependency=afterany:{every} {shlex.quote(summary)}')
  submit.append(f'echo "Submitted {len(jobs) + 1} jobs; when they have ended, the table is in '
                f'{workdir}/results.md."')
  submit_path = os.path.join(folder, SUBMIT_SCRIPT)
  with open(submit_path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(submit) + '\n')
  os.chmod(submit_path, 0o755)
  return paths


def sbatch(path: str, after: list[str], kind: str = 'afterok') -> str:
  """Submits a script; returns its job id. One line with sbatch's own reason if it refuses."""
  command = ['sbatch', '--parsable']
  if after:
    command.append(f'--dependency={kind}:' + ':'.join(after))
  try:
    done = subprocess.run(command + [path], capture_output=True, text=True, check=False,
                          env=cli.environment_elsewhere())
  except FileNotFoundError as e:
    raise ValueError('sbatch is not on this machine\'s PATH: run sweep.py --slurm=submit on a '
                     'SLURM login node, or --slurm=scripts and submit.sh there.') from e
  if done.returncode != 0:
    reason = ' '.join((done.stderr or done.stdout).split())
    raise ValueError(f'sbatch refused {path}: {reason}')
  return done.stdout.strip().split(';')[0]


def define_flags() -> None:
  """The flags of a job's resources and requeues, shared by sweep.py --slurm and this module's
  command line; called by the program that parses them."""
  flags.DEFINE_integer('gpus_per_run', None, 'SLURM jobs: the GPUs each run asks for (default: '
                       'the devices its config.mesh fixes, at least 1; 0: CPU-only jobs).')
  flags.DEFINE_integer('gpus_per_node', 8, 'SLURM jobs: the GPUs of a node; a run with more '
                       'spans several nodes, one train.py on each.')
  flags.DEFINE_multi_string('slurm_option', [], 'SLURM jobs: an sbatch option for every job, '
                            'as sbatch spells it, e.g. --slurm_option=--partition=gpu.')
  flags.DEFINE_integer('max_requeues', MAX_REQUEUES, 'SLURM jobs: how many times a job stopped '
                       'unfinished (a time limit, a preemption) requeues itself before it fails '
                       '(SLURM_RESTART_COUNT).')


def main(argv: list[str]) -> None:
  """Prints the sbatch script of the train.py command given after `--`."""
  command = argv[1:]
  workdir = next((a.split('=', 1)[1] for a in command if a.startswith('--workdir=')), None)
  if not command or workdir is None:
    sys.exit('python -m trainer.slurm: error: give the command after --, e.g. -- python train.py '
             '--config=configs/bert_base.py --workdir=runs/bert.')
  flag = flags.FLAGS
  resources = Resources(1 if flag.gpus_per_run is None else flag.gpus_per_run,
                        flag.gpus_per_node, tuple(flag.slurm_option), flag.max_requeues)
  try:
    resources.check()
  except ValueError as e:
    sys.exit(f'python -m trainer.slurm: error: {e}')
  name = os.path.basename(os.path.normpath(workdir))
  # In this directory: the workdir need not exist yet when SLURM opens the log.
  log_path = os.path.abspath(f'{name}.slurm.log')
  print(script(name, command, log_path, os.getcwd(), resources), end='')


if __name__ == '__main__':
  define_flags()
  app.run(main)
