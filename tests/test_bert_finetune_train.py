"""BERT end to end: tiny pretraining learns, and every fine-tuning head beats its offline
task's trivial baseline after it (sec. 4, 5.3).

Subprocesses on one device (8 simulated devices on 2 cores would take half as long again):
the README's main job, `train.py --config=configs/bert_base.py:tiny`, for 300 steps at half
its sequence length, then configs/bert_finetune.py on three offline tasks from it: a pair
(the sentence-classification head with segment ids, at 64 tokens; 200 steps), tagging and
spans (150 steps each). Each run ends with the results line that the tests read.
"""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import end_to_end
from configs import bert_base
import input_pipeline
from input_pipeline import squad
from input_pipeline.common import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_STEPS = 300
PHASE_END = 270  # 90% of the steps at 64 tokens, then 128 (the fixture's data.later_phases)
# The pair task needs its 200 steps (0.625 eval accuracy; 0.584 after 150, against the bar of
# 0.56); tagging and spans pass their bars well after 150 (span F1 0.52 against 0.3; EM 11.2 and
# F1 30.3 against 8 and 22), as after 200 (0.58; 12.2 and 29.6).
FINETUNE_STEPS = {'offline_next': 200, 'offline_capitalized': 150, 'offline_span': 150}
_ENV = end_to_end.env()

_RUN = """
import json, os, sys
from configs import bert_finetune
import trainer.loop
root, pretrained, data_dir = sys.argv[1], sys.argv[2], sys.argv[3]
for task, finetune_steps in json.loads(sys.argv[4]).items():
  config = bert_finetune.get_config(task)
  config.init_from = pretrained
  config.data.data_dir = data_dir
  config.data.update(max_train_examples=2000, max_eval_examples=400, max_examples=3000)
  if task == 'offline_next':  # its pairs: 38 tokens at the median, 89% within 64 (half the step)
    config.data.max_seq_length = 64
  config.train.update(num_steps=finetune_steps, eval_every=finetune_steps,
                      checkpoint_every=finetune_steps)
  config.optimizer.warmup_steps = finetune_steps // 10
  trainer.loop.train_and_evaluate(config, os.path.join(root, task))
"""


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [m for m in map(json.loads, f) if 'results' not in m]  # the per-step lines


@pytest.fixture(scope='module')
def pretrained(shared_data_dir, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('bert_tiny')
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/bert_base.py:tiny', f'--workdir={workdir}',
       f'--config.data.data_dir={shared_data_dir}', f'--config.train.num_steps={PRETRAIN_STEPS}',
       f'--config.train.eval_every={PRETRAIN_STEPS}',  # and the 64-token phase's end
       f'--config.train.checkpoint_every={PRETRAIN_STEPS}', '--config.optimizer.warmup_steps=30',
       '--config.data.max_seq_length=64', '--config.data.max_predictions_per_seq=10',
       # The last 10% at the tasks' 128 tokens, so that fine-tuning finds them trained.
       "--config.data.later_phases=((0.9,128,20,False),)"],
      cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert end_to_end.EVAL_WRAPPED not in result.stderr  # configs/common.TINY_EVAL_HOLDOUT
  return workdir


@pytest.fixture(scope='module')
def runs(pretrained, shared_data_dir, tmp_path_factory):
  root = str(tmp_path_factory.mktemp('bert_finetune'))
  result = subprocess.run(
      [sys.executable, '-c', _RUN, root, str(pretrained), shared_data_dir,
       json.dumps(FINETUNE_STEPS)],
      cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return root


def unigram_baseline(workdir, data_dir) -> tuple[float, float]:
  """end_to_end.unigram_baseline on the tokens MLM may mask ([UNK] too, not [PAD], [CLS],
  [SEP] or [MASK]) of the train and eval splits, with the run's vocabulary."""
  config = bert_base.get_config('tiny')
  config.data.data_dir = data_dir
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size,
                                           saved_dir=str(workdir))
  never = [i for i in tokenizer.special_ids if i != tokenizer.unk_id]
  def tokens(split):
    sentences = [s for document in sources.documents(config.data, split) for s in document]
    ids = np.concatenate([np.asarray(i, np.int64) for i in tokenizer.encode_batch(sentences)])
    return ids[~np.isin(ids, never)]
  return end_to_end.unigram_baseline(tokens('train'), tokens('eval'), config.model.vocab_size,
                                     left_out=never)


@pytest.mark.slow
def test_tiny_pretraining_learns_on_embedded_corpus(pretrained, shared_data_dir):
  # The loss falls and MLM beats a unigram model; the workdir holds what fine-tuning reads.
  logged = [m for m in read_metrics(pretrained) if 'loss' in m]
  first, last = logged[0], logged[-1]
  evals = {m['step']: m for m in read_metrics(pretrained) if 'eval_loss' in m}
  unigram_perplexity, unigram_accuracy = unigram_baseline(pretrained, shared_data_dir)
  print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}, "
        f"mlm_accuracy {first['mlm_accuracy']:.3f} -> {last['mlm_accuracy']:.3f}; "
        + ', '.join(f"eval at step {step}: MLM perplexity {m['eval_mlm_perplexity']:.0f}, "
                    f"accuracy {m['eval_mlm_accuracy']:.3f} (where the input hides the answer: "
                    f"{m['eval_mlm_hidden_perplexity']:.0f}, {m['eval_mlm_hidden_accuracy']:.3f})"
                    for step, m in evals.items())
        + f'; unigram {unigram_perplexity:.0f}, {unigram_accuracy:.3f}')
  assert last['step'] == PRETRAIN_STEPS
  assert last['loss'] < first['loss'] - 1.5
  assert last['mlm_accuracy'] > first['mlm_accuracy'] + 0.03
  assert sorted(evals) == [PHASE_END, PRETRAIN_STEPS]
  assert evals[PHASE_END]['max_seq_length'] == 64
  # At the end of the 64-token phase the model beats one that reads nothing of its input:
  # measured (e33568e's eval split, 1 in 10 documents), perplexity 470 and accuracy 0.074
  # against the unigram model's 503 and 0.061. 10% of the predicted tokens are shown as they
  # are, and copying them is that gain: where the input hides the answer (mlm_hidden_*: [MASK]
  # or another token) the model is at the unigram model's level, 525 and 0.064, and at step 300
  # (after 30 steps at 128 tokens) 484 and 0.073 (hidden 526, 0.065). So this run shows no use
  # of the context. With 1 in 100 held out (a few dozen instances, each read several times an
  # eval; 9% more training text) the hidden figure had been 465 against 519.
  assert evals[PHASE_END]['eval_mlm_perplexity'] < 0.95 * unigram_perplexity
  assert evals[PHASE_END]['eval_mlm_accuracy'] > unigram_accuracy + 0.01
  assert np.isfinite(evals[PRETRAIN_STEPS]['eval_loss'])
  assert (pretrained / 'checkpoints' / str(PRETRAIN_STEPS)).exists()
  assert (pretrained / 'config.json').exists() and (pretrained / 'vocab.txt').exists()
  assert any(name.startswith('events') for name in os.listdir(pretrained / 'tensorboard'))


def results(root, task):
  with open(os.path.join(root, task, 'metrics.jsonl'), encoding='utf-8') as f:
    lines = [m for m in map(json.loads, f) if 'results' in m]
  assert len(lines) == 1 and lines[0]['step'] == FINETUNE_STEPS[task]
  return lines[0]['results']


@pytest.mark.slow
def test_pair_classification_beats_the_majority_class(runs):
  # The task's labels are balanced (input_pipeline/tasks/offline_tasks.py): the majority is 0.5,
  # and 0.56 is over two standard errors above it on these 400 eval examples.
  scores = results(runs, 'offline_next')
  print(f'BERT tiny ({PRETRAIN_STEPS} pretraining steps), offline_next, '
        f"{FINETUNE_STEPS['offline_next']} steps: {scores}")
  assert scores['eval_accuracy'] > 0.56
  assert 0.0 < scores['eval_f1'] <= 1.0 and scores['eval_matthews_corr'] > 0.1


@pytest.mark.slow
def test_tagging_finds_the_capitalized_words(runs):
  scores = results(runs, 'offline_capitalized')
  print(f"BERT tiny, offline_capitalized, {FINETUNE_STEPS['offline_capitalized']} steps: {scores}")
  # Tagging every word O (the majority) finds no chunk: span F1 0.
  assert scores['eval_span_f1'] > 0.3


@pytest.mark.slow
def test_span_head_answers_better_than_the_trivial_answer(runs):
  scores = results(runs, 'offline_span')
  print(f"BERT tiny, offline_span, {FINETUNE_STEPS['offline_span']} steps: {scores}")
  # The best trivial predictor of input_pipeline/squad.py's docstring, a random run of 1 to 3
  # of the context's words, scores EM 5.7 and F1 16.0.
  assert scores['eval_exact_match'] > 8.0 and scores['eval_f1'] > 22.0
  # The last eval's answers by question id, as run_squad.py's predictions.json (the official
  # script's input): scored against the eval split's answers, they give the results' figures.
  workdir = os.path.join(runs, 'offline_span')
  with open(os.path.join(workdir, 'predictions.json'), encoding='utf-8') as f:
    predicted = json.load(f)
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size, workdir)
  questions = squad.SquadIterator(config.data, 'eval', tokenizer=tokenizer, batch_size=8,
                                  seed=0).examples.questions
  assert sorted(predicted) == sorted(q.id for q in questions)
  again = squad.evaluate(predicted, {q.id: q.answers for q in questions})
  assert again == pytest.approx({'exact_match': scores['eval_exact_match'],
                                 'f1': scores['eval_f1']})
