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

MakeBatchFn = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]


class ExampleIterator:
  """Host-local batches of a split's examples, exactly resumable, whatever the examples are.

  make_batch(indices, example_weights) builds a batch of the pipeline's spec.
  """

  def __init__(self, num_examples: int, make_batch: MakeBatchFn, *, split: str,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1,
               name: str = ''):
    self._num_examples, self._make_batch = num_examples, make_batch
    self._batch_size, self._seed = batch_size, seed
    self._process_index, self._process_count = process_index, process_count
    self._is_eval = split == 'eval'
    logging.info('Task %s, split %s: %d examples.', name, split, num_examples)
    if self._is_eval:
      self._host_indices = np.arange(process_index, num_examples, process_count)
      per_host = math.ceil(num_examples / process_count)
      self.steps_per_epoch = math.ceil(per_host / batch_size)
    else:
      # The last N mod P are left out of each epoch, so every host has as many.
      self._per_host = num_examples // process_count
      if self._per_host == 0:
        raise ValueError(f'Task {name!r} has {num_examples} training examples, fewer '
                         f'than the {process_count} hosts: use a larger task.')
    self._order_epoch, self._order = None, None
    self.set_state({'epoch': 0, 'offset': 0})

  @property
  def num_examples(self) -> int:
    """Examples of the split, all hosts together."""
    return self._num_examples

  def get_state(self) -> dict[str, int]:
    """Position after the last returned batch, JSON-serializable."""
    return {'epoch': self._epoch, 'offset': self._offset}

  def set_state(self, state: dict[str, int]) -> None:
    self._epoch, self._offset = int(state['epoch']), int(state['offset'])

  def __iter__(self) -> 'ExampleIterator':
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._is_eval:
      return self._make_batch(*self._eval_indices())
    return self._make_batch(self._train_indices(), np.ones(self._batch_size, np.float32))

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """This host's examples in epoch `epoch`."""
    if self._order_epoch != epoch:
      permutation = np.random.default_rng([self._seed, epoch]).permutation(self._num_examples)
      used = permutation[:self._per_host * self._process_count]
      self._order_epoch, self._order = epoch, used[self._process_index::self._process_count]
    return self._order

  def _train_indices(self) -> np.ndarray:
    pieces, needed = [], self._batch_size
    while needed:
      if self._offset >= self._per_host:
        self._epoch, self._offset = self._epoch + 1, 0
      taken = self._epoch_order(self._epoch)[self._offset:self._offset + needed]
      pieces.append(taken)
      self._offset += len(taken)
      needed -= len(taken)
    return np.concatenate(pieces)

  def _eval_indices(self) -> tuple[np.ndarray, np.ndarray]:
    """The next eval batch; positions past this host's examples repeat one, with weight 0."""
    if self._offset >= self.steps_per_epoch * self._batch_size:
      self._offset = 0
    positions = self._offset + np.arange(self._batch_size)
    self._offset += self._batch_size
    host = self._host_indices if len(self._host_indices) else np.zeros(1, np.int64)
    real = positions < len(self._host_indices)
    indices = np.where(real, host[np.minimum(positions, len(host) - 1)], host[0])
    return indices, real.astype(np.float32)
