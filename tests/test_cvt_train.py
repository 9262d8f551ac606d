"""CVT end to end: with few labels, the consistency loss on unlabeled text beats supervised-only."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import end_to_end


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Both runs of configs/cvt.py:tiny in one process on one device (8 simulated devices on
# 2 cores would be slower): CVT, then the same model with the consistency loss off; then
# a short multi-task run.
_RUNS = """
import sys
from configs import cvt
import trainer.loop
for workdir, ratio in ((sys.argv[1], 1.0), (sys.argv[2], 0.0)):
  config = cvt.get_config('tiny')
  config.data.data_dir = sys.argv[3]
  config.data.unlabeled_ratio = ratio
  trainer.loop.train_and_evaluate(config, workdir)
# And a few steps of the two offline tasks sharing the encoder.
config = cvt.get_config('tiny_multitask')
config.data.data_dir = sys.argv[3]
config.data.update(max_train_examples=40, max_eval_examples=16)
config.train.update(batch_size=8, num_steps=4, eval_every=4, checkpoint_every=4)
config.optimizer.warmup_steps = 0
trainer.loop.train_and_evaluate(config, sys.argv[4])
"""


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [m for m in map(json.loads, f) if 'results' not in m]  # the per-step lines


@pytest.fixture(scope='module')
def runs(tmp_path_factory, shared_data_dir):
  workdirs = {name: str(tmp_path_factory.mktemp(name))
              for name in ('cvt', 'supervised', 'multitask')}
  data_dir = shared_data_dir
  env = end_to_end.env()
  result = subprocess.run(
      [sys.executable, '-c', _RUNS, workdirs['cvt'], workdirs['supervised'], data_dir,
       workdirs['multitask']],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdirs


@pytest.mark.slow
def test_cvt_reaches_at_least_the_supervised_baseline(runs):
  final = {name: [m for m in read_metrics(runs[name]) if 'eval_offline_names_span_f1' in m][-1]
           for name in ('cvt', 'supervised')}
  f1 = {name: m['eval_offline_names_span_f1'] for name, m in final.items()}
  print(f"offline_names span F1 with 200 labeled sentences: CVT {f1['cvt']:.3f}, "
        f"supervised only {f1['supervised']:.3f}")
  assert f1['supervised'] > 0.3  # both learn the task
  # 0.985 against 0.928 at f3725fd; a CVT whose auxiliary modules learned nothing scored
  # 0.915-0.938 against 0.922-0.928 (docs/cvt.md): a tie is no pass.
  assert f1['cvt'] >= f1['supervised'] + 0.02


@pytest.mark.slow
def test_batches_alternate_and_the_baseline_sees_no_unlabeled_text(runs):
  cvt_logs = [m for m in read_metrics(runs['cvt']) if 'loss' in m]
  supervised_logs = [m for m in read_metrics(runs['supervised']) if 'loss' in m]
  assert all('consistency_loss' in m and 'supervised_loss' in m for m in cvt_logs)
  assert not any('consistency_loss' in m for m in supervised_logs)
  # The auxiliary modules learn to agree with the primary module.
  assert cvt_logs[-1]['consistency_loss'] < cvt_logs[0]['consistency_loss']
  assert np.isfinite(cvt_logs[-1]['loss'])


@pytest.mark.slow
def test_multitask_trains_and_evaluates_every_task(runs):
  final = read_metrics(runs['multitask'])[-1]
  assert final['step'] == 4
  assert 'eval_offline_names_span_f1' in final and 'eval_offline_pos_accuracy' in final
  assert 'eval_offline_pos_span_f1' not in final  # part of speech is scored by accuracy
