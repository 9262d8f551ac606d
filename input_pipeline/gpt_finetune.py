"""GPT fine-tuning examples and their input transformations (Radford et al. 2018, sec. 3.3, fig. 1).

Every task becomes C token sequences per example, each ending in the extract
token whose final state feeds the linear head:

  classification   [start] text [extract]                                  C = 1
  entailment       [start] premise [delim] hypothesis [extract]            C = 1
  similarity       [start] a [delim] b [extract], [start] b [delim] a [extract]   C = 2
  multiple choice  [start] context [delim] answer_k [extract], k = 1..N    C = N

Texts longer than data.max_seq_length lose tokens from their ends, one at a
time from the longest text (the later one on ties); the specials always stay.

Feature spec of a host-local batch (numpy, static shapes; B batch, C sequences
per example, L = data.max_seq_length):

  input_ids          int32   (B, C, L)  the sequences above, pad_id after them
  segment_ids        int32   (B, C, L)  1 on the sequence's tokens, 0 on padding
  positions          int32   (B, C, L)  0, 1, ... along the sequence, 0 on padding
  targets            int32   (B, C, L)  the next token of the sequence, 0 where there is none
  weights            float32 (B, C, L)  1 where targets is a real token of the sequence
                                        (the auxiliary LM, sec. 3.2: every token after
                                        [start], the delimiter and extract included)
  extract_positions  int32   (B, C)     index of each sequence's extract token
  labels             int32   (B,)       class or correct choice; float32 for regression
  example_weights    float32 (B,)       1, or 0 for the padding of the last eval batch
  example_index      int32   (B,)       the example's index in its split; -1 on padding rows

Tasks (TASKS): GLUE and SNLI from TFDS (downloaded when named), PIQA and
HellaSwag for multiple choice, and four offline tasks made from the embedded
corpus (input_pipeline/tasks/offline_tasks.py), so that fine-tuning runs with no
download.

Order and resume: every host loads and tokenizes all the examples of a split
once (GLUE-sized tasks fit in memory as flat token arrays), then keeps its share.
Training reshuffles them every epoch with a generator seeded by (seed,
epoch); host i takes examples i, i + P, ... of that order (the last
N mod P are left out, so hosts stay in step), and the position is
{'epoch', 'offset'}. Eval reads its split in a fixed order, host i taking
examples i, i + P, ...; a pass is `steps_per_epoch` batches on every host,
the last one padded with example_weights 0, then it starts over.
"""

import dataclasses
import itertools
from typing import Sequence

from absl import logging
import ml_collections
import numpy as np

from input_pipeline.common import example_iterator
from input_pipeline.common import sources
from input_pipeline.common import workers
from input_pipeline.tasks import offline_tasks
from input_pipeline.tasks import task_metrics

KINDS = ('classification', 'entailment', 'similarity', 'multiple_choice')
# example_batch's ids, the byte-level BPE layout; words from 5 on.
_SYNTHETIC_PAD, _SYNTHETIC_START, _SYNTHETIC_DELIM, _SYNTHETIC_EXTRACT = 0, 2, 3, 4
_NUM_SYNTHETIC_SPECIAL = 5


@dataclasses.dataclass(frozen=True)
class Task:
  """Where a task's examples come from and how they become sequences (sec. 3.3)."""
  kind: str  # one of KINDS
  num_labels: int  # classes; 1 = regression; the number of answers for multiple choice
  source: str = 'tfds'  # 'tfds' | 'offline'
  tfds_name: str = ''
  text_fields: tuple[str, ...] = ()  # 1 for classification, 2 for entailment and similarity
  label_field: str = 'label'
  train_split: str = 'train'
  eval_split: str = 'validation'
  # Multiple choice: the context fields are joined with a space; a choice
  # field may hold one answer or a sequence of them.
  context_fields: tuple[str, ...] = ()
  choice_fields: tuple[str, ...] = ()

  @property
  def head(self) -> str:
    """models/gpt.py's head: one score per sequence for multiple choice, else classes."""
    return 'choice' if self.kind == 'multiple_choice' else 'classify'

  @property
  def num_choices(self) -> int:
    """C, the sequences per example."""
    return {'similarity': 2, 'multiple_choice': self.num_labels}.get(self.kind, 1)

  @property
  def regression(self) -> bool:
    return self.num_labels == 1

  @property
  def fields(self) -> tuple[str, ...]:
    return self.text_fields + self.context_fields + self.choice_fields + (self.label_field,)


def _glue(kind: str, num_labels: int, config: str, *text_fields: str, **kwargs) -> Task:
  # GLUE's test labels are hidden (-1): the validation split is the eval split.
  return Task(kind, num_labels, tfds_name=f'glue/{config}', text_fields=text_fields, **kwargs)


# Feature names checked against the TFDS 4.9.10 builders. Not here: Story
# Cloze (TFDS 'story_cloze' needs a manual download), RACE (one TFDS example
# holds all the questions of an article), ARC (3 to 5 answers per question).
TASKS: dict[str, Task] = {
    'sst2': _glue('classification', 2, 'sst2', 'sentence'),
    'cola': _glue('classification', 2, 'cola', 'sentence'),
    'mnli': _glue('entailment', 3, 'mnli', 'premise', 'hypothesis',
                  eval_split='validation_matched'),
    'mnli_mismatched': _glue('entailment', 3, 'mnli', 'premise', 'hypothesis',
                             eval_split='validation_mismatched'),
    'qnli': _glue('entailment', 2, 'qnli', 'question', 'sentence'),
    'rte': _glue('entailment', 2, 'rte', 'sentence1', 'sentence2'),
    # SNLI's label -1 marks pairs without a gold label; they are dropped. 'snli' evaluates on
    # its validation (dev) split; the papers' SNLI figures (GPT table 2, ELMo's, CoVe's) are of
    # its test split, which has labels: 'snli_test', trained alike.
    'snli': Task('entailment', 3, tfds_name='snli', text_fields=('premise', 'hypothesis')),
    'snli_test': Task('entailment', 3, tfds_name='snli', text_fields=('premise', 'hypothesis'),
                      eval_split='test'),
    'stsb': _glue('similarity', 1, 'stsb', 'sentence1', 'sentence2'),
    'qqp': _glue('similarity', 2, 'qqp', 'question1', 'question2'),
    'mrpc': _glue('similarity', 2, 'mrpc', 'sentence1', 'sentence2'),
    'piqa': Task('multiple_choice', 2, tfds_name='piqa', context_fields=('goal',),
                 choice_fields=('sol1', 'sol2')),
    'hellaswag': Task('multiple_choice', 4, tfds_name='hellaswag', context_fields=('context',),
                      choice_fields=('endings',)),
    'offline_shuffled': Task('classification', 2, source='offline'),
    'offline_next': Task('entailment', 2, source='offline'),
    'offline_same_doc': Task('similarity', 2, source='offline'),
    'offline_cloze': Task('multiple_choice', 4, source='offline'),
}


def task_spec(name: str) -> Task:
  """The task called `name`, or a one-line error listing the tasks."""
  if name not in TASKS:
    raise ValueError(f'Unknown task {name!r}: use --config=configs/gpt_finetune.py:<task>[,size] '
                     f'with one of {", ".join(TASKS)}.')
  return TASKS[name]


def check_config(config: ml_collections.ConfigDict) -> None:
  """A one-line ValueError unless the model's head and the batch shape are config.data.task's."""
  # An override of data.task alone would train the wrong head on the wrong batch shape.
  task = task_spec(config.data.task)
  wanted = {'model.num_labels': task.num_labels, 'model.head': task.head,
            'data.num_choices': task.num_choices}
  have = {'model.num_labels': config.model.get('num_labels'),
          'model.head': config.model.get('head'),
          'data.num_choices': config.data.get('num_choices')}
  if have != wanted:
    needs = ', '.join(f'{k}={v}' for k, v in wanted.items())
    raise ValueError(f'config.data.task={config.data.task} needs {needs}: choose the task with '
                     f'--config=configs/gpt_finetune.py:{config.data.task}[,size].')


# The input transformations (sec. 3.3, figure 1), on token-id lists.


@dataclasses.dataclass(frozen=True)
class Specials:
  """Ids of the randomly initialized start, delimiter and extract tokens (sec. 3.3)."""
  start: int
  delim: int
  extract: int

  @classmethod
  def of(cls, tokenizer) -> 'Specials':
    return cls(tokenizer.start_id, tokenizer.delim_id, tokenizer.extract_id)


def kept_lengths(lengths: Sequence[int], budget: int) -> list[int]:
  """Lengths after removing one token at a time from the longest text (the later on ties)."""
  if sum(lengths) <= budget:
    return list(lengths)
  # The removal levels the longest texts down to a cap c (the largest with
  # sum(min(l, c)) <= budget); the tokens left over go to the earliest of them.
  low, high = 0, max(lengths)
  while low < high:
    middle = (low + high + 1) // 2
    if sum(min(length, middle) for length in lengths) <= budget:
      low = middle
    else:
      high = middle - 1
  kept = [min(length, low) for length in lengths]
  spare = budget - sum(kept)
  for i, length in enumerate(lengths):
    if spare and length > low:
      kept[i] += 1
      spare -= 1
  return kept


def _truncated(texts: Sequence[list[int]], budget: int) -> list[list[int]]:
  return [text[:kept] for text, kept in zip(texts, kept_lengths([len(t) for t in texts], budget))]


def classification(text: list[int], specials: Specials, max_length: int) -> list[list[int]]:
  """[start] text [extract]."""
  (text,) = _truncated([text], max_length - 2)
  return [[specials.start] + text + [specials.extract]]


def entailment(premise: list[int], hypothesis: list[int], specials: Specials,
               max_length: int) -> list[list[int]]:
  """[start] premise [delim] hypothesis [extract]."""
  premise, hypothesis = _truncated([premise, hypothesis], max_length - 3)
  return [[specials.start] + premise + [specials.delim] + hypothesis + [specials.extract]]


def similarity(a: list[int], b: list[int], specials: Specials,
               max_length: int) -> list[list[int]]:
  """Both orders, as the two texts have none: [start] a [delim] b [extract], then b before a."""
  a, b = _truncated([a, b], max_length - 3)
  return [[specials.start] + a + [specials.delim] + b + [specials.extract],
          [specials.start] + b + [specials.delim] + a + [specials.extract]]


def multiple_choice(context: list[int], answers: Sequence[list[int]], specials: Specials,
                    max_length: int) -> list[list[int]]:
  """[start] context [delim] answer_k [extract] for each answer k."""
  sequences = []
  for answer in answers:
    kept_context, answer = _truncated([context, answer], max_length - 3)
    sequences.append([specials.start] + kept_context + [specials.delim] + answer
                     + [specials.extract])
  return sequences


def task_sequences(kind: str, texts: Sequence[list[int]], specials: Specials,
                   max_length: int) -> list[list[int]]:
  """The sequences of one example; texts are (text,), (a, b) or (context, *answers)."""
  if kind == 'classification':
    return classification(texts[0], specials, max_length)
  if kind == 'entailment':
    return entailment(texts[0], texts[1], specials, max_length)
  if kind == 'similarity':
    return similarity(texts[0], texts[1], specials, max_length)
  return multiple_choice(texts[0], texts[1:], specials, max_length)


def _num_specials(kind: str) -> int:
  return 2 if kind == 'classification' else 3


def validate(data_cfg: ml_collections.ConfigDict) -> Task:
  """The configured task, after checking that its sequences fit, in one line naming the fix."""
  task = task_spec(data_cfg.task)
  needed = _num_specials(task.kind) + (1 if task.kind == 'classification' else 2)
  if data_cfg.max_seq_length < needed:
    raise ValueError(f'data.max_seq_length={data_cfg.max_seq_length} leaves no room for the '
                     f'{task.kind} sequence of task {data_cfg.task!r} with its special '
                     f'tokens: use {needed} or more.')
  return task


# Arrays.


@dataclasses.dataclass
class Examples:
  """Tokenized examples: sequence (n, c) is tokens[starts[n, c]:][:lengths[n, c]]."""
  tokens: np.ndarray  # int32, flat
  starts: np.ndarray  # int64 (N, C)
  lengths: np.ndarray  # int64 (N, C)
  labels: np.ndarray  # int32 or float32 (N,)

  def __len__(self) -> int:
    return len(self.labels)


def make_examples(sequences: Sequence[Sequence[list[int]]], labels: Sequence) -> Examples:
  """Examples of per-example lists of C sequences."""
  lengths = np.array([[len(s) for s in example] for example in sequences], np.int64)
  flat = itertools.chain.from_iterable(itertools.chain.from_iterable(sequences))
  tokens = np.fromiter(flat, np.int32, int(lengths.sum()))
  starts = (np.cumsum(lengths.ravel()) - lengths.ravel()).reshape(lengths.shape)
  labels = np.asarray(labels)
  labels = labels.astype(np.float32 if labels.dtype.kind == 'f' else np.int32)
  return Examples(tokens, starts, lengths, labels)


def batch_arrays(examples: Examples, indices: np.ndarray, example_weights: np.ndarray,
                 max_length: int, pad_id: int) -> dict[str, np.ndarray]:
  """The batch of the spec above for examples[indices]."""
  starts, lengths = examples.starts[indices], examples.lengths[indices]
  col = np.arange(max_length)
  real = col < lengths[..., None]
  source = np.where(real, starts[..., None] + col, 0)
  input_ids = np.where(real, examples.tokens[source] if examples.tokens.size else 0, pad_id)
  has_next = (col < lengths[..., None] - 1) & (example_weights[:, None, None] > 0)
  targets = np.where(has_next, np.roll(input_ids, -1, axis=-1), 0)
  return {
      'input_ids': input_ids.astype(np.int32),
      'segment_ids': real.astype(np.int32),
      'positions': np.where(real, col, 0).astype(np.int32),
      'targets': targets.astype(np.int32),
      'weights': has_next.astype(np.float32),
      'extract_positions': (lengths - 1).astype(np.int32),
      'labels': examples.labels[indices],
      'example_weights': example_weights.astype(np.float32),
      'example_index': np.where(example_weights > 0, indices, -1).astype(np.int32),
  }


# Loading.


def task_texts(data_cfg: ml_collections.ConfigDict, task: Task,
               split: str) -> tuple[list[tuple[str, ...]], list]:
  """(texts, label) of every example of data.task's split, offline or from TFDS."""
  if split not in ('train', 'eval'):
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'eval'.")
  if task.source == 'offline':
    texts, labels = offline_tasks.offline_examples(data_cfg.task, data_cfg, split)
  else:
    texts, labels = tfds_examples(data_cfg.task, data_cfg, split)
  if not labels:
    raise ValueError(f'Task {data_cfg.task!r} has no {split!r} examples: check the dataset, '
                     'or lower data.eval_holdout for an offline task.')
  return texts, labels


def load_examples(data_cfg: ml_collections.ConfigDict, split: str, tokenizer) -> Examples:
  """All examples of the task's split, tokenized and transformed (sec. 3.3)."""
  task = validate(data_cfg)
  texts, labels = task_texts(data_cfg, task, split)
  specials = Specials.of(tokenizer)
  width = len(texts[0])
  # One call: the tokenizer batches in Rust.
  encoded = tokenizer.encode_batch([text for example in texts for text in example])
  sequences = [task_sequences(task.kind, encoded[i * width:(i + 1) * width], specials,
                              data_cfg.max_seq_length) for i in range(len(texts))]
  return make_examples(sequences, labels)


def _decoded(value) -> str:
  return value.decode('utf-8', 'replace') if isinstance(value, bytes) else str(value)


def tfds_examples(name: str, data_cfg: ml_collections.ConfigDict,
                  split: str) -> tuple[list[tuple[str, ...]], list]:
  """(texts, label) of a TFDS task; texts are (text,), (a, b) or (context, *answers)."""
  # Imported here: TensorFlow takes seconds to import and offline tasks do not need it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  task = TASKS[name]
  builder = tfds.builder(task.tfds_name, data_dir=data_cfg.tfds_data_dir or None)
  features = builder.info.features
  missing = [field for field in task.fields if field not in features]
  if missing:
    raise ValueError(f'TFDS dataset {task.tfds_name!r} has no feature {missing[0]!r} for task '
                     f'{name!r} (it has {", ".join(features)}): fix TASKS[{name!r}] in '
                     'input_pipeline/gpt_finetune.py.')
  sources.prepare_tfds(builder)
  tfds_split = task.train_split if split == 'train' else task.eval_split
  dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
  texts, labels, unlabeled = [], [], 0
  for example in tfds.as_numpy(dataset):
    label = example[task.label_field]
    if not task.regression:
      label = int(label)
      if label < 0:  # no gold label (SNLI), or a hidden test label
        unlabeled += 1
        continue
      if label >= task.num_labels:
        raise ValueError(f'Task {name!r} has {task.num_labels} labels but {task.tfds_name}:'
                         f'{tfds_split} has label {label}: fix TASKS[{name!r}].')
    if task.kind == 'multiple_choice':
      answers = []
      for field in task.choice_fields:
        value = example[field]
        answers += [_decoded(v) for v in value] if isinstance(value, np.ndarray) else [
            _decoded(value)]
      if len(answers) != task.num_labels:
        raise ValueError(f'Task {name!r} expects {task.num_labels} answers but an example of '
                         f'{task.tfds_name}:{tfds_split} has {len(answers)}: fix TASKS[{name!r}].')
      context = ' '.join(_decoded(example[field]) for field in task.context_fields)
      texts.append((context, *answers))
    else:
      texts.append(tuple(_decoded(example[field]) for field in task.text_fields))
    labels.append(float(label) if task.regression else label)
  if unlabeled:
    logging.info('Dropped %d examples of %s:%s without a gold label.', unlabeled,
                 task.tfds_name, tfds_split)
  return texts, labels


# Iteration.

class FinetuneIterator(example_iterator.ExampleIterator):
  """Host-local batches of one task's split, exactly resumable (sec. 3.3); `score` rates an eval
  pass with GLUE's metrics (input_pipeline/tasks/task_metrics.py)."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1):
    examples = load_examples(data_cfg, split, tokenizer)
    self.task, self.labels = task_spec(data_cfg.task), examples.labels
    max_length, pad_id = data_cfg.max_seq_length, tokenizer.pad_id
    super().__init__(
        len(examples),
        lambda indices, weights: batch_arrays(examples, indices, weights, max_length, pad_id),
        split=split, batch_size=batch_size, seed=seed, process_index=process_index,
        process_count=process_count, name=data_cfg.task, workers=workers.configured(data_cfg))


  def score(self, predictions: dict[str, np.ndarray]) -> dict[str, float]:
    predicted = task_metrics.by_example(predictions, 'prediction', len(self.labels))
    return task_metrics.classification(
        self.labels, predicted, regression=self.task.regression,
        binary=self.task.num_labels == 2 and self.task.kind != 'multiple_choice')


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer, batch_size: int,
                 seed: int, process_index: int = 0, process_count: int = 1) -> FinetuneIterator:
  """Batches of data.task's `split` ('train' endless and reshuffled, 'eval' in passes)."""
  return FinetuneIterator(data_cfg, split, tokenizer=tokenizer, batch_size=batch_size, seed=seed,
                          process_index=process_index, process_count=process_count)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> dict[str, np.ndarray]:
  """A random batch of data.task's spec; ids 0..4 are pad, eot, start, delim, extract."""
  task = validate(data_cfg)
  rng = np.random.default_rng(0)
  specials = Specials(_SYNTHETIC_START, _SYNTHETIC_DELIM, _SYNTHETIC_EXTRACT)
  num_texts = {'classification': 1, 'multiple_choice': 1 + task.num_labels}.get(task.kind, 2)
  sequences = []
  for _ in range(batch_size):
    texts = [rng.integers(_NUM_SYNTHETIC_SPECIAL, vocab_size,
                          int(rng.integers(1, data_cfg.max_seq_length))).tolist()
             for _ in range(num_texts)]
    sequences.append(task_sequences(task.kind, texts, specials, data_cfg.max_seq_length))
  if task.regression:
    labels = rng.uniform(0.0, 5.0, batch_size).astype(np.float32)
  else:
    labels = rng.integers(0, task.num_labels, batch_size)
  examples = make_examples(sequences, labels)
  return batch_arrays(examples, np.arange(batch_size), np.ones(batch_size, np.float32),
                      data_cfg.max_seq_length, _SYNTHETIC_PAD)
