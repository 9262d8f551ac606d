"""Batches of examples built per chunk of documents, exactly resumable from a small position.

A host's documents of a split are read in order and cut into chunks of
data.docs_per_chunk. A pipeline's `build(documents, rng)` turns one chunk into
examples (arrays sharing a leading example axis, already shuffled); the
generator is seeded from (seed, epoch, chunk, process_index), so the stream
is a pure function of its position {'epoch', 'chunk', 'offset'}: a resumed run
skips the earlier documents untokenized and rebuilds only its own chunk. The
chunks are built ahead by data.workers processes (common/workers.py) and
arrive in order, so the batches do not depend on the number of workers. The
eval split repeats epoch 0 with a fixed seed, so eval examples do not depend
on the run.
"""

import itertools
from typing import Callable, Iterator

from absl import logging
import ml_collections
import numpy as np

from input_pipeline.common import sources
from input_pipeline.common import workers

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


class ChunkMaker:
  """The u-th chunk's examples after (epoch, chunk), tagged with its (epoch, chunk): a unit of
  workers.UnitStream. Reads forward, so a worker's chunks u, u + W, ... cost one pass."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, build: BuildFn,
               documents_fn: DocumentsFn, *, seed: int, epoch: int, chunk: int,
               process_index: int, process_count: int):
    self._cfg, self._split, self._build, self._documents_fn = data_cfg, split, build, documents_fn
    self._seed, self._start = seed, (epoch, chunk)
    self._process_index, self._process_count = process_index, process_count
    self._chunks, self._next = None, 0

  def __getstate__(self) -> dict:
    return self.__dict__ | {'_chunks': None, '_next': 0}  # a worker opens its own pass

  def __call__(self, u: int) -> tuple[int, int, Examples]:
    if self._chunks is None or u < self._next:
      self._chunks, self._next = self._documents_by_chunk(), 0
    for _ in range(u - self._next):  # another worker's chunks
      next(self._chunks)
    epoch, chunk, documents = next(self._chunks)
    self._next = u + 1
    rng = np.random.default_rng([self._seed, epoch, chunk, self._process_index])
    return epoch, chunk, self._build(documents, rng)

  def _documents_by_chunk(self) -> Iterator[tuple[int, int, list[list[str]]]]:
    """(epoch, chunk, its documents) from the start on, endlessly; eval repeats epoch 0."""
    (epoch, chunk), size = self._start, self._cfg.docs_per_chunk
    while True:
      documents = iter(self._documents_fn(self._cfg, self._split,
                                          process_index=self._process_index,
                                          process_count=self._process_count))
      skip = chunk * size
      if sum(1 for _ in itertools.islice(documents, skip)) < skip:
        raise ValueError(f'Data position chunk {chunk} is past the end of split '
                         f'{self._split!r}: the data changed since the checkpoint; restore the '
                         'data.')
      while batch := list(itertools.islice(documents, size)):
        yield epoch, chunk, batch
        chunk += 1
      if chunk == 0:
        raise ValueError(f'Split {self._split!r} of data source {self._cfg.source!r} has no '
                         'text: check config.data.source and its files/tfds fields.')
      epoch, chunk = epoch + (self._split != 'eval'), 0


class ChunkedIterator:
  """Endless host-local batches of the examples `build` makes of each chunk of documents."""

  steps_per_epoch = None  # an eval split's examples are counted by train.eval_steps

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, build: BuildFn, *,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
               documents_fn: DocumentsFn | None = None):
    self._cfg, self._split, self._build = data_cfg, split, build
    self._batch_size = batch_size
    self._seed = EVAL_SEED if split == 'eval' else seed
    self._process_index, self._process_count = process_index, process_count
    # Looked up now, not at definition, so tests can monkeypatch sources.documents.
    self._documents_fn = documents_fn or sources.documents
    # Eval batches are few; they are made in a thread.
    self._workers = workers.configured(data_cfg) if split == 'train' else 0
    self._units = None
    self._pass_examples, self._said_wrapped = 0, False
    self.set_state({'epoch': 0, 'chunk': 0, 'offset': 0})

  def get_state(self) -> dict[str, int]:
    """Position after the last returned batch, JSON-serializable."""
    return {'epoch': self._epoch, 'chunk': self._chunk, 'offset': self._offset}

  def set_state(self, state: dict[str, int]) -> None:
    """Resumes at `state`; only its chunk is rebuilt, earlier documents are skipped untokenized."""
    self.close()  # the chunk at the position is made on the next batch
    self._epoch, self._chunk, self._offset = (int(state[k])
                                              for k in ('epoch', 'chunk', 'offset'))
    # A resumed pass had examples before the checkpoint.
    self._pass_has_examples = self._chunk > 0 or self._offset > 0

  def maker(self) -> ChunkMaker:
    """What makes the chunks from the current (epoch, chunk) on: maker(u) is the u-th."""
    return ChunkMaker(self._cfg, self._split, self._build, self._documents_fn, seed=self._seed,
                      epoch=self._epoch, chunk=self._chunk, process_index=self._process_index,
                      process_count=self._process_count)

  def close(self) -> None:
    """Stops the workers and frees the chunk (shared memory); the next batch makes it again."""
    self._examples = None
    if self._units is not None:
      self._units.close()
      self._units = None

  def __iter__(self) -> 'ChunkedIterator':
    return self

  def __next__(self) -> Examples:
    pieces, needed = [], self._batch_size
    while needed:
      if self._examples is None:
        self._next_chunk()
      available = _num_examples(self._examples) - self._offset
      if available <= 0:
        self._examples, self._offset = None, 0
        continue
      take = min(available, needed)
      end = self._offset + take
      pieces.append({k: v[self._offset:end] for k, v in self._examples.items()})
      self._offset += take
      needed -= take
    return {k: np.concatenate([piece[k] for piece in pieces]) for k in pieces[0]}

  def _next_chunk(self) -> None:
    """The next chunk's examples from the workers; a new pass of the documents must give some."""
    if self._units is None:
      self._units = workers.UnitStream(self.maker(), self._workers)
      first = True
    else:
      first = False
    epoch, chunk, examples = next(self._units)
    # Views of the arrays a worker left in shared memory (freed with the last view).
    self._examples = {k: v.view(np.ndarray) for k, v in examples.items()}
    if chunk == 0 and not first:
      if self._split == 'eval' and self._pass_has_examples and not self._said_wrapped:
        self._said_wrapped = True
        fits = self._pass_examples // self._batch_size
        logging.warning(
            'An eval read all %d examples of the eval split (this host\'s) and goes on from its '
            'first again, which then count more than the others: %shold out more documents '
            '(data.eval_holdout, data.eval_files or data.tfds_eval_split).', self._pass_examples,
            f'set train.eval_steps to {fits} or fewer at this batch size, or ' if fits else '')
      if not self._pass_has_examples:
        # BERT's NSP pairs sentences of one document: a corpus of one-sentence documents
        # (lm1b, or text without blank lines between documents) has text but no pair.
        nsp = (' or no document of two sentences or more for next sentence prediction (one '
               'sentence a line, a blank line between documents; or set '
               'data.next_sentence_prediction=False)'
               if self._cfg.get('next_sentence_prediction') else '')
        raise ValueError(f'Split {self._split!r} of data source {self._cfg.source!r} has no '
                         f'text{nsp}: check config.data.source and its files/tfds fields.')
      self._pass_has_examples = False
    self._epoch, self._chunk = epoch, chunk
    num_examples = _num_examples(self._examples)
    self._pass_examples = num_examples + (self._pass_examples if chunk else 0)
    if self._offset > num_examples:
      raise ValueError(f'Data position {self.get_state()} is past its chunk of {num_examples} '
                       'examples: the data or config.data changed since the checkpoint.')
    self._pass_has_examples |= num_examples > 0


def _num_examples(examples: Examples) -> int:
  return len(next(iter(examples.values())))
