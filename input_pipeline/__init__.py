"""Input pipelines: host-local numpy batches per model family, resumable by a small state dict.

    data = input_pipeline.get_dataset(config.data, 'train', tokenizer=tok,
                                      batch_size=host_batch, seed=config.seed)
    batch = next(data); state = data.get_state()  # saved with the checkpoint
"""

import queue
import threading
from typing import Any, Callable, Iterator
import weakref

import ml_collections
import numpy as np

from input_pipeline import bert_pretraining
from input_pipeline import sources
# Importing the submodule also binds input_pipeline.tokenizer; get_dataset's argument has that name.
from input_pipeline import tokenizer as tokenizer_lib

Batch = dict[str, np.ndarray]


def _bert_example(data_cfg: ml_collections.ConfigDict, vocab_size: int, batch_size: int) -> Batch:
  return bert_pretraining.synthetic_batch(np.random.default_rng(0), batch_size,
                                          data_cfg.max_seq_length,
                                          data_cfg.max_predictions_per_seq, vocab_size)


# Pipeline family, named like the objective it feeds -> (iterator, synthetic batch of its spec).
_FAMILIES: dict[str, tuple[type, Callable[..., Batch]]] = {
    'mlm_nsp': (bert_pretraining.PretrainingIterator, _bert_example),  # BERT sec. 3.1
}


def _family(name: str) -> tuple[type, Callable[..., Batch]]:
  if name not in _FAMILIES:
    raise ValueError(f'Unknown input pipeline {name!r}: use one of {", ".join(_FAMILIES)}.')
  return _FAMILIES[name]


def get_tokenizer(data_cfg: ml_collections.ConfigDict,
                  vocab_size: int) -> tokenizer_lib.WordPieceTokenizer:
  """The WordPiece tokenizer of the data config (Devlin et al. 2018 sec. 3)."""
  return sources.get_tokenizer(data_cfg, vocab_size)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int, *, batch_size: int,
                  family: str = 'mlm_nsp') -> Batch:
  """A synthetic batch of the family's feature spec, for initialization, tests and benchmarks."""
  return _family(family)[1](data_cfg, vocab_size, batch_size)


def _produce(iterator: Any, out: queue.Queue, stopping: threading.Event) -> None:
  """Puts (batch, state after it, error) on `out` until `stopping` is set or an error occurs."""
  while not stopping.is_set():
    try:
      # Read right after its batch, so each pair is consistent.
      item = (next(iterator), iterator.get_state(), None)
    except Exception as error:  # re-raised by the consumer, in its own thread
      item = (None, None, error)
    # Polls, so that stopping is never stuck behind a full queue.
    while not stopping.is_set():
      try:
        out.put(item, timeout=0.05)
        break
      except queue.Full:
        pass
    if item[2] is not None:
      return


class Prefetcher:
  """Runs a resumable iterator `depth` batches ahead in a thread; get_state follows the consumer."""

  def __init__(self, iterator: Any, depth: int = 2):
    self._iterator, self._depth = iterator, depth
    self._state = iterator.get_state()
    self._thread = None

  def __iter__(self) -> 'Prefetcher':
    return self

  def __next__(self) -> Batch:
    if self._thread is None:  # started lazily: set_state right after construction builds nothing
      self._start()
    batch, state, error = self._queue.get()
    if error is not None:
      self.close()
      raise error
    self._state = state
    return batch

  def get_state(self) -> dict[str, int]:
    """Position after the last batch returned by __next__ (the thread runs ahead of it)."""
    return dict(self._state)

  def set_state(self, state: dict[str, int]) -> None:
    """Stops the thread and moves the wrapped iterator; the next batch restarts the thread."""
    self.close()
    self._iterator.set_state(state)
    self._state = self._iterator.get_state()

  def close(self) -> None:
    if self._thread is not None:
      self._stopping.set()
      self._thread.join()
      self._thread = None

  def _start(self) -> None:
    self._queue, self._stopping = queue.Queue(self._depth), threading.Event()
    # The thread holds no reference to self, so a dropped Prefetcher (an eval
    # iterator that is never closed) is collected and its thread stopped.
    self._thread = threading.Thread(target=_produce, daemon=True,
                                    args=(self._iterator, self._queue, self._stopping))
    weakref.finalize(self, self._stopping.set)
    self._thread.start()


def get_dataset(data_cfg: ml_collections.ConfigDict, split: str, *,
                tokenizer: tokenizer_lib.WordPieceTokenizer, batch_size: int, seed: int,
                process_index: int = 0, process_count: int = 1, family: str = 'mlm_nsp',
                prefetch: int = 2) -> Iterator[Batch]:
  """Endless host-local batches of `batch_size` with get_state/set_state; prefetch=0 for none."""
  iterator = _family(family)[0](data_cfg, split, tokenizer=tokenizer, batch_size=batch_size,
                                seed=seed, process_index=process_index,
                                process_count=process_count)
  return Prefetcher(iterator, prefetch) if prefetch else iterator
