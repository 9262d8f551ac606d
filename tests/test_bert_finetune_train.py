"""BERT end to end: every fine-tuning head beats its offline task's trivial baseline (sec. 4, 5.3).

One subprocess (one device, so the steps are not split over 8 simulated
devices on 2 cores) pretrains configs/bert_base.py:tiny for 200 steps, then
fine-tunes it with configs/bert_finetune.py on the four offline tasks: one
sentence, a pair, spans and tagging. Each run ends with the results line
that the tests read.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_STEPS, FINETUNE_STEPS = 200, 200
TASKS = ('offline_shuffled', 'offline_next', 'offline_capitalized', 'offline_span')

_RUN = """
import os, sys
import train
from configs import bert_base, bert_finetune
root, data_dir, pretrain_steps, finetune_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = bert_base.get_config('tiny')
config.data.data_dir = data_dir
config.train.update(num_steps=pretrain_steps, eval_every=pretrain_steps, checkpoint_every=pretrain_steps)
train.train_and_evaluate(config, os.path.join(root, 'bert'))
for task in sys.argv[5:]:
  config = bert_finetune.get_config(task)
  config.init_from = os.path.join(root, 'bert')
  config.data.data_dir = data_dir
  config.data.update(max_train_examples=2000, max_eval_examples=400, max_examples=3000)
  config.train.update(num_steps=finetune_steps, eval_every=finetune_steps,
                      checkpoint_every=finetune_steps)
  config.optimizer.warmup_steps = finetune_steps // 10
  train.train_and_evaluate(config, os.path.join(root, task))
"""


@pytest.fixture(scope='module')
def runs(shared_data_dir, tmp_path_factory):
  root = str(tmp_path_factory.mktemp('bert_finetune'))
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1',
             JAX_PLATFORMS='cpu')
  result = subprocess.run(
      [sys.executable, '-c', _RUN, root, shared_data_dir, str(PRETRAIN_STEPS),
       str(FINETUNE_STEPS), *TASKS], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return root


def results(root, task):
  with open(os.path.join(root, task, 'metrics.jsonl'), encoding='utf-8') as f:
    lines = [m for m in map(json.loads, f) if 'results' in m]
  assert len(lines) == 1 and lines[0]['step'] == FINETUNE_STEPS
  return lines[0]['results']


@pytest.mark.slow
@pytest.mark.parametrize('task', ['offline_shuffled', 'offline_next'])
def test_sentence_and_pair_classification_beat_the_majority_class(runs, task):
  # Both tasks have balanced labels (input_pipeline/offline_tasks.py): the majority is 0.5,
  # and 0.56 is over two standard errors above it on these 400 eval examples.
  scores = results(runs, task)
  print(f'BERT tiny ({PRETRAIN_STEPS} pretraining steps), {task}, {FINETUNE_STEPS} steps: {scores}')
  assert scores['eval_accuracy'] > 0.56
  assert 0.0 < scores['eval_f1'] <= 1.0 and scores['eval_matthews_corr'] > 0.1


@pytest.mark.slow
def test_tagging_finds_the_capitalized_words(runs):
  scores = results(runs, 'offline_capitalized')
  print(f'BERT tiny, offline_capitalized, {FINETUNE_STEPS} steps: {scores}')
  # Tagging every word O (the majority) finds no chunk: span F1 0.
  assert scores['eval_span_f1'] > 0.3


@pytest.mark.slow
def test_span_head_answers_better_than_the_trivial_answer(runs):
  scores = results(runs, 'offline_span')
  print(f'BERT tiny, offline_span, {FINETUNE_STEPS} steps: {scores}')
  # The best trivial predictor of input_pipeline/squad.py's docstring, a random run of 1 to 3
  # of the context's words, scores EM 5.7 and F1 16.0.
  assert scores['eval_exact_match'] > 8.0 and scores['eval_f1'] > 22.0
