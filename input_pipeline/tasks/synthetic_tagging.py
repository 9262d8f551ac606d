"""An offline tagging language for Cross-View Training's few-label setting (Clark et al. 2018, sec. 4).

CVT's gain comes from unlabeled sentences that show a word in contexts the
model already understands. This seeded generator makes a small lowercase
language with that property, so the gain can be measured without a download:

- Names are an open class of pseudo-words (2-3 syllables); person (PER) and
  location (LOC) names are drawn from the same syllables, so spelling does not
  tell their type. Each type has NAMES_PER_TYPE names used with Zipfian
  frequencies, so a name recurs across sentences but most names are rare.
  Persons have 1 or 2 tokens (B-PER I-PER), locations 1.
- A clause either cues the type of its name ("mr X", "dr X", "X said",
  "in X", "near X", "to X") or does not ("we talked about X", "X is big"):
  AMBIGUOUS_SHARE of the clauses do not. A sentence is one or two clauses
  joined by "and", then ".".
- Two tag columns: 'names' (BIO: B-PER I-PER B-LOC I-LOC) and 'pos' (one
  part of speech per word; names are PROPN).

A tagger trained on a few hundred labeled sentences has never seen most
names; in an uncued clause it cannot tell their type. The unlabeled text
(data.source='synthetic', the same generator without tags) shows every
name in cued clauses too. Splits use different seeds; sentence i of a split
is a pure function of (split, i).
"""

import functools
import zlib

import numpy as np

NAMES_PER_TYPE = 400
AMBIGUOUS_SHARE = 0.5
TRAIN_DOCUMENTS, EVAL_DOCUMENTS, SENTENCES_PER_DOCUMENT = 2000, 100, 10
NAME_TAGS = ('O', 'B-PER', 'I-PER', 'B-LOC', 'I-LOC')
POS_TAGS = ('DET', 'NOUN', 'VERB', 'ADJ', 'ADP', 'PRON', 'PROPN', 'AUX', 'CCONJ', 'PUNCT')

_NOUNS = ('house', 'river', 'letter', 'market', 'song', 'road', 'garden', 'book', 'ship', 'bridge',
          'school', 'window', 'story', 'horse', 'train', 'festival')
_VERBS = ('visited', 'painted', 'sold', 'found', 'liked', 'built', 'watched', 'cleaned')
_ADJECTIVES = ('old', 'big', 'quiet', 'famous', 'green', 'small', 'busy', 'strange')
# A clause: (words, where P is a person, L a location, A a person or a location,
# N a noun, V a verb, J an adjective). Words that cue a type sit next to it.
_CUED = (
    ('mr', 'P', 'V', 'the', 'N'), ('dr', 'P', 'said', 'the', 'N', 'was', 'J'),
    ('P', 'said', 'that', 'the', 'N', 'is', 'J'), ('the', 'N', 'in', 'L', 'is', 'J'),
    ('we', 'V', 'a', 'N', 'near', 'L'), ('the', 'J', 'N', 'went', 'to', 'L'),
)
_UNCUED = (
    ('we', 'talked', 'about', 'A'), ('A', 'is', 'J'), ('the', 'N', 'of', 'A', 'was', 'J'),
    ('they', 'V', 'the', 'N', 'of', 'A'),
)
_POS = {'the': 'DET', 'a': 'DET', 'that': 'PRON', 'we': 'PRON', 'they': 'PRON', 'mr': 'NOUN',
        'dr': 'NOUN', 'said': 'VERB', 'went': 'VERB', 'talked': 'VERB', 'is': 'AUX',
        'was': 'AUX', 'in': 'ADP', 'near': 'ADP', 'to': 'ADP', 'about': 'ADP', 'of': 'ADP',
        'and': 'CCONJ', '.': 'PUNCT', **{w: 'NOUN' for w in _NOUNS},
        **{w: 'VERB' for w in _VERBS}, **{w: 'ADJ' for w in _ADJECTIVES}}
_SEEDS = {'train': 1, 'eval': 2, 'train_text': 3, 'eval_text': 4}


@functools.lru_cache(maxsize=1)
def lexicon() -> dict[str, tuple[str, ...]]:
  """PER and LOC names: distinct pseudo-words, no common word among them."""
  rng = np.random.default_rng(zlib.crc32(b'synthetic_tagging'))
  onsets, vowels = list('bdfgklmnprstvz'), list('aeiou')
  names, taken = [], set(_POS)
  while len(names) < 2 * NAMES_PER_TYPE:
    name = ''.join(rng.choice(onsets) + rng.choice(vowels)
                   for _ in range(int(rng.integers(2, 4))))
    if name not in taken:
      taken.add(name)
      names.append(name)
  return {'PER': tuple(names[0::2]), 'LOC': tuple(names[1::2])}


@functools.lru_cache(maxsize=1)
def _zipf_cdf() -> np.ndarray:
  weights = 1.0 / np.arange(1, NAMES_PER_TYPE + 1)
  return np.cumsum(weights / weights.sum())


def _clause(rng: np.random.Generator) -> tuple[list[str], list[str]]:
  """Words and 'names' tags of one clause."""
  templates = _UNCUED if rng.random() < AMBIGUOUS_SHARE else _CUED
  words, tags = [], []
  for slot in templates[rng.integers(len(templates))]:
    kind = {'P': 'PER', 'L': 'LOC', 'A': ('PER', 'LOC')[rng.integers(2)]}.get(slot)
    if kind:
      length = 1 + int(kind == 'PER' and rng.random() < 0.4)
      for k in range(length):
        rank = min(int(np.searchsorted(_zipf_cdf(), rng.random())), NAMES_PER_TYPE - 1)
        words.append(lexicon()[kind][rank])
        tags.append(('B-' if k == 0 else 'I-') + kind)
    else:
      pool = {'N': _NOUNS, 'V': _VERBS, 'J': _ADJECTIVES}.get(slot, (slot,))
      words.append(pool[rng.integers(len(pool))])
      tags.append('O')
  return words, tags


def sentence(split: str, index: int) -> tuple[list[str], list[str], list[str]]:
  """(words, 'names' tags, 'pos' tags) of sentence `index` of `split`."""
  rng = np.random.default_rng([_SEEDS[split], index])
  words, tags = _clause(rng)
  if rng.random() < 0.5:
    more_words, more_tags = _clause(rng)
    words, tags = words + ['and'] + more_words, tags + ['O'] + more_tags
  words, tags = words + ['.'], tags + ['O']
  pos = [_POS.get(w, 'PROPN') for w in words]
  return words, tags, pos


def tagged_sentences(split: str, column: str, count: int
                     ) -> tuple[list[list[str]], list[list[int]]]:
  """(words, tag ids) of the first `count` sentences of `split` ('train' or 'eval')."""
  names = NAME_TAGS if column == 'names' else POS_TAGS
  ids = {name: i for i, name in enumerate(names)}
  sentences, tags = [], []
  for i in range(count):
    words, name_tags, pos_tags = sentence(split, i)
    sentences.append(words)
    tags.append([ids[t] for t in (name_tags if column == 'names' else pos_tags)])
  return sentences, tags


def documents(split: str):
  """The unlabeled text: documents of SENTENCES_PER_DOCUMENT sentences, seeded apart from the
  labeled sentences."""
  count = TRAIN_DOCUMENTS if split == 'train' else EVAL_DOCUMENTS
  for d in range(count):
    yield [' '.join(sentence(f'{split}_text', d * SENTENCES_PER_DOCUMENT + s)[0])
           for s in range(SENTENCES_PER_DOCUMENT)]
