"""Input pipelines: host-local numpy batches, resumable by a small state dict.

A pipeline is a module of this package named by config.data.pipeline
(bert_pretraining, packed_lm, gpt_finetune, bilm, tagging, cvt,
translation, word_classification, bert_finetune, squad). What they share is
in common/ (text sources, tokenizers, GloVe, the resumable iterators); the
offline tasks and the task metrics are in tasks/. It exports
`get_iterator(data_cfg, split, *, tokenizer, batch_size, seed, process_index,
process_count)` and `example_batch(data_cfg, vocab_size, batch_size)`, a
synthetic batch of the same feature spec. The training split's examples are
made by data.workers processes (common/workers.py), the same batches with
any number of them.

    data = input_pipeline.get_dataset(config.data, 'train', tokenizer=tok,
                                      batch_size=host_batch, seed=config.seed, workers=4)
    batch = next(data); state = data.get_state()  # saved with the checkpoint
    data.close()  # stops the workers
"""

import importlib
import math
from types import ModuleType
from typing import Any, Iterator, Sequence

import ml_collections
import numpy as np

from input_pipeline.common import sources
from input_pipeline.common import workers as workers_lib

Batch = dict[str, np.ndarray]


# The modules of this package that are pipelines (the others are shared parts).
PIPELINES = ('bert_pretraining', 'packed_lm', 'gpt_finetune', 'bilm', 'tagging', 'cvt',
             'translation', 'word_classification', 'bert_finetune', 'squad')


def _pipeline(data_cfg: ml_collections.ConfigDict) -> ModuleType:
  if data_cfg.pipeline not in PIPELINES:
    raise ValueError(f'Unknown data.pipeline {data_cfg.pipeline!r}: use one of '
                     f'{", ".join(PIPELINES)}.')
  return importlib.import_module(f'input_pipeline.{data_cfg.pipeline}')


# Pipelines whose eval iterator knows the length of one pass (train.eval_steps=0).
_EVAL_PASS = ('gpt_finetune', 'tagging', 'cvt', 'word_classification', 'bert_finetune', 'squad')
# Pipelines whose eval iterator has `score(predictions)`: the objective's `predict` outputs of
# one eval pass, scored on the host (metrics from maintained libraries, SQuAD's answer text).
SCORED = ('gpt_finetune', 'bert_finetune', 'squad')
# Pipelines whose eval is a whole pass: host-scored, or with span F1 counted in the step.
WHOLE_EVAL = SCORED + ('tagging', 'cvt')


def check_config(config: ml_collections.ConfigDict) -> None:
  """Rejects a config whose model or train fields cannot work with its pipeline, in one line."""
  module = _pipeline(config.data)
  if config.train.eval_steps == 0 and config.data.pipeline not in _EVAL_PASS:
    raise ValueError(f'train.eval_steps=0 (one eval pass) needs a pipeline with a fixed eval '
                     f'split ({", ".join(_EVAL_PASS)}): set train.eval_steps to a number of '
                     'batches.')
  if hasattr(module, 'check_config'):
    module.check_config(config)


def check_source(data_cfg: ml_collections.ConfigDict) -> None:
  """A TFDS dataset name that TFDS does not know, in one line before anything is read (TFDS is
  imported for a TFDS source only)."""
  if 'tfds' in (data_cfg.get('source'), data_cfg.get('pairs')):
    sources.tfds_builder(data_cfg)


def prepare_source(data_cfg: ml_collections.ConfigDict) -> None:
  """A TFDS text source downloaded and prepared once, by every host at the same point of its
  main thread (sources.prepare_tfds waits for the other hosts), before any data is read."""
  if data_cfg.get('source') == 'tfds':
    sources.prepare_tfds(sources.tfds_builder(data_cfg))


def trains_eot(data_cfg: ml_collections.ConfigDict) -> bool:
  """Whether the pipeline's examples hold the end-of-text token (packed_lm frames documents
  with it, translation ends each side with it), so that training trains its embedding."""
  return getattr(_pipeline(data_cfg), 'TRAINS_EOT', False)


def holds_out(data: Any) -> bool:
  """Whether a run with these data fields (a ConfigDict, or its config.json's dict) takes its
  eval examples out of its training text, 1 in data.eval_holdout, so that the holdout moves its
  training stream; else its eval split is a source of its own (files, a TFDS split, a task's
  dev set, a synthetic language's own seeds)."""
  pipeline, task = data.get('pipeline'), data.get('task')
  if pipeline == 'translation':
    pairs = data.get('pairs')
    return pairs == 'offline' or (pairs == 'files' and not data.get('eval_source_files'))
  if pipeline == 'tagging':  # offline_names and offline_pos are synthetic: seeds of their own
    from input_pipeline import tagging  # pylint: disable=g-import-not-at-top
    spec = tagging.TASKS.get(task)
    return spec is not None and spec.source == 'offline'
  if task is not None:  # a fine-tuning task: the offline ones are made of the embedded corpus
    return str(task).startswith('offline_')
  return sources.holds_out(data)  # a text source (pretraining, CVT's unlabeled text)


def get_tokenizer(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  saved_dir: str | None = None) -> Any:
  """The tokenizer saved in `saved_dir` if it has one, else the configured or a learned one.

  A pipeline that learns its vocabulary from other text than sources.documents
  (translation: both sides of sentence pairs) has a get_tokenizer of its own.
  """
  module = _pipeline(data_cfg)
  if hasattr(module, 'get_tokenizer'):
    return module.get_tokenizer(data_cfg, vocab_size, saved_dir=saved_dir)
  return sources.get_tokenizer(data_cfg, vocab_size, saved_dir=saved_dir)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int, *,
                  batch_size: int) -> Batch:
  """A synthetic batch of the pipeline's feature spec, for initialization, tests and benchmarks."""
  return _pipeline(data_cfg).example_batch(data_cfg, vocab_size, batch_size)


class ShardedStream:
  """This host's rows of global batches that `num_shards` data shards make together.

  A training run's data is `num_shards` independent, resumable streams: shard
  s is what host s read in the run's first job, with as many hosts as shards.
  Each global batch is every shard's next global_batch/num_shards examples at
  the rows the shard fills (`shard_rows`, the run's layout, sharding.shard_rows:
  those host s fed in the first job; by default shard after shard). A host
  takes its rows of it (`rows`: [start, stop) ranges in the order its local
  batch lists them, sharding.process_rows; by default the process's contiguous
  share) and reads only the shards those rows come from: its own alone in the
  run's first job. So a run resumed on another number of hosts (or with another
  mesh) sees the same global batches in the same order.
  State: {shard: that shard's position} for the shards this host reads.
  """

  def __init__(self, make_shard: Any, *, num_shards: int, global_batch: int,
               process_index: int, process_count: int, workers: int = 0,
               rows: Sequence[tuple[int, int]] | None = None,
               shard_rows: Sequence[Sequence[tuple[int, int]]] | None = None):
    if global_batch % num_shards or global_batch % process_count:
      raise ValueError(f'train.batch_size={global_batch} must divide among the {num_shards} '
                       f'data shards this run started with and the {process_count} hosts: '
                       f'use a multiple of {math.lcm(num_shards, process_count)}.')
    per_shard, per_host = global_batch // num_shards, global_batch // process_count
    if rows is None:
      rows = [(process_index * per_host, (process_index + 1) * per_host)]
    if shard_rows is None:
      shard_rows = [[(s * per_shard, (s + 1) * per_shard)] for s in range(num_shards)]
    if [sum(b - a for a, b in ranges) for ranges in shard_rows] != [per_shard] * num_shards:
      raise ValueError(f'A layout of {shard_rows} does not give each of {num_shards} data '
                       f'shards {per_shard} rows of a batch of {global_batch}.')
    self._pieces = []  # (shard, its rows in the shard's batch), in the local batch's order
    for first, last in rows:
      pieces = []  # (the first global row, shard, rows in the shard's batch)
      for shard, ranges in enumerate(shard_rows):
        offset = 0
        for start, stop in ranges:
          lo, hi = max(first, start), min(last, stop)
          if lo < hi:
            pieces.append((lo, shard, slice(offset + lo - start, offset + hi - start)))
          offset += stop - start
      self._pieces += [(shard, piece) for _, shard, piece in sorted(pieces, key=lambda p: p[0])]
    # The host's workers divide among the shards it reads, at least one each (a host that reads
    # more shards than data.workers runs one per shard).
    read = sorted({shard for shard, _ in self._pieces})
    shard_workers = max(1, workers // len(read)) if workers else 0
    self._shards = {shard: make_shard(shard, per_shard, shard_workers) for shard in read}
    # One shard's whole batch (the same hosts as shards): passed on without a copy.
    self._whole = [piece for _, piece in self._pieces] == [slice(0, per_shard)]

  @property
  def steps_per_epoch(self) -> int | None:
    """One pass's steps of a stream of one shard (an eval split's), else None."""
    if len(self._shards) != 1:
      return None
    return getattr(next(iter(self._shards.values())), 'steps_per_epoch', None)

  def get_state(self) -> dict[int, dict[str, int]]:
    return {shard: it.get_state() for shard, it in self._shards.items()}

  def set_state(self, state: dict[int, dict[str, int]]) -> None:
    for shard, it in self._shards.items():
      it.set_state(state[shard])

  def close(self) -> None:
    """Stops every shard's workers (the next batch would start them again)."""
    for it in self._shards.values():
      it.close()

  def __iter__(self) -> 'ShardedStream':
    return self

  def __next__(self) -> Batch:
    batches = {shard: next(it) for shard, it in self._shards.items()}  # each shard's once
    if self._whole:
      return batches[self._pieces[0][0]]
    return {k: np.concatenate([batches[shard][k][rows] for shard, rows in self._pieces])
            for k in batches[self._pieces[0][0]]}


def get_train_stream(data_cfg: ml_collections.ConfigDict, *, tokenizer: Any,
                     global_batch: int, seed: int, num_shards: int, process_index: int = 0,
                     process_count: int = 1, workers: int = 0,
                     rows: Sequence[tuple[int, int]] | None = None,
                     shard_rows: Sequence[Sequence[tuple[int, int]]] | None = None
                     ) -> ShardedStream:
  """Endless training batches of this host's rows (ShardedStream's `rows`), from `num_shards`
  data shards at their rows (`shard_rows`), made by `workers` processes of this host;
  get_state/set_state carry every shard it reads."""
  module = _pipeline(data_cfg)

  def make_shard(shard: int, batch_size: int, shard_workers: int) -> Any:
    return module.get_iterator(with_workers(data_cfg, shard_workers), 'train',
                               tokenizer=tokenizer, batch_size=batch_size, seed=seed,
                               process_index=shard, process_count=num_shards)

  return ShardedStream(make_shard, num_shards=num_shards, global_batch=global_batch,
                       process_index=process_index, process_count=process_count,
                       workers=workers, rows=rows, shard_rows=shard_rows)


def get_dataset(data_cfg: ml_collections.ConfigDict, split: str, *,
                tokenizer: Any, batch_size: int, seed: int,
                process_index: int = 0, process_count: int = 1,
                workers: int = 0) -> Iterator[Batch]:
  """Endless host-local batches of `batch_size` with get_state/set_state and close; the train
  split's made by `workers` processes, the others' in a thread."""
  return _pipeline(data_cfg).get_iterator(
      with_workers(data_cfg, workers), split, tokenizer=tokenizer, batch_size=batch_size,
      seed=seed, process_index=process_index, process_count=process_count)


def num_workers(data_cfg: ml_collections.ConfigDict, platform: str, local_devices: int) -> int:
  """data.workers, with -1 (auto) resolved for a host of `local_devices` devices of `platform`."""
  workers = data_cfg.get('workers', 0)
  return workers_lib.default_workers(platform, local_devices) if workers == -1 else workers


def with_workers(data_cfg: ml_collections.ConfigDict, workers: int) -> ml_collections.ConfigDict:
  """data_cfg with data.workers set to a number of processes (a config may say -1: auto)."""
  data_cfg = data_cfg.copy_and_resolve_references()
  with data_cfg.unlocked():
    data_cfg.workers = workers
  return data_cfg
