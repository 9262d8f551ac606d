"""BERT pretraining examples (MLM + NSP), Devlin et al. 2018, sec. 3.1 and appendix A.1.

Feature spec of a host-local batch (numpy, static shapes; B = batch size,
L = data.max_seq_length, P = data.max_predictions_per_seq):

  input_ids             int32   (B, L)  [CLS] A [SEP] B [SEP] [PAD]..., chosen tokens corrupted
  input_mask            int32   (B, L)  1 at real tokens ([CLS]/[SEP] included), 0 at padding
  segment_ids           int32   (B, L)  0 for [CLS] A [SEP], 1 for B [SEP], 0 at padding
  masked_lm_positions   int32   (B, P)  ascending positions of the tokens to predict, 0 at padding
  masked_lm_ids         int32   (B, P)  original tokens at those positions, 0 at padding
  masked_lm_weights     float32 (B, P)  1.0 at real predictions, 0.0 at padding
  next_sentence_labels  int32   (B,)    0 = B is the actual next segment, 1 = B is random

With data.next_sentence_prediction False an example is [CLS] A [SEP] with A up
to L - 2 tokens, segment_ids are all 0 and batches carry no next_sentence_labels
(so the objective trains MLM alone).

Order and resume (input_pipeline/common/chunked.py): the host's document stream is
cut into chunks of data.docs_per_chunk documents. The examples of chunk c in
epoch e are built, shuffled and masked by one generator seeded from (seed, e,
c, process_index), so segment pairs and masks are drawn afresh each epoch
(dynamic masking) and the stream is a pure function of its position
{'epoch', 'chunk', 'offset'}.
"""

import bisect
import functools
import itertools

import ml_collections
import numpy as np

from input_pipeline.common import chunked
from input_pipeline.common import tokenizer as tokenizer_lib

# Per document, its sentences' (starts, ends) into the chunk's flat token array.
Spans = list[tuple[list[int], list[int]]]
# synthetic_batch's ids: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, words from 5 on.
_SYNTHETIC_PAD, _SYNTHETIC_CLS, _SYNTHETIC_SEP, _SYNTHETIC_MASK = 0, 2, 3, 4
_NUM_SYNTHETIC_SPECIAL = 5


def tokenize_documents(documents: list[list[str]], tokenizer: tokenizer_lib.WordPieceTokenizer
                       ) -> tuple[np.ndarray, Spans]:
  """All sentences' token ids, flat, and each document's sentence spans into them (sec. 3.1)."""
  texts = [sentence for document in documents for sentence in document]
  # One call for the whole chunk: the tokenizer batches and parallelizes in Rust.
  encoded = tokenizer.encode_batch(texts) if texts else []
  lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
  flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
  ends = np.cumsum(lengths)
  starts = ends - lengths
  spans, first = [], 0
  for document in documents:
    # Empty sentences would make empty segments; documents left without text are dropped.
    keep = slice(first, first + len(document))
    nonempty = lengths[keep] > 0
    if nonempty.any():
      spans.append((starts[keep][nonempty].tolist(), ends[keep][nonempty].tolist()))
    first += len(document)
  return flat, spans


def _random_segment(spans: Spans, index: int, rng: np.random.Generator,
                    target_length: int) -> tuple[int, int]:
  """Sentences of another document from a random start up to target_length tokens (sec. 3.1)."""
  other = index
  if len(spans) > 1:  # a one-document chunk can only draw from itself
    other = int(rng.integers(len(spans) - 1))
    other += other >= index
  starts, ends = spans[other]
  first = int(rng.integers(len(starts)))
  last = bisect.bisect_left(ends, starts[first] + target_length, lo=first)
  return starts[first], ends[min(last, len(starts) - 1)]


def _document_instances(spans: Spans, index: int, rng: np.random.Generator, max_num_tokens: int,
                        short_seq_prob: float, nsp: bool) -> list[tuple[int, ...]]:
  """Segment pairs of one document, as the reference create_instances_from_document (sec. 3.1)."""
  starts, ends = spans[index]
  # As in the reference, one target per document; short ones lessen the
  # mismatch with short fine-tuning inputs (appendix A.2).
  target = max_num_tokens
  if rng.random() < short_seq_prob:
    target = int(rng.integers(2, max_num_tokens, endpoint=True))
  instances, first = [], 0
  while first < len(starts):
    # The chunk is sentences first..last: up to the target length or the end of the document.
    last = bisect.bisect_left(ends, starts[first] + target, lo=first)
    last = min(last, len(starts) - 1)
    num_sentences = last - first + 1
    if not nsp:
      instances.append((starts[first], ends[last], 0, 0, 0))
      first = last + 1
      continue
    # The coin comes first. A one-sentence chunk drawn IsNext takes the next
    # sentence as B, or, at the end of the document, the previous one as A
    # (which then serves twice). A and B thus always end and start at sentence
    # boundaries, so only their content tells IsNext from random, and labels
    # stay at 50% (the reference forces random-next for one-sentence chunks).
    if rng.random() >= 0.5:
      a_first = first
      if num_sentences == 1:
        if last + 1 < len(starts):
          last += 1
        else:
          a_first -= 1
      cut = starts[a_first + int(rng.integers(1, last - a_first + 1))]
      instances.append((starts[a_first], cut, cut, ends[last], 0))
      first = last + 1
    else:
      a_sentences = int(rng.integers(1, num_sentences)) if num_sentences > 1 else 1
      a_end = ends[first + a_sentences - 1]
      b_start, b_end = _random_segment(spans, index, rng, target - (a_end - starts[first]))
      instances.append((starts[first], a_end, b_start, b_end, 1))
      first += a_sentences  # the chunk's unused sentences are put back, as in the reference
  return instances


def _truncate(instances: np.ndarray, max_num_tokens: int, rng: np.random.Generator) -> np.ndarray:
  """Trims pairs to max_num_tokens, longer side first (reference truncate_seq_pair, sec. 3.1)."""
  a_start, a_end, b_start, b_end, labels = instances.T
  len_a, len_b = a_end - a_start, b_end - b_start
  # The reference removes one token at a time from the longer side (B on ties);
  # the lengths it ends with are these.
  over = len_a + len_b > max_num_tokens
  kept_a = np.where(over, np.minimum(len_a, np.maximum((max_num_tokens + 1) // 2,
                                                       max_num_tokens - len_b)), len_a)
  kept_b = np.where(over, max_num_tokens - kept_a, len_b)
  # It flips a fair coin per removed token for front or back: the count cut
  # from the front is binomial.
  a_start = a_start + rng.binomial(len_a - kept_a, 0.5)
  b_start = b_start + rng.binomial(len_b - kept_b, 0.5)
  return np.stack([a_start, a_start + kept_a, b_start, b_start + kept_b, labels], axis=1)


def create_instances(spans: Spans, rng: np.random.Generator, *, max_seq_length: int,
                     short_seq_prob: float, next_sentence_prediction: bool) -> np.ndarray:
  """Segment pairs (N, 5): a_start, a_end, b_start, b_end into the flat tokens, label (sec. 3.1)."""
  # [CLS] A [SEP] B [SEP] has 3 special tokens, [CLS] A [SEP] two.
  max_num_tokens = max_seq_length - (3 if next_sentence_prediction else 2)
  # With NSP, a one-sentence document has no next sentence to pair: it only
  # serves as the random B of other documents, and NSP labels stay at 50%.
  sources = [i for i, (starts, _) in enumerate(spans)
             if len(starts) > 1 or not next_sentence_prediction]
  instances = [instance for index in sources
               for instance in _document_instances(spans, index, rng, max_num_tokens,
                                                   short_seq_prob, next_sentence_prediction)]
  instances = np.array(instances, np.int64).reshape(-1, 5)
  return _truncate(instances, max_num_tokens, rng)


def pack_instances(flat: np.ndarray, instances: np.ndarray, max_seq_length: int,
                   tokenizer: tokenizer_lib.WordPieceTokenizer) -> dict[str, np.ndarray]:
  """[CLS] A [SEP] B [SEP] rows, segment ids, input mask and maskable positions (sec. 3.1)."""
  a_start, a_end, b_start, b_end, labels = (column[:, None] for column in instances.T)
  len_a, len_b = a_end - a_start, b_end - b_start
  col = np.arange(max_seq_length)[None, :]
  in_a = (col >= 1) & (col <= len_a)
  in_b = (col >= len_a + 2) & (col < len_a + 2 + len_b)
  source = np.where(in_a, a_start + col - 1, np.where(in_b, b_start + col - len_a - 2, 0))
  input_ids = np.where(in_a | in_b, flat[source] if flat.size else 0, tokenizer.pad_id)
  has_b = len_b > 0
  length = len_a + 2 + np.where(has_b, len_b + 1, 0)
  is_sep = (col == len_a + 1) | (has_b & (col == length - 1))
  input_ids = np.where(col == 0, tokenizer.cls_id, np.where(is_sep, tokenizer.sep_id, input_ids))
  input_mask = col < length
  return {
      'input_ids': input_ids.astype(np.int32),
      'input_mask': input_mask.astype(np.int32),
      'segment_ids': (input_mask & (col >= len_a + 2)).astype(np.int32),
      'next_sentence_labels': labels[:, 0].astype(np.int32),
      'eligible': in_a | in_b,
  }


def _choose_whole_words(keys: np.ndarray, eligible: np.ndarray, word_start: np.ndarray,
                        num_to_predict: np.ndarray) -> np.ndarray:
  """Chosen positions (N, L), a word's pieces together (reference whole-word masking, 2019)."""
  n, length = keys.shape
  col = np.arange(length)[None, :]
  # A word runs from its start to the next start or non-maskable token.
  boundary = np.where(word_start | ~eligible, col, length)
  next_boundary = np.minimum.accumulate(boundary[:, ::-1], axis=1)[:, ::-1]
  next_boundary = np.concatenate([next_boundary[:, 1:], np.full((n, 1), length)], axis=1)
  word_length = np.where(word_start, next_boundary - col, 0)
  # Words in random order, then the other positions.
  order = np.argsort(np.where(word_start, keys, 2.0), axis=1)
  lengths = np.take_along_axis(word_length, order, axis=1)
  taken, total = np.zeros((n, length), bool), np.zeros(n, np.int64)
  # Greedy in random order; as in the reference, a word that would overshoot
  # is skipped and shorter later words may still fit.
  for rank in range(int(word_start.sum(1).max(initial=0))):
    fits = (lengths[:, rank] > 0) & (total + lengths[:, rank] <= num_to_predict)
    taken[:, rank] = fits
    total += np.where(fits, lengths[:, rank], 0)
  chosen_start = np.zeros((n, length), bool)
  np.put_along_axis(chosen_start, order, taken, axis=1)
  own_start = np.maximum.accumulate(np.where(word_start, col, 0), axis=1)
  return eligible & np.take_along_axis(chosen_start, own_start, axis=1)


def create_masked_lm_predictions(
    input_ids: np.ndarray, eligible: np.ndarray, rng: np.random.Generator, *,
    max_predictions: int, masked_lm_prob: float, mask_token_prob: float,
    random_token_prob: float, mask_id: int, replacement_ids: np.ndarray,
    is_continuation: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Chooses and corrupts the tokens to predict (sec. 3.1 "Masked LM", appendix A.1)."""
  n, length = input_ids.shape
  num_candidates = eligible.sum(1)
  # Deviation: the reference rounds len(tokens) * p, [CLS]/[SEP] included;
  # stochastic rounding over eligible tokens makes the expected rate exactly p.
  expected = num_candidates * masked_lm_prob
  num_to_predict = np.floor(expected) + (rng.random(n) < expected - np.floor(expected))
  num_to_predict = np.minimum(np.clip(num_to_predict, 1, max_predictions), num_candidates)
  keys = np.where(eligible, rng.random((n, length)), 2.0)
  if is_continuation is None:
    order = np.argsort(keys, axis=1)[:, :max_predictions]
    chosen = np.zeros((n, length), bool)
    in_budget = np.arange(order.shape[1]) < num_to_predict[:, None]
    np.put_along_axis(chosen, order, in_budget, axis=1)
  else:
    # Deviation: a '##' piece right after [SEP] (B cut at its front mid-word) starts a word;
    # the reference, skipping [SEP] before it looks back, glues it to A's last word.
    previous_eligible = np.pad(eligible[:, :-1], ((0, 0), (1, 0)))
    word_start = eligible & ~(is_continuation[input_ids] & previous_eligible)
    chosen = _choose_whole_words(keys, eligible, word_start, num_to_predict)

  positions = np.argsort(~chosen, axis=1, kind='stable')[:, :max_predictions]  # ascending
  weights = np.arange(max_predictions) < chosen.sum(1, keepdims=True)
  positions = np.where(weights, positions, 0)
  original = np.take_along_axis(input_ids, positions, axis=1)
  draw = rng.random((n, max_predictions))
  random_ids = replacement_ids[rng.integers(len(replacement_ids), size=(n, max_predictions))]
  corrupted = np.where(draw < mask_token_prob, mask_id,
                       np.where(draw < mask_token_prob + random_token_prob, random_ids, original))
  rows, slots = np.nonzero(weights)
  masked_input_ids = input_ids.copy()
  masked_input_ids[rows, positions[rows, slots]] = corrupted[rows, slots]
  return {
      'input_ids': masked_input_ids.astype(np.int32),
      'masked_lm_positions': positions.astype(np.int32),
      'masked_lm_ids': np.where(weights, original, 0).astype(np.int32),
      'masked_lm_weights': weights.astype(np.float32),
  }


def build_examples(documents: list[list[str]], rng: np.random.Generator, *,
                   tokenizer: tokenizer_lib.WordPieceTokenizer,
                   data_cfg: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """All examples of one chunk of documents: paired, shuffled and masked (sec. 3.1)."""
  flat, spans = tokenize_documents(documents, tokenizer)
  instances = create_instances(spans, rng, max_seq_length=data_cfg.max_seq_length,
                               short_seq_prob=data_cfg.short_seq_prob,
                               next_sentence_prediction=data_cfg.next_sentence_prediction)
  examples = pack_instances(flat, instances[rng.permutation(len(instances))],
                            data_cfg.max_seq_length, tokenizer)
  eligible = examples.pop('eligible')
  examples |= create_masked_lm_predictions(
      examples['input_ids'], eligible, rng,
      max_predictions=data_cfg.max_predictions_per_seq,
      masked_lm_prob=data_cfg.masked_lm_prob,
      mask_token_prob=data_cfg.mask_token_prob,
      random_token_prob=data_cfg.random_token_prob,
      mask_id=tokenizer.mask_id,
      # The reference draws from the whole vocabulary; without the specials a
      # random replacement never fakes a [SEP] or [MASK].
      replacement_ids=np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.special_ids),
      is_continuation=tokenizer.is_continuation if data_cfg.whole_word_masking else None)
  return examples


def validate(data_cfg: ml_collections.ConfigDict, batch_size: int) -> None:
  """Rejects data settings that cannot make BERT examples, in one line naming the fix."""
  length, predictions = data_cfg.max_seq_length, data_cfg.max_predictions_per_seq
  mask_prob, random_prob = data_cfg.mask_token_prob, data_cfg.random_token_prob
  chunked.validate(
      data_cfg, batch_size,
      (data_cfg.tokenizer == 'wordpiece', f'config.data.tokenizer={data_cfg.tokenizer!r}: BERT '
       "needs [CLS], [SEP] and [MASK]; use --config.data.tokenizer=wordpiece."),
      (length >= 5, f'config.data.max_seq_length={length} leaves no room for '
       '[CLS] A [SEP] B [SEP]: use 5 or more.'),
      (1 <= predictions <= length, f'config.data.max_predictions_per_seq={predictions} '
       f'must be in [1, max_seq_length={length}].'),
      (0 < data_cfg.masked_lm_prob <= 1,
       f'config.data.masked_lm_prob={data_cfg.masked_lm_prob} must be in (0, 1].'),
      (0 <= data_cfg.short_seq_prob <= 1,
       f'config.data.short_seq_prob={data_cfg.short_seq_prob} must be in [0, 1].'),
      (min(mask_prob, random_prob) >= 0 and mask_prob + random_prob <= 1,
       'config.data.mask_token_prob and random_token_prob must be >= 0 and sum to <= 1.'))


def check_config(config: ml_collections.ConfigDict) -> None:
  """The data fields, before anything is read; trainer.checks runs it on each phase's config,
  so a later phase's mistake stops the run before its first step."""
  validate(config.data, config.train.batch_size)


class PretrainingIterator(chunked.ChunkedIterator):
  """Endless host-local batches of MLM + NSP examples, exactly resumable (sec. 3.1, A.1)."""

  def __init__(self, data_cfg: ml_collections.ConfigDict, split: str, *,
               tokenizer: tokenizer_lib.WordPieceTokenizer, batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1,
               documents_fn: chunked.DocumentsFn | None = None):
    validate(data_cfg, batch_size)
    build = functools.partial(build_examples, tokenizer=tokenizer, data_cfg=data_cfg)
    super().__init__(data_cfg, split, build, batch_size=batch_size, seed=seed,
                     process_index=process_index, process_count=process_count,
                     documents_fn=documents_fn)

  def __next__(self) -> dict[str, np.ndarray]:
    batch = super().__next__()
    if not self._cfg.next_sentence_prediction:
      del batch['next_sentence_labels']  # objectives/mlm_nsp.py trains NSP iff they are present
    return batch


def synthetic_batch(rng: np.random.Generator, batch_size: int, seq_len: int,
                    max_predictions: int, vocab_size: int) -> dict[str, np.ndarray]:
  """A random batch of the spec above; ids 0..4 are [PAD] [UNK] [CLS] [SEP] [MASK] (sec. 3.1).

  Rows are as full as pretraining's: seq_len tokens, but one in ten (short_seq_prob, 0.1 in
  the reference) of a length drawn from 5..seq_len, so that a benchmark's attention (cuDNN's
  skips padding) does the work a real batch needs.
  """
  if seq_len < 5 or not 1 <= max_predictions <= seq_len:
    raise ValueError(f'synthetic_batch needs seq_len >= 5 and 1 <= max_predictions <= seq_len, '
                     f'got {seq_len} and {max_predictions}.')
  col = np.arange(seq_len)[None, :]
  length = np.where(rng.random((batch_size, 1)) < 0.1,
                    rng.integers(5, seq_len, endpoint=True, size=(batch_size, 1)), seq_len)
  len_a = rng.integers(1, length - 4, endpoint=True)  # leaves B at least one token
  is_sep = (col == len_a + 1) | (col == length - 1)
  real = col < length
  words = rng.integers(_NUM_SYNTHETIC_SPECIAL, vocab_size, (batch_size, seq_len))
  input_ids = np.where(real, words, _SYNTHETIC_PAD)
  input_ids = np.where(col == 0, _SYNTHETIC_CLS, np.where(is_sep, _SYNTHETIC_SEP, input_ids))
  batch = {
      'input_mask': real.astype(np.int32),
      'segment_ids': (real & (col > len_a + 1)).astype(np.int32),
      'next_sentence_labels': rng.integers(0, 2, batch_size).astype(np.int32),
  }
  batch |= create_masked_lm_predictions(
      input_ids, real & (col > 0) & ~is_sep, rng, max_predictions=max_predictions,
      masked_lm_prob=0.15, mask_token_prob=0.8, random_token_prob=0.1, mask_id=_SYNTHETIC_MASK,
      replacement_ids=np.arange(_NUM_SYNTHETIC_SPECIAL, vocab_size))
  return batch


def get_iterator(data_cfg: ml_collections.ConfigDict, split: str, *,
                 tokenizer: tokenizer_lib.WordPieceTokenizer, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1) -> PretrainingIterator:
  """The pipeline entry point that input_pipeline.get_dataset calls by name."""
  return PretrainingIterator(data_cfg, split, tokenizer=tokenizer, batch_size=batch_size,
                             seed=seed, process_index=process_index, process_count=process_count)


def example_batch(data_cfg: ml_collections.ConfigDict, vocab_size: int,
                  batch_size: int) -> dict[str, np.ndarray]:
  """A synthetic batch of this pipeline's spec, for initialization, tests and benchmarks (and
  the train step a later phase compiles ahead): without NSP labels where the pipeline has none."""
  batch = synthetic_batch(np.random.default_rng(0), batch_size, data_cfg.max_seq_length,
                          data_cfg.max_predictions_per_seq, vocab_size)
  if not data_cfg.get('next_sentence_prediction', True):
    del batch['next_sentence_labels']
  return batch
