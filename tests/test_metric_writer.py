"""The metric writer's start: tensorboardX's writer imports torch wherever it is installed (1.3 s
of every run's start on this machine); the writer imports tensorboardX without it. Where torch is
not installed the test still checks the event file and that `import torch` is not left blocked."""

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WRITE = """
import sys
from trainer import metric_writer
writer = metric_writer.MetricWriter(sys.argv[1], total_steps=2)
writer.write(1, {'loss': 1.5})
writer.close()
print(sys.modules.get('torch', 'absent'))
"""


def test_the_writer_writes_its_event_file_without_importing_torch(tmp_path):
  result = subprocess.run([sys.executable, '-c', _WRITE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  # Neither imported nor left blocked (a later `import torch` in the process works).
  assert result.stdout.split()[-1] == 'absent', result.stdout
  assert glob.glob(str(tmp_path / 'tensorboard' / 'events.out.tfevents.*'))


def test_results_count_only_at_the_step_asked_for(tmp_path):
  # A run extended from 4 to 6 steps holds the results of step 4; killed in its final eval, it
  # must evaluate again when run again, not report "Nothing to do" with no results at step 6.
  from trainer import metric_writer  # pylint: disable=g-import-not-at-top
  assert not metric_writer.has_results(str(tmp_path), 4)
  (tmp_path / 'metrics.jsonl').write_text(
      '{"step": 4, "loss": 2.0}\n{"step": 4, "results": {"eval_loss": 1.0}}\n'
      '{"step": 6, "loss": 1.5}\n{"step": 6, "eval_loss": 0.9}\n')
  assert metric_writer.has_results(str(tmp_path), 4)
  assert not metric_writer.has_results(str(tmp_path), 6)
