"""Batches of a split held in memory (fine-tuning tasks), exactly resumable from {'epoch', 'offset'}.

Shared by the fine-tuning pipelines (gpt_finetune, tagging). Training runs
endless epochs, each a permutation seeded by (seed, epoch); every host takes
its stride of the first N - N mod P examples, so hosts have as many. Eval
runs in passes of steps_per_epoch batches over all examples, each host its
stride; the last batch is padded by repeating an example with example
weight 0, so metrics weighted by example_weights cover each example once.
"""

import math
from typing import Callable

from absl import logging
import numpy as np

from input_pipeline.common import workers

MakeBatchFn = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


def eval_steps(num_examples: int, process_count: int, batch_size: int) -> int:
  """Batches of one eval pass: every host takes its stride of the examples, the last padded."""
  return math.ceil(math.ceil(num_examples / process_count) / batch_size)


class BatchMaker:
  """The u-th batch after the position (epoch, offset): a unit of workers.UnitStream.

  Training reads the epochs' orders as one stream of this host's examples;
  eval cycles through steps_per_epoch batches of its stride.
  """

  def __init__(self, num_examples: int, make_batch: MakeBatchFn, *, is_eval: bool,
               batch_size: int, seed: int, process_index: int, process_count: int,
               epoch: int, offset: int):
    self._num_examples, self._make_batch, self._is_eval = num_examples, make_batch, is_eval
    self._batch_size, self._seed = batch_size, seed
    self._process_index, self._process_count = process_index, process_count
    self._order_epoch, self._order = None, None
    if is_eval:
      self.host_indices = np.arange(process_index, num_examples, process_count)
      self.steps_per_epoch = eval_steps(num_examples, process_count, batch_size)
      self._first_step = offset // batch_size % self.steps_per_epoch
    else:
      # The last N mod P are left out of each epoch, so every host has as many.
      self.per_host = num_examples // process_count
      self._first = epoch * self.per_host + offset

  def __getstate__(self) -> dict:
    return self.__dict__ | {'_order_epoch': None, '_order': None}

  def __call__(self, u: int) -> dict[str, np.ndarray]:
    if self._is_eval:
      return self._make_batch(*self._eval_indices(u))
    return self._make_batch(self._train_indices(u), np.ones(self._batch_size, np.float32))

  def end(self, u: int) -> dict[str, int]:
    """The position after batch u."""
    if self._is_eval:
      return {'epoch': 0,
              'offset': ((self._first_step + u) % self.steps_per_epoch + 1) * self._batch_size}
    last = self._first + (u + 1) * self._batch_size - 1
    epoch = last // self.per_host
    return {'epoch': epoch, 'offset': last + 1 - epoch * self.per_host}

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """This host's examples in epoch `epoch`."""
    if self._order_epoch != epoch:
      permutation = np.random.default_rng([self._seed, epoch]).permutation(self._num_examples)
      used = permutation[:self.per_host * self._process_count]
      self._order_epoch, self._order = epoch, used[self._process_index::self._process_count]
    return self._order

  def _train_indices(self, u: int) -> np.ndarray:
    positions = self._first + u * self._batch_size + np.arange(self._batch_size)
    epochs = positions // self.per_host
    pieces = [self._epoch_order(epoch)[positions[epochs == epoch] - epoch * self.per_host]
              for epoch in np.unique(epochs)]
    return np.concatenate(pieces)

  def _eval_indices(self, u: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch u; positions past this host's examples repeat one, with weight 0."""
    step = (self._first_step + u) % self.steps_per_epoch
    positions = step * self._batch_size + np.arange(self._batch_size)
    host = self.host_indices if len(self.host_indices) else np.zeros(1, np.int64)
    real = positions < len(self.host_indices)
    indices = np.where(real, host[np.minimum(positions, len(host) - 1)], host[0])
    return indices, real.astype(np.float32)


class ExampleIterator:
  """Host-local batches of a split's examples, exactly resumable, whatever the examples are.

  make_batch(indices, example_weights) builds a batch of the pipeline's spec; the training
  split's are made by `workers` processes (common/workers.py), the eval split's in a thread.
  """

  steps_per_epoch = None  # batches of one eval pass (eval split only)

  def __init__(self, num_examples: int, make_batch: MakeBatchFn, *, split: str,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
               name: str = '', workers: int = 0):
    self._num_examples, self._make_batch = num_examples, make_batch
    self._batch_size, self._seed = batch_size, seed
    self._process_index, self._process_count = process_index, process_count
    self._is_eval = split == 'eval'
    self._workers = 0 if self._is_eval else workers
    logging.info('Task %s, split %s: %d examples.', name, split, num_examples)
    if self._is_eval:
      self.steps_per_epoch = eval_steps(num_examples, process_count, batch_size)
    elif num_examples // process_count == 0:
      raise ValueError(f'Task {name!r} has {num_examples} training examples, fewer '
                       f'than the {process_count} hosts: use a larger task.')
    self._units = None
    self.set_state({'epoch': 0, 'offset': 0})

  @property
  def num_examples(self) -> int:
    """Examples of the split, all hosts together."""
    return self._num_examples

  def get_state(self) -> dict[str, int]:
    """Position after the last returned batch, JSON-serializable."""
    return dict(self._state)

  def set_state(self, state: dict[str, int]) -> None:
    self.close()
    self._state = {'epoch': int(state['epoch']), 'offset': int(state['offset'])}

  def close(self) -> None:
    """Stops the workers; the next batch starts them again."""
    if self._units is not None:
      self._units.close()
      self._units = None

  def __iter__(self) -> 'ExampleIterator':
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._units is None:
      self._maker = BatchMaker(
          self._num_examples, self._make_batch, is_eval=self._is_eval,
          batch_size=self._batch_size, seed=self._seed, process_index=self._process_index,
          process_count=self._process_count, **self._state)
      self._units, self._made = workers.UnitStream(self._maker, self._workers), 0
    batch = {k: np.array(v) for k, v in next(self._units).items()}  # out of shared memory
    self._state = self._maker.end(self._made)
    self._made += 1
    return batch
