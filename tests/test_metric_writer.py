"""The metric writer's start: tensorboardX's writer imports torch wherever it is installed (1.3 s
of every run's start on this machine); the writer imports tensorboardX without it. Where torch is
not installed the test still checks the event file and that `import torch` is not left blocked."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

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


def test_a_resume_drops_the_lines_after_its_checkpoint_and_finds_its_eval(tmp_path):
  # Killed after logging steps 5 and 6, resumed from the checkpoint of step 4: they are logged
  # again, once; TensorBoard hides the killed run's events from step 5 (purge_step).
  from trainer import metric_writer  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 2, "loss": 2.0}\n{"step": 4, "loss": 1.8}\n'
                  '{"step": 4, "eval_loss": 1.7}\n{"step": 6, "loss": 1.6}\n{"step": 6, "ev')
  assert metric_writer.has_eval(str(tmp_path), 4) and not metric_writer.has_eval(str(tmp_path), 2)
  writer = metric_writer.MetricWriter(str(tmp_path), total_steps=8, resumed_step=4)
  assert writer._tb.purge_step == 5  # pylint: disable=protected-access
  writer.write(6, {'loss': 1.5})
  writer.close()
  steps = [json.loads(line)['step'] for line in path.read_text().splitlines()]
  assert steps == [2, 4, 4, 6]
  # A blank line (an editor's) is no step; a line that is not JSON is named, and kept.
  path.write_text('{"step": 2, "loss": 2.0}\n\n{"step": 6, "loss": 1.6}\n')
  metric_writer.MetricWriter(str(tmp_path), total_steps=8, resumed_step=4).close()
  assert path.read_text() == '{"step": 2, "loss": 2.0}\n\n'
  path.write_text('{"step": 2, "loss": 2.0}\nstep 4 | loss 1.8\n')
  with pytest.raises(ValueError, match=re.escape(f'{path}: line 2 is not JSON (')):
    metric_writer.MetricWriter(str(tmp_path), total_steps=8, resumed_step=4)
  assert path.read_text() == '{"step": 2, "loss": 2.0}\nstep 4 | loss 1.8\n'
