"""Tests of the BERT pretraining pipeline, Devlin et al. 2018 sec. 3.1 and appendix A.1."""

import functools
import importlib.util
import json
import pathlib

import numpy as np
import pytest

from input_pipeline import bert_pretraining
import input_pipeline

CONFIG_PATH = pathlib.Path(__file__).resolve().parents[1] / 'configs' / 'bert_base.py'
PAD, UNK, CLS, SEP, MASK = range(5)
VOCAB, FIRST_CONTINUATION = 1000, 500


class FakeTokenizer:
  """WordPiece stand-in: a sentence is its ids as text; ids 0..4 special, >= 500 are '##' pieces."""
  vocab_size = VOCAB
  pad_id, unk_id, cls_id, sep_id, mask_id = PAD, UNK, CLS, SEP, MASK
  special_ids = np.arange(5)
  is_continuation = np.arange(VOCAB) >= FIRST_CONTINUATION

  def encode(self, text: str) -> list[int]:
    return [int(token) for token in text.split()]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [self.encode(text) for text in texts]


@functools.cache
def make_documents(num_docs: int, seed: int = 0, max_words: int = 20,
                   max_sentences: int = 12) -> tuple[tuple[str, ...], ...]:
  """Documents of 1..max_sentences sentences (40% have one) of 2..max_words words of 1..3 pieces."""
  rng = np.random.default_rng(seed)
  documents = []
  for _ in range(num_docs):
    num_sentences = 1 if rng.random() < 0.4 else int(rng.integers(2, max_sentences + 1))
    sentences = []
    for num_words in rng.integers(2, max_words + 1, num_sentences):
      # A word: a first piece, then 0, 0, 1 or 2 continuations (drawn a sentence at a time:
      # the statistics test's 3,000 documents took 2.8 s a word at a time).
      continuations = rng.choice([0, 0, 1, 2], num_words)
      starts = np.arange(num_words) + np.cumsum(continuations) - continuations
      tokens = rng.integers(FIRST_CONTINUATION, VOCAB, num_words + continuations.sum())
      tokens[starts] = rng.integers(5, FIRST_CONTINUATION, num_words)
      sentences.append(' '.join(map(str, tokens.tolist())))
    documents.append(tuple(sentences))
  return tuple(documents)


def documents_fn(documents, sharded=True):
  """A sources.documents stand-in over a fixed list, sharded across hosts unless told otherwise."""
  def documents_of(data_cfg, split, process_index=0, process_count=1):
    shard = documents[process_index::process_count] if sharded else documents
    return (list(document) for document in shard)
  return documents_of


@functools.cache
def _config_module():
  spec = importlib.util.spec_from_file_location('bert_base_config', CONFIG_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def data_config(**overrides):
  """configs/bert_base.py:tiny data fields; a misspelled override fails."""
  cfg = _config_module().get_config('tiny').data
  cfg.lock()
  for name, value in overrides.items():
    setattr(cfg, name, value)
  return cfg


def make_iterator(cfg, documents, split='train', batch_size=32, seed=0, **kwargs):
  return bert_pretraining.PretrainingIterator(
      cfg, split, tokenizer=FakeTokenizer(), batch_size=batch_size, seed=seed,
      documents_fn=documents_fn(documents), **kwargs)


def take(iterator, num_batches):
  return [next(iterator) for _ in range(num_batches)]


def concat(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def originals(batch):
  """input_ids with the predicted positions restored to their original tokens."""
  ids = batch['input_ids'].copy()
  rows, slots = np.nonzero(batch['masked_lm_weights'])
  ids[rows, batch['masked_lm_positions'][rows, slots]] = batch['masked_lm_ids'][rows, slots]
  return ids


def assert_batches_equal(expected, actual):
  assert len(expected) == len(actual)
  for want, got in zip(expected, actual):
    assert want.keys() == got.keys()
    for k in want:
      np.testing.assert_array_equal(want[k], got[k], err_msg=k)


def assert_valid_batch(batch, batch_size, length, predictions, nsp=True):
  """The feature spec of bert_pretraining's docstring, [CLS] A [SEP] B [SEP] layout (sec. 3.1)."""
  spec = {
      'input_ids': (np.int32, (batch_size, length)),
      'input_mask': (np.int32, (batch_size, length)),
      'segment_ids': (np.int32, (batch_size, length)),
      'masked_lm_positions': (np.int32, (batch_size, predictions)),
      'masked_lm_ids': (np.int32, (batch_size, predictions)),
      'masked_lm_weights': (np.float32, (batch_size, predictions)),
  }
  if nsp:
    spec['next_sentence_labels'] = (np.int32, (batch_size,))
  assert set(batch) == set(spec)
  for name, (dtype, shape) in spec.items():
    assert batch[name].dtype == dtype and batch[name].shape == shape, name
  ids, mask = batch['input_ids'], batch['input_mask']
  col, rows = np.arange(length), np.arange(batch_size)
  num_real = mask.sum(1)
  np.testing.assert_array_equal(mask, col < num_real[:, None])  # 1 exactly on a prefix
  assert (ids[:, 0] == CLS).all() and (ids[mask == 0] == PAD).all()
  is_sep = ids == SEP
  assert (is_sep.sum(1) == (2 if nsp else 1)).all()
  assert (ids[rows, num_real - 1] == SEP).all()
  first_sep = is_sep.argmax(1)
  assert (first_sep >= 2).all()  # A has a token
  if nsp:
    assert (first_sep <= num_real - 3).all()  # B has a token
  np.testing.assert_array_equal(batch['segment_ids'], (col > first_sep[:, None]) & (mask == 1))
  body = (mask == 1) & (col > 0) & ~is_sep
  assert not np.isin(ids[body], [PAD, CLS]).any()

  weights, positions = batch['masked_lm_weights'], batch['masked_lm_positions']
  count = weights.sum(1).astype(int)
  np.testing.assert_array_equal(weights, np.arange(predictions) < count[:, None])
  assert (positions[weights == 0] == 0).all() and (batch['masked_lm_ids'][weights == 0] == 0).all()
  assert (np.diff(np.where(weights == 1, positions, length + col[:predictions]), axis=1) > 0).all()
  # Never [CLS], [SEP] or padding.
  assert np.take_along_axis(body, positions, axis=1)[weights == 1].all()
  assert (batch['masked_lm_ids'][weights == 1] >= 5).all()
  if nsp:
    assert np.isin(batch['next_sentence_labels'], [0, 1]).all()


def test_masking_and_nsp_statistics():
  """15% of eligible tokens predicted, 80/10/10 corruption, 50% random next (sec. 3.1, A.1)."""
  cfg = data_config(docs_per_chunk=500)
  batch = concat(take(make_iterator(cfg, make_documents(3000), batch_size=500), 24))
  assert_valid_batch(batch, 12000, cfg.max_seq_length, cfg.max_predictions_per_seq)
  eligible = int(batch['input_mask'].sum()) - 3 * len(batch['input_mask'])
  assert eligible >= 100_000
  chosen = batch['masked_lm_weights'] == 1
  assert abs(chosen.sum() / eligible - 0.15) < 0.005
  now = np.take_along_axis(batch['input_ids'], batch['masked_lm_positions'], axis=1)[chosen]
  before = batch['masked_lm_ids'][chosen]
  is_mask, is_kept = now == MASK, now == before
  is_random = ~is_mask & ~is_kept
  assert abs(is_mask.mean() - 0.8) < 0.01
  assert abs(is_random.mean() - 0.1) < 0.01
  assert abs(is_kept.mean() - 0.1) < 0.01
  assert (now[is_random] >= 5).all()  # random replacements come from the non-special vocabulary
  assert abs(batch['next_sentence_labels'].mean() - 0.5) < 0.02


def test_predicted_ids_are_the_original_tokens():
  """With corruption off the input is untouched, so masked_lm_ids must read it back (A.1)."""
  cfg = data_config(docs_per_chunk=200, mask_token_prob=0.0, random_token_prob=0.0)
  batch = next(make_iterator(cfg, make_documents(400), batch_size=256))
  chosen = batch['masked_lm_weights'] == 1
  now = np.take_along_axis(batch['input_ids'], batch['masked_lm_positions'], axis=1)
  np.testing.assert_array_equal(now[chosen], batch['masked_lm_ids'][chosen])


def test_create_masked_lm_predictions_counts_and_corruption():
  """Exactly p * eligible predictions when integral, stochastic rounding otherwise (A.1)."""
  rng = np.random.default_rng(0)
  ids = rng.integers(5, VOCAB, (4000, 24)).astype(np.int32)
  eligible = np.zeros_like(ids, bool)
  eligible[:, 2:22] = True
  kwargs = dict(max_predictions=6, mask_token_prob=0.8, random_token_prob=0.1, mask_id=MASK,
                replacement_ids=np.arange(5, VOCAB))
  out = bert_pretraining.create_masked_lm_predictions(ids, eligible, rng, masked_lm_prob=0.15,
                                                      **kwargs)
  assert (out['masked_lm_weights'].sum(1) == 3).all()  # 20 * 0.15
  chosen = out['masked_lm_weights'] == 1
  np.testing.assert_array_equal(out['masked_lm_ids'][chosen],
                                np.take_along_axis(ids, out['masked_lm_positions'], 1)[chosen])
  untouched = np.ones_like(ids, bool)
  np.put_along_axis(untouched, out['masked_lm_positions'], ~chosen, axis=1)
  np.put_along_axis(untouched, out['masked_lm_positions'][:, :1], False, axis=1)  # slot 0 is real
  np.testing.assert_array_equal(out['input_ids'][untouched], ids[untouched])
  counts = bert_pretraining.create_masked_lm_predictions(
      ids, eligible, rng, masked_lm_prob=0.125, **kwargs)['masked_lm_weights'].sum(1)
  assert set(np.unique(counts)) == {2, 3} and abs(counts.mean() - 2.5) < 0.05  # 20 * 0.125


def test_truncation_matches_the_reference_loop():
  """Kept lengths equal reference truncate_seq_pair's; front or back with even odds."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 80, (2000, 2))
  instances = np.stack([np.zeros(2000, int), lengths[:, 0], np.full(2000, 100),
                        100 + lengths[:, 1], np.zeros(2000, int)], axis=1)
  out = bert_pretraining._truncate(instances, 61, rng)
  for (len_a, len_b), (a0, a1, b0, b1, _) in zip(lengths, out):
    assert 0 <= a0 and a1 <= len_a and 100 <= b0 and b1 <= 100 + len_b  # inside the original spans
    while len_a + len_b > 61:  # the reference, one token at a time
      if len_a > len_b:
        len_a -= 1
      else:
        len_b -= 1
    assert (a1 - a0, b1 - b0) == (len_a, len_b)
  cut_a = lengths[:, 0] - (out[:, 1] - out[:, 0])
  assert abs(out[:, 0].sum() / cut_a.sum() - 0.5) < 0.03


def test_instances_tile_documents_and_draw_random_next_from_others():
  """A and IsNext B cover each document in order; random B is other sentences (sec. 3.1)."""
  documents = [list(d) for d in make_documents(600, seed=3, max_words=6)] + [['', ''], []]
  flat, spans = bert_pretraining.tokenize_documents(documents, FakeTokenizer())
  assert len(spans) == 600  # documents without text are dropped

  def instances(spans, seed):  # long enough that nothing is truncated
    return bert_pretraining.create_instances(
        spans, np.random.default_rng(seed), max_seq_length=512, short_seq_prob=0.3,
        next_sentence_prediction=True).T

  document_starts = np.array([starts[0] for starts, _ in spans])

  def document_of(offsets):
    return np.searchsorted(document_starts, offsets, side='right') - 1

  a_start, a_end, b_start, b_end, label = instances(spans, 0)
  assert (a_end > a_start).all() and (b_end > b_start).all()
  is_next, is_random = label == 0, label == 1
  np.testing.assert_array_equal(a_end[is_next], b_start[is_next])
  # Every segment starts and ends at sentence boundaries, so no surface cue gives the label away.
  sentence_starts = np.concatenate([starts for starts, _ in spans])
  sentence_ends = np.concatenate([ends for _, ends in spans])
  assert np.isin(np.concatenate([a_start, b_start]), sentence_starts).all()
  assert np.isin(np.concatenate([a_end, b_end]), sentence_ends).all()
  # A and IsNext B cover every sentence of the documents that have a next
  # sentence; one-sentence documents are never A.
  covered = np.zeros(len(flat), bool)
  for lo, hi in np.concatenate([np.stack([a_start, a_end], 1),
                                np.stack([b_start, b_end], 1)[is_next]]):
    covered[lo:hi] = True
  multi = np.zeros(len(flat), bool)
  for starts, ends in spans:
    multi[starts[0]:ends[-1]] = len(starts) > 1
  np.testing.assert_array_equal(covered, multi)
  assert not multi.all()  # the data has one-sentence documents...
  assert multi[a_start].all()  # ...and none of them is ever A
  assert (document_of(b_start[is_random]) != document_of(a_start[is_random])).all()
  assert np.isin(b_start[is_random], np.concatenate([starts for starts, _ in spans])).all()
  assert np.isin(b_end[is_random], np.concatenate([ends for _, ends in spans])).all()
  assert np.mean(~np.isin(b_start[is_random], document_starts)) > 0.3  # random start sentence
  assert abs(is_random.mean() - 0.5) < 0.04
  for seed in range(30):  # with few documents, drawing from A's own would show
    a_start, _, b_start, _, label = instances(spans[:3], seed)
    assert (document_of(b_start[label == 1]) != document_of(a_start[label == 1])).all()


@pytest.mark.parametrize('overrides, nsp', [
    ({}, True),
    ({'next_sentence_prediction': False}, False),
    ({'whole_word_masking': True, 'max_seq_length': 64, 'max_predictions_per_seq': 10}, True),
])
def test_batches_follow_the_spec(overrides, nsp):
  """Shapes, dtypes, [CLS]/[SEP] layout, segment ids, mask and positions (sec. 3.1)."""
  cfg = data_config(docs_per_chunk=50, **overrides)
  for batch in take(make_iterator(cfg, make_documents(300), batch_size=64), 8):
    assert_valid_batch(batch, 64, cfg.max_seq_length, cfg.max_predictions_per_seq, nsp)


def test_without_nsp_a_fills_the_sequence():
  """Without NSP, [CLS] A [SEP] fills up to L tokens and batches carry no NSP labels."""
  cfg = data_config(next_sentence_prediction=False, short_seq_prob=0.0, max_seq_length=64)
  batch = concat(take(make_iterator(cfg, make_documents(300)), 10))
  assert batch['input_mask'].sum(1).max() == 64
  assert 'next_sentence_labels' not in batch and (batch['segment_ids'] == 0).all()


def whole_word_violations(batch):
  """Continuation pieces whose prediction differs from the previous piece of their word."""
  ids = originals(batch)
  col = np.arange(ids.shape[1])
  eligible = (batch['input_mask'] == 1) & (col > 0) & (ids != SEP)
  chosen = np.zeros_like(ids, bool)
  np.put_along_axis(chosen, batch['masked_lm_positions'], batch['masked_lm_weights'] == 1, axis=1)
  continues = eligible[:, 1:] & eligible[:, :-1] & (ids[:, 1:] >= FIRST_CONTINUATION)
  return int((continues & (chosen[:, 1:] != chosen[:, :-1])).sum()), int(continues.sum())


def test_whole_word_masking():
  """A '##' piece is predicted iff its word's first piece is (BERT whole-word-masking release)."""
  cfg = data_config(docs_per_chunk=200, whole_word_masking=True)
  batch = concat(take(make_iterator(cfg, make_documents(600), batch_size=200), 5))
  violations, continuations = whole_word_violations(batch)
  assert continuations > 10_000 and violations == 0
  eligible = batch['input_mask'].sum() - 3 * len(batch['input_mask'])
  rate = batch['masked_lm_weights'].sum() / eligible
  # Near 15%: as in the reference, a word that would overshoot is skipped and shorter ones fill.
  assert abs(rate - 0.15) < 0.003
  # The check has teeth: token-level masking splits words.
  cfg = data_config(docs_per_chunk=200, whole_word_masking=False)
  batch = concat(take(make_iterator(cfg, make_documents(600), batch_size=200), 5))
  assert whole_word_violations(batch)[0] > 100


def test_same_seed_same_batches_other_seed_other_batches():
  cfg = data_config(docs_per_chunk=40)
  documents = make_documents(200)
  first = take(make_iterator(cfg, documents, seed=3), 6)
  assert_batches_equal(first, take(make_iterator(cfg, documents, seed=3), 6))
  other = next(make_iterator(cfg, documents, seed=4))
  assert not np.array_equal(first[0]['input_ids'], other['input_ids'])


def test_masks_are_drawn_afresh_each_epoch():
  """Dynamic masking: the same sequences get new masks and a new order in the next epoch."""
  # One sequence per document: no NSP, no short targets, documents shorter than L - 2.
  cfg = data_config(next_sentence_prediction=False, short_seq_prob=0.0)
  documents = make_documents(200, seed=1, max_words=8, max_sentences=4)
  iterator = make_iterator(cfg, documents, batch_size=20)
  epoch0 = concat(take(iterator, 10))
  assert iterator.get_state() == {'epoch': 0, 'chunk': 0, 'offset': 200}
  epoch1 = concat(take(iterator, 10))
  assert iterator.get_state() == {'epoch': 1, 'chunk': 0, 'offset': 200}

  def masks_by_sequence(batch):
    return {originals(batch)[i].tobytes(): batch['masked_lm_positions'][i].tobytes()
            for i in range(len(batch['input_ids']))}
  masks0, masks1 = masks_by_sequence(epoch0), masks_by_sequence(epoch1)
  assert masks0.keys() == masks1.keys() and len(masks0) == 200
  assert np.mean([masks0[k] != masks1[k] for k in masks0]) > 0.8
  assert not np.array_equal(originals(epoch0), originals(epoch1))  # reshuffled


def reference_run(cfg, documents, num_batches, batch_size):
  iterator = make_iterator(cfg, documents, batch_size=batch_size)
  batches, states = [], [iterator.get_state()]
  for _ in range(num_batches):
    batches.append(next(iterator))
    states.append(iterator.get_state())
  return batches, states


def test_exact_resume_across_chunks_and_epochs():
  """Restoring any saved position continues with exactly the uninterrupted batches."""
  cfg = data_config(docs_per_chunk=7, max_seq_length=32, max_predictions_per_seq=5)
  documents = make_documents(40, seed=2)
  batches, states = reference_run(cfg, documents, 45, batch_size=8)
  assert states[-1]['epoch'] >= 2
  spans_chunks = [k for k in range(1, 45) if states[k]['chunk'] != states[k + 1]['chunk']]
  new_epoch = [k for k in range(1, 45) if states[k]['epoch'] != states[k + 1]['epoch']]
  assert spans_chunks and new_epoch
  for k in range(41):
    resumed = make_iterator(cfg, documents, batch_size=8)
    resumed.set_state(json.loads(json.dumps(states[k])))
    assert_batches_equal(batches[k:k + 4], take(resumed, 4))
    assert resumed.get_state() == states[k + 4]


# Slow (16-18 s): tests/test_workers.py's fast tests take BERT's chunks through two workers and
# resume them with another number of workers; this one runs 30 batches and moves the stream.
@pytest.mark.slow
def test_exact_resume_through_worker_processes():
  """Chunks made by 2 grain workers, run ahead of the batches: the same batches and states as
  in this process, and set_state moves a running stream back and forth."""
  cfg = data_config(docs_per_chunk=7, max_seq_length=32, max_predictions_per_seq=5)
  documents = make_documents(40, seed=2)
  batches, states = reference_run(cfg, documents, 30, batch_size=8)
  cfg.workers = 2
  parallel = make_iterator(cfg, documents, batch_size=8)
  for k in range(12):
    assert_batches_equal([batches[k]], [next(parallel)])
    assert parallel.get_state() == states[k + 1]
  for k in (20, 3, 14, 25):
    parallel.set_state(states[k])
    assert parallel.get_state() == states[k]
    assert_batches_equal(batches[k:k + 5], take(parallel, 5))
    assert parallel.get_state() == states[k + 5]
  parallel.close()


def test_hosts_get_different_batches():
  cfg = data_config(docs_per_chunk=20)
  documents = make_documents(100)
  host0 = next(make_iterator(cfg, documents, process_index=0, process_count=2))
  host1 = next(make_iterator(cfg, documents, process_index=1, process_count=2))
  assert not np.array_equal(originals(host0), originals(host1))
  assert not np.array_equal(host0['masked_lm_positions'], host1['masked_lm_positions'])
  # Hosts given the same documents still draw their own pairs, order and masks.
  def unsharded(process_index):
    return bert_pretraining.PretrainingIterator(
        cfg, 'train', tokenizer=FakeTokenizer(), batch_size=32, seed=0,
        process_index=process_index, process_count=2,
        documents_fn=documents_fn(documents, sharded=False))
  assert not np.array_equal(next(unsharded(0))['input_ids'], next(unsharded(1))['input_ids'])


def test_eval_split_repeats_epoch_zero_whatever_the_seed():
  cfg = data_config(docs_per_chunk=50)
  documents = make_documents(20)
  first = take(make_iterator(cfg, documents, split='eval', batch_size=1, seed=1), 120)
  again = make_iterator(cfg, documents, split='eval', batch_size=1, seed=2)
  offsets = []
  for want in first:
    assert_batches_equal([want], [next(again)])
    offsets.append(again.get_state()['offset'])
  assert again.get_state()['epoch'] == 0
  period = max(offsets)  # examples in the one chunk
  ids = np.stack([b['input_ids'][0] for b in first])
  assert 2 * period <= len(ids) and np.array_equal(ids[period:2 * period], ids[:period])


def test_an_eval_that_reads_past_the_eval_split_says_so_once(caplog):
  cfg = data_config(docs_per_chunk=50)
  examples = take(make_iterator(cfg, make_documents(20), split='eval', batch_size=1), 400)
  n = next(i for i in range(1, 400) if np.array_equal(examples[i]['input_ids'],
                                                      examples[0]['input_ids']))  # the split's
  evals = make_iterator(cfg, make_documents(20), split='eval', batch_size=8)
  start = evals.get_state()
  caplog.clear()  # (the iterator above read past the split too)
  with caplog.at_level('WARNING'):
    for _ in range(3):  # evals that rewind, each within the split
      evals.set_state(start)
      take(evals, 2)
    assert not [r for r in caplog.records if 'eval split' in r.getMessage()]
    for _ in range(2):
      evals.set_state(start)
      take(evals, n // 8 + 2)  # past the end, twice
  said = [r.getMessage() for r in caplog.records if 'eval split' in r.getMessage()]
  assert len(said) == 1 and said[0].startswith(f'An eval read all {n} examples'), said
  assert f'set train.eval_steps to {n // 8} or fewer' in said[0]


def test_user_errors_are_one_line():
  with pytest.raises(ValueError, match='has no text'):
    next(make_iterator(data_config(), ()))
  with pytest.raises(ValueError, match='has no text'):
    next(make_iterator(data_config(), (('',), ('', ''))))
  # Text, but no document of two sentences for NSP to pair: the message says so.
  one_line = tuple((doc[0],) for doc in make_documents(30))
  with pytest.raises(ValueError, match='no document of two sentences or more for next '
                     r'sentence prediction .*data.next_sentence_prediction=False'):
    next(make_iterator(data_config(docs_per_chunk=10), one_line))
  next(make_iterator(data_config(docs_per_chunk=10, next_sentence_prediction=False), one_line))
  with pytest.raises(ValueError, match='max_predictions_per_seq'):
    make_iterator(data_config(max_predictions_per_seq=500), make_documents(5))
  resumed = make_iterator(data_config(docs_per_chunk=2), make_documents(5))
  resumed.set_state({'epoch': 0, 'chunk': 9, 'offset': 0})
  with pytest.raises(ValueError, match='past the end'):
    next(resumed)


def test_get_dataset_entry_point(monkeypatch):
  from input_pipeline.common import sources
  monkeypatch.setattr(sources, 'documents', documents_fn(make_documents(50)))
  cfg = data_config(docs_per_chunk=10)
  dataset = input_pipeline.get_dataset(cfg, 'train', tokenizer=FakeTokenizer(), batch_size=16,
                                       seed=0)
  plain = make_iterator(cfg, make_documents(50), batch_size=16)
  for _ in range(3):
    assert_batches_equal([next(plain)], [next(dataset)])
    assert dataset.get_state() == plain.get_state()
  dataset.close()
  example = input_pipeline.example_batch(cfg, 300, batch_size=4)
  assert_valid_batch(example, 4, cfg.max_seq_length, cfg.max_predictions_per_seq)
  cfg.pipeline = 'bilm_typo'
  with pytest.raises(ValueError, match='Unknown data.pipeline'):
    input_pipeline.get_dataset(cfg, 'train', tokenizer=FakeTokenizer(), batch_size=16, seed=0)


def test_synthetic_batch_follows_the_spec():
  rng = np.random.default_rng(0)
  for length, predictions in ((5, 1), (16, 3), (128, 20)):
    batch = bert_pretraining.synthetic_batch(rng, 64, length, predictions, vocab_size=300)
    assert_valid_batch(batch, 64, length, predictions)
    assert (batch['input_ids'] < 300).all()
  assert (batch['input_mask'] == 0).any() and (batch['masked_lm_weights'] == 0).any()
  # As full as pretraining's rows (bench.py times it): 1 in 10 short (short_seq_prob).
  mask = bert_pretraining.synthetic_batch(rng, 256, 128, 20, vocab_size=300)['input_mask']
  assert 0.9 < mask.mean() < 0.99 and 0.8 < mask.all(axis=1).mean() < 0.97
