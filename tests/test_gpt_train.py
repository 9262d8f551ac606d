"""GPT end to end: pretraining learns, fine-tuning from it beats the majority class, generation runs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import checkpoints
import train
from configs import gpt as gpt_configs
from configs import gpt_finetune as finetune_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('data'))


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='session')
def pretrained(data_dir, tmp_path_factory):
  """The first 300 steps of configs/gpt.py:tiny (the issue's learning check), shared below."""
  workdir = str(tmp_path_factory.mktemp('gpt_tiny'))
  config = gpt_configs.get_config('tiny')
  config.data.data_dir = data_dir
  train.train_and_evaluate(config, workdir, stop_after_steps=300)
  return workdir


@pytest.mark.slow
def test_tiny_pretraining_loss_falls(pretrained):
  logged = [m for m in read_metrics(pretrained) if 'loss' in m]
  first, last = logged[0], logged[-1]
  print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}, "
        f"accuracy {first['lm_accuracy']:.3f} -> {last['lm_accuracy']:.3f}")
  assert last['step'] == 300
  # Steps 1-20 start near ln(4096) = 8.3; the unigram plateau is about 6.7.
  assert last['loss'] < first['loss'] - 2.0
  assert last['lm_accuracy'] > first['lm_accuracy'] + 0.1
  evals = [m for m in read_metrics(pretrained) if 'eval_loss' in m]
  assert evals and evals[-1]['eval_lm_perplexity'] < np.exp(first['loss']) / 4
  assert os.path.exists(os.path.join(pretrained, 'tokenizer.json'))


def finetune_config(task, pretrained, data_dir, **overrides):
  config = finetune_configs.get_config(f'{task},tiny')
  config.init_from = pretrained
  config.data.data_dir = data_dir
  config.update(overrides)
  return config


@pytest.mark.slow
def test_finetuning_from_pretrained_beats_the_majority_class(pretrained, data_dir, tmp_path):
  config = finetune_config('offline_shuffled', pretrained, data_dir)
  # The corpus's sentences are short: 48 tokens keep almost all of them whole.
  config.data.update(max_examples=4000, max_seq_length=48)
  config.train.update(num_steps=150, eval_every=150, checkpoint_every=150)
  config.optimizer.learning_rate = 1e-3
  train.train_and_evaluate(config, str(tmp_path))
  final = [m for m in read_metrics(tmp_path) if 'eval_accuracy' in m][-1]
  print(f"offline_shuffled eval accuracy {final['eval_accuracy']:.3f}")
  assert final['eval_accuracy'] > 0.6  # the task is balanced: the majority class scores 0.5


def test_init_from_copies_the_pretrained_transformer(pretrained, data_dir, tmp_path):
  config = finetune_config('offline_next', pretrained, data_dir)
  config.data.max_examples = 200
  config.train.update(num_steps=1, checkpoint_every=1, eval_every=1, eval_steps=1)
  config.optimizer.update(warmup_steps=1)
  mesh = train.sharding.make_mesh(config.mesh)
  with jax.set_mesh(mesh):
    run = train.setup(config, str(tmp_path), mesh)
  pretrained_params, new, unused = checkpoints.restore_params(pretrained, run.state.params)
  assert sorted(new) == ['classifier/bias', 'classifier/kernel'] and not unused
  # Every array of the pretrained transformer (trained, so unlike a fresh
  # initialization) was loaded; only the head is fresh.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.state.params),
               jax.device_get(pretrained_params))
  # The vocabulary of the pretraining run came along.
  assert os.path.exists(tmp_path / 'tokenizer.json')


def test_init_from_with_another_size_is_one_clear_line(pretrained, data_dir, tmp_path):
  config = finetune_configs.get_config('offline_shuffled,mini')
  config.init_from = pretrained
  config.data.data_dir = data_dir
  with pytest.raises(ValueError, match=r'config.model.vocab_size=16384 .* set '
                     r'--config.model.vocab_size=4096'):
    train.validate(config, train.sharding.make_mesh(config.mesh))


@pytest.mark.slow
def test_generate_command_continues_a_prompt(pretrained):
  result = subprocess.run(
      [sys.executable, 'generate.py', f'--workdir={pretrained}', '--prompt=Return the',
       '--prompt=The', '--max_new_tokens=12'],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.strip().splitlines()
  assert len(lines) == 2 and lines[0].startswith('Return the') and lines[1].startswith('The')
  assert len(lines[0]) > len('Return the ')
