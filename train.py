"""Trains a model of the project with its objective on a device mesh.

    python train.py --config=configs/bert_base.py:tiny --workdir=runs/bert_tiny

Running the same command on the same workdir resumes from its last checkpoint.

What a run does, and where (trainer/ unless named otherwise):

  1. checks.py        the config is checked (every field's range: ranges.py), each
                      mistake in one line naming the fix, before anything is read or
                      compiled; model fields left unset come from the run it resumes
                      or starts from
  2. sharding.py      the mesh (data x fsdp x tensor) over every device
  3. input_pipeline/  the tokenizer; this host's rows of every global batch
  4. state.py         models.<model_name>.Model, objectives.<objective>, the
                      optimizer (optimizer.py), the state created on its shards,
                      the jitted train and eval steps (steps.py)
  5. checkpoints.py   the newest checkpoint that restores, with the data position
  6. loop.py          the steps, phase by phase (phases.py: BERT's 128 then 512
                      tokens); logs (metric_writer.py), evals (evaluation.py)
                      and checkpoints on the way; SIGTERM and Ctrl-C save, then stop

Exit status: 0 the run reached train.num_steps; 75 (stop.RESUME_EXIT_STATUS) a signal
(SIGTERM: a preemption or a time limit; Ctrl-C) stopped it before, after saving, and the same
command resumes it (trainer/slurm.py's job scripts requeue on it); 130 a second Ctrl-C stopped
it at once (the newest complete checkpoint stays); 1 an error, said in one line.
"""

import logging as python_logging
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from input_pipeline.common import workers
from trainer import checkpoints
from trainer import cli
from trainer import host_memory
from trainer import loop
from trainer import sharding
from trainer import steps
from trainer import stop


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  cli.skip_absent_accelerators()
  if flags.FLAGS.keep_freed_memory:
    host_memory.keep_freed_memory()  # before JAX's backend starts
  # Read by JAX's GPU client when it starts; nothing on CPU or TPU.
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', str(steps.GPU_MEMORY_FRACTION))
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  sharding.initialize_hosts(flags.FLAGS.multihost)
  config, workdir = cli.loaded_config('train.py'), flags.FLAGS.workdir
  if not workdir or config is None:
    sys.exit('train.py: error: pass --config=configs/<file>.py[:variant] and --workdir=DIR.')
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    sys.exit(f'train.py: error: --workdir={workdir} is a file: pass a directory, new or a '
             'run\'s.')
  interrupted = False
  try:
    state = loop.train_and_evaluate(config, workdir)
  except (ValueError, OSError) as e:  # OSError: a workdir that cannot be made or written
    sys.exit(f'train.py: error: {e}')
  except (FloatingPointError, checkpoints.WriteError, workers.WorkersDied) as e:
    if isinstance(e, checkpoints.WriteError):
      # orbax's other failed writes (a full disk fails them all) would each be reported by
      # asyncio when collected at exit, after the line below.
      python_logging.getLogger('asyncio').disabled = True
    sys.exit(f'train.py: stopped: {e}')
  except KeyboardInterrupt:  # before the first step, or a second Ctrl-C (trainer/stop.py)
    interrupted = True
  if interrupted:
    newest = checkpoints.newest_step(workdir)
    kept = (f'the newest complete checkpoint is step {newest} in {workdir}, and the same command '
            'resumes from it' if newest is not None else 'no checkpoint was written yet')
    print(f'train.py: stopped at once by Ctrl-C: {kept}.', file=sys.stderr, flush=True)
    # The loop has closed its input workers and checkpoints. An XLA compile the interrupt left
    # running in a thread of its own would crash the interpreter's teardown (a segmentation
    # fault, exit 139, in 4 of 5 interrupts of bert_base.py:tiny at 10-13 s here): exit
    # without one.
    sys.stdout.flush()
    logging.flush()
    os._exit(128 + signal.SIGINT)  # pylint: disable=protected-access
  sys.exit(stop.exit_status(int(state.step), config.train.num_steps))


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints and logs.')
  flags.DEFINE_bool('multihost', False, 'Call jax.distributed.initialize() (TPU pods and '
                    'SLURM jobs are detected without it).')
  flags.DEFINE_bool('keep_freed_memory', True, 'On a CPU backend, set glibc\'s malloc to keep the '
                    'memory XLA frees between steps: faster steps, a larger resident size '
                    '(--nokeep_freed_memory for less memory).')
  jax.config.config_with_absl()
  app.run(main, flags_parser=cli.parse_flags)
