"""Windows of a sentence stream for biLM pretraining (Peters et al. 2018, sec. 3; bilm-tf).

ELMo's biLM is trained on the 1B Word Benchmark, a corpus of shuffled
sentences: each sentence is framed <S> words </S> and the sentences are
concatenated into one token stream that is cut into windows of L tokens, the
forward LM predicting the next token and the backward LM the previous one,
also across the window's ends (the stream's neighbours of the window, as
bilm-tf's targets run on into the next batch). Feature spec of a host-local
batch (numpy, static shapes; B batch, L = data.max_seq_length, W =
data.max_characters_per_token):

  token_ids  int32 (B, L)     word ids (input_pipeline/common/words.py), 0 at padding
  char_ids   int32 (B, L, W)  character ids of each token, 0 at padding
  lengths    int32 (B,)       tokens in the row: L, except the last row of a chunk
  next_ids   int32 (B,)       the stream's token after the row, -1 at the chunk's end
  prev_ids   int32 (B,)       the stream's token before the row, -1 at the chunk's start

The windows of a chunk of data.docs_per_chunk documents (sentences of a
document in order) do not overlap, are shuffled within the chunk, and the
last one is padded rather than dropped, so every token is input exactly once
per epoch. A TFDS text dataset of one sentence per example (lm1b, feature
'text') is a corpus of one-sentence documents. Order and resume as in
input_pipeline/common/chunked.py. A chunk holds 4 W + 4 bytes per token (about 200
at W = 50): size data.docs_per_chunk to memory.
"""

import functools

import ml_collections
import numpy as np

from input_pipeline.common import chunked
from input_pipeline.common import words as words_lib

Batch = dict[str, np.ndarray]


def validate(data_cfg: ml_collections.ConfigDict, batch_size: int) -> None:
  """Rejects data settings that cannot make biLM rows, in one line naming the fix."""
  length, width = data_cfg.max_seq_length, data_cfg.max_characters_per_token
  chunked.validate(
      data_cfg, batch_size,
      (length >= 2, f'config.data.max_seq_length={length} leaves no neighbour token to predict: '
                    'use 2 or more (bilm-tf uses 20).'),
      (width >= 3, f'config.data.max_characters_per_token={width} leaves no room for a '
                   'character between the word markers: use 3 or more (ELMo uses 50).'))


def check_config(config: ml_collections.ConfigDict) -> None:
  """One-line errors before anything is learned or compiled."""
  words_lib.check_tokenizer(config.data)
  validate(config.data, config.train.batch_size)


def stream_rows(token_ids: np.ndarray, char_ids: np.ndarray, length: int) -> Batch:
  """A token stream (T,) with its char ids (T, W) cut into rows of `length`, the last one padded,
  and each row's neighbours in the stream (-1 where there is none)."""
  total, width = char_ids.shape
  num_rows = -(-total // length)
  padded_ids = np.zeros(num_rows * length, np.int32)
  padded_ids[:total] = token_ids
  padded_chars = np.zeros((num_rows * length, width), np.int32)
  padded_chars[:total] = char_ids
  starts = length * np.arange(num_rows)
  after, before = starts + length, starts - 1
  return {
      'token_ids': padded_ids.reshape(num_rows, length),
      'char_ids': padded_chars.reshape(num_rows, length, width),
      'lengths': np.minimum(length, total - starts).astype(np.int32),
      'next_ids': np.where(after < total, padded_ids[np.minimum(after, total - 1)], -1
                           ).astype(np.int32),
      'prev_ids': np.where(before >= 0, padded_ids[np.maximum(before, 0)], -1).astype(np.int32),
  }


def build_rows(documents: list[list[str]], rng: np.random.Generator, *,
               vocab: words_lib.WordVocab, length: int, max_characters: int) -> Batch:
  """All rows of one chunk of documents: framed sentences in order, cut, then shuffled."""
  sentences = [words for document in documents for sentence in document
               if (words := vocab.words_of(sentence))]
  token_ids, char_ids, _ = vocab.frame_sentences(sentences, max_characters)
  rows = stream_rows(token_ids, char_ids, length)
  order = rng.permutation(len(rows['lengths']))
  return {k: v[order] for k, v in rows.items()}


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: words_lib.WordVocab, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1,
                 documents_fn: chunked.DocumentsFn | None = None) -> chunked.ChunkedIterator:
  """Endless host-local batches of stream windows, resumable by get_state/set_state."""
  validate(data_cfg, batch_size)
  build = functools.partial(build_rows, vocab=tokenizer, length=data_cfg.max_seq_length,
                            max_characters=data_cfg.max_characters_per_token)
  return chunked.ChunkedIterator(data_cfg, split, build, batch_size=batch_size, seed=seed,
                                 process_index=process_index, process_count=process_count,
                                 documents_fn=documents_fn)


def synthetic_stream(rng: np.random.Generator, vocab_size: int, num_tokens: int,
                     max_words: int) -> np.ndarray:
  """`num_tokens` ids of framed sentences of 1..max_words random words (ids from 3 on)."""
  if vocab_size <= len(words_lib.SPECIAL_WORDS):
    raise ValueError(f'vocab_size={vocab_size} leaves no ids for words: use more than '
                     f'{len(words_lib.SPECIAL_WORDS)}.')
  ids = []
  while len(ids) < num_tokens:
    sentence = rng.integers(len(words_lib.SPECIAL_WORDS), vocab_size,
                            int(rng.integers(1, max_words + 1)))
    ids += [0, *sentence.tolist(), 1]
  return np.array(ids[:num_tokens], np.int32)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A synthetic batch of the spec: full rows, and every second row shorter."""
  validate(data_cfg, batch_size)
  length, width = data_cfg.max_seq_length, data_cfg.max_characters_per_token
  rng = np.random.default_rng(0)
  rows = []
  for b in range(batch_size):
    num_tokens = length if b % 2 == 0 else int(rng.integers(1, length + 1))
    ids = synthetic_stream(rng, vocab_size, num_tokens, max(1, length // 2))
    row = stream_rows(ids, words_lib.synthetic_char_ids(ids, width), length)
    rows.append({k: v[0] for k, v in row.items()})
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}
