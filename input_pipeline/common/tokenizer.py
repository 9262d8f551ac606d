"""Tokenizers: BERT's WordPiece and GPT's byte-level BPE, with the same interface.

Both expose the token roles pad_id, eot_id, start_id, delim_id, extract_id,
plus vocab_size, vocab_file (the one file that defines the vocabulary), encode,
encode_batch, decode and convert_ids_to_tokens; `load` picks the class by file.

WordPiece: Devlin et al. 2018, section 3 ("We use WordPiece embeddings with a 30,000
token vocabulary"); the rules are those of google-research/bert
tokenization.py (BasicTokenizer + WordpieceTokenizer). Built from components
of the HF `tokenizers` library so that encoding is fast (Rust, batched).

Why not BertNormalizer + BertPreTokenizer: they differ from the reference on
private-use characters (dropped instead of kept), on CJK Extension C
U+2B820..U+2B91F (not split) and on final sigma when lower-casing. The
normalizer and pre-tokenizer below spell out the reference rules with
Unicode-property regexes instead; tests/test_tokenizer.py checks every
assigned code point against those rules.

Byte-level BPE: Radford et al. 2018, section 4.1 (a BPE vocabulary with 40,000
merges; GPT-1 lower-cased its text) over bytes as in GPT-2, so that no text is
unknown and decoding gives back the exact text. The same class also reads
GPT-1's own BPE (openai-gpt's vocab.json and merges.txt, converted by
convert_checkpoint.py): lower-cased, '</w>' ending each word, after the basic
tokenization above (what HF's OpenAIGPTTokenizer does without ftfy and spaCy).
"""

import collections
from collections.abc import Iterable
import json
import os
import uuid

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

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


class _LibraryTokenizer:
  """Encoding shared by both kinds: the library's tokenizer in self._tokenizer does the work."""

  _tokenizer: tokenizers.Tokenizer

  def tokenize(self, text: str) -> list[str]:
    return self._tokenizer.encode(text, add_special_tokens=False).tokens

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, no special token added ([CLS], [SEP], <|endoftext|>)."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, encoded in parallel by the library."""
    encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [e.ids for e in encodings]

  def encode_with_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Token ids of each text and each token's (start, end) character span in that text.

    The spans are in the original text, before lower-casing and accent
    stripping (SQuAD maps predicted tokens back to the context this way).
    """
    encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
    return [(e.ids, [tuple(o) for o in e.offsets]) for e in encodings]


class WordPieceTokenizer(_LibraryTokenizer):
  """Basic tokenization + greedy longest-match-first WordPiece (BERT sec. 3)."""

  FILE_NAME = 'vocab.txt'

  def __init__(self, vocab_file: str, lower_case: bool):
    self.vocab_file = vocab_file
    self.lower_case = lower_case
    self._tokens = _read_vocab(vocab_file)
    # A token listed twice keeps its last id, as in the reference load_vocab.
    ids = {token: i for i, token in enumerate(self._tokens)}
    self.vocab_size = len(self._tokens)
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        ids[t] for t in SPECIAL_TOKENS)
    # GPT's roles, so that its pipelines also run on a BERT vocabulary.
    self.eot_id, self.start_id, self.delim_id, self.extract_id = (
        self.sep_id, self.cls_id, self.sep_id, self.mask_id)
    self.special_ids = np.array([ids[t] for t in SPECIAL_TOKENS], np.int32)
    self.is_continuation = np.array(
        [t.startswith(CONTINUATION_PREFIX) for t in self._tokens], bool)
    self._tokenizer = _bert_tokenizer(
        models.WordPiece(ids, unk_token=UNK,
                         continuing_subword_prefix=CONTINUATION_PREFIX,
                         max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD),
        lower_case)

  def convert_ids_to_tokens(self, ids) -> list[str]:
    return [self._tokens[int(i)] for i in ids]

  def decode(self, ids) -> str:
    """Tokens joined by spaces, '##' pieces glued on; [PAD] [CLS] [SEP] [MASK] dropped.

    Not the original text: the basic tokenizer split off punctuation and may
    have lower-cased and stripped accents ([UNK] stays as is).
    """
    dropped = {self.pad_id, self.cls_id, self.sep_id, self.mask_id}
    tokens = self.convert_ids_to_tokens(i for i in ids if int(i) not in dropped)
    return ' '.join(tokens).replace(' ' + CONTINUATION_PREFIX, '')


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


# Byte-level BPE (GPT).

BPE_SPECIAL_TOKENS = ('<|pad|>', '<|endoftext|>', '<|start|>', '<|delim|>', '<|extract|>')
NUM_BYTES = 256
# GPT-1's BPE (openai-gpt): the suffix that ends a word, and its unknown token.
END_OF_WORD, GPT1_UNK = '</w>', '<unk>'


def _byte_symbols() -> list[str]:
  """The symbols of bytes 0..255, as GPT-2's bytes_to_unicode: printable, never whitespace."""
  printable = {*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
               *range(ord('®'), ord('ÿ') + 1)}
  shifted = iter(range(NUM_BYTES, 2 * NUM_BYTES))
  return [chr(b) if b in printable else chr(next(shifted)) for b in range(NUM_BYTES)]


def _byte_level_tokenizer(model: models.Model, lower_case: bool) -> tokenizers.Tokenizer:
  tokenizer = tokenizers.Tokenizer(model)
  if lower_case:
    tokenizer.normalizer = normalizers.Lowercase()
  # GPT-2's word-splitting regex. No prefix space, so that decoding gives the text back.
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def _read_bpe(path: str, lower_case: bool) -> tokenizers.Tokenizer:
  """A tokenizer.json of learn_bpe's kind (or GPT-1's BPE), checked, or a one-line ValueError."""
  if not os.path.isfile(path):
    raise ValueError(f'Tokenizer file {path!r} not found: point data.vocab_file at a '
                     'tokenizer.json, or leave it empty to learn one.')
  try:
    tokenizer = tokenizers.Tokenizer.from_file(path)
  except Exception as error:  # the library raises a bare Exception on a malformed file
    raise ValueError(f'Tokenizer file {path!r} is not a tokenizer.json ({error}): point '
                     'data.vocab_file at one, or leave it empty to learn one.') from None
  byte_level = isinstance(tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel)
  if not (isinstance(tokenizer.model, models.BPE) and (
      byte_level or tokenizer.model.end_of_word_suffix == END_OF_WORD)):
    raise ValueError(f'Tokenizer file {path!r} is not a byte-level BPE: use one written by '
                     "learn_bpe, or set data.tokenizer='wordpiece' for a WordPiece vocab.")
  missing = [t for t in BPE_SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
  if missing:
    raise ValueError(f'Tokenizer file {path!r} lacks {" ".join(missing)}: use one written '
                     'by learn_bpe (data.vocab_file empty learns one).')
  lower_cases = tokenizer.normalizer is not None and tokenizer.normalizer.normalize_str('A') == 'a'
  if lower_cases != lower_case:
    raise ValueError(f'Tokenizer file {path!r} was learned with lower_case={lower_cases}: set '
                     f'--config.data.lower_case={lower_cases}, or learn another one.')
  # The specials are plain vocabulary entries that no merge builds, so raw text
  # never becomes one. A file from elsewhere may register them as added tokens,
  # which the library would match in text: this makes it read them as text.
  tokenizer.encode_special_tokens = True
  return tokenizer


class ByteLevelBPETokenizer(_LibraryTokenizer):
  """BPE over bytes (Radford et al. 2018 sec. 4.1, bytes as in GPT-2): no text is unknown.

  Also GPT-1's lower-cased BPE with '</w>' (write_gpt1_bpe), where text outside
  its characters is <unk> and decoding gives the basic tokens joined by spaces.
  encode never gives a special token, even for text that spells one ('<|endoftext|>').
  """

  FILE_NAME = 'tokenizer.json'

  def __init__(self, tokenizer_file: str, lower_case: bool):
    self._tokenizer = _read_bpe(tokenizer_file, lower_case)
    self.vocab_file, self.lower_case = tokenizer_file, lower_case
    self.vocab_size = self._tokenizer.get_vocab_size()
    self.pad_id, self.eot_id, self.start_id, self.delim_id, self.extract_id = (
        self._tokenizer.token_to_id(t) for t in BPE_SPECIAL_TOKENS)
    self.special_ids = np.array([self._tokenizer.token_to_id(t) for t in BPE_SPECIAL_TOKENS],
                                np.int32)
    self._special = frozenset(self.special_ids.tolist())

  def decode(self, ids) -> str:
    """The text of `ids`, special tokens dropped: decode(encode(t)) == t unless lower-cased."""
    kept = [int(i) for i in ids if int(i) not in self._special]
    return self._tokenizer.decode(kept, skip_special_tokens=False)

  def convert_ids_to_tokens(self, ids) -> list[str]:
    """Byte-level symbols, e.g. 'Ġthe' for ' the'."""
    return [self._tokenizer.id_to_token(int(i)) for i in ids]


def learn_bpe(texts: Iterable[str], vocab_size: int, lower_case: bool,
              output_file: str) -> str:
  """Learns a byte-level BPE vocabulary of exactly `vocab_size` ids, writes a tokenizer.json.

  Ids: the specials 0..4, the 256 byte symbols in byte order (so nothing is
  unknown), then the merged tokens in the order they were learned, padded
  with <|unusedN|> tokens when the text has fewer merges to give. The same
  texts give the same file. Returns `output_file`.
  """
  fixed = list(BPE_SPECIAL_TOKENS) + _byte_symbols()
  if vocab_size < len(fixed):
    raise ValueError(f'vocab_size={vocab_size} is too small for byte-level BPE: use at least '
                     f'{len(fixed)} (5 specials + 256 bytes), typically thousands.')
  # A pair seen once is not worth a token (the library's own default for byte-level BPE).
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                special_tokens=list(BPE_SPECIAL_TOKENS),
                                initial_alphabet=_byte_symbols(), show_progress=False)
  learner = _byte_level_tokenizer(models.BPE(), lower_case)
  learner.train_from_iterator(texts, trainer)
  merges = [tuple(m) for m in json.loads(learner.to_str())['model']['merges']]
  merges = merges[:vocab_size - len(fixed)]
  # Numbered here rather than as the trainer did, so the layout is the documented one.
  vocab = {token: i for i, token in enumerate(fixed)}
  for left, right in merges:
    vocab.setdefault(left + right, len(vocab))
  vocab |= {f'<|unused{i}|>': len(vocab) + i for i in range(vocab_size - len(vocab))}
  tokenizer = _byte_level_tokenizer(models.BPE(vocab, merges, fuse_unk=False), lower_case)
  return write_lines_atomically([tokenizer.to_str()], output_file)


def write_gpt1_bpe(vocab_file: str, merges_file: str, output_file: str) -> str:
  """GPT-1's BPE (openai-gpt's vocab.json and merges.txt) as a tokenizer.json of this module.

  Text is lower-cased and split as BERT's basic tokenizer does (HF's
  OpenAIGPTTokenizer without ftfy and spaCy), then BPE with '</w>' ending each
  word. BPE_SPECIAL_TOKENS get the ids after the vocabulary's, as OpenAI's
  fine-tuning code appends its special tokens. Returns `output_file`.
  """
  for path in (vocab_file, merges_file):
    if not os.path.isfile(path):
      raise ValueError(f'{path} does not exist: add the BPE vocabulary files of the model.')
  with open(vocab_file, encoding='utf-8') as f:
    vocab = json.load(f)
  with open(merges_file, encoding='utf-8') as f:
    merges = [tuple(line.rstrip('\r\n').split(' ')) for line in f
              if line.strip() and not line.startswith('#version')]
  if sorted(vocab.values()) != list(range(len(vocab))):
    raise ValueError(f'The ids of {vocab_file} are not 0..{len(vocab) - 1}: use the vocab.json '
                     'that came with the checkpoint.')
  taken = [t for t in BPE_SPECIAL_TOKENS if t in vocab]
  if taken:
    raise ValueError(f'{vocab_file} already has {" ".join(taken)}: convert the original '
                     'openai-gpt vocabulary.')
  vocab = vocab | {t: len(vocab) + i for i, t in enumerate(BPE_SPECIAL_TOKENS)}
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab, merges, unk_token=GPT1_UNK if GPT1_UNK in vocab else None,
      end_of_word_suffix=END_OF_WORD, fuse_unk=False))
  tokenizer.normalizer = _normalizer(lower_case=True)
  tokenizer.pre_tokenizer = _pre_tokenizer()
  tokenizer.decoder = decoders.BPEDecoder(suffix=END_OF_WORD)
  return write_lines_atomically([tokenizer.to_str()], output_file)


Tokenizer = WordPieceTokenizer | ByteLevelBPETokenizer


def vocab_is_cased(path: str) -> bool:
  """Whether a WordPiece vocab.txt is cased: it has capitalized pieces ([CLS] and the like
  aside), where an uncased one was made from lower-cased text."""
  return vocab_casing(path) == 'cased'


def vocab_casing(path: str) -> str | None:
  """'cased' (capitalized pieces, [CLS] and the like aside), 'uncased' (letters that have a
  case, none capitalized) or None (no letter with a case: a script without one, such as
  Devanagari or Chinese, says nothing)."""
  with open(path, encoding='utf-8') as f:
    pieces = [line.rstrip('\n') for line in f if not line.startswith('[')]
  if any(p != p.lower() for p in pieces):
    return 'cased'
  return 'uncased' if any(p != p.upper() for p in pieces) else None


def load(path: str, lower_case: bool) -> Tokenizer:
  """The tokenizer a file defines: a .json is a byte-level BPE tokenizer.json, else a vocab.txt."""
  kind = ByteLevelBPETokenizer if path.endswith('.json') else WordPieceTokenizer
  return kind(path, lower_case)
