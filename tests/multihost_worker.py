"""One host of a CPU run of `num_processes` processes, started by tests/test_multihost.py."""

import os
import signal
import sys

import jax

port, process_id, num_processes, workdir, data_dir, files, stop_after = sys.argv[1:8]
# The Ctrl-C test's runs (every host): Ctrl-C on this host alone after this step (0: none).
interrupt_after = int(sys.argv[8]) if len(sys.argv) > 8 else None
if int(num_processes) > 1:
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=int(num_processes),
                             process_id=int(process_id))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top
import test_train  # pylint: disable=g-import-not-at-top
import trainer.loop  # pylint: disable=g-import-not-at-top
import trainer.stop  # pylint: disable=g-import-not-at-top

config = test_train.micro_config(data_dir, num_steps=4, checkpoint_every=2, log_every=1)
config.data.update(source='files', files=files, docs_per_chunk=4, eval_holdout=10)
if interrupt_after is not None:
  # The hosts agree on a stop every log_every steps: here every 2, with checkpoints at 6.
  config.train.update(num_steps=6, log_every=2, checkpoint_every=6)
  add = trainer.loop.Progress.add

  def add_then_interrupt(self, step, metrics):
    add(self, step, metrics)
    if step == interrupt_after:
      os.kill(os.getpid(), signal.SIGINT)
  trainer.loop.Progress.add = add_then_interrupt
state = trainer.loop.train_and_evaluate(
    config, workdir, stop_after_steps=int(stop_after) if int(stop_after) else None)
checksum = sum(float(np.abs(np.asarray(x.addressable_data(0))).sum())
               for x in jax.tree.leaves(state.params))
status = trainer.stop.exit_status(int(state.step), config.train.num_steps)  # train.py's
print(f'RESULT process={process_id} step={int(state.step)} devices={jax.device_count()} '
      f'status={status} checksum={checksum:.6f}', flush=True)
