"""WordPiece tokenizer giving the tokens of the reference BERT tokenizer.

Devlin et al. 2018, section 3 ("We use WordPiece embeddings with a 30,000
token vocabulary"); the rules are those of google-research/bert
tokenization.py (BasicTokenizer + WordpieceTokenizer). Built from components
of the HF `tokenizers` library so that encoding is fast (Rust, batched).

Why not BertNormalizer + BertPreTokenizer: they differ from the reference on
private-use characters (dropped instead of kept), on CJK Extension C
U+2B820..U+2B91F (not split) and on final sigma when lower-casing. The
normalizer and pre-tokenizer below spell out the reference rules with
Unicode-property regexes instead; tests/test_tokenizer.py checks every
assigned code point against those rules.
"""

import collections
from collections.abc import Iterable
import os
import uuid

import numpy as np
import tokenizers
from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

PAD, UNK, CLS, SEP, MASK = '[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
CONTINUATION_PREFIX = '##'
# The reference WordpieceTokenizer's default (HF transformers uses 100).
MAX_INPUT_CHARS_PER_WORD = 200

# The reference drops NUL, U+FFFD and categories Cc/Cf, but keeps tab,
# newline and carriage return as whitespace.
_DROPPED = r'[\x00\x{FFFD}[\p{Cc}\p{Cf}&&[^\t\n\r]]]'
_WHITESPACE = r'[\t\n\r\p{Zs}]'
# Python's str.lower() turns a word-final capital sigma into 'ς'; the
# library lower-cases character by character, so that context is added here.
_FINAL_SIGMA = r'(?<=\p{Cased}\p{Case_Ignorable}*)Σ(?!\p{Case_Ignorable}*\p{Cased})'
# Every CJK ideograph is a word of its own; the reference's code point ranges.
_CJK = (r'[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}'
        r'\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}\x{2B820}-\x{2CEAF}'
        r'\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]')
# Unicode punctuation plus all non-alphanumeric printable ASCII.
_PUNCTUATION = r'[\p{P}!-/:-@\[-`{-~]'


def _normalizer(lower_case: bool) -> normalizers.Normalizer:
  """Reference BasicTokenizer: _clean_text, then lower() and _run_strip_accents."""
  steps = [normalizers.Replace(Regex(_DROPPED), ''),
           normalizers.Replace(Regex(_WHITESPACE), ' ')]
  if lower_case:
    steps += [normalizers.Replace(Regex(_FINAL_SIGMA), 'ς'),
              normalizers.Lowercase(),
              normalizers.NFD(),
              normalizers.Replace(Regex(r'\p{Mn}'), '')]
  return normalizers.Sequence(steps)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
  """Reference BasicTokenizer: whitespace split, CJK and punctuation split."""
  return pre_tokenizers.Sequence([
      pre_tokenizers.WhitespaceSplit(),
      pre_tokenizers.Split(Regex(f'{_CJK}|{_PUNCTUATION}'), 'isolated'),
  ])


def _bert_tokenizer(model: models.Model, lower_case: bool) -> tokenizers.Tokenizer:
  tokenizer = tokenizers.Tokenizer(model)
  tokenizer.normalizer = _normalizer(lower_case)
  tokenizer.pre_tokenizer = _pre_tokenizer()
  return tokenizer


def _read_vocab(vocab_file: str) -> list[str]:
  """One token per line, stripped, line number = id (reference load_vocab)."""
  if not os.path.isfile(vocab_file):
    raise ValueError(f'Vocabulary file {vocab_file!r} not found: point '
                     'data.vocab_file at a BERT vocab.txt, or leave it empty '
                     'to learn one.')
  with open(vocab_file, encoding='utf-8') as f:
    tokens = [line.strip() for line in f]
  missing = [t for t in SPECIAL_TOKENS if t not in tokens]
  if missing:
    raise ValueError(f'Vocabulary file {vocab_file!r} lacks {" ".join(missing)}:'
                     f' add them (lines of their own) or use a BERT vocab.txt.')
  return tokens


class WordPieceTokenizer:
  """Basic tokenization + greedy longest-match-first WordPiece (BERT sec. 3)."""

  def __init__(self, vocab_file: str, lower_case: bool):
    self.vocab_file = vocab_file
    self.lower_case = lower_case
    self._tokens = _read_vocab(vocab_file)
    # A token listed twice keeps its last id, as in the reference load_vocab.
    ids = {token: i for i, token in enumerate(self._tokens)}
    self.vocab_size = len(self._tokens)
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        ids[t] for t in SPECIAL_TOKENS)
    self.special_ids = np.array([ids[t] for t in SPECIAL_TOKENS], np.int32)
    self.is_continuation = np.array(
        [t.startswith(CONTINUATION_PREFIX) for t in self._tokens], bool)
    self._tokenizer = _bert_tokenizer(
        models.WordPiece(ids, unk_token=UNK,
                         continuing_subword_prefix=CONTINUATION_PREFIX,
                         max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD),
        lower_case)

  def tokenize(self, text: str) -> list[str]:
    return self._tokenizer.encode(text, add_special_tokens=False).tokens

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without [CLS]/[SEP]."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, encoded in parallel by the library."""
    encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [e.ids for e in encodings]

  def convert_ids_to_tokens(self, ids) -> list[str]:
    return [self._tokens[int(i)] for i in ids]


def learn_vocab(texts: Iterable[str], vocab_size: int, lower_case: bool,
                output_file: str) -> str:
  """Learns a WordPiece vocabulary of `vocab_size` tokens, writes vocab.txt.

  Specials take ids 0..4; the file has exactly `vocab_size` lines, padded
  with [unusedN] tokens (as in the released BERT vocabularies) when the text
  is too small to learn that many pieces. Returns `output_file`.
  """
  if vocab_size < 2 * len(SPECIAL_TOKENS):
    raise ValueError(f'vocab_size={vocab_size} is too small to learn a '
                     'vocabulary: use at least a few hundred.')
  texts = list(texts)
  tokenizer = _bert_tokenizer(models.WordPiece(unk_token=UNK), lower_case)
  # Rarer characters become [UNK] rather than crowd out word pieces.
  alphabet = _alphabet(tokenizer.normalizer, texts, min(1000, vocab_size // 4))
  # The trainer numbers '##' characters in hash-map order, and that order
  # breaks ties between merges: numbered up front, learning is deterministic.
  # Punctuation and CJK characters are words of their own, never continuations.
  continuations = [CONTINUATION_PREFIX + c for c in alphabet
                   if len(tokenizer.pre_tokenizer.pre_tokenize_str('a' + c)) == 1]
  trainer = trainers.WordPieceTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS) + continuations,
      initial_alphabet=alphabet, limit_alphabet=len(alphabet),
      continuing_subword_prefix=CONTINUATION_PREFIX, show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  vocab = tokenizer.get_vocab()
  tokens = sorted(vocab, key=vocab.get)[:vocab_size]
  tokens += [f'[unused{i}]' for i in range(vocab_size - len(tokens))]
  return write_lines_atomically(tokens, output_file)


def _alphabet(normalizer: normalizers.Normalizer, texts: list[str],
              size: int) -> list[str]:
  """The `size` most frequent characters of the normalized texts, sorted."""
  counts = collections.Counter()
  for i in range(0, len(texts), 10_000):
    counts.update(normalizer.normalize_str('\n'.join(texts[i:i + 10_000])))
  ranked = sorted((c for c in counts if not c.isspace()),
                  key=lambda c: (-counts[c], c))
  return sorted(ranked[:size])


def write_lines_atomically(lines: Iterable[str], path: str) -> str:
  """Writes one line per item; readers never see a half-written file."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  # Unique per writer: hosts sharing a file system may build the same file.
  tmp = f'{path}.{uuid.uuid4().hex}.tmp'
  try:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.writelines(line + '\n' for line in lines)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return path
