"""BERT fine-tuning examples: sentence (pair) classification and token tagging (Devlin et al. 2018,
sec. 4.1 and 5.3, figure 4). SQuAD spans are input_pipeline/squad.py.

Sequences are [CLS] A [SEP] for one sentence and [CLS] A [SEP] B [SEP] for a
pair, with segment ids 0 up to the first [SEP] and 1 after it. Too long a
pair loses tokens from the end of its longer text, one at a time (the
reference's _truncate_seq_pair); a single text or a tagged sentence loses its
last tokens. A tagged sentence is split into words as the dataset gives them;
each word's label goes on its first WordPiece, and the other pieces, [CLS],
[SEP] and padding carry none (sec. 5.3: "the representation of the first
sub-token as the input to the token-level classifier").

Feature spec of a host-local batch (numpy, static shapes; B batch, L = data.max_seq_length):

  input_ids        int32   (B, L)  the sequence above, [PAD] after it
  segment_ids      int32   (B, L)  0 on [CLS] A [SEP], 1 on B [SEP], 0 on padding
  input_mask       int32   (B, L)  1 on the sequence's tokens
  labels           int32   (B,)    sequence tasks: the class; float32 for regression (STS-B)
                   int32   (B, L)  tagging: the word's tag at its first piece, 0 elsewhere
  label_weights    float32 (B, L)  tagging only: 1 at the first pieces of real examples' words
  example_weights  float32 (B,)    1, or 0 for the padding of the last eval batch
  example_index    int32   (B,)    the example's index in its split; -1 on padding rows

Tasks: the classification, entailment and similarity tasks of
input_pipeline/gpt_finetune.py (GLUE and SNLI from TFDS; offline_shuffled,
one sentence, and offline_next, a pair, from the embedded corpus) and the
tagging tasks of input_pipeline/tagging.py (conll2003 from TFDS;
offline_replaced from the embedded corpus).

After an eval pass, `score` gives the metrics from maintained libraries, on
the predictions of objectives/classification.py or objectives/tagging.py:
accuracy, and for two classes F1 (label 1 positive) and Matthews correlation
(scikit-learn); Pearson and Spearman correlation for regression (SciPy);
span precision, recall and F1 over the words' tags for tagging (seqeval,
conlleval's chunks; a word cut off by max_seq_length is predicted O).

Order and resume: example_iterator.ExampleIterator.
"""

import dataclasses
import functools
import itertools
from typing import Any

import ml_collections
import numpy as np

from input_pipeline import gpt_finetune
from input_pipeline import tagging
from input_pipeline.common import example_iterator
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import workers
from input_pipeline.tasks import task_metrics

Batch = dict[str, np.ndarray]
SEQUENCE_KINDS = ('classification', 'entailment', 'similarity')
# example_batch's ids: the WordPiece layout of input_pipeline/common/tokenizer.py.
_PAD, _CLS, _SEP = 0, 2, 3


def task_spec(name: str) -> gpt_finetune.Task | tagging.Task:
  """A sequence task (gpt_finetune.Task) or a tagging task (tagging.Task), by name."""
  if name in gpt_finetune.TASKS and gpt_finetune.TASKS[name].kind in SEQUENCE_KINDS:
    return gpt_finetune.TASKS[name]
  if name in tagging.TASKS and tagging.TASKS[name].source != 'synthetic':
    return tagging.TASKS[name]
  names = [n for n, t in gpt_finetune.TASKS.items() if t.kind in SEQUENCE_KINDS]
  names += [n for n, t in tagging.TASKS.items() if t.source != 'synthetic']
  raise ValueError(f'Unknown BERT fine-tuning task {name!r}: use one of {", ".join(names)}, or '
                   'squad / offline_span (input_pipeline/squad.py).')


def is_tagging(task) -> bool:
  return isinstance(task, tagging.Task)


def check_config(config: ml_collections.ConfigDict) -> None:
  """One-line ValueErrors unless the model's head fits config.data.task and the sequences fit."""
  data = config.data
  task = task_spec(data.task)
  if data.get('tokenizer', 'wordpiece') != 'wordpiece':
    raise ValueError(f'BERT fine-tuning reads WordPiece ids, not data.tokenizer='
                     f'{data.tokenizer!r}: set --config.data.tokenizer=wordpiece.')
  # [CLS] a [SEP], or [CLS] a [SEP] b [SEP] for a pair: a token of each text at least.
  needed = 3 if is_tagging(task) or task.kind == 'classification' else 5
  if data.max_seq_length < needed:
    raise ValueError(f'data.max_seq_length={data.max_seq_length} leaves no room for task '
                     f'{data.task!r} between [CLS] and [SEP]: use {needed} or more.')
  head = 'tag' if is_tagging(task) else 'classify'
  if config.model.get('head', head) != head or config.model.get('num_labels') != task.num_labels:
    raise ValueError(f'config.data.task={data.task} needs model.head={head} and '
                     f'model.num_labels={task.num_labels}: choose the task with '
                     f'--config=configs/bert_finetune.py:{data.task}.')


# Arrays.


@dataclasses.dataclass
class Examples:
  """Sequences in flat arrays: example n is tokens[starts[n]:][:lengths[n]]."""
  tokens: np.ndarray  # int32 (T,): [CLS] A [SEP] (B [SEP]) of every example
  starts: np.ndarray  # int64 (N,)
  lengths: np.ndarray  # int64 (N,)
  first_segment: np.ndarray  # int64 (N,): the length of [CLS] A [SEP]
  labels: np.ndarray  # sequence tasks (N,) int32 or float32; tagging (T,) int32 per token
  first_piece: np.ndarray | None = None  # tagging: bool (T,), a word's first piece
  # Tagging, for scoring: each word's gold tag and the index of its first piece in the row.
  word_tags: list[list[int]] | None = None
  word_positions: list[np.ndarray] | None = None

  def __len__(self) -> int:
    return len(self.lengths)


def _flatten(sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  lengths = np.array([len(s) for s in sequences], np.int64)
  tokens = np.fromiter(itertools.chain.from_iterable(sequences), np.int32, int(lengths.sum()))
  return tokens, np.cumsum(lengths) - lengths, lengths


def sequence_examples(texts: list[list[list[int]]], labels: list, cls_id: int, sep_id: int,
                      max_length: int) -> Examples:
  """Examples of one or two token-id texts each: [CLS] A [SEP] (B [SEP]), truncated."""
  sequences, first_segment = [], []
  for parts in texts:
    budget = max_length - 1 - len(parts)
    kept = [p[:k] for p, k in zip(parts, gpt_finetune.kept_lengths([len(p) for p in parts],
                                                                    budget))]
    sequence = [cls_id] + kept[0] + [sep_id]
    first_segment.append(len(sequence))
    for part in kept[1:]:
      sequence += part + [sep_id]
    sequences.append(sequence)
  tokens, starts, lengths = _flatten(sequences)
  labels = np.asarray(labels)
  labels = labels.astype(np.float32 if labels.dtype.kind == 'f' else np.int32)
  return Examples(tokens, starts, lengths, np.array(first_segment, np.int64), labels)


def first_piece_labels(word_pieces: list[list[int]], tags: list[int], cls_id: int, sep_id: int,
                       max_length: int) -> tuple[list[int], list[int], list[bool], np.ndarray]:
  """[CLS] pieces [SEP] of one sentence, each word's tag on its first piece (0 elsewhere), the
  first-piece flags, and each word's first-piece position (-1 for a word cut off)."""
  tokens, labels, first, positions = [cls_id], [0], [False], []
  for pieces, tag in zip(word_pieces, tags):
    kept = pieces[:max_length - 1 - len(tokens)]
    positions.append(len(tokens) if kept else -1)
    tokens += kept
    labels += [tag] + [0] * (len(kept) - 1) if kept else []
    first += [True] + [False] * (len(kept) - 1) if kept else []
  return tokens + [sep_id], labels + [0], first + [False], np.array(positions, np.int64)


def word_labels(positions: np.ndarray, predicted_tags: np.ndarray) -> np.ndarray:
  """Each word's tag, read at its first piece; a word cut off (position -1) gets tag 0 (O)."""
  return np.where(positions >= 0, predicted_tags[np.maximum(positions, 0)], 0)


def tagging_examples(sentences: list[list[str]], tags: list[list[int]], tokenizer,
                     max_length: int) -> Examples:
  """Examples of tagged sentences: words split into WordPieces, labels on first pieces."""
  words = [w for sentence in sentences for w in sentence]
  # One call for every word: the library tokenizes in parallel. A word that gives no
  # piece (only characters the tokenizer drops) is [UNK], so every word has a position.
  pieces = [ids or [tokenizer.unk_id] for ids in tokenizer.encode_batch(words)]
  sequences, labels, first, positions = [], [], [], []
  offset = 0
  for sentence, sentence_tags in zip(sentences, tags):
    row = first_piece_labels(pieces[offset:offset + len(sentence)], sentence_tags,
                             tokenizer.cls_id, tokenizer.sep_id, max_length)
    offset += len(sentence)
    sequences.append(row[0])
    labels.append(row[1])
    first.append(row[2])
    positions.append(row[3])
  tokens, starts, lengths = _flatten(sequences)
  return Examples(tokens, starts, lengths, lengths.copy(),
                  np.fromiter(itertools.chain.from_iterable(labels), np.int32, len(tokens)),
                  np.fromiter(itertools.chain.from_iterable(first), bool, len(tokens)),
                  [list(t) for t in tags], positions)


def batch_arrays(examples: Examples, indices: np.ndarray, example_weights: np.ndarray,
                 max_length: int, pad_id: int) -> Batch:
  """The batch of the spec above for examples[indices]."""
  lengths = examples.lengths[indices]
  col = np.arange(max_length)
  real = col < lengths[:, None]
  source = np.where(real, examples.starts[indices][:, None] + col, 0)
  batch = {
      'input_ids': np.where(real, examples.tokens[source], pad_id).astype(np.int32),
      'segment_ids': (real & (col >= examples.first_segment[indices][:, None])).astype(np.int32),
      'input_mask': real.astype(np.int32),
      'example_weights': example_weights.astype(np.float32),
      'example_index': np.where(example_weights > 0, indices, -1).astype(np.int32),
  }
  if examples.first_piece is None:
    batch['labels'] = examples.labels[indices]
  else:
    counted = real & examples.first_piece[source] & (example_weights[:, None] > 0)
    batch['labels'] = np.where(real, examples.labels[source], 0).astype(np.int32)
    batch['label_weights'] = counted.astype(np.float32)
  return batch


# Loading.


def load_examples(data_cfg: ml_collections.ConfigDict, split: str, tokenizer) -> Examples:
  """All examples of data.task's split, tokenized and framed."""
  task = task_spec(data_cfg.task)
  length = data_cfg.max_seq_length
  if not is_tagging(task):
    texts, labels = gpt_finetune.task_texts(data_cfg, task, split)
    width = len(texts[0])
    encoded = tokenizer.encode_batch([t for example in texts for t in example])
    grouped = [encoded[i * width:(i + 1) * width] for i in range(len(texts))]
    return sequence_examples(grouped, labels, tokenizer.cls_id, tokenizer.sep_id, length)
  if split not in ('train', 'eval'):
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'eval'.")
  if task.source == 'offline':
    cap = data_cfg.max_train_examples if split == 'train' else data_cfg.max_eval_examples
    sentences, tags = tagging.offline_sentences(data_cfg, split, cap)
  else:
    sentences, tags = tagging.tfds_sentences(data_cfg.task, data_cfg, split)
  if not sentences:
    raise ValueError(f'Task {data_cfg.task!r} has no {split!r} sentences: check the dataset, '
                     'or lower data.eval_holdout for an offline task.')
  return tagging_examples(sentences, tags, tokenizer, length)


# Scoring, on the host after an eval pass.


def score(task, examples: Examples, predictions: dict[str, np.ndarray]) -> dict[str, float]:
  """The task's metrics from maintained libraries (input_pipeline/tasks/task_metrics.py)."""
  if is_tagging(task):
    predicted = task_metrics.by_example(predictions, 'predicted_tags', len(examples))
    names = task.label_names
    gold = [[names[t] for t in tags] for tags in examples.word_tags]
    guessed = [[names[t] for t in word_labels(positions, row)]
               for positions, row in zip(examples.word_positions, predicted)]
    return task_metrics.spans(gold, guessed, chunks=bool(tagging.span_tags(task)))
  predicted = task_metrics.by_example(predictions, 'prediction', len(examples))
  return task_metrics.classification(examples.labels, predicted, regression=task.regression,
                                     binary=task.num_labels == 2)


# Iteration.


class FinetuneIterator(example_iterator.ExampleIterator):
  """Host-local batches of one task's split, exactly resumable; `score` rates an eval pass."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer,
               batch_size: int, seed: int, process_index: int = 0, process_count: int = 1):
    self.task = task_spec(data_cfg.task)
    self.examples = load_examples(data_cfg, split, tokenizer)
    make_batch = functools.partial(batch_arrays, self.examples,
                                   max_length=data_cfg.max_seq_length, pad_id=tokenizer.pad_id)
    super().__init__(len(self.examples), make_batch, split=split, batch_size=batch_size,
                     seed=seed, process_index=process_index, process_count=process_count,
                     name=data_cfg.task, workers=workers.configured(data_cfg))

  def score(self, predictions: dict[str, np.ndarray]) -> dict[str, float]:
    return score(self.task, self.examples, predictions)


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer, batch_size: int,
                 seed: int, process_index: int = 0, process_count: int = 1) -> FinetuneIterator:
  """Batches of data.task's `split` ('train' endless and reshuffled, 'eval' in passes)."""
  return FinetuneIterator(data_cfg, split, tokenizer=tokenizer, batch_size=batch_size, seed=seed,
                          process_index=process_index, process_count=process_count)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A random batch of data.task's spec; ids 0..4 are the WordPiece specials."""
  task = task_spec(data_cfg.task)
  rng = np.random.default_rng(0)
  first = len(tokenizer_lib.SPECIAL_TOKENS)
  length = data_cfg.max_seq_length
  random_text = lambda n: rng.integers(first, vocab_size, n).tolist()  # noqa: E731
  if is_tagging(task):
    sentences = [[random_text(int(rng.integers(1, 3))) for _ in range(int(rng.integers(1, length)))]
                 for _ in range(batch_size)]
    tags = [rng.integers(0, task.num_labels, len(s)).tolist() for s in sentences]
    rows = [first_piece_labels(s, t, _CLS, _SEP, length) for s, t in zip(sentences, tags)]
    tokens, starts, lengths = _flatten([r[0] for r in rows])
    examples = Examples(tokens, starts, lengths, lengths.copy(),
                        np.concatenate([r[1] for r in rows]).astype(np.int32),
                        np.concatenate([r[2] for r in rows]))
  else:
    parts = 1 if task.kind == 'classification' else 2
    texts = [[random_text(int(rng.integers(1, length))) for _ in range(parts)]
             for _ in range(batch_size)]
    labels: Any = (rng.uniform(0.0, 5.0, batch_size).astype(np.float32) if task.regression
                   else rng.integers(0, task.num_labels, batch_size))
    examples = sequence_examples(texts, labels, _CLS, _SEP, length)
  return batch_arrays(examples, np.arange(batch_size), np.ones(batch_size, np.float32),
                      length, _PAD)
