"""Batches of examples built per chunk of documents, exactly resumable from a small position.

A host's documents of a split are read in order and cut into chunks of
data.docs_per_chunk. A pipeline's `build(documents, rng)` turns one chunk into
examples (arrays sharing a leading example axis, already shuffled); the
generator is seeded from (seed, epoch, chunk, process_index), so the stream
is a pure function of its position {'epoch', 'chunk', 'offset'}: a resumed run
skips the earlier documents untokenized and rebuilds only its own chunk. The
eval split repeats epoch 0 with a fixed seed, so eval examples do not depend
on the run.
"""

import itertools
from typing import Callable, Iterator

import ml_collections
import numpy as np

from input_pipeline.common import sources

Examples = dict[str, np.ndarray]
BuildFn = Callable[[list[list[str]], np.random.Generator], Examples]
DocumentsFn = Callable[..., Iterator[list[str]]]
# Eval examples do not depend on the training seed, so eval losses compare across runs.
EVAL_SEED = 0


def validate(data_cfg: ml_collections.ConfigDict, batch_size: int,
             *checks: tuple[bool, str]) -> None:
  """Raises the message of the first failing (ok, message) check: the pipeline's, then these."""
  checks += (
      (data_cfg.docs_per_chunk >= 1,
       f'config.data.docs_per_chunk={data_cfg.docs_per_chunk} must be 1 or more.'),
      (batch_size >= 1,
       f'The host batch size is {batch_size}: raise config.train.batch_size to the host count.'),
  )
  for ok, message in checks:
    if not ok:
      raise ValueError(message)


class ChunkedIterator:
  """Endless host-local batches of the examples `build` makes of each chunk of documents."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, build: BuildFn, *,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
               documents_fn: DocumentsFn | None = None):
    self._cfg, self._split, self._build = data_cfg, split, build
    self._batch_size = batch_size
    self._is_eval = split == 'eval'
    self._seed = EVAL_SEED if self._is_eval else seed
    self._process_index, self._process_count = process_index, process_count
    # Looked up now, not at definition, so tests can monkeypatch sources.documents.
    self._documents_fn = documents_fn or sources.documents
    self.set_state({'epoch': 0, 'chunk': 0, 'offset': 0})

  def get_state(self) -> dict[str, int]:
    """Position after the last returned batch, JSON-serializable."""
    return {'epoch': self._epoch, 'chunk': self._chunk, 'offset': self._offset}

  def set_state(self, state: dict[str, int]) -> None:
    """Resumes at `state`; only its chunk is rebuilt, earlier documents are skipped untokenized."""
    self._epoch, self._chunk, self._offset = (int(state[k])
                                              for k in ('epoch', 'chunk', 'offset'))
    self._examples = None  # built on the next batch
    self._documents = None  # a fresh pass, skipped to the chunk, on the next batch

  def __iter__(self) -> 'ChunkedIterator':
    return self

  def __next__(self) -> Examples:
    pieces, needed = [], self._batch_size
    while needed:
      if self._examples is None:
        self._examples = self._build_chunk()
      available = _num_examples(self._examples) - self._offset
      if available <= 0:
        self._chunk, self._offset, self._examples = self._chunk + 1, 0, None
        continue
      take = min(available, needed)
      end = self._offset + take
      pieces.append({k: v[self._offset:end] for k, v in self._examples.items()})
      self._offset += take
      needed -= take
    return {k: np.concatenate([piece[k] for piece in pieces]) for k in pieces[0]}

  def _open_pass(self, skip: int) -> Iterator[list[str]]:
    """A fresh pass over the host's documents with the first `skip` consumed, untokenized."""
    documents = iter(self._documents_fn(self._cfg, self._split,
                                        process_index=self._process_index,
                                        process_count=self._process_count))
    # A resumed pass had examples before the checkpoint.
    self._pass_has_examples = skip > 0
    if sum(1 for _ in itertools.islice(documents, skip)) < skip:
      raise ValueError(f'Data position chunk {self._chunk} is past the end of split '
                       f'{self._split!r}: the data changed since the checkpoint; restore the data.')
    return documents

  def _build_chunk(self) -> Examples:
    """Examples of the current (epoch, chunk); the end of the documents starts the next epoch."""
    chunk_size = self._cfg.docs_per_chunk
    if self._documents is None:
      self._documents = self._open_pass(skip=self._chunk * chunk_size)
    documents = list(itertools.islice(self._documents, chunk_size))
    if not documents:
      if not self._pass_has_examples:
        raise ValueError(f'Split {self._split!r} of data source {self._cfg.source!r} has no '
                         'text: check config.data.source and its files/tfds fields.')
      self._epoch += not self._is_eval
      self._chunk = 0
      self._documents = self._open_pass(skip=0)
      documents = list(itertools.islice(self._documents, chunk_size))
    rng = np.random.default_rng([self._seed, self._epoch, self._chunk, self._process_index])
    examples = self._build(documents, rng)
    num_examples = _num_examples(examples)
    if self._offset > num_examples:
      raise ValueError(f'Data position {self.get_state()} is past its chunk of {num_examples} '
                       'examples: the data or config.data changed since the checkpoint.')
    self._pass_has_examples |= num_examples > 0
    return examples


def _num_examples(examples: Examples) -> int:
  return len(next(iter(examples.values())))
