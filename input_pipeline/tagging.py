"""Sequence tagging examples for ELMo's task models (Peters et al. 2018, sec. 3.3, 5.1 NER).

A sentence is the biLM's input, framed <S> words </S>, and has one tag per
word. Training sentences longer than data.max_seq_length - 2 words lose their
last words; eval sentences are kept whole, their batches as long as the
split's longest (batch_length), so that span F1 and accuracy count every gold
tag, as conlleval scores the whole file. Feature spec of a host-local batch
(numpy, static shapes; B batch, L = data.max_seq_length, or batch_length for
eval, W = data.max_characters_per_token):

  token_ids        int32   (B, L)     word ids (input_pipeline/common/words.py), 0 at padding
  char_ids         int32   (B, L, W)  character ids of each token, 0 at padding
  lengths          int32   (B,)       tokens of the framed sentence (words + 2)
  labels           int32   (B, L)     tag id of each word; 0 at <S>, </S> and padding
  label_weights    float32 (B, L)     1 at the words of real examples, else 0
  example_weights  float32 (B,)       1, or 0 for the padding of the last eval batch

Tasks (TASKS, by data.task):
  conll2003         CoNLL 2003 NER from TFDS (downloaded when named): the
                    given tokens and their 9 IOB tags; train on 'train',
                    evaluate on 'dev'.
  offline_replaced  made from the embedded corpus, no download: sentences of
                    5 to L - 2 words in which 15% of the words (at least one)
                    are replaced by a word drawn from the unigram
                    distribution of the split's words (so frequency is no
                    cue), never by the same word; tag 1 marks a replaced word.
                    Train and eval sentences come from the corpus's train and
                    eval documents (input_pipeline/tasks/offline_tasks.py), at most
                    data.max_train_examples and data.max_eval_examples (0 = all).
  offline_capitalized  likewise from the embedded corpus: sentences of 5 to
                    L - 2 words, lower-cased; tag 1 marks a word that the
                    corpus capitalizes after a sentence's first word (names
                    of things such as Python, None, RFC), a name-finding
                    task that a model can learn from word identity and
                    context alone, since the case is gone.

Order and resume as for GPT fine-tuning (example_iterator.ExampleIterator):
training reshuffles every epoch, eval runs in passes of steps_per_epoch
batches whose padding rows have example_weights 0.
"""

import dataclasses
import functools
import itertools
import zlib

import ml_collections
import numpy as np

from input_pipeline.common import example_iterator
from input_pipeline.common import sources
from input_pipeline.common import words as words_lib
from input_pipeline.common import workers
from input_pipeline.tasks import offline_tasks
from input_pipeline.tasks import synthetic_tagging

Batch = dict[str, np.ndarray]
# TFDS conll2003's 'ner' ClassLabel names (conll_dataset_builder_utils.NER_TAGS), in id order.
CONLL2003_NER_TAGS = ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC', 'B-MISC',
                      'I-MISC')
# TFDS conll2003's 'pos' and 'chunks' ClassLabel names, in id order.
CONLL2003_POS_TAGS = (
    '"', "''", '#', '$', '(', ')', ',', '.', ':', '``', 'CC', 'CD', 'DT', 'EX', 'FW', 'IN', 'JJ',
    'JJR', 'JJS', 'LS', 'MD', 'NN', 'NNP', 'NNPS', 'NNS', 'NN|SYM', 'PDT', 'POS', 'PRP', 'PRP$',
    'RB', 'RBR', 'RBS', 'RP', 'SYM', 'TO', 'UH', 'VB', 'VBD', 'VBG', 'VBN', 'VBP', 'VBZ', 'WDT',
    'WP', 'WP$', 'WRB')
CONLL2003_CHUNK_TAGS = (
    'O', 'B-ADJP', 'I-ADJP', 'B-ADVP', 'I-ADVP', 'B-CONJP', 'I-CONJP', 'B-INTJ', 'I-INTJ', 'B-LST',
    'I-LST', 'B-NP', 'I-NP', 'B-PP', 'I-PP', 'B-PRT', 'I-PRT', 'B-SBAR', 'I-SBAR', 'B-UCP',
    'I-UCP', 'B-VP', 'I-VP')
ENCODINGS = ('BIO', 'BIOES')
# offline_replaced: the share of a sentence's words that are replaced, and redraws of a
# replacement equal to the word it replaces.
REPLACED_SHARE, _MAX_DRAWS = 0.15, 100


@dataclasses.dataclass(frozen=True)
class Task:
  """Where a tagging task's sentences and tags come from."""
  label_names: tuple[str, ...]  # by tag id
  source: str = 'tfds'  # 'tfds' | 'offline' | 'synthetic' (input_pipeline/tasks/synthetic_tagging.py)
  min_words: int = 1
  tfds_name: str = ''
  tokens_feature: str = 'tokens'
  tags_feature: str = ''
  train_split: str = 'train'
  eval_split: str = 'dev'
  train_sentences: int = 0  # of a TFDS task's train split, for the configs' step counts
  column: str = ''  # a synthetic task's tag column: 'names' or 'pos'

  @property
  def num_labels(self) -> int:
    return len(self.label_names)

  def train_examples(self, data_cfg: ml_collections.ConfigDict) -> int:
    """Training sentences per epoch: the TFDS split's, or an offline task's cap."""
    if self.source == 'tfds':
      return self.train_sentences
    if self.source == 'synthetic' and data_cfg.max_train_examples <= 0:
      raise ValueError('A synthetic task has endless sentences: set data.max_train_examples to '
                       'the number of labeled sentences.')
    if data_cfg.max_train_examples <= 0:
      raise ValueError('An offline task has as many sentences as the corpus gives: set '
                       'data.max_train_examples to a number to size the run by it.')
    return data_cfg.max_train_examples


def span_tags(task: Task) -> tuple[tuple[int, int], ...]:
  """(B-X id, I-X id) of each type X of the task's IOB tags, for span F1; () if not IOB.

  A type without an I- tag has one-word chunks only (its pair is (B-X id, B-X id)).
  """
  ids = {name: i for i, name in enumerate(task.label_names)}
  return tuple((i, ids.get(f'I-{name[2:]}', i)) for i, name in enumerate(task.label_names)
               if name.startswith('B-'))


TASKS: dict[str, Task] = {
    # TFDS counts one more sentence per split: the empty one its builder yields at the end.
    'conll2003': Task(CONLL2003_NER_TAGS, tfds_name='conll2003', tags_feature='ner',
                      train_sentences=14_041),
    'conll2003_pos': Task(CONLL2003_POS_TAGS, tfds_name='conll2003', tags_feature='pos',
                          train_sentences=14_041),
    'conll2003_chunk': Task(CONLL2003_CHUNK_TAGS, tfds_name='conll2003', tags_feature='chunks',
                            train_sentences=14_041),
    # CVT's offline tasks: person and location names, and parts of speech, of a synthetic language.
    'offline_names': Task(synthetic_tagging.NAME_TAGS, source='synthetic', column='names'),
    'offline_pos': Task(synthetic_tagging.POS_TAGS, source='synthetic', column='pos'),
    # One-word chunks: span F1 is the F1 of finding the replaced words.
    'offline_replaced': Task(('O', 'B-REPLACED'), source='offline', min_words=5),
    'offline_capitalized': Task(('O', 'B-CAP'), source='offline', min_words=5),
}


def label_names(task: Task, encoding: str = 'BIO') -> tuple[str, ...]:
  """The task's tags in `encoding`: BIOES appends E-X and S-X after the BIO tags of each type."""
  if encoding not in ENCODINGS:
    raise ValueError(f'data.label_encoding={encoding!r}: use one of {", ".join(ENCODINGS)}.')
  names = task.label_names
  if encoding == 'BIO':
    return names
  return names + tuple(f'{prefix}-{name[2:]}' for name in names if name.startswith('B-')
                       for prefix in ('E', 'S'))


def num_labels(task: Task, encoding: str = 'BIO') -> int:
  return len(label_names(task, encoding))


def to_bio_ids(task: Task, encoding: str = 'BIO') -> tuple[int, ...]:
  """For each label id in `encoding`, the BIO id that conlleval scores it as (S-X: B-X, E-X: I-X)."""
  bio = {name: i for i, name in enumerate(task.label_names)}
  def as_bio(name):
    kind, _, chunk = name.partition('-')
    if kind == 'S':
      return bio[f'B-{chunk}']
    if kind == 'E':
      return bio.get(f'I-{chunk}', bio[f'B-{chunk}'])
    return bio[name]
  return tuple(as_bio(name) for name in label_names(task, encoding))


def bio_to_bioes(tags: list[int], task: Task) -> list[int]:
  """One sentence's BIO tag ids as BIOES ids; chunks as conlleval reads them (I-X after O starts one)."""
  bio_names = task.label_names
  ids = {name: i for i, name in enumerate(label_names(task, 'BIOES'))}
  chunk = lambda i: bio_names[i][2:] if bio_names[i][:2] in ('B-', 'I-') else None  # noqa: E731
  out = []
  for k, tag in enumerate(tags):
    kind = chunk(tag)
    if kind is None:
      out.append(tag)
      continue
    starts = bio_names[tag].startswith('B-') or k == 0 or chunk(tags[k - 1]) != kind
    following = tags[k + 1] if k + 1 < len(tags) else None
    ends = (following is None or chunk(following) != kind or
            bio_names[following].startswith('B-'))
    prefix = {(True, True): 'S', (True, False): 'B', (False, False): 'I', (False, True): 'E'}
    name = f'{prefix[(starts, ends)]}-{kind}'
    out.append(ids.get(name, ids[f'B-{kind}']))  # a type without I- has one-word chunks only
  return out


def task_spec(name: str) -> Task:
  """The task called `name`, or a one-line error listing the tasks."""
  if name not in TASKS:
    raise ValueError(f'Unknown tagging task {name!r}: set config.data.task to one of '
                     f'{", ".join(TASKS)}.')
  return TASKS[name]


def validate(data_cfg: ml_collections.ConfigDict) -> Task:
  """The configured task, after checking that its sentences fit, in one line naming the fix."""
  task = task_spec(data_cfg.task)
  words_lib.check_tokenizer(data_cfg)
  length, width = data_cfg.max_seq_length, data_cfg.max_characters_per_token
  if length < task.min_words + 2:
    raise ValueError(f'data.max_seq_length={length} leaves no room for {task.min_words} '
                     f'word(s) of task {data_cfg.task!r} between <S> and </S>: use '
                     f'{task.min_words + 2} or more.')
  if width is not None and width < 3:  # None: from config.init_from, filled in before training
    raise ValueError(f'data.max_characters_per_token={width} leaves no room for a character '
                     'between the word markers: use 3 or more (ELMo uses 50).')
  return task


def check_config(config: ml_collections.ConfigDict) -> None:
  """A one-line ValueError unless the model has config.data.task's number of tags."""
  task = validate(config.data)
  num_labels = config.model.get('num_labels')
  if num_labels != task.num_labels:
    raise ValueError(f'config.data.task={config.data.task} has {task.num_labels} tags but '
                     f'config.model.num_labels={num_labels}: set '
                     f'--config.model.num_labels={task.num_labels}.')


# Arrays.


@dataclasses.dataclass
class Examples:
  """Framed sentences in flat arrays: sentence n is rows starts[n] : starts[n] + lengths[n]."""
  token_ids: np.ndarray  # int32 (T,)
  char_ids: np.ndarray  # int32 (T, W)
  labels: np.ndarray  # int32 (T,)
  starts: np.ndarray  # int64 (N,)
  lengths: np.ndarray  # int64 (N,)

  def __len__(self) -> int:
    return len(self.lengths)


def make_examples(token_ids: np.ndarray, char_ids: np.ndarray, lengths: np.ndarray,
                  tags: list[list[int]]) -> Examples:
  """Examples of framed sentences (words.WordVocab.frame_sentences) and the tags of their words."""
  labels = np.fromiter(itertools.chain.from_iterable((0, *t, 0) for t in tags), np.int32,
                       int(lengths.sum()))
  return Examples(token_ids, char_ids, labels, np.cumsum(lengths) - lengths, lengths)


def batch_arrays(examples: Examples, indices: np.ndarray, example_weights: np.ndarray,
                 max_length: int) -> Batch:
  """The batch of the spec above for examples[indices]."""
  lengths = examples.lengths[indices]
  col = np.arange(max_length)
  real = col < lengths[:, None]
  source = np.where(real, examples.starts[indices][:, None] + col, 0)
  words = (col >= 1) & (col < lengths[:, None] - 1) & (example_weights[:, None] > 0)
  return {
      'token_ids': np.where(real, examples.token_ids[source], 0).astype(np.int32),
      'char_ids': np.where(real[..., None], examples.char_ids[source], 0).astype(np.int32),
      'lengths': lengths.astype(np.int32),
      'labels': np.where(real, examples.labels[source], 0).astype(np.int32),
      'label_weights': words.astype(np.float32),
      'example_weights': example_weights.astype(np.float32),
  }


# Loading.


def load_examples(data_cfg: ml_collections.ConfigDict, split: str,
                  vocab: words_lib.WordVocab) -> Examples:
  """All examples of the task's split, framed; training ones truncated to max_seq_length."""
  if split not in ('train', 'eval'):
    raise ValueError(f"Unknown split {split!r}: use 'train' or 'eval'.")
  task = validate(data_cfg)
  cap = data_cfg.max_train_examples if split == 'train' else data_cfg.max_eval_examples
  if task.source == 'offline':
    sentences, tags = offline_sentences(data_cfg, split, cap)
  elif task.source == 'synthetic':
    if cap <= 0:
      raise ValueError(f'Synthetic task {data_cfg.task!r} has endless sentences: set '
                       f'data.max_{split}_examples to a positive number.')
    sentences, tags = synthetic_tagging.tagged_sentences(split, task.column, cap)
  else:
    sentences, tags = tfds_sentences(data_cfg.task, data_cfg, split)
  if not sentences:
    raise ValueError(f'Task {data_cfg.task!r} has no {split!r} sentences: check the dataset, '
                     'or lower data.eval_holdout for an offline task.')
  if split == 'train':
    max_words = data_cfg.max_seq_length - 2
    sentences, tags = [s[:max_words] for s in sentences], [t[:max_words] for t in tags]
  framed = vocab.frame_sentences(sentences, data_cfg.max_characters_per_token)
  return make_examples(*framed, tags)


def batch_length(data_cfg: ml_collections.ConfigDict, examples: Examples, split: str) -> int:
  """L of the split's batches: data.max_seq_length, or for eval the longest framed sentence
  if longer (the models read any length; eval's step compiles for its own shape)."""
  if split == 'train' or not len(examples):
    return data_cfg.max_seq_length
  return max(data_cfg.max_seq_length, int(examples.lengths.max()))


def tfds_sentences(name: str, data_cfg: ml_collections.ConfigDict,
                   split: str) -> tuple[list[list[str]], list[list[int]]]:
  """(words, tags) of the sentences of a TFDS task's split, in order."""
  # Imported here: TensorFlow takes seconds to import and offline tasks do not need it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  task = TASKS[name]
  builder = tfds.builder(task.tfds_name, data_dir=data_cfg.tfds_data_dir or None)
  features = builder.info.features
  for field in (task.tokens_feature, task.tags_feature):
    if field not in features:
      raise ValueError(f'TFDS dataset {task.tfds_name!r} has no feature {field!r} (it has '
                       f'{", ".join(features)}): fix TASKS[{name!r}] in input_pipeline/tagging.py.')
  names = tuple(features[task.tags_feature].feature.names)
  if names != task.label_names:
    raise ValueError(f'TFDS {task.tfds_name!r} tags {task.tags_feature!r} are {names}, not '
                     f'{task.label_names}: fix TASKS[{name!r}] in input_pipeline/tagging.py.')
  sources.prepare_tfds(builder)
  tfds_split = task.train_split if split == 'train' else task.eval_split
  dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
  sentences, tags = [], []
  for example in tfds.as_numpy(dataset):
    words = [token.decode('utf-8', 'replace') for token in example[task.tokens_feature]]
    sentence_tags = example[task.tags_feature].tolist()
    if len(words) != len(sentence_tags):
      raise ValueError(f'An example of {task.tfds_name}:{tfds_split} has {len(words)} tokens but '
                       f'{len(sentence_tags)} tags: the dataset is damaged; prepare it again.')
    if words:  # the builder yields an empty example at the end of each file
      sentences.append(words)
      tags.append(sentence_tags)
  return sentences, tags


def offline_sentences(data_cfg: ml_collections.ConfigDict, split: str,
                      max_examples: int) -> tuple[list[list[str]], list[list[int]]]:
  """(words, tags) of data.task, an offline task: a pure function of the corpus and the config."""
  documents = sources.documents(offline_tasks.corpus_config(data_cfg), split)
  sentences = [words_lib.word_tokens(s) for document in documents for s in document]
  max_words = data_cfg.max_seq_length - 2
  candidates = [list(words) for words in dict.fromkeys(map(tuple, sentences))
                if TASKS[data_cfg.task].min_words <= len(words) <= max_words]
  rng = np.random.default_rng([zlib.crc32(data_cfg.task.encode()), split == 'eval'])
  order = rng.permutation(len(candidates))
  if max_examples > 0:
    order = order[:max_examples]
  chosen = [candidates[i] for i in order]
  if data_cfg.task == 'offline_capitalized':
    return ([[w.lower() for w in words] for words in chosen],
            [[int(k > 0 and w[:1].isupper()) for k, w in enumerate(words)] for words in chosen])
  return offline_replaced(chosen, [w for words in sentences for w in words], rng)


def offline_replaced(chosen: list[list[str]], unigram: list[str], rng: np.random.Generator
                     ) -> tuple[list[list[str]], list[list[int]]]:
  """(words, tags) of the replaced-word task: REPLACED_SHARE of each sentence's words redrawn."""
  sentences, tags = [], []
  for words in chosen:
    sentence_tags = [0] * len(words)
    num_replaced = max(1, round(REPLACED_SHARE * len(words)))
    for position in rng.choice(len(words), num_replaced, replace=False):
      words[position] = _other_word(words[position], unigram, rng)
      sentence_tags[position] = 1
    sentences.append(words)
    tags.append(sentence_tags)
  return sentences, tags


def _other_word(word: str, unigram: list[str], rng: np.random.Generator) -> str:
  """A word of the corpus drawn by frequency, other than `word`."""
  for _ in range(_MAX_DRAWS):
    other = unigram[rng.integers(len(unigram))]
    if other != word:
      return other
  raise ValueError('The embedded corpus split has too few distinct words for offline_replaced: '
                   'lower data.eval_holdout.')


# Iteration.


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: words_lib.WordVocab, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1) -> example_iterator.ExampleIterator:
  """Batches of data.task's `split` ('train' endless and reshuffled, 'eval' in passes)."""
  examples = load_examples(data_cfg, split, tokenizer)
  make_batch = functools.partial(batch_arrays, examples,
                                 max_length=batch_length(data_cfg, examples, split))
  return example_iterator.ExampleIterator(
      len(examples), make_batch, split=split, batch_size=batch_size, seed=seed,
      process_index=process_index, process_count=process_count, name=data_cfg.task,
      workers=workers.configured(data_cfg))


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A random batch of data.task's spec: sentences of random words (ids from 3 on) and tags."""
  task = validate(data_cfg)
  if vocab_size <= len(words_lib.SPECIAL_WORDS):
    raise ValueError(f'vocab_size={vocab_size} leaves no ids for words: use more than '
                     f'{len(words_lib.SPECIAL_WORDS)}.')
  rng = np.random.default_rng(0)
  num_words = rng.integers(task.min_words, data_cfg.max_seq_length - 1, batch_size)
  sentences = [rng.integers(len(words_lib.SPECIAL_WORDS), vocab_size, n) for n in num_words]
  token_ids = np.concatenate([[0, *ids, 1] for ids in sentences]).astype(np.int32)
  char_ids = words_lib.synthetic_char_ids(token_ids, data_cfg.max_characters_per_token)
  tags = [rng.integers(0, task.num_labels, n).tolist() for n in num_words]
  examples = make_examples(token_ids, char_ids, num_words + 2, tags)
  return batch_arrays(examples, np.arange(batch_size), np.ones(batch_size, np.float32),
                      data_cfg.max_seq_length)
