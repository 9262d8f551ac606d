"""Evaluation on the held-out split, and what an objective adds to it.

The hook: an objective module may define `eval_metrics(config, model,
params, tokenizer) -> dict[str, float]`, metrics that need more than the
jitted eval step (BLEU needs decoding, objectives/seq2seq.py). They are
computed on the host after each eval and written with its metrics. A
pipeline whose eval iterator has `predictions_text` (SQuAD) has each whole
pass's answers written to workdir/predictions.json, question id -> answer, as
run_squad.py writes them for the official evaluation script.
"""

import importlib
import json
import os
from typing import Any

import jax
import numpy as np

import input_pipeline
from input_pipeline.common import tokenizer as tokenizer_lib
from trainer import sharding
from trainer.checks import model_config
from trainer.steps import accumulate


def eval_batches(config, tokenizer, mesh):
  """The held-out split's iterator and its start; fine-tuning tasks (a fixed eval pass) read
  one batch now, so that a missing or empty eval split stops the run before it trains.

  A number of batches (train.eval_steps, pretraining's) is read as one stream whose global
  batches each host takes its rows of: the same examples, masks included, on any number of
  hosts (split by host, each host's documents and draws were its own). A whole pass
  (eval_steps=0) is split by example, each counted once by its index, on any number too."""
  if config.train.eval_steps:
    batches = input_pipeline.ShardedStream(
        lambda shard, batch_size, workers: input_pipeline.get_dataset(
            config.data, 'eval', tokenizer=tokenizer, batch_size=batch_size, seed=config.seed),
        num_shards=1, global_batch=config.train.batch_size, process_index=jax.process_index(),
        process_count=jax.process_count(),
        rows=sharding.process_rows(mesh, config.train.batch_size, jax.process_index()))
  else:
    batches = input_pipeline.get_dataset(
        config.data, 'eval', tokenizer=tokenizer,
        batch_size=config.train.batch_size // jax.process_count(), seed=config.seed,
        process_index=jax.process_index(), process_count=jax.process_count())
  start = batches.get_state()
  if config.train.eval_steps == 0:
    next(batches)
    if not batches.steps_per_epoch:
      raise ValueError(f'data.pipeline={config.data.pipeline!r} has no fixed eval pass: set '
                       'train.eval_steps to the number of eval batches.')
    batches.set_state(start)
  return batches, start


def evaluate(run: Any, params) -> dict[str, float]:
  """Mean metrics over config.train.eval_steps batches of the held-out split (same every time);
  eval_steps=0 takes one pass of it, for pipelines that know its length (fine-tuning tasks)."""
  config, batches, mesh = run.config, run.eval_data, run.mesh
  batches.set_state(run.eval_start)
  steps = config.train.eval_steps or batches.steps_per_epoch
  # Scored on the host only over whole passes (fine-tuning's eval_steps=0): a task's metric
  # is over all of its examples, and an unseen SQuAD question would count as wrong.
  whole_pass = steps >= (batches.steps_per_epoch or steps + 1)
  totals, predicted = {}, []
  for _ in range(steps):
    metrics, predictions = run.eval_step(params, sharding.global_batch(next(batches), mesh))
    totals = accumulate(totals, metrics)
    if predictions and whole_pass:
      predicted.append(jax.device_get(predictions))
  summary = run.objective.summarize(totals)
  if predicted:
    # Every host holds every row's predictions (replicated) and scores the whole pass;
    # padding rows (example_index -1) are left out. The libraries' figures replace the
    # step's in-graph ones of the same name.
    joined = {k: np.concatenate([p[k] for p in predicted]) for k in predicted[0]}
    real = joined['example_index'] >= 0
    passed = {k: v[real] for k, v in joined.items()}
    summary.update(batches.score(passed))
    if hasattr(batches, 'predictions_text') and jax.process_index() == 0:
      tokenizer_lib.write_lines_atomically(
          [json.dumps(batches.predictions_text(passed), ensure_ascii=False)],
          os.path.join(run.workdir, 'predictions.json'))
  return summary


def evaluate_and_write(run: Any, params, step: int, writer) -> None:
  """An eval line in metrics.jsonl; at train.num_steps also the run's results line."""
  metrics = evaluate(run, params)
  if hasattr(run.objective, 'eval_metrics'):
    model = importlib.import_module(f'models.{run.config.model_name}').Model(
        model_config(run.config))
    metrics.update(run.objective.eval_metrics(run.config, model, params, run.tokenizer))
  writer.write(step, metrics, prefix='eval_', fields=run.row_fields())
  if step == run.config.train.num_steps:
    writer.results(step, {f'eval_{k}': v for k, v in metrics.items()}, run.workdir,
                   fields=run.row_fields())
