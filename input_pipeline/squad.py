"""SQuAD v1.1 answer spans for BERT fine-tuning (Devlin et al. 2018, sec. 4.2, figure 4c).

A question and its context (a paragraph) are packed as [CLS] question [SEP]
context [SEP]; the model scores each token as the answer's start and end.
The question is cut to data.max_query_length tokens. A context too long for
one row is split into windows of at most max_seq_length - len(question) - 3
tokens that start every data.doc_stride tokens, the last one ending at the
context's end, so every context token is in some window (the doc spans of
google-research/bert run_squad.py). Each window is one row.

Feature spec of a host-local batch (numpy, static shapes; B batch, L = data.max_seq_length):

  input_ids        int32   (B, L)  [CLS] question [SEP] window [SEP], [PAD] after it
  segment_ids      int32   (B, L)  0 on [CLS] question [SEP], 1 on the window and its [SEP],
                                   0 on padding
  input_mask       int32   (B, L)  1 on the row's tokens
  start_positions  int32   (B,)    index in the row of the answer's first token; 0 ([CLS])
                                   when the window does not hold the whole answer
  end_positions    int32   (B,)    index of the answer's last token; 0 likewise
  example_weights  float32 (B,)    1, or 0 for the padding of the last eval batch
  example_index    int32   (B,)    the window's index in its split; -1 on padding rows

The targets come from the first answer (SQuAD's train split has one per
question). Its tokens are those whose character span in the context overlaps
the answer's: the tokenizer gives each token's span in the original text, so
this is the tokenized answer itself, which run_squad reaches from whitespace
words and then _improve_answer_span. (An answer that ends inside a token, as
'Japan' in 'Japanese', takes the whole token, as it must there too.) A training question whose answer covers
no token is left out, as run_squad leaves out answers it cannot find; eval
keeps every question and all its gold answers. An answer whose text is not
at its answer_start (a damaged example) is taken as the span given there.

Scoring (`score`, after an eval pass of objectives/span.py's predict): for
each question, over its windows, the candidates pair the n_best_size highest
start logits with the n_best_size highest end logits of the row, keeping
those inside the window's context with end >= start, at most
max_answer_length tokens, and a start token that is in the window where it
has the most context (min(tokens left, tokens right) + 0.01 * window length;
the earlier window on ties: run_squad's _check_is_max_context). The best
candidate by start + end logit gives the answer: the context's text from its
first token's start to its last token's end (case, accents and spacing as in
the context). Exact match and F1 are those of the official SQuAD v1.1
evaluate script: answers are normalized (lower-cased, punctuation and the
articles a/an/the removed, whitespace collapsed), F1 counts the common
words, and each question takes its best over the gold answers; percentages
over all eval questions, a question with no scored window counting 0.
`predictions_text` gives each question's answer by id: trainer/evaluation.py writes it to
workdir/predictions.json after each eval.

Tasks (by data.task):
  squad         TFDS squad/v1.1 (downloaded when named): train on 'train', evaluate on
                'validation'.
  offline_span  made from the embedded corpus, no download. A context is a run of
                consecutive sentences of a document, at most CONTEXT_WORDS (150) words (a
                longer sentence is a context of its own). A question is QUESTION_WORDS
                (4) consecutive words of it (words are runs of letters, digits and '_'),
                whose lower-cased words occur only there in the context, copied as
                written (punctuation between the words included); the answer is the
                words right after them, at most MAX_ANSWER_WORDS (3) and only as long as
                plain spaces separate them (punctuation ends it), never articles only.
                Up to QUESTIONS_PER_CONTEXT (2) questions per context. Train and eval come
                from the corpus's train and eval documents (input_pipeline/
                offline_tasks.py), shuffled and cut to data.max_train_examples and
                data.max_eval_examples questions (0 = all). A model must find the
                question in the context and mark what follows; trivial predictors
                score low on the 1000 eval questions of configs/bert_finetune.py
                (eval_holdout=10): the context's first word EM 0.0 F1 0.5, the most
                frequent training answer EM 0.3 F1 1.0, a random run of 1 to 3 of the
                context's words EM 5.7 F1 16.0. With the 4096-token vocabulary
                of its tiny size (max_seq_length 128, doc_stride 32), 8% of the eval
                questions (10% of the training ones) have more than one window.

Order and resume as for the other fine-tuning tasks (example_iterator.ExampleIterator),
over windows: training reshuffles the windows every epoch, eval runs in passes of
steps_per_epoch batches whose padding rows have example_weights 0 and example_index -1.
Every host holds all the windows of its split, so each can score a whole pass.
"""

import collections
import dataclasses
import functools
import itertools
import re
import string
import zlib
from typing import Iterable, Sequence

from absl import logging
import ml_collections
import numpy as np

from input_pipeline.common import example_iterator
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import workers
from input_pipeline.tasks import offline_tasks

Batch = dict[str, np.ndarray]
TASKS = ('squad', 'offline_span')
TFDS_NAME = 'squad/v1.1'
# example_batch's ids: the WordPiece layout of input_pipeline/common/tokenizer.py.
_PAD, _CLS, _SEP = 0, 2, 3
# offline_span (see the module docstring).
CONTEXT_WORDS = 150
QUESTION_WORDS = 4
MAX_ANSWER_WORDS = 3
QUESTIONS_PER_CONTEXT = 2
_WORD = re.compile(r'\w+')


@dataclasses.dataclass(frozen=True)
class Question:
  """A question about a context, its gold answers, and where the first one is in the context."""
  id: str
  question: str
  context: str
  answers: tuple[str, ...]
  answer_span: tuple[int, int] | None  # characters [start, end) of the first answer


def validate(data_cfg: ml_collections.ConfigDict) -> None:
  """One-line ValueErrors naming the fix, unless the task and the windows' sizes can work."""
  if data_cfg.task not in TASKS:
    raise ValueError(f'Unknown SQuAD task {data_cfg.task!r}: set config.data.task to one of '
                     f'{", ".join(TASKS)} (other BERT tasks: data.pipeline=bert_finetune).')
  if data_cfg.get('tokenizer', 'wordpiece') != 'wordpiece':
    raise ValueError(f'SQuAD rows are WordPiece ids, not data.tokenizer={data_cfg.tokenizer!r}: '
                     'set --config.data.tokenizer=wordpiece.')
  length, query, stride = data_cfg.max_seq_length, data_cfg.max_query_length, data_cfg.doc_stride
  if query < 1:
    raise ValueError(f'data.max_query_length={query} leaves no question: use 1 or more '
                     '(run_squad: 64).')
  room = length - query - 3
  if room < 2:
    raise ValueError(f'data.max_seq_length={length} leaves {max(room, 0)} context tokens per '
                     f'window after data.max_query_length={query} and [CLS] [SEP] [SEP]: use '
                     f'{query + 5} or more (run_squad: 384 with 64).')
  if not 1 <= stride < room:
    raise ValueError(f'data.doc_stride={stride} must be between 1 and {room - 1}, below the '
                     f'{room} context tokens of a window (data.max_seq_length - '
                     'data.max_query_length - 3), so that windows overlap: set '
                     '--config.data.doc_stride.')
  for field in ('n_best_size', 'max_answer_length'):
    if data_cfg[field] < 1:
      raise ValueError(f'data.{field}={data_cfg[field]} allows no answer: use 1 or more '
                       '(run_squad: n_best_size 20, max_answer_length 30).')


def check_config(config: ml_collections.ConfigDict) -> None:
  """validate(config.data), and the model must have the span head within its positions."""
  validate(config.data)
  if config.model.get('head', 'span') != 'span':
    raise ValueError(f'config.data.task={config.data.task} needs model.head=span, not '
                     f'{config.model.head!r}: choose the task with '
                     f'--config=configs/bert_finetune.py:{config.data.task}.')
  positions = config.model.get('max_position_embeddings')
  if positions is not None and config.data.max_seq_length > positions:
    raise ValueError(f'data.max_seq_length={config.data.max_seq_length} exceeds the model\'s '
                     f'{positions} positions: set --config.data.max_seq_length={positions} or '
                     'less.')


# Windows.


def windows(num_tokens: int, room: int, doc_stride: int) -> list[tuple[int, int]]:
  """(start, length) of the windows of a context of num_tokens tokens (run_squad's doc spans).

  Windows start every doc_stride tokens and hold at most `room`; the last one
  ends at the context's end. An empty context has one empty window, so that
  every question has a row.
  """
  spans, start = [], 0
  while True:
    length = min(num_tokens - start, room)
    spans.append((start, length))
    if start + length >= num_tokens:
      return spans
    start += min(length, doc_stride)


def max_context(spans: Sequence[tuple[int, int]], index: int) -> np.ndarray:
  """Whether each token of window `index` is most central there (run_squad's _check_is_max_context).

  A token's score in a window that holds it is min(tokens left, tokens right)
  + 0.01 * the window's length; the highest wins, the earlier window on ties.
  """
  start, length = spans[index]
  tokens = np.arange(start, start + length)
  best_score, best = np.full(length, -np.inf), np.full(length, -1)
  for i, (other_start, other_length) in enumerate(spans):
    inside = (tokens >= other_start) & (tokens < other_start + other_length)
    score = (np.minimum(tokens - other_start, other_start + other_length - 1 - tokens)
             + 0.01 * other_length)
    better = inside & (score > best_score)
    best_score, best = np.where(better, score, best_score), np.where(better, i, best)
  return best == index


def token_span(offsets: np.ndarray, span: tuple[int, int] | None) -> tuple[int, int] | None:
  """(first, last) token whose character span overlaps characters [start, end); None if none."""
  if span is None or not len(offsets):
    return None
  overlapping = np.flatnonzero((offsets[:, 0] < span[1]) & (offsets[:, 1] > span[0]))
  return (int(overlapping[0]), int(overlapping[-1])) if len(overlapping) else None


@dataclasses.dataclass
class Examples:
  """A split's windows (the rows) and what scoring needs; question q's windows are
  first_window[q] : first_window[q + 1], and its context's tokens start at context_starts[q]."""
  questions: list[Question]
  query_tokens: np.ndarray  # int32 (T_q,): every question's tokens, cut to max_query_length
  query_starts: np.ndarray  # int64 (Q,)
  query_lengths: np.ndarray  # int64 (Q,)
  context_tokens: np.ndarray  # int32 (T_c,): every distinct context's tokens
  context_offsets: np.ndarray  # int64 (T_c, 2): each token's characters [start, end)
  context_starts: np.ndarray  # int64 (Q,)
  first_window: np.ndarray  # int64 (Q + 1,)
  question: np.ndarray  # int64 (W,): each window's question
  start: np.ndarray  # int64 (W,): the window's first token, in its context
  length: np.ndarray  # int64 (W,): its context tokens
  start_positions: np.ndarray  # int32 (W,)
  end_positions: np.ndarray  # int32 (W,)

  def __len__(self) -> int:
    return len(self.question)

  def spans(self, q: int) -> list[tuple[int, int]]:
    """(start, length) of question q's windows."""
    rows = slice(self.first_window[q], self.first_window[q + 1])
    return list(zip(self.start[rows].tolist(), self.length[rows].tolist()))

  def text(self, window: int, first: int, last: int) -> str:
    """The context's text of the window's context tokens first..last (indices in the window)."""
    q = self.question[window]
    base = self.context_starts[q] + self.start[window]
    return self.questions[q].context[self.context_offsets[base + first, 0]:
                                     self.context_offsets[base + last, 1]]


def _flat(pieces: Sequence[Sequence[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
  """The pieces end to end, and where each starts."""
  lengths = np.array([len(p) for p in pieces], np.int64)
  flat = np.fromiter(itertools.chain.from_iterable(pieces), dtype, int(lengths.sum()))
  return flat, np.cumsum(lengths) - lengths


def assemble(questions: list[Question], queries: Sequence[Sequence[int]],
             contexts: Sequence[Sequence[int]], offsets: Sequence[np.ndarray],
             context_of: Sequence[int], answers: Sequence[tuple[int, int] | None], *,
             max_seq_length: int, doc_stride: int) -> Examples:
  """The windows of tokenized questions: query ids, context ids and offsets (one per distinct
  context, context_of[q] picking question q's), and the answer's (first, last) context token."""
  rows = collections.defaultdict(list)
  first_window = [0]
  for q, (query, answer) in enumerate(zip(queries, answers)):
    room = max_seq_length - len(query) - 3
    for start, length in windows(len(contexts[context_of[q]]), room, doc_stride):
      inside = answer is not None and start <= answer[0] and answer[1] < start + length
      shift = len(query) + 2 - start  # context token i is at row index i + shift
      rows['question'].append(q)
      rows['start'].append(start)
      rows['length'].append(length)
      rows['start_positions'].append(answer[0] + shift if inside else 0)
      rows['end_positions'].append(answer[1] + shift if inside else 0)
    first_window.append(len(rows['question']))
  query_tokens, query_starts = _flat(queries, np.int32)
  context_tokens, context_token_starts = _flat(contexts, np.int32)
  context_offsets = (np.concatenate([np.asarray(o, np.int64).reshape(-1, 2) for o in offsets])
                     if offsets else np.zeros((0, 2), np.int64))
  return Examples(
      questions=questions, query_tokens=query_tokens, query_starts=query_starts,
      query_lengths=np.array([len(q) for q in queries], np.int64),
      context_tokens=context_tokens, context_offsets=context_offsets,
      context_starts=context_token_starts[np.asarray(context_of, np.int64)],
      first_window=np.array(first_window, np.int64),
      question=np.array(rows['question'], np.int64), start=np.array(rows['start'], np.int64),
      length=np.array(rows['length'], np.int64),
      start_positions=np.array(rows['start_positions'], np.int32),
      end_positions=np.array(rows['end_positions'], np.int32))


def make_examples(questions: list[Question], tokenizer: tokenizer_lib.WordPieceTokenizer, *,
                  max_seq_length: int, doc_stride: int, max_query_length: int,
                  training: bool) -> Examples:
  """The windows of `questions`; training leaves out a question whose answer covers no token."""
  distinct = list(dict.fromkeys(q.context for q in questions))
  encoded = tokenizer.encode_with_offsets(distinct)
  offsets = [np.asarray(o, np.int64).reshape(-1, 2) for _, o in encoded]
  index = {context: i for i, context in enumerate(distinct)}
  answers = [token_span(offsets[index[q.context]], q.answer_span) for q in questions]
  if training:
    kept = [i for i, answer in enumerate(answers) if answer is not None]
    if len(kept) < len(questions):
      logging.warning('Left out %d of %d training questions whose answer covers no token.',
                      len(questions) - len(kept), len(questions))
    questions, answers = [questions[i] for i in kept], [answers[i] for i in kept]
  queries = [ids[:max_query_length] for ids in
             tokenizer.encode_batch([q.question for q in questions])] if questions else []
  return assemble(questions, queries, [ids for ids, _ in encoded], offsets,
                  [index[q.context] for q in questions], answers,
                  max_seq_length=max_seq_length, doc_stride=doc_stride)


def _take(flat: np.ndarray, source: np.ndarray) -> np.ndarray:
  return flat[source] if flat.size else np.zeros_like(source)


def batch_arrays(examples: Examples, indices: np.ndarray, example_weights: np.ndarray, *,
                 max_length: int, cls_id: int, sep_id: int, pad_id: int) -> Batch:
  """The batch of the spec above for windows[indices]."""
  q = examples.question[indices]
  query_length = examples.query_lengths[q][:, None]
  window_length = examples.length[indices][:, None]
  col = np.arange(max_length)[None, :]
  in_query = (col >= 1) & (col <= query_length)
  in_window = (col >= query_length + 2) & (col < query_length + 2 + window_length)
  query_source = np.where(in_query, examples.query_starts[q][:, None] + col - 1, 0)
  window_source = np.where(in_window, (examples.context_starts[q] + examples.start[indices]
                                       - 2)[:, None] + col - query_length, 0)
  seps = (col == query_length + 1) | (col == query_length + 2 + window_length)
  input_ids = np.where(col == 0, cls_id, np.where(seps, sep_id, pad_id))
  input_ids = np.where(in_query, _take(examples.query_tokens, query_source), input_ids)
  input_ids = np.where(in_window, _take(examples.context_tokens, window_source), input_ids)
  real = col < query_length + window_length + 3
  return {
      'input_ids': input_ids.astype(np.int32),
      'segment_ids': (real & (col >= query_length + 2)).astype(np.int32),
      'input_mask': real.astype(np.int32),
      'start_positions': examples.start_positions[indices],
      'end_positions': examples.end_positions[indices],
      'example_weights': example_weights.astype(np.float32),
      'example_index': np.where(example_weights > 0, indices, -1).astype(np.int32),
  }


# Loading.


def load_questions(data_cfg: ml_collections.ConfigDict, split: str) -> list[Question]:
  """The questions of data.task's split ('train' or 'eval')."""
  if split not in ('train', 'eval'):
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'eval'.")
  if data_cfg.task == 'offline_span':
    questions = offline_span(data_cfg, split)
  else:
    questions = tfds_questions(data_cfg, split)
  if not questions:
    raise ValueError(f'Task {data_cfg.task!r} has no {split!r} questions: check the dataset, '
                     'or lower data.eval_holdout for offline_span.')
  return questions


def load_examples(data_cfg: ml_collections.ConfigDict, split: str,
                  tokenizer: tokenizer_lib.WordPieceTokenizer) -> Examples:
  """All the windows of data.task's split."""
  validate(data_cfg)
  examples = make_examples(
      load_questions(data_cfg, split), tokenizer, max_seq_length=data_cfg.max_seq_length,
      doc_stride=data_cfg.doc_stride, max_query_length=data_cfg.max_query_length,
      training=split == 'train')
  if not len(examples):
    raise ValueError(f'No {split!r} question of task {data_cfg.task!r} has its answer in its '
                     'context: check the dataset.')
  logging.info('Task %s, split %s: %d questions in %d windows.', data_cfg.task, split,
               len(examples.questions), len(examples))
  return examples


def _decoded(value) -> str:
  return value.decode('utf-8', 'replace') if isinstance(value, bytes) else str(value)


def answer_span(context: str, text: str, start: int) -> tuple[int, int] | None:
  """Characters [start, start + len(text)) of the context, clipped to it; None if that is empty.

  Where the text is not there (a damaged example), the span as given is the answer.
  """
  first, end = min(max(start, 0), len(context)), min(max(start, 0) + len(text), len(context))
  return (first, end) if first < end else None


def tfds_questions(data_cfg: ml_collections.ConfigDict, split: str) -> list[Question]:
  """The questions of TFDS squad/v1.1's 'train' or 'validation' split, in order."""
  # Imported here: TensorFlow takes seconds to import and offline_span does not need it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder(TFDS_NAME, data_dir=data_cfg.get('tfds_data_dir') or None)
  sources.prepare_tfds(builder)
  tfds_split = 'train' if split == 'train' else 'validation'
  dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
  questions, misplaced = [], 0
  for example in tfds.as_numpy(dataset):
    context = _decoded(example['context'])
    texts = tuple(_decoded(t) for t in example['answers']['text'])
    starts = example['answers']['answer_start']
    span = None
    if texts and len(starts):
      span = answer_span(context, texts[0], int(starts[0]))
      misplaced += context[int(starts[0]):][:len(texts[0])] != texts[0]
    questions.append(Question(_decoded(example['id']), _decoded(example['question']), context,
                              texts, span))
  if misplaced:
    logging.warning('%d answers of %s:%s are not at their answer_start: taken as the span '
                    'given.', misplaced, TFDS_NAME, tfds_split)
  return questions


def _contexts(documents: Iterable[list[str]]) -> Iterable[str]:
  """Runs of a document's consecutive sentences of at most CONTEXT_WORDS (150) words."""
  for document in documents:
    context, words = [], 0
    for sentence in document:
      size = len(sentence.split())
      if context and words + size > CONTEXT_WORDS:
        yield ' '.join(context)
        context, words = [], 0
      context.append(' '.join(sentence.split()))
      words += size
    if context:
      yield ' '.join(context)


def span_candidates(context: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
  """(question, answer) character spans of the offline_span questions a context allows."""
  words = [match.span() for match in _WORD.finditer(context)]
  keys = [context[start:end].lower() for start, end in words]
  # Only spaces separate an answer's words, so it normalizes to nothing iff each of them does.
  content = [_has_content(key) for key in keys]
  counts = collections.Counter(tuple(keys[i:i + QUESTION_WORDS])
                               for i in range(len(words) - QUESTION_WORDS + 1))
  candidates = []
  for i in range(len(words) - QUESTION_WORDS):
    if counts[tuple(keys[i:i + QUESTION_WORDS])] > 1:
      continue
    first = last = i + QUESTION_WORDS
    while (last + 1 < len(words) and last + 1 - first < MAX_ANSWER_WORDS
           and context[words[last][1]:words[last + 1][0]].isspace()):
      last += 1
    if any(content[first:last + 1]):
      candidates.append(((words[i][0], words[i + QUESTION_WORDS - 1][1]),
                         (words[first][0], words[last][1])))
  return candidates


@functools.lru_cache(maxsize=1 << 16)
def _has_content(word: str) -> bool:
  """Whether a lower-cased word survives normalize_answer (cached: the corpus's contexts repeat
  their words, 645,000 of them in a test's four builds of the questions)."""
  return bool(normalize_answer(word))


def offline_span(data_cfg: ml_collections.ConfigDict, split: str) -> list[Question]:
  """The offline_span questions of a split, a pure function of the corpus and the config."""
  documents = sources.documents(offline_tasks.corpus_config(data_cfg), split)
  rng = np.random.default_rng([zlib.crc32(b'offline_span'), split == 'eval'])
  questions = []
  for context in dict.fromkeys(_contexts(documents)):
    candidates = span_candidates(context)
    chosen = rng.choice(len(candidates), min(QUESTIONS_PER_CONTEXT, len(candidates)),
                        replace=False)
    for k in sorted(chosen.tolist()):
      (question_start, question_end), (start, end) = candidates[k]
      questions.append(Question(f'offline_span-{split}-{len(questions)}',
                                context[question_start:question_end], context,
                                (context[start:end],), (start, end)))
  cap = data_cfg.max_train_examples if split == 'train' else data_cfg.max_eval_examples
  order = rng.permutation(len(questions))
  return [questions[i] for i in (order[:cap] if cap > 0 else order)]


# Scoring: the official SQuAD v1.1 evaluation's rules.


_NO_PUNCTUATION = str.maketrans('', '', string.punctuation)
_ARTICLES = re.compile(r'\b(a|an|the)\b')


def normalize_answer(text: str) -> str:
  """Lower case, no punctuation (string.punctuation), no articles, single spaces."""
  return ' '.join(_ARTICLES.sub(' ', text.lower().translate(_NO_PUNCTUATION)).split())


def exact_match(prediction: str, ground_truth: str) -> float:
  """1 if the normalized answers are equal, else 0."""
  return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
  """F1 of the normalized answers' words, common words counted with multiplicity."""
  predicted, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
  common = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
  if common == 0:
    return 0.0
  precision, recall = common / len(predicted), common / len(gold)
  return 2 * precision * recall / (precision + recall)


def evaluate(predicted: dict[str, str], gold: dict[str, Sequence[str]]) -> dict[str, float]:
  """Exact match and F1 in percent over the questions of `gold` (id -> answers), each
  the best over its answers; a question missing from `predicted` counts 0."""
  exact, f1 = 0.0, 0.0
  for question_id, answers in gold.items():
    if question_id in predicted and answers:
      exact += max(exact_match(predicted[question_id], a) for a in answers)
      f1 += max(f1_score(predicted[question_id], a) for a in answers)
  count = max(len(gold), 1)
  return {'exact_match': 100.0 * exact / count, 'f1': 100.0 * f1 / count}


def best_answers(examples: Examples, predictions: dict[str, np.ndarray], *, n_best_size: int,
                 max_answer_length: int) -> dict[int, str]:
  """Question index -> the text of its best span over its scored windows (see the docstring)."""
  windows_seen, rows = np.unique(predictions['example_index'], return_index=True)
  if len(windows_seen) and not 0 <= windows_seen[0] <= windows_seen[-1] < len(examples):
    raise ValueError(f'Predictions of window {windows_seen[-1]} for a split of {len(examples)} '
                     'windows: score the eval pass of this split.')
  # float64 sums, as the reference adds Python floats.
  start_logits = np.asarray(predictions['start_logits'], np.float64)[rows]
  end_logits = np.asarray(predictions['end_logits'], np.float64)[rows]
  # Stable: equal logits rank by position, as the reference's sorted() does.
  top_starts = np.argsort(-start_logits, axis=1, kind='stable')[:, :n_best_size]
  top_ends = np.argsort(-end_logits, axis=1, kind='stable')[:, :n_best_size]
  best = {}  # question -> (score, window, first, last)
  for row, window in enumerate(windows_seen.tolist()):
    q = int(examples.question[window])
    shift = examples.query_lengths[q] + 2
    starts, ends = top_starts[row] - shift, top_ends[row] - shift
    length = examples.length[window]
    central = max_context(examples.spans(q), window - examples.first_window[q])
    start_ok = (starts >= 0) & (starts < length)
    start_ok[start_ok] = central[starts[start_ok]]
    end_ok = (ends >= 0) & (ends < length)
    size = ends[None, :] - starts[:, None] + 1
    allowed = start_ok[:, None] & end_ok[None, :] & (size >= 1) & (size <= max_answer_length)
    if not allowed.any():
      continue
    scores = start_logits[row, top_starts[row]][:, None] + end_logits[row, top_ends[row]][None, :]
    # The first best in the reference's order: windows, then starts, then ends by rank.
    i, j = np.unravel_index(np.argmax(np.where(allowed, scores, -np.inf)), scores.shape)
    if q not in best or scores[i, j] > best[q][0]:
      best[q] = (scores[i, j], window, int(starts[i]), int(ends[j]))
  return {q: examples.text(window, first, last) for q, (_, window, first, last) in best.items()}


# Iteration.


class SquadIterator(example_iterator.ExampleIterator):
  """Host-local batches of a split's windows, exactly resumable; `score` rates an eval pass."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, *,
               tokenizer: tokenizer_lib.WordPieceTokenizer, batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    self.examples = load_examples(data_cfg, split, tokenizer)
    self._n_best_size, self._max_answer_length = (data_cfg.n_best_size,
                                                  data_cfg.max_answer_length)
    examples, max_length = self.examples, data_cfg.max_seq_length
    ids = dict(cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id)
    super().__init__(
        len(examples),
        lambda indices, weights: batch_arrays(examples, indices, weights, max_length=max_length,
                                              **ids),
        split=split, batch_size=batch_size, seed=seed, process_index=process_index,
        process_count=process_count, name=data_cfg.task, workers=workers.configured(data_cfg))

  def predictions_text(self, predictions: dict[str, np.ndarray]) -> dict[str, str]:
    """Question id -> predicted answer ('' without a scored window), for predictions.json."""
    found = best_answers(self.examples, predictions, n_best_size=self._n_best_size,
                         max_answer_length=self._max_answer_length)
    return {question.id: found.get(q, '') for q, question in enumerate(self.examples.questions)}

  def score(self, predictions: dict[str, np.ndarray]) -> dict[str, float]:
    """Exact match and F1 (percent) of one eval pass's 'example_index', 'start_logits' and
    'end_logits' (rows of real windows, in any order)."""
    found = best_answers(self.examples, predictions, n_best_size=self._n_best_size,
                         max_answer_length=self._max_answer_length)
    questions = self.examples.questions
    return evaluate({questions[q].id: text for q, text in found.items()},
                    {question.id: question.answers for question in questions})


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: tokenizer_lib.WordPieceTokenizer, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1) -> SquadIterator:
  """Batches of data.task's `split` ('train' endless and reshuffled, 'eval' in passes)."""
  return SquadIterator(data_cfg, split, tokenizer=tokenizer, batch_size=batch_size, seed=seed,
                       process_index=process_index, process_count=process_count)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A random batch of the spec: random questions and contexts (ids from 5 on), some answers
  outside their window; ids 0..4 are the WordPiece specials."""
  validate(data_cfg)
  rng = np.random.default_rng(0)
  first_id = len(tokenizer_lib.SPECIAL_TOKENS)
  room = data_cfg.max_seq_length - data_cfg.max_query_length - 3
  queries = [rng.integers(first_id, vocab_size, int(rng.integers(data_cfg.max_query_length)) + 1)
             for _ in range(batch_size)]
  contexts = [rng.integers(first_id, vocab_size, int(rng.integers(1, 2 * room)))
              for _ in range(batch_size)]
  answers = []
  for context in contexts:
    start = int(rng.integers(len(context)))
    answers.append((start, min(start + int(rng.integers(data_cfg.max_answer_length)),
                               len(context) - 1)))
  offsets = [np.stack([np.arange(len(c)), np.arange(1, len(c) + 1)], 1) for c in contexts]
  questions = [Question(str(i), '', ' ' * len(c), ('',), None) for i, c in enumerate(contexts)]
  examples = assemble(questions, queries, contexts, offsets, range(batch_size), answers,
                      max_seq_length=data_cfg.max_seq_length, doc_stride=data_cfg.doc_stride)
  return batch_arrays(examples, np.arange(batch_size), np.ones(batch_size, np.float32),
                      max_length=data_cfg.max_seq_length, cls_id=_CLS, sep_id=_SEP, pad_id=_PAD)
