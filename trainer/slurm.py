"""A sweep's runs as SLURM batch jobs: sweep.py --slurm.

Each run gets one sbatch script, WORKDIR/slurm/NNN_<stage>__<run>.sbatch, that
runs exactly the train.py command of --print_commands under `srun`, from the
directory the sweep was written in, with the nodes and GPUs the run needs. A
run that starts from another (config.init_from) is submitted with
`--dependency=afterok:<that run's job>`, so a stage starts as soon as the run
it reads has finished, and never after it failed. A last job, after all of
them whatever their ends, writes the sweep's table (sweep.py --summarize).

The jobs are preemption-safe the way train.py is: SLURM sends SIGTERM to the
job's steps (two minutes before its time limit too, `--signal`), train.py
saves a checkpoint and exits, and a requeued job (or the same script
submitted again) resumes from it; the log is appended to, not replaced.

WORKDIR/slurm/submit.sh submits the scripts with their dependencies from a
shell; `sweep.py --slurm=submit` does the same from Python and skips the runs
that have finished.
"""

import dataclasses
import os
import shlex
import subprocess

SUBMIT_SCRIPT = 'submit.sh'
SUMMARY_SCRIPT = 'summarize.sbatch'


@dataclasses.dataclass(frozen=True)
class Resources:
  """What one run asks SLURM for."""
  gpus: int  # per run; 0 for a CPU-only job
  gpus_per_node: int
  options: tuple[str, ...] = ()  # more sbatch options, e.g. --partition=gpu, --time=4:00:00

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

  def lines(self) -> list[str]:
    lines = [f'--nodes={self.nodes}', '--ntasks-per-node=1']
    if self.gpus:
      lines.append(f'--gpus-per-node={min(self.gpus, self.gpus_per_node)}')
    return lines + list(self.options)


def script(name: str, argv: list[str], log_path: str, directory: str,
           resources: Resources) -> str:
  """The sbatch script of one run: its resources, its log, then its command under srun."""
  options = [f'--job-name={name}', f'--output={log_path}', '--open-mode=append',
             '--signal=TERM@120', '--requeue', '--kill-on-invalid-dep=yes'] + resources.lines()
  return '\n'.join(['#!/bin/bash'] + [f'#SBATCH {o}' for o in options] + [
      '# One train.py per node (jax.distributed reads the nodes from SLURM); SIGTERM makes it',
      '# save a checkpoint, and the same script submitted again resumes from it.',
      f'cd {shlex.quote(directory)}',
      f'exec srun --kill-on-bad-exit=1 {shlex.join(argv)}', ''])


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
    done = subprocess.run(command + [path], capture_output=True, text=True, check=False)
  except FileNotFoundError as e:
    raise ValueError('sbatch is not on this machine\'s PATH: run sweep.py --slurm=submit on a '
                     'SLURM login node, or --slurm=scripts and submit.sh there.') from e
  if done.returncode != 0:
    reason = ' '.join((done.stderr or done.stdout).split())
    raise ValueError(f'sbatch refused {path}: {reason}')
  return done.stdout.strip().split(';')[0]
