"""Parallel text for translation models: sentence pairs packed into rows (Vaswani et al. 2017, sec. 5.1).

Pairs come from `data.pairs`:
  tfds     a TFDS translation dataset by name (`wmt14_translate/de-en`), its
           `data.source_language` and `data.target_language` features;
  files    line-aligned local files, data.source_files / data.target_files
           (and data.eval_source_files / data.eval_target_files, or every
           data.eval_holdout-th pair held out);
  offline  the offline task: each sentence of the text source (data.source,
           the embedded corpus by default) and its `cipher`, below.

One byte-level BPE vocabulary, learned from both sides of the training pairs,
serves source and target (the paper's shared source-target vocabulary); the
workdir keeps it. Each side ends with EOS (the tokenizer's eot_id); the
decoder's input is the target shifted right behind BOS (start_id). With
data.source_tokenizer='words' (CoVe), the source is words instead, ids of a
word vocabulary (words.txt) learned from the training sources and kept to
the words of data.glove_file when one is given; it has no EOS. Pairs with a
side longer than data.max_seq_length tokens are left out (counted in the
log). Examples are shuffled per chunk of data.docs_per_chunk pairs and
packed greedily into rows (data.pack; one pair per row without it), so
batches have static shapes and little padding.

Feature spec, all int32, B rows of S = L = data.max_seq_length:
  source_ids, source_segment_ids, source_positions      (B, S)
  target_input_ids, target_ids, target_segment_ids,
  target_positions                                      (B, L)
Segment ids number the examples of a row from 1 (0 = padding); positions
restart at 0 for each example.
"""

import collections
import hashlib
import itertools
import os
import re
import string
import time
from typing import Iterator

from absl import logging
import ml_collections
import numpy as np

from input_pipeline.common import chunked
from input_pipeline.common import glove
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import words as words_lib

TRAINS_EOT = True  # each side ends with it (input_pipeline.trains_eot)

PAIR_SOURCES = ('offline', 'files', 'tfds')
Pair = list[str]  # [source sentence, target sentence]


# The offline task: English sentences and their cipher.

_LETTERS = string.ascii_lowercase
# A fixed derangement of the alphabet (seeded, so the task never changes).
_CIPHER = ''.join(np.random.default_rng(20171206).permutation(list(_LETTERS)))
_TABLE = str.maketrans(_LETTERS + _LETTERS.upper(), _CIPHER + _CIPHER.upper())


def cipher(sentence: str) -> str:
  """The offline task's "translation" of an English sentence: a substitution cipher.

  Every letter is replaced by a fixed other letter, so the target language
  has words of its own whose subwords mirror the source's, aligned word for
  word (a learned lexicon and monotone attention, without reordering).
  """
  return sentence.translate(_TABLE)


def pairs(data_cfg: ml_collections.ConfigDict, split: str, process_index: int = 0,
          process_count: int = 1) -> Iterator[Pair]:
  """This host's [source, target] pairs of `split` ('train' or 'eval'), a fresh pass per call."""
  kind = data_cfg.pairs
  if kind == 'offline':
    sentences = (s for doc in sources.documents(data_cfg, split) for s in doc
                 if len(s.split()) <= data_cfg.offline_max_words)
    found = ([s, cipher(s)] for s in sentences)
  elif kind == 'files':
    found = _file_pairs(data_cfg, split)
  elif kind == 'tfds':
    found = _tfds_pairs(data_cfg, split)
  else:
    raise ValueError(f'Unknown data.pairs {kind!r}: use one of {", ".join(PAIR_SOURCES)}.')
  found = itertools.islice(found, process_index, None, process_count)
  first = next(found, None)
  if first is None:
    raise ValueError(f'data.pairs={kind!r} gives no {split!r} sentence pairs for host '
                     f'{process_index} of {process_count}: check its files or dataset.')
  return itertools.chain([first], found)


def _lines(pattern: str, field: str) -> Iterator[str]:
  for path in sources._glob(field, pattern):  # pylint: disable=protected-access
    with sources._open_binary(path) as f:  # pylint: disable=protected-access
      for raw in f:
        yield raw.decode('utf-8', errors='replace').strip()


def _file_pairs(data_cfg: ml_collections.ConfigDict, split: str) -> Iterator[Pair]:
  explicit = split == 'eval' and data_cfg.eval_source_files
  prefix = 'eval_' if explicit else ''
  source = _lines(data_cfg[f'{prefix}source_files'], f'data.{prefix}source_files')
  target = _lines(data_cfg[f'{prefix}target_files'], f'data.{prefix}target_files')
  missing = object()
  for i, (s, t) in enumerate(itertools.zip_longest(source, target, fillvalue=missing)):
    if s is missing or t is missing:
      raise ValueError(f'data.{prefix}source_files and data.{prefix}target_files have different '
                       f'numbers of lines (the shorter ends at line {i}): give line-aligned files.')
    held_out = not data_cfg.eval_source_files and i % data_cfg.eval_holdout == 0
    if (explicit or held_out == (split == 'eval')) and s and t:
      yield [s, t]


def _tfds_pairs(data_cfg: ml_collections.ConfigDict, split: str) -> Iterator[Pair]:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = sources.tfds_builder(data_cfg)
  languages = (data_cfg.source_language, data_cfg.target_language)
  for language in languages:
    if language not in builder.info.features:
      raise ValueError(f'TFDS dataset {data_cfg.tfds_name!r} has no language {language!r}: set '
                       f'data.source_language and data.target_language to two of '
                       f'{", ".join(builder.info.features)}.')
  sources.prepare_tfds(builder)
  tfds_split = data_cfg.tfds_eval_split if split == 'eval' else data_cfg.tfds_split
  dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
  for example in tfds.as_numpy(dataset):
    s, t = (example[language].decode('utf-8', errors='replace').strip()
            for language in languages)
    if s and t:
      yield [s, t]


# The shared vocabulary.

VOCAB_MAX_PAIRS = 200_000  # both sides of this many training pairs (sources.VOCAB_MAX_SENTENCES)


def _pairs_key(data_cfg: ml_collections.ConfigDict) -> str:
  """A file-name-safe name of the training pairs, for the vocabulary cache."""
  kind = data_cfg.pairs
  if kind == 'offline':
    # sources keys the text (a digest of files, or the corpus's Python version, and the
    # holdout); the pairs are its sentences of at most offline_max_words words.
    text = sources._source_key(data_cfg)  # pylint: disable=protected-access
    return f'offline-cipher-{text}-max{data_cfg.offline_max_words}'
  if kind == 'files':
    identity = [(os.path.abspath(p), os.path.getsize(p))
                for field in ('source_files', 'target_files')
                for p in sources._glob(f'data.{field}', data_cfg[field])]  # pylint: disable=protected-access
    name = os.path.basename(identity[0][0])
  else:
    identity = [data_cfg.tfds_name, data_cfg.tfds_split]
    name = data_cfg.tfds_name
  identity += [data_cfg.source_language, data_cfg.target_language]
  digest = hashlib.sha256(repr(identity).encode()).hexdigest()[:10]
  name = re.sub(r'[^\w.-]+', '_', name)[:40]
  held_out = kind == 'files' and not data_cfg.eval_source_files  # as _file_pairs holds out
  return f'{kind}-{name}-{digest}{sources.holdout_key(data_cfg, held_out)}'


class SourceWords:
  """CoVe's two vocabularies: source words (words.txt) and the target's BPE (tokenizer.json).

  Stands in for the BPE tokenizer wherever a run uses one: its vocab_size,
  ids and decode are the target's.
  """

  def __init__(self, source: words_lib.WordVocab, target: tokenizer_lib.ByteLevelBPETokenizer,
               lower_case: bool):
    self.source, self.target, self.lower_case = source, target, lower_case
    self.vocab_file, self.vocab_size = target.vocab_file, target.vocab_size
    self.pad_id, self.eot_id, self.start_id = target.pad_id, target.eot_id, target.start_id

  def files(self) -> dict[str, str]:
    """What a run keeps in its workdir: file name there -> this vocabulary's file."""
    return {words_lib.WordVocab.FILE_NAME: self.source.vocab_file,
            tokenizer_lib.ByteLevelBPETokenizer.FILE_NAME: self.target.vocab_file}

  def encode_source_batch(self, texts: list[str]) -> list[list[int]]:
    """Word ids of each text; a text without words reads as one <UNK>."""
    encoded = self.source.encode_batch([t.lower() if self.lower_case else t for t in texts])
    return [ids or [self.source.unk_id] for ids in encoded]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return self.target.encode_batch(texts)

  def decode(self, ids) -> str:
    return self.target.decode(ids)


def encode_sources(tokenizer, texts: list[str]) -> list[list[int]]:
  """Source ids: BPE ids and EOS, or CoVe's words alone (OpenNMT's encoder reads no marker)."""
  if isinstance(tokenizer, SourceWords):
    return tokenizer.encode_source_batch(texts)
  return [ids + [tokenizer.eot_id] for ids in tokenizer.encode_batch(texts)]


def _source_words(data_cfg: ml_collections.ConfigDict, saved_dir: str | None
                  ) -> words_lib.WordVocab:
  """The saved source words, else those of the training sources (GloVe's, with a file)."""
  size, split = data_cfg.source_vocab_size, words_lib.split_of(data_cfg)
  if saved_dir:
    path = os.path.join(saved_dir, words_lib.WordVocab.FILE_NAME)
    if not os.path.isfile(path):
      raise ValueError(f'{saved_dir} has no {words_lib.WordVocab.FILE_NAME}: it was not '
                       "trained with data.source_tokenizer='words'; match its config.json.")
  else:
    casing = 'uncased' if data_cfg.lower_case else 'cased'
    vectors = glove.file_key(data_cfg.glove_file) if data_cfg.glove_file else 'any'
    spaces = '-spaces' if split == 'spaces' else ''  # (raw text's names as before)
    path = os.path.join(sources.default_data_dir(data_cfg), 'vocab',
                        f'{_pairs_key(data_cfg)}-source-words-{size}-{casing}-{vectors}'
                        f'{spaces}.txt')
    if not os.path.exists(path):
      texts = (p[0].lower() if data_cfg.lower_case else p[0]
               for p in itertools.islice(pairs(data_cfg, 'train'), VOCAB_MAX_PAIRS))
      counts = words_lib.count_words(texts, split)
      if data_cfg.glove_file:  # other words share the learned <UNK> vector (models/cove.py)
        known = glove.known_words(data_cfg.glove_file, counts, data_cfg.lower_case)
        counts = collections.Counter({w: n for w, n in counts.items() if w in known})
      words_lib.write_word_vocab(counts, size, path)
  vocab = words_lib.WordVocab(path, split=split)
  if vocab.vocab_size > size:
    raise ValueError(f'The source vocabulary {path} has {vocab.vocab_size} words but '
                     f'data.source_vocab_size={size}: set --config.data.source_vocab_size='
                     f'{vocab.vocab_size}.')
  return vocab


def get_tokenizer(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  saved_dir: str | None = None
                  ) -> tokenizer_lib.ByteLevelBPETokenizer | SourceWords:
  """The saved or configured vocabulary, else one learned from both sides of the training pairs;
  with data.source_tokenizer='words', that and the source words (SourceWords)."""
  if data_cfg.get('source_tokenizer', 'bpe') == 'words':
    return SourceWords(_source_words(data_cfg, saved_dir),
                       _target_tokenizer(data_cfg, vocab_size, saved_dir), data_cfg.lower_case)
  return _target_tokenizer(data_cfg, vocab_size, saved_dir)


def _target_tokenizer(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                      saved_dir: str | None) -> tokenizer_lib.ByteLevelBPETokenizer:
  if saved_dir or data_cfg.vocab_file:
    return sources.get_tokenizer(data_cfg, vocab_size, saved_dir)
  casing = 'uncased' if data_cfg.lower_case else 'cased'
  path = os.path.join(sources.default_data_dir(data_cfg), 'vocab',
                      f'{_pairs_key(data_cfg)}-bpe-{vocab_size}-{casing}.json')
  if not os.path.exists(path):
    started = time.time()
    texts = (text for pair in itertools.islice(pairs(data_cfg, 'train'), VOCAB_MAX_PAIRS)
             for text in pair)
    tokenizer_lib.learn_bpe(texts, vocab_size, data_cfg.lower_case, path)
    logging.info('Learned a shared BPE vocabulary of %d tokens in %.1f s: %s', vocab_size,
                 time.time() - started, path)
  return tokenizer_lib.ByteLevelBPETokenizer(path, data_cfg.lower_case)


# Examples and packing.

SOURCE_FEATURES = ('source_ids', 'source_segment_ids', 'source_positions')
TARGET_FEATURES = ('target_input_ids', 'target_ids', 'target_segment_ids', 'target_positions')


def encode_pairs(batch: list[Pair], tokenizer, length: int
                 ) -> tuple[list[list[int]], list[list[int]], int]:
  """Source ids (encode_sources) and target ids ending with EOS; pairs with a side over
  `length` are left out."""
  source = encode_sources(tokenizer, [p[0] for p in batch])
  target = [ids + [tokenizer.eot_id] for ids in tokenizer.encode_batch([p[1] for p in batch])]
  kept = [(s, t) for s, t in zip(source, target) if len(s) <= length and len(t) <= length]
  return [s for s, _ in kept], [t for _, t in kept], len(batch) - len(kept)


def pack(source: list[list[int]], target: list[list[int]], length: int, bos_id: int,
         one_per_row: bool = False) -> dict[str, np.ndarray]:
  """Examples in order, as many per row as fit on both sides (or one); the spec's arrays
  (rows, length)."""
  rows, row, used_s, used_t = [], [], 0, 0
  for s, t in zip(source, target):
    full = one_per_row or used_s + len(s) > length or used_t + len(t) > length
    if row and full:
      rows.append(row)
      row, used_s, used_t = [], 0, 0
    row.append((s, t))
    used_s, used_t = used_s + len(s), used_t + len(t)
  if row:
    rows.append(row)
  out = {k: np.zeros((len(rows), length), np.int32) for k in SOURCE_FEATURES + TARGET_FEATURES}
  for r, examples in enumerate(rows):
    at_s = at_t = 0
    for segment, (s, t) in enumerate(examples, 1):
      span_s, span_t = slice(at_s, at_s + len(s)), slice(at_t, at_t + len(t))
      out['source_ids'][r, span_s] = s
      out['source_segment_ids'][r, span_s] = segment
      out['source_positions'][r, span_s] = np.arange(len(s))
      out['target_ids'][r, span_t] = t
      out['target_input_ids'][r, span_t] = [bos_id] + t[:-1]
      out['target_segment_ids'][r, span_t] = segment
      out['target_positions'][r, span_t] = np.arange(len(t))
      at_s, at_t = at_s + len(s), at_t + len(t)
  return out


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *, tokenizer,
                 batch_size: int, seed: int, process_index: int = 0,
                 process_count: int = 1) -> chunked.ChunkedIterator:
  """Endless packed rows; each chunk of data.docs_per_chunk pairs is shuffled, then packed."""
  chunked.validate(data_cfg, batch_size)
  length = data_cfg.max_seq_length

  def build(chunk: list[Pair], rng: np.random.Generator) -> dict[str, np.ndarray]:
    chunk = [chunk[i] for i in rng.permutation(len(chunk))]
    source, target, dropped = encode_pairs(chunk, tokenizer, length)
    if dropped and split == 'eval':
      # tensor2tensor evaluates every pair (eval_drop_long_sequences=False): say it, once.
      logging.log_first_n(logging.WARNING, 'Left out %d of %d eval pairs longer than '
                          'data.max_seq_length=%d tokens: eval_loss and eval_perplexity leave '
                          'them out (BLEU translates its decode.bleu_examples pairs whatever their '
                          'length); raise data.max_seq_length to '
                          'score them.', 1, dropped, len(chunk), length)
    elif dropped:
      logging.info('Left out %d of %d %s pairs longer than data.max_seq_length=%d tokens.',
                   dropped, len(chunk), split, length)
    return pack(source, target, length, tokenizer.start_id, not data_cfg.get('pack', True))

  return chunked.ChunkedIterator(data_cfg, split, build, batch_size=batch_size, seed=seed,
                                 process_index=process_index, process_count=process_count,
                                 documents_fn=pairs)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> dict[str, np.ndarray]:
  """Rows of two random examples each (one without data.pack), in the spec (ids 5 and up:
  not special tokens; source words below data.source_vocab_size)."""
  rng = np.random.default_rng(0)
  length = data_cfg.max_seq_length
  half = max(length // 2, 1)
  source_vocab = (data_cfg.source_vocab_size
                  if data_cfg.get('source_tokenizer', 'bpe') == 'words' else vocab_size)
  source = [list(rng.integers(5, source_vocab, half)) for _ in range(2 * batch_size)]
  target = [list(rng.integers(5, vocab_size, half)) for _ in range(2 * batch_size)]
  rows = pack(source, target, length, bos_id=2, one_per_row=not data_cfg.get('pack', True))
  return {k: v[:batch_size] for k, v in rows.items()}


def check_config(config: ml_collections.ConfigDict) -> None:
  data = config.data
  if data.pairs not in PAIR_SOURCES:
    raise ValueError(f'Unknown data.pairs {data.pairs!r}: use one of {", ".join(PAIR_SOURCES)}.')
  if data.get('tokenizer', 'bpe') != 'bpe':
    raise ValueError(f'data.tokenizer={data.tokenizer!r}: translation uses the shared byte-level '
                     "BPE vocabulary; set data.tokenizer='bpe'.")
  if data.max_seq_length < 2:
    raise ValueError(f'data.max_seq_length={data.max_seq_length}: use 2 or more tokens.')
  if data.pairs == 'files' and not (data.source_files and data.target_files):
    raise ValueError('data.pairs=files needs data.source_files and data.target_files: set both '
                     'to globs of line-aligned text files.')
  if bool(data.eval_source_files) != bool(data.eval_target_files):
    raise ValueError('Set both data.eval_source_files and data.eval_target_files, or neither.')
  source_tokenizer = data.get('source_tokenizer', 'bpe')
  if source_tokenizer not in ('bpe', 'words'):
    raise ValueError(f'data.source_tokenizer={source_tokenizer!r}: use bpe (the shared '
                     'vocabulary) or words (CoVe).')
  if source_tokenizer == 'words' and data.glove_file:
    if not os.path.isfile(data.glove_file):
      raise ValueError(f'data.glove_file={data.glove_file!r} does not exist: point it at a GloVe '
                       'text file (e.g. glove.840B.300d.txt) or set it to "" for random vectors.')
    width = glove.width(data.glove_file)
    if width != config.model.word_dim:
      raise ValueError(f'data.glove_file has {width}-d vectors but model.word_dim='
                       f'{config.model.word_dim}: set --config.model.word_dim={width}.')


def eval_pairs(data_cfg: ml_collections.ConfigDict, limit: int) -> list[Pair]:
  """The first `limit` pairs of the eval split (all hosts), for BLEU."""
  return list(itertools.islice(pairs(data_cfg, 'eval'), limit))
