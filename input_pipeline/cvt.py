"""Labeled and unlabeled sentence batches for Cross-View Training (Clark et al. 2018, sec. 2, 3.3).

Sentences are framed <S> words </S> as for the tagging pipeline
(input_pipeline/tagging.py). Feature spec of a host-local batch (B batch,
L = data.max_seq_length, W = data.max_characters_per_token):

  labeled (train and eval; one task per batch):
    token_ids int32 (B, L), char_ids int32 (B, L, W), lengths int32 (B,),
    labels int32 (B, L)          the task's tag ids in data.label_encoding (BIO or BIOES)
    label_weights float32 (B, L) 1 at the words of real rows
    example_weights float32 (B,) 1, or 0 for the padding of the last eval batch
    task_ids int32 (B,)          the task's index in data.tasks
  unlabeled (train only): token_ids, char_ids, lengths, example_weights.

Training step n is unlabeled iff floor((n + 1) r / (1 + r)) > floor(n r / (1 + r))
with r = data.unlabeled_ratio, so r = 1 alternates labeled and unlabeled
batches as cvt_text does, and r = 0 is the supervised-only baseline. A
labeled step draws its task with probability proportional to the square
root of the task's training sentences (cvt_text's choice), from a generator
seeded by (seed, n): every host draws the same task and a resumed run the
same tasks. Each task's labeled sentences come from its own
example_iterator.ExampleIterator (reshuffled epochs, data.max_train_examples
sentences of a task at most); the unlabeled sentences from the text source
(data.source ..., as for pretraining) through chunked.ChunkedIterator, one
row per sentence of at most L - 2 words, shuffled within a chunk of
data.docs_per_chunk documents. The state is a flat dict: the step counter
and each part's position. Eval runs one pass over each task's eval sentences
in data.tasks order (steps_per_epoch batches), then repeats.
"""

import functools
import math

import ml_collections
import numpy as np

from input_pipeline import tagging
from input_pipeline.common import chunked
from input_pipeline.common import example_iterator
from input_pipeline.common import words as words_lib

Batch = dict[str, np.ndarray]


def task_config(data_cfg: ml_collections.ConfigDict, task: str) -> ml_collections.ConfigDict:
  """data_cfg with data.task set, for the tagging pipeline's loaders."""
  cfg = ml_collections.ConfigDict(data_cfg.to_dict())
  cfg.task = task
  return cfg


def check_config(config: ml_collections.ConfigDict) -> None:
  """One-line errors before anything is read or compiled."""
  data = config.data
  words_lib.check_tokenizer(data)
  if not data.tasks:
    raise ValueError('data.tasks is empty: name one or more tagging tasks, e.g. '
                     "('offline_names',).")
  specs = []
  for task in data.tasks:
    specs.append(tagging.validate(task_config(data, task)))
  expected = tuple(tagging.num_labels(spec, data.label_encoding) for spec in specs)
  if tuple(config.model.num_labels) != expected:
    raise ValueError(f'config.model.num_labels={tuple(config.model.num_labels)} but data.tasks '
                     f'{tuple(data.tasks)} in {data.label_encoding} have {expected} tags: set '
                     f'--config.model.num_labels="{expected}".')
  if tuple(config.loss.get('tasks', ())) != tuple(data.tasks):
    raise ValueError(f'config.loss.tasks={tuple(config.loss.get("tasks", ()))} differs from '
                     f'data.tasks={tuple(data.tasks)}: set them to the same names.')
  chunked.validate(data, config.train.batch_size)


def is_unlabeled_step(step: int, ratio: float) -> bool:
  """Whether training step `step` (from 0) takes an unlabeled batch."""
  share = ratio / (1.0 + ratio)
  return math.floor((step + 1) * share + 1e-9) > math.floor(step * share + 1e-9)


def task_probabilities(sizes: list[int]) -> np.ndarray:
  """Proportional to the square root of each task's training sentences (cvt_text)."""
  weights = np.sqrt(np.asarray(sizes, np.float64))
  return weights / weights.sum()


def labeled_batch(examples: tagging.Examples, indices: np.ndarray, example_weights: np.ndarray,
                  max_length: int, task_id: int) -> Batch:
  batch = tagging.batch_arrays(examples, indices, example_weights, max_length)
  batch['task_ids'] = np.full(len(indices), task_id, np.int32)
  return batch


def load_task(data_cfg, task: str, split: str, vocab) -> tagging.Examples:
  """A task's framed sentences with tags in data.label_encoding."""
  cfg = task_config(data_cfg, task)
  examples = tagging.load_examples(cfg, split, vocab)
  if data_cfg.label_encoding == 'BIOES':
    spec = tagging.task_spec(task)
    out = np.array(examples.labels)
    for start, length in zip(examples.starts, examples.lengths):
      words = slice(start + 1, start + length - 1)
      out[words] = tagging.bio_to_bioes(examples.labels[words].tolist(), spec)
    examples.labels = out
  return examples


def unlabeled_rows(documents: list[list[str]], rng: np.random.Generator, *,
                   vocab: words_lib.WordVocab, length: int, max_characters: int) -> Batch:
  """One framed row per sentence of a chunk of documents, shuffled."""
  sentences = [words[:length - 2] for document in documents for s in document
               if (words := vocab.words_of(s))]
  token_ids, char_ids, lengths = vocab.frame_sentences(sentences, max_characters)
  starts = np.cumsum(lengths) - lengths
  col = np.arange(length)
  real = col < lengths[:, None]
  source = np.where(real, starts[:, None] + col, 0)
  rows = {
      'token_ids': np.where(real, token_ids[source], 0).astype(np.int32),
      'char_ids': np.where(real[..., None], char_ids[source], 0).astype(np.int32),
      'lengths': lengths.astype(np.int32),
      'example_weights': np.ones(len(lengths), np.float32),
  }
  order = rng.permutation(len(lengths))
  return {k: v[order] for k, v in rows.items()}


class TrainIterator:
  """Labeled batches of the drawn tasks and unlabeled batches, in the order the docstring says."""

  def __init__(self, data_cfg, labeled, unlabeled, seed: int):
    self._ratio, self._seed = float(data_cfg.unlabeled_ratio), seed
    self._labeled, self._unlabeled = labeled, unlabeled
    self._probabilities = task_probabilities([it.num_examples for it in labeled])
    self._step = 0

  def get_state(self) -> dict[str, int]:
    state = {'step': self._step}
    for t, iterator in enumerate(self._labeled):
      state.update({f'task_{t}_{k}': v for k, v in iterator.get_state().items()})
    state.update({f'unlabeled_{k}': v for k, v in self._unlabeled.get_state().items()})
    return state

  def set_state(self, state: dict[str, int]) -> None:
    self._step = int(state['step'])
    for t, iterator in enumerate(self._labeled):
      prefix = f'task_{t}_'
      iterator.set_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    self._unlabeled.set_state({k[len('unlabeled_'):]: v for k, v in state.items()
                               if k.startswith('unlabeled_')})

  def close(self) -> None:
    for iterator in self._labeled + [self._unlabeled]:
      iterator.close()

  def __iter__(self) -> 'TrainIterator':
    return self

  def __next__(self) -> Batch:
    step, self._step = self._step, self._step + 1
    if is_unlabeled_step(step, self._ratio):
      return next(self._unlabeled)
    task = np.random.default_rng([self._seed, step]).choice(
        len(self._labeled), p=self._probabilities)
    return next(self._labeled[task])


class EvalIterator:
  """One pass over every task's eval sentences, task after task, then again."""

  def __init__(self, iterators: list[example_iterator.ExampleIterator]):
    self._iterators = iterators
    self._starts = [it.get_state() for it in iterators]
    self.steps_per_epoch = sum(it.steps_per_epoch for it in iterators)
    self._step = 0

  def get_state(self) -> dict[str, int]:
    return {'step': self._step}

  def set_state(self, state: dict[str, int]) -> None:
    """Back at `step` of the passes: each task's iterator rewound to its start, then the batches
    before `step` read again (an eval starts at step 0, so none are)."""
    for iterator, start in zip(self._iterators, self._starts):
      iterator.set_state(start)
    self._step = 0
    for _ in range(int(state['step'])):
      next(self)

  def close(self) -> None:
    for iterator in self._iterators:
      iterator.close()

  def __iter__(self) -> 'EvalIterator':
    return self

  def __next__(self) -> Batch:
    position = self._step % self.steps_per_epoch
    self._step += 1
    for iterator in self._iterators:
      if position < iterator.steps_per_epoch:
        return next(iterator)
      position -= iterator.steps_per_epoch
    raise AssertionError('unreachable')


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: words_lib.WordVocab, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
  """Training batches (endless) or eval passes of data.tasks, resumable."""
  iterators = []
  for t, task in enumerate(data_cfg.tasks):
    examples = load_task(data_cfg, task, split, tokenizer)
    make_batch = functools.partial(labeled_batch, examples, task_id=t,
                                   max_length=tagging.batch_length(data_cfg, examples, split))
    iterators.append(example_iterator.ExampleIterator(
        len(examples), make_batch, split=split, batch_size=batch_size, seed=seed + t,
        process_index=process_index, process_count=process_count, name=task))
  if split == 'eval':
    return EvalIterator(iterators)
  build = functools.partial(unlabeled_rows, vocab=tokenizer, length=data_cfg.max_seq_length,
                            max_characters=data_cfg.max_characters_per_token)
  unlabeled = chunked.ChunkedIterator(data_cfg, 'train', build, batch_size=batch_size, seed=seed,
                                      process_index=process_index, process_count=process_count)
  return TrainIterator(data_cfg, iterators, unlabeled, seed)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int, batch_size: int) -> Batch:
  """A labeled batch of the first task's spec, of random words and tags."""
  batch = tagging.example_batch(task_config(data_cfg, data_cfg.tasks[0]), vocab_size, batch_size)
  batch['task_ids'] = np.zeros(batch_size, np.int32)
  return batch
