"""ELMo's words: a vocabulary for the softmax, char ids for the CNN (Peters et al. 2018, sec. 3).

The biLM reads each word through its characters (so no word is unknown to
the input) and predicts word ids from a vocabulary of frequent words (rarer
ones are <UNK>). Vocabulary layout as bilm-tf's: 0 '<S>', 1 '</S>', 2
'<UNK>', then words by descending frequency (ties in order of first
appearance). ELMo is cased: data.lower_case is ignored. data.normalize_words
(CVT's, as cvt_text's normalize_word) looks each word up lower-cased with
every digit 0 ('Paris' and 'paris' one entry, '1996' and '2001' both
'0000'); its characters stay as written.

Character ids, allennlp's ELMoCharacterMapper (bilm-tf's ids plus one, so 0
is free for padding); W = data.max_characters_per_token:

  0          a padding position (every character of a padding token)
  b + 1      utf-8 byte b (1..256)
  257, 258   the single character of the sentence markers <S>, </S>
  259, 260   begin-of-word, end-of-word
  261        padding within a word

A word is [259] + its bytes + 1 (the first W - 2) + [260], padded with 261
to W; <S> is [259, 257, 260, 261, ...] and </S> is [259, 258, 260, 261, ...].
"""

import collections
import re
from typing import Iterable, Sequence

import numpy as np

from input_pipeline.common import tokenizer as tokenizer_lib

BOS, EOS, UNK = '<S>', '</S>', '<UNK>'
SPECIAL_WORDS = (BOS, EOS, UNK)
BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_WORDS))  # their ids in every vocabulary
NUM_CHARACTERS = 262
PAD_CHAR, BOS_CHAR, EOS_CHAR, BOW_CHAR, EOW_CHAR, WORD_PAD_CHAR = 0, 257, 258, 259, 260, 261

# Abbreviations of single letters ('U.S.', 'e.g.'); words with inner hyphens,
# apostrophes or periods ('state-of-the-art', "don't", 'os.path', '3.14');
# English clitics as pre-tokenized text writes them ("'s", "n't" is a word
# of the second kind); then any other character that is not a space, alone.
_WORD = re.compile(r"(?:[^\W\d_]\.){2,}|\w+(?:[-'.]\w+)*|'(?:s|re|ve|ll|m|d)\b|[^\w\s]",
                   re.IGNORECASE)


# data.split_words: how a text becomes words. 'punctuation' for raw text (the embedded corpus,
# local files of prose); 'spaces' for text tokenized already (lm1b, the text a released ELMo
# reads: bilm-tf and allennlp split at spaces alone).
SPLITS = ('punctuation', 'spaces')


def split_of(data_cfg) -> str:
  """data.split_words, checked (absent, or unset before train.py takes it from init_from:
  'punctuation')."""
  split = data_cfg.get('split_words') or 'punctuation'
  if split not in SPLITS:
    raise ValueError(f'data.split_words={split!r}: use \'punctuation\' (raw text) or '
                     "'spaces' (text tokenized already, as lm1b and a released ELMo's input).")
  return split


def check_tokenizer(data_cfg) -> None:
  """ELMo's pipelines read words and characters: data.tokenizer must be 'words'."""
  if data_cfg.get('tokenizer') != 'words':
    raise ValueError(f'data.pipeline={data_cfg.pipeline!r} needs data.tokenizer=\'words\' (a '
                     f'word vocabulary and character ids), not {data_cfg.get("tokenizer")!r}: '
                     "set --config.data.tokenizer=words.")
  split_of(data_cfg)


def word_tokens(text: str, split: str = 'punctuation') -> list[str]:
  """The words of a text.

  'spaces': the text's tokens as they are, split at white space (bilm-tf's
  and allennlp's reading of pre-tokenized text: lm1b's '1,000', '...',
  'U.S.-based', "'90s" stay whole). 'punctuation': split at spaces, with
  punctuation split off as words of its own, so that raw text such as the
  embedded corpus gives 'end' for 'end.' and one vocabulary entry for both;
  single-letter abbreviations ('U.S.'), inner hyphens, apostrophes and
  periods ("don't", '3.14') and English clitics ("'s") stay whole, other
  punctuation becomes single characters ('1,000' -> '1', ',', '000').
  """
  return text.split() if split == 'spaces' else _WORD.findall(text)


_DIGIT = re.compile('[0-9]')  # cvt_text's \d on Python 2 without re.UNICODE: ASCII digits


def normalize_word(word: str) -> str:
  """The vocabulary entry of a word under data.normalize_words: lower-cased, each digit 0
  (cvt_text's normalize_word); the sentence markers and <UNK> stay as they are."""
  return word if word in SPECIAL_WORDS else _DIGIT.sub('0', word.lower())


def char_ids(words: Sequence[str], max_characters: int) -> np.ndarray:
  """(len(words), W) int32 character ids of each word; '<S>' and '</S>' are the sentence markers.

  Each distinct word is encoded once.
  """
  index = {}
  rows = np.array([index.setdefault(word, len(index)) for word in words], np.int64)
  table = np.full((len(index), max_characters), WORD_PAD_CHAR, np.int32)
  table[:, 0] = BOW_CHAR
  for word, i in index.items():
    if word in (BOS, EOS):
      chars = [BOS_CHAR if word == BOS else EOS_CHAR]
    else:
      utf8 = word.encode('utf-8')[:max_characters - 2]
      chars = np.frombuffer(utf8, np.uint8).astype(np.int32) + 1
    table[i, 1:len(chars) + 1] = chars
    table[i, len(chars) + 1] = EOW_CHAR
  return table[rows] if len(rows) else np.zeros((0, max_characters), np.int32)


def synthetic_char_ids(token_ids: Sequence[int], max_characters: int) -> np.ndarray:
  """Char ids of made-up words for synthetic batches: the specials' own, id i spelled 'w<i>'."""
  words = [SPECIAL_WORDS[i] if i < len(SPECIAL_WORDS) else f'w{i}' for i in token_ids]
  return char_ids(words, max_characters)


def _read_words(vocab_file: str) -> list[str]:
  """The words of a vocabulary file, one a line, checked to start with bilm-tf's specials."""
  try:
    with open(vocab_file, encoding='utf-8') as f:
      words = [line.strip() for line in f]
  except FileNotFoundError:
    raise ValueError(f'Word vocabulary {vocab_file!r} not found: point data.vocab_file at a '
                     'words.txt, or leave it empty to learn one.') from None
  if tuple(words[:len(SPECIAL_WORDS)]) != SPECIAL_WORDS:
    raise ValueError(f'{vocab_file!r} is not a word vocabulary: its first lines must be '
                     f'{" ".join(SPECIAL_WORDS)}; learn one with data.vocab_file="".')
  if len(set(words)) != len(words):
    repeated = next(w for w, n in collections.Counter(words).items() if n > 1)
    raise ValueError(f'Word vocabulary {vocab_file!r} lists {repeated!r} twice: remove the '
                     'repeat, the ids of the words after it would be ambiguous.')
  return words


class WordVocab:
  """The word vocabulary of the biLM's softmax, and the char ids of its input (sec. 3.1)."""

  FILE_NAME = 'words.txt'

  def __init__(self, vocab_file: str, lower_case: bool = False, split: str = 'punctuation',
               normalize: bool = False):
    del lower_case  # ELMo is cased; the argument keeps the constructor of the other tokenizers
    self.vocab_file = vocab_file
    self.lower_case = False
    self.split = split  # data.split_words: how words_of reads a text
    self.normalize = normalize  # data.normalize_words: ids of normalize_word(word)
    self._words = _read_words(vocab_file)
    if normalize and (odd := next((w for w in self._words if normalize_word(w) != w), None)):
      raise ValueError(f'{vocab_file!r} has {odd!r}, which data.normalize_words never looks up '
                       '(words are lower-cased, digits 0): point data.vocab_file at a '
                       'vocabulary of normalized words, or set data.normalize_words=False.')
    self._ids = {word: i for i, word in enumerate(self._words)}
    self.vocab_size = len(self._words)
    self.bos_id, self.eos_id, self.unk_id = BOS_ID, EOS_ID, UNK_ID
    self.pad_id = 0  # padding positions also hold <S>'s id; lengths say where rows end

  def ids(self, words: Iterable[str]) -> np.ndarray:
    """int32 ids of the words (normalized first under data.normalize_words), <UNK> for the
    words not in the vocabulary."""
    key = normalize_word if self.normalize else (lambda word: word)
    return np.array([self._ids.get(key(word), self.unk_id) for word in words], np.int32)

  def word(self, i: int) -> str:
    return self._words[int(i)]

  @property
  def words(self) -> list[str]:
    """Every entry, in id order."""
    return list(self._words)

  def words_of(self, text: str) -> list[str]:
    """The words of a text, split as this vocabulary's training text was (data.split_words)."""
    return word_tokens(text, self.split)

  def encode(self, text: str) -> list[int]:
    """Word ids of a text, no sentence markers added."""
    return self.ids(self.words_of(text)).tolist()

  def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
    """Word ids of each text (encode)."""
    return [self.encode(text) for text in texts]

  char_ids = staticmethod(char_ids)

  def sentence(self, words: Sequence[str], max_characters: int) -> tuple[np.ndarray, np.ndarray]:
    """One sentence framed <S> words </S>: (token_ids (n + 2,), char_ids (n + 2, W))."""
    token_ids, chars, _ = self.frame_sentences([words], max_characters)
    return token_ids, chars

  def frame_sentences(self, sentences: Sequence[Sequence[str]],
                      max_characters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sentences framed <S> words </S> and concatenated: (token_ids_T, char_ids_TW, lengths_N)."""
    framed = [word for words in sentences for word in (BOS, *words, EOS)]
    lengths = np.array([len(words) + 2 for words in sentences], np.int64)
    return self.ids(framed), char_ids(framed, max_characters), lengths


def count_words(texts: Iterable[str], split: str = 'punctuation', normalize: bool = False
                ) -> collections.Counter:
  """How often each word of the texts occurs (normalize: each normalize_word), in order of
  first appearance."""
  counts = collections.Counter()
  for text in texts:
    words = word_tokens(text, split)
    counts.update(map(normalize_word, words) if normalize else words)
  return counts


def learn_word_vocab(texts: Iterable[str], vocab_size: int, path: str,
                     split: str = 'punctuation', normalize: bool = False) -> str:
  """Writes the specials and the vocab_size - 3 most frequent words of the texts; returns path.

  Fewer lines when the texts have fewer distinct words.
  """
  return write_word_vocab(count_words(texts, split, normalize), vocab_size, path)


def write_word_vocab(counts: collections.Counter, vocab_size: int, path: str) -> str:
  """Writes the specials and the vocab_size - 3 most frequent of the counted words."""
  if vocab_size <= len(SPECIAL_WORDS):
    raise ValueError(f'vocab_size={vocab_size} leaves no room for words after '
                     f'{" ".join(SPECIAL_WORDS)}: use thousands (ELMo used 793,471).')
  counts = collections.Counter(counts)
  for special in SPECIAL_WORDS:
    counts.pop(special, None)
  # A stable sort (reverse=True too): ties keep the Counter's order, that of first appearance.
  ranked = sorted(counts, key=counts.__getitem__, reverse=True)
  return tokenizer_lib.write_lines_atomically(
      [*SPECIAL_WORDS, *ranked[:vocab_size - len(SPECIAL_WORDS)]], path)
