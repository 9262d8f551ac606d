"""Contiguous text for LM pretraining, documents packed into rows (Radford et al. 2018, sec. 4.1).

GPT is pretrained on "long stretches of contiguous text" in "contiguous
sequences of 512 tokens". Feature spec of a host-local batch (numpy, static
shapes; B = batch size, L = data.max_seq_length):

  input_ids    int32   (B, L)  tokens of the row, tokenizer.pad_id at padding
  targets      int32   (B, L)  the next token of the same document, 0 where there is none
  weights      float32 (B, L)  1 exactly where targets holds a next token, else 0
  segment_ids  int32   (B, L)  1, 2, ... per document piece within the row, 0 at padding
  positions    int32   (B, L)  position within the document piece, restarting at 0

Packing: a document is its sentences joined by a space, tokenized and framed
[eot] tokens [eot] (the leading eot serves as BOS, the trailing one as EOS).
The documents of a chunk are concatenated in order into one token stream
that is cut into rows of L tokens, so a row holds the end of one document,
whole ones and the start of another; only the last row of a chunk is padded,
and every token of the text is input exactly once per epoch. A document cut
by a row boundary continues in the next row as a new piece whose positions
restart at 0 (the model attends within a piece only).

Targets are the stream shifted by one (inputs stream[i:i+L], targets
stream[i+1:i+L+1], the usual convention for contiguous text): the last token
of a row keeps its target, the first token of the next row, when both belong
to one document. So every token but a document's leading eot is a weighted
target exactly once per epoch, and nothing is lost at row boundaries (the
simpler rule, targets only inside a row, would drop 1 target in L). Targets
never cross documents: a trailing eot predicts nothing.

Order and resume (input_pipeline/common/chunked.py): rows are shuffled within their
chunk of data.docs_per_chunk documents by a generator seeded from (seed,
epoch, chunk, process_index); the eval split repeats the same rows in the
same order every pass, whatever the seed.
"""

import functools
import itertools

import ml_collections
import numpy as np

from input_pipeline.common import chunked
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib

Batch = dict[str, np.ndarray]
# example_batch's ids, the byte-level BPE layout: <|pad|> 0, <|endoftext|> 1, specials to 4.
_SYNTHETIC_PAD, _SYNTHETIC_EOT, _NUM_SYNTHETIC_SPECIAL = 0, 1, 5
TRAINS_EOT = True  # every document starts and ends with it (input_pipeline.trains_eot)


def validate(data_cfg: ml_collections.ConfigDict, batch_size: int) -> None:
  """Rejects data settings that cannot make LM rows, in one line naming the fix."""
  length = data_cfg.max_seq_length
  chunked.validate(data_cfg, batch_size, (
      length >= 2, f'config.data.max_seq_length={length} leaves no next token to predict: '
      'use 2 or more (GPT uses 512).'))


def pack_rows(documents: list[list[int]], length: int, *, eot_id: int, pad_id: int) -> Batch:
  """Rows of `length` tokens cut from the documents framed [eot] ... [eot], in order (sec. 4.1)."""
  documents = [ids for ids in documents if len(ids)]  # a document without text adds nothing
  sizes = np.array([len(ids) + 2 for ids in documents], np.int64)
  total = int(sizes.sum())
  num_rows = -(-total // length)
  tokens = np.full(num_rows * length, pad_id, np.int32)
  document = np.full(num_rows * length, -1, np.int64)
  document[:total] = np.repeat(np.arange(len(documents)), sizes)
  frame = np.zeros(total, bool)
  ends = np.cumsum(sizes)
  frame[ends - sizes] = frame[ends - 1] = True
  tokens[:total][frame] = eot_id
  tokens[:total][~frame] = np.fromiter(itertools.chain.from_iterable(documents), np.int32,
                                       total - 2 * len(documents))
  has_next = np.zeros(num_rows * length, bool)
  has_next[:-1] = (document[1:] == document[:-1]) & (document[:-1] >= 0)
  targets = np.where(has_next, np.roll(tokens, -1), 0)

  col = np.arange(length)
  document = document.reshape(num_rows, length)
  piece_start = (col == 0) | (document != np.roll(document, 1, axis=1))
  real = document >= 0
  piece_first_col = np.maximum.accumulate(np.where(piece_start, col, 0), axis=1)
  return {
      'input_ids': tokens.reshape(num_rows, length),
      'targets': targets.reshape(num_rows, length).astype(np.int32),
      'weights': has_next.reshape(num_rows, length).astype(np.float32),
      'segment_ids': np.where(real, np.cumsum(piece_start, axis=1), 0).astype(np.int32),
      'positions': np.where(real, col - piece_first_col, 0).astype(np.int32),
  }


def build_rows(documents: list[list[str]], rng: np.random.Generator, *,
               tokenizer: tokenizer_lib.Tokenizer, length: int) -> Batch:
  """All rows of one chunk of documents, packed and shuffled (sec. 4.1)."""
  texts = [sources.document_text(document) for document in documents]
  # One call for the whole chunk: the tokenizer batches and parallelizes in Rust.
  encoded = tokenizer.encode_batch(texts) if texts else []
  rows = pack_rows(encoded, length, eot_id=tokenizer.eot_id, pad_id=tokenizer.pad_id)
  order = rng.permutation(len(rows['input_ids']))
  return {k: v[order] for k, v in rows.items()}


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: tokenizer_lib.Tokenizer, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1,
                 documents_fn: chunked.DocumentsFn | None = None) -> chunked.ChunkedIterator:
  """Endless host-local batches of packed rows, resumable by get_state/set_state."""
  validate(data_cfg, batch_size)
  build = functools.partial(build_rows, tokenizer=tokenizer, length=data_cfg.max_seq_length)
  return chunked.ChunkedIterator(data_cfg, split, build, batch_size=batch_size, seed=seed,
                                 process_index=process_index, process_count=process_count,
                                 documents_fn=documents_fn)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> Batch:
  """A synthetic batch of the spec: per row, whole documents then the start of one more.

  Ids 0..4 are the specials (<|pad|> 0, <|endoftext|> 1), words are drawn from 5 on.
  """
  validate(data_cfg, batch_size)
  if vocab_size <= _NUM_SYNTHETIC_SPECIAL:
    raise ValueError(f'vocab_size={vocab_size} leaves no ids for words: use more than '
                     f'{_NUM_SYNTHETIC_SPECIAL}.')
  length = data_cfg.max_seq_length
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(batch_size):
    # Two whole documents when they fit, then one that runs past the row.
    sizes = rng.integers(3, max(4, length // 2), size=2)
    documents = [rng.integers(_NUM_SYNTHETIC_SPECIAL, vocab_size, n).tolist()
                 for n in [*(sizes - 2), length]]
    packed = pack_rows(documents, length, eot_id=_SYNTHETIC_EOT, pad_id=_SYNTHETIC_PAD)
    rows.append({k: v[0] for k, v in packed.items()})
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}
