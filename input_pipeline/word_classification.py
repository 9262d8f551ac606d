"""Sentence and sentence-pair classification over word ids, for the BCN on CoVe (McCann et al. 2017, sec. 5).

The words are those of a CoVe run's source vocabulary (its words.txt, read
from config.init_from, or from the workdir on resume): a text is split into
words as the CoVe run's sources were (data.split_words), after lower-casing
with data.lower_case (train.py checks both against the CoVe run's); a word
outside the vocabulary is <UNK> (id 2, CoVe's learned unknown vector). Words
beyond data.max_seq_length are cut; an empty text becomes one <UNK>.

Feature spec of a host-local batch (numpy, static shapes; B batch,
L = data.max_seq_length):

  x_ids            int32   (B, L)  word ids of x, 0 after its words
  y_ids            int32   (B, L)  word ids of y; y = x for single-sentence tasks (sec. 5)
  x_lengths        int32   (B,)    x's words, 1..L
  y_lengths        int32   (B,)    y's words, 1..L
  labels           int32   (B,)    the class
  example_weights  float32 (B,)    1, or 0 for the padding of the last eval batch

Tasks (data.task): the classification, entailment and similarity tasks of
input_pipeline/gpt_finetune.py TASKS: GLUE and SNLI from TFDS (downloaded
when named; x = the premise or first text, y = the hypothesis or second),
and the offline ones made from the embedded corpus
(input_pipeline/tasks/offline_tasks.py: offline_shuffled for single sentences,
offline_next and offline_same_doc for pairs). Multiple choice and
regression (STS-B) are not BCN tasks here.

Order and resume as for GPT fine-tuning (example_iterator.ExampleIterator):
training reshuffles every epoch, eval runs in passes of steps_per_epoch
batches whose padding rows have example_weights 0.
"""

import os

import ml_collections
import numpy as np

from input_pipeline import gpt_finetune
from input_pipeline.common import example_iterator
from input_pipeline.common import words as words_lib
from input_pipeline.common import workers

Batch = dict[str, np.ndarray]
KINDS = ('classification', 'entailment', 'similarity')
UNKNOWN_ID = 2  # words.py: <S> </S> <UNK>, then the words
TASKS: dict[str, gpt_finetune.Task] = {
    name: task for name, task in gpt_finetune.TASKS.items()
    if task.kind in KINDS and not task.regression}


def task_spec(name: str) -> gpt_finetune.Task:
  """The task called `name`, or a one-line error saying which tasks the BCN takes."""
  task = gpt_finetune.TASKS.get(name)
  if task is None:
    raise ValueError(f'Unknown task {name!r}: use --config=configs/cove_classifier.py:<task>[,size] '
                     f'with one of {", ".join(TASKS)}.')
  if task.kind not in KINDS:
    raise ValueError(f'Task {name!r} is multiple choice, which the BCN does not classify: use '
                     f'one of {", ".join(TASKS)}.')
  if task.regression:
    raise ValueError(f'Task {name!r} is a regression, which the BCN does not classify: use '
                     f'one of {", ".join(TASKS)}.')
  return task


def validate(data_cfg: ml_collections.ConfigDict) -> gpt_finetune.Task:
  """The configured task, after checking the sequence length, in one line naming the fix."""
  task = task_spec(data_cfg.task)
  if data_cfg.max_seq_length < 1:
    raise ValueError(f'data.max_seq_length={data_cfg.max_seq_length} leaves no room for a '
                     'word: use 1 or more (tens).')
  return task


def check_config(config: ml_collections.ConfigDict) -> None:
  """A one-line ValueError unless the model has config.data.task's number of labels."""
  task = validate(config.data)
  num_labels = config.model.get('num_labels')
  if num_labels != task.num_labels:
    raise ValueError(f'config.data.task={config.data.task} has {task.num_labels} labels but '
                     f'config.model.num_labels={num_labels}: set '
                     f'--config.model.num_labels={task.num_labels}.')


def get_tokenizer(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  saved_dir: str | None = None) -> words_lib.WordVocab:
  """The word vocabulary (words.txt) of the CoVe run in config.init_from, or of the workdir."""
  del vocab_size  # the saved run's; train.py checks its size against model.vocab_size
  if not saved_dir:
    raise ValueError('data.pipeline=word_classification reads the word vocabulary of a CoVe '
                     'run: set --config.init_from to the workdir of a configs/cove.py run.')
  path = os.path.join(saved_dir, words_lib.WordVocab.FILE_NAME)
  if not os.path.isfile(path):
    raise ValueError(f'{saved_dir} has no {words_lib.WordVocab.FILE_NAME}: config.init_from '
                     'must be a CoVe run (configs/cove.py, data.source_tokenizer=words).')
  return words_lib.WordVocab(path, split=words_lib.split_of(data_cfg))


def word_ids(texts: list[str], tokenizer, lower_case: bool, max_length: int) -> list[list[int]]:
  """Each text's word ids, cut to max_length; one <UNK> for a text without words."""
  encoded = tokenizer.encode_batch([t.lower() if lower_case else t for t in texts])
  return [ids[:max_length] or [UNKNOWN_ID] for ids in encoded]


def load_examples(data_cfg: ml_collections.ConfigDict, split: str,
                  tokenizer) -> gpt_finetune.Examples:
  """All examples of the task's split as word ids: one sequence (x) or two (x, y) per example."""
  texts, labels = gpt_finetune.task_texts(data_cfg, validate(data_cfg), split)
  width = len(texts[0])
  ids = word_ids([text for example in texts for text in example], tokenizer,
                 data_cfg.lower_case, data_cfg.max_seq_length)
  return gpt_finetune.make_examples([ids[i * width:(i + 1) * width] for i in range(len(texts))],
                                    labels)


def batch_arrays(examples: gpt_finetune.Examples, indices: np.ndarray,
                 example_weights: np.ndarray, max_length: int) -> Batch:
  """The batch of the spec above for examples[indices]; the last sequence is y (x when alone)."""
  starts, lengths = examples.starts[indices], examples.lengths[indices]
  col = np.arange(max_length)
  real = col < lengths[..., None]
  ids = np.where(real, examples.tokens[np.where(real, starts[..., None] + col, 0)], 0)
  return {
      'x_ids': ids[:, 0].astype(np.int32),
      'y_ids': ids[:, -1].astype(np.int32),
      'x_lengths': lengths[:, 0].astype(np.int32),
      'y_lengths': lengths[:, -1].astype(np.int32),
      'labels': examples.labels[indices].astype(np.int32),
      'example_weights': example_weights.astype(np.float32),
  }


class WordClassificationIterator(example_iterator.ExampleIterator):
  """Host-local batches of one task's split, exactly resumable."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1):
    examples = load_examples(data_cfg, split, tokenizer)
    max_length = data_cfg.max_seq_length
    super().__init__(
        len(examples),
        lambda indices, weights: batch_arrays(examples, indices, weights, max_length),
        split=split, batch_size=batch_size, seed=seed, process_index=process_index,
        process_count=process_count, name=data_cfg.task, workers=workers.configured(data_cfg))


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer, batch_size: int,
                 seed: int, process_index: int = 0,
                 process_count: int = 1) -> WordClassificationIterator:
  """Batches of data.task's `split` ('train' endless and reshuffled, 'eval' in passes)."""
  return WordClassificationIterator(data_cfg, split, tokenizer=tokenizer, batch_size=batch_size,
                                    seed=seed, process_index=process_index,
                                    process_count=process_count)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A random batch of data.task's spec: words from <UNK> (2) up, 1..L of them per text."""
  task = validate(data_cfg)
  rng = np.random.default_rng(0)
  num_texts = 1 if task.kind == 'classification' else 2
  sequences = [[rng.integers(UNKNOWN_ID, vocab_size,
                             int(rng.integers(1, data_cfg.max_seq_length + 1))).tolist()
                for _ in range(num_texts)] for _ in range(batch_size)]
  examples = gpt_finetune.make_examples(sequences, rng.integers(0, task.num_labels, batch_size))
  return batch_arrays(examples, np.arange(batch_size), np.ones(batch_size, np.float32),
                      data_cfg.max_seq_length)
