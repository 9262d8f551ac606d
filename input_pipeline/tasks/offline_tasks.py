"""Offline fine-tuning tasks made from the embedded corpus, one per input transformation of GPT.

The embedded corpus is the standard library's docstrings (input_pipeline/
sources.py), so these tasks need no download (Radford et al. 2018, sec. 3.3
names the transformations; the tasks themselves are this project's).

Each split of an offline task comes from that split's documents (document i
is eval iff i % data.eval_holdout == 0), shuffled by a generator seeded with the task name and split, cut to
data.max_examples, then given exactly balanced labels; a "random" sentence
is drawn from another document of the same split, with a different text:

  offline_shuffled  (classification) a sentence of at least 4 words, as
                    written (label 1) or with its words shuffled (label 0):
                    a CoLA-like acceptability task. Whitespace is normalized
                    in both, so only word order tells them apart.
  offline_next      (entailment) premise = a sentence, hypothesis = the next
                    sentence of its document (label 1) or a random one (0).
  offline_same_doc  (similarity) two sentences of the same document (1) or
                    of different documents (0).
  offline_cloze     (multiple choice, 4) context = up to 4 sentences, the
                    answer is the sentence after them, the 3 distractors are
                    random sentences; the answer's position is uniform over
                    the 4 (the Story Cloze test's format, with 4 endings).
"""

import zlib

import ml_collections
import numpy as np

from input_pipeline.common import sources

# Random sentences are redrawn when they repeat a text they must differ from.
_MAX_DRAWS = 100


class _Corpus:
  """The sentences of a split's documents, with the document of each."""

  def __init__(self, documents: list[list[str]]):
    self.sentences = [' '.join(s.split()) for document in documents for s in document]
    self.doc_lengths = np.array([len(document) for document in documents], np.int64)
    self.doc_starts = np.cumsum(self.doc_lengths) - self.doc_lengths
    self.doc_of = np.repeat(np.arange(len(documents)), self.doc_lengths)

  def document_range(self, i: int) -> tuple[int, int]:
    doc = self.doc_of[i]
    return int(self.doc_starts[doc]), int(self.doc_starts[doc] + self.doc_lengths[doc])

  def other_document_sentence(self, i: int, rng: np.random.Generator,
                              avoid: set[str]) -> str:
    """A random sentence from another document than sentence i's, whose text is not in avoid."""
    start, end = self.document_range(i)
    for _ in range(_MAX_DRAWS):
      j = int(rng.integers(len(self.sentences) - (end - start)))
      j += (end - start) if j >= start else 0
      if self.sentences[j] not in avoid:
        return self.sentences[j]
    raise ValueError('The embedded corpus split has too few distinct sentences for an offline '
                     'task: lower data.eval_holdout.')


def _balanced_labels(n: int, num_labels: int, rng: np.random.Generator) -> np.ndarray:
  return rng.permutation(np.arange(n) % num_labels)


def _capped(candidates: list, rng: np.random.Generator, max_examples: int) -> list:
  order = rng.permutation(len(candidates))
  if max_examples > 0:
    order = order[:max_examples]
  return [candidates[i] for i in order]


def _shuffled_words(sentence: str, rng: np.random.Generator) -> str:
  words = sentence.split()
  for _ in range(_MAX_DRAWS):
    shuffled = ' '.join(words[i] for i in rng.permutation(len(words)))
    if shuffled != sentence:
      return shuffled
  raise AssertionError(f'no word order differs from {sentence!r}')  # candidates exclude these


def _offline_shuffled(corpus: _Corpus, rng: np.random.Generator, max_examples: int):
  # Distinct sentences (the corpus repeats some), with at least 2 distinct words to reorder.
  candidates = [s for s in dict.fromkeys(corpus.sentences)
                if len(s.split()) >= 4 and len(set(s.split())) > 1]
  candidates = _capped(candidates, rng, max_examples)
  labels = _balanced_labels(len(candidates), 2, rng)
  texts = [(s if label else _shuffled_words(s, rng),) for s, label in zip(candidates, labels)]
  return texts, labels


def _offline_next(corpus: _Corpus, rng: np.random.Generator, max_examples: int):
  candidates = [i for i in range(len(corpus.sentences) - 1)
                if corpus.doc_of[i] == corpus.doc_of[i + 1]]
  candidates = _capped(candidates, rng, max_examples)
  labels = _balanced_labels(len(candidates), 2, rng)
  texts = []
  for i, label in zip(candidates, labels):
    following = corpus.sentences[i + 1]
    hypothesis = following if label else corpus.other_document_sentence(i, rng, {following})
    texts.append((corpus.sentences[i], hypothesis))
  return texts, labels


def _offline_same_doc(corpus: _Corpus, rng: np.random.Generator, max_examples: int):
  candidates = [i for i in range(len(corpus.sentences))
                if corpus.doc_lengths[corpus.doc_of[i]] >= 2]
  candidates = _capped(candidates, rng, max_examples)
  labels = _balanced_labels(len(candidates), 2, rng)
  texts = []
  for i, label in zip(candidates, labels):
    if label:
      start, end = corpus.document_range(i)
      j = start + int(rng.integers(end - start - 1))
      j += j >= i
      other = corpus.sentences[j]
    else:
      other = corpus.other_document_sentence(i, rng, {corpus.sentences[i]})
    texts.append((corpus.sentences[i], other))
  return texts, labels


_CLOZE_CHOICES, _CLOZE_CONTEXT_SENTENCES = 4, 4


def _offline_cloze(corpus: _Corpus, rng: np.random.Generator, max_examples: int):
  candidates = [i for i in range(1, len(corpus.sentences))
                if corpus.doc_of[i] == corpus.doc_of[i - 1]]
  candidates = _capped(candidates, rng, max_examples)
  labels = _balanced_labels(len(candidates), _CLOZE_CHOICES, rng)
  texts = []
  for i, label in zip(candidates, labels):
    start, _ = corpus.document_range(i)
    context = ' '.join(corpus.sentences[max(start, i - _CLOZE_CONTEXT_SENTENCES):i])
    answers, avoid = [], {corpus.sentences[i]}
    for _ in range(_CLOZE_CHOICES - 1):
      answers.append(corpus.other_document_sentence(i, rng, avoid))
      avoid.add(answers[-1])
    answers.insert(int(label), corpus.sentences[i])
    texts.append((context, *answers))
  return texts, labels


_OFFLINE = {
    'offline_shuffled': _offline_shuffled,
    'offline_next': _offline_next,
    'offline_same_doc': _offline_same_doc,
    'offline_cloze': _offline_cloze,
}


def corpus_config(data_cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The data config of the embedded corpus that the offline tasks are made from."""
  return ml_collections.ConfigDict({
      'source': 'embedded', 'data_dir': data_cfg.data_dir,
      'eval_holdout': data_cfg.eval_holdout, 'files': '', 'eval_files': ''})


def offline_examples(name: str, data_cfg: ml_collections.ConfigDict,
                     split: str) -> tuple[list[tuple[str, ...]], list]:
  """(texts, label) of an offline task, a pure function of the corpus and the config."""
  documents = list(sources.documents(corpus_config(data_cfg), split))
  if len(documents) < 2:
    raise ValueError(f'The {split!r} split of the embedded corpus has {len(documents)} '
                     'document: offline tasks draw from others; lower data.eval_holdout.')
  rng = np.random.default_rng([zlib.crc32(name.encode()), split == 'eval'])
  texts, labels = _OFFLINE[name](_Corpus(documents), rng, data_cfg.max_examples)
  return texts, [int(label) for label in labels]
