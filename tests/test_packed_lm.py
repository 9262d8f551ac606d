"""Tests of the packed LM pretraining pipeline (Radford et al. 2018, sec. 4.1: contiguous text).

Documents are written as text files of integers; FakeTokenizer reads each
word as its id, so the expected rows can be written by hand.
"""

import json
import os
import shutil
import time

import numpy as np
import pytest

from configs import gpt
from input_pipeline import packed_lm
import input_pipeline
from input_pipeline.common import sources

PAD, EOT = 0, 1
FIELDS = ('input_ids', 'targets', 'weights', 'segment_ids', 'positions')


class FakeTokenizer:
  """A word is its id; ids 0..4 are the BPE specials."""
  pad_id, eot_id, start_id, delim_id, extract_id = range(5)
  vocab_size = 10_000

  def encode(self, text: str) -> list[int]:
    return [int(word) for word in text.split()]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [self.encode(text) for text in texts]


def write_documents(path, documents) -> str:
  """The reference format: one sentence per line, a blank line after each document."""
  path.write_text(''.join(''.join(' '.join(map(str, s)) + '\n' for s in doc) + '\n'
                          for doc in documents), encoding='utf-8')
  return str(path)


def data_config(tmp_path, train_docs, eval_docs=([[9]],), **overrides):
  cfg = gpt.get_config('tiny').data
  cfg.update(dict(source='files', files=write_documents(tmp_path / 'train.txt', train_docs),
                  eval_files=write_documents(tmp_path / 'eval.txt', eval_docs),
                  data_dir=str(tmp_path / 'cache')))
  cfg.update(overrides)
  return cfg


def make_iterator(cfg, split='train', batch_size=1, seed=0, **kwargs):
  return packed_lm.get_iterator(cfg, split, tokenizer=FakeTokenizer(), batch_size=batch_size,
                                seed=seed, **kwargs)


def random_documents(num_docs, seed=0, first_id=5):
  """Documents of 1..4 sentences of 1..30 tokens; every token id is used once."""
  rng = np.random.default_rng(seed)
  next_id, documents = first_id, []
  for _ in range(num_docs):
    document = []
    for _ in range(rng.integers(1, 5)):
      length = int(rng.integers(1, 31))
      document.append(list(range(next_id, next_id + length)))
      next_id += length
    documents.append(document)
  return documents


def one_epoch(iterator):
  """The rows of epoch 0 (batch size 1), in order."""
  rows = []
  while True:
    row = next(iterator)
    if iterator.get_state()['epoch'] > 0:
      return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    rows.append(row)


def assert_valid_rows(batch, length):
  """The LM batch spec: dtypes, shapes, pieces, positions, and where targets may be."""
  assert set(batch) == set(FIELDS)
  for name in FIELDS:
    dtype = np.float32 if name == 'weights' else np.int32
    assert batch[name].dtype == dtype and batch[name].shape[1:] == (length,), name
  ids, targets, weights = batch['input_ids'], batch['targets'], batch['weights']
  segments, positions = batch['segment_ids'], batch['positions']
  assert np.isin(weights, [0, 1]).all() and (targets[weights == 0] == 0).all()
  padding = segments == 0
  assert (ids[padding] == PAD).all() and (weights[padding] == 0).all()
  assert (positions[padding] == 0).all()
  assert not (padding[:, :-1] & ~padding[:, 1:]).any()  # padding only at the end of a row
  # Pieces number 1, 2, ... from the left; positions count from 0 within each.
  steps = np.diff(segments, axis=1)
  same = steps == 0
  assert (segments[:, 0] == 1).all() and np.isin(steps[~padding[:, 1:]], [0, 1]).all()
  np.testing.assert_array_equal(positions[:, 1:][same & ~padding[:, 1:]],
                                positions[:, :-1][same & ~padding[:, 1:]] + 1)
  assert (positions[:, 1:][~same] == 0).all()
  # Inside a row, a weighted target is the next input of the same piece.
  inner = weights[:, :-1] == 1
  np.testing.assert_array_equal(targets[:, :-1][inner], ids[:, 1:][inner])
  assert same[inner].all()


def test_hand_packed_rows(tmp_path):
  """[eot] doc [eot] concatenated in order, cut into rows of 6; padding only at the chunk's end."""
  documents = [[[10, 11], [12]], [[20]], [[30, 31, 32], [33]]]
  cfg = data_config(tmp_path, documents, max_seq_length=6, docs_per_chunk=10)
  expected = {
      'input_ids': [[1, 10, 11, 12, 1, 1], [20, 1, 1, 30, 31, 32], [33, 1, 0, 0, 0, 0]],
      # The last token of a row is trained on the first of the next when the document goes on.
      'targets': [[10, 11, 12, 1, 0, 20], [1, 0, 30, 31, 32, 33], [1, 0, 0, 0, 0, 0]],
      'weights': [[1, 1, 1, 1, 0, 1], [1, 0, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]],
      'segment_ids': [[1, 1, 1, 1, 1, 2], [1, 1, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]],
      'positions': [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3], [0, 1, 0, 0, 0, 0]],
  }
  batch = next(make_iterator(cfg, batch_size=3))
  assert_valid_rows(batch, 6)
  # Rows are shuffled: find each expected row by its tokens.
  order = [next(i for i, row in enumerate(batch['input_ids']) if row.tolist() == want)
           for want in expected['input_ids']]
  for name, want in expected.items():
    np.testing.assert_array_equal(batch[name][order], want, err_msg=name)

  # Two documents per chunk: each chunk is cut on its own and its last row padded.
  cfg = data_config(tmp_path, documents, max_seq_length=6, docs_per_chunk=2)
  iterator = make_iterator(cfg, batch_size=3)
  batch = next(iterator)
  assert iterator.get_state() == {'epoch': 0, 'chunk': 1, 'offset': 1}
  first_chunk = sorted(batch['input_ids'][:2].tolist())
  assert first_chunk == [[1, 10, 11, 12, 1, 1], [20, 1, 0, 0, 0, 0]]
  for name, want in (('input_ids', [1, 30, 31, 32, 33, 1]), ('targets', [30, 31, 32, 33, 1, 0]),
                     ('weights', [1, 1, 1, 1, 1, 0]), ('segment_ids', [1] * 6),
                     ('positions', range(6))):
    np.testing.assert_array_equal(batch[name][2], want, err_msg=name)


@pytest.mark.parametrize('length, docs_per_chunk', [(16, 7), (64, 100), (2, 3)])
def test_an_epoch_holds_every_token_once(tmp_path, length, docs_per_chunk):
  """Each token is input once per epoch; each weighted target is its true next token (sec. 4.1)."""
  documents = random_documents(40)
  cfg = data_config(tmp_path, documents, max_seq_length=length, docs_per_chunk=docs_per_chunk)
  rows = one_epoch(make_iterator(cfg))
  assert_valid_rows(rows, length)
  ids, targets, weights = rows['input_ids'], rows['targets'], rows['weights']
  words = [token for document in documents for sentence in document for token in sentence]
  np.testing.assert_array_equal(np.sort(ids[ids >= 5]), words)
  assert (ids == EOT).sum() == 2 * len(documents)
  # Successor of each token in its framed document; a leading eot is followed by the first word.
  successor = {}
  for document in documents:
    tokens = [token for sentence in document for token in sentence] + [EOT]
    successor.update(zip(tokens[:-1], tokens[1:]))
  weighted = weights == 1
  word_inputs = weighted & (ids >= 5)
  assert word_inputs.sum() == len(words)  # every word predicts its successor
  np.testing.assert_array_equal(targets[word_inputs], [successor[t] for t in ids[word_inputs]])
  # Leading eots predict each document's first word; trailing eots and padding predict nothing.
  np.testing.assert_array_equal(np.sort(targets[weighted & (ids == EOT)]),
                                sorted(document[0][0] for document in documents))
  assert (~weighted & (ids == EOT)).sum() == len(documents)
  assert weights.sum() == len(words) + len(documents)
  # Padding: at most one row per chunk, and only that row's end.
  num_chunks = -(-len(documents) // docs_per_chunk)
  assert (rows['segment_ids'] == 0).any(axis=1).sum() <= num_chunks


def test_row_order_depends_on_seed_and_epoch_not_the_rows(tmp_path):
  """The packing of a chunk is fixed; its rows are reshuffled per seed and per epoch."""
  cfg = data_config(tmp_path, random_documents(40), max_seq_length=16, docs_per_chunk=40)
  epoch0 = one_epoch(make_iterator(cfg, seed=3))['input_ids']
  np.testing.assert_array_equal(epoch0, one_epoch(make_iterator(cfg, seed=3))['input_ids'])
  other_seed = one_epoch(make_iterator(cfg, seed=4))['input_ids']
  iterator = make_iterator(cfg, seed=3)
  iterator.set_state({'epoch': 1, 'chunk': 0, 'offset': 0})
  epoch1 = np.concatenate([next(iterator)['input_ids'] for _ in range(len(epoch0))])
  for rows in (other_seed, epoch1):
    assert not np.array_equal(rows, epoch0)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, epoch0.tolist()))


def test_exact_resume_across_chunks_and_epochs(tmp_path):
  """Restoring any saved position continues with exactly the uninterrupted batches."""
  cfg = data_config(tmp_path, random_documents(30, seed=2), max_seq_length=16, docs_per_chunk=7)
  iterator = make_iterator(cfg, batch_size=8)
  batches, states = [], [iterator.get_state()]
  for _ in range(40):
    batches.append(next(iterator))
    states.append(iterator.get_state())
  assert states[-1]['epoch'] >= 2
  assert any(a['chunk'] != b['chunk'] and a['epoch'] == b['epoch']
             for a, b in zip(states[1:], states[2:]))
  for k in range(0, 37):
    resumed = make_iterator(cfg, batch_size=8)
    resumed.set_state(json.loads(json.dumps(states[k])))
    for want in batches[k:k + 3]:
      got = next(resumed)
      for name in FIELDS:
        np.testing.assert_array_equal(want[name], got[name], err_msg=f'{k} {name}')
    assert resumed.get_state() == states[k + 3]


def test_hosts_get_disjoint_rows(tmp_path):
  """Each host packs only its own documents (sources shards them), so no row is shared."""
  documents = random_documents(41, seed=5)
  cfg = data_config(tmp_path, documents, max_seq_length=32, docs_per_chunk=5)
  words = []
  for process_index in range(2):
    rows = one_epoch(make_iterator(cfg, process_index=process_index, process_count=2))
    host_words = np.sort(rows['input_ids'][rows['input_ids'] >= 5])
    expected = [t for document in documents[process_index::2] for s in document for t in s]
    np.testing.assert_array_equal(host_words, expected)
    words.append(set(host_words.tolist()))
  assert not words[0] & words[1]


def test_eval_repeats_the_same_rows_whatever_the_seed(tmp_path):
  eval_docs = random_documents(12, seed=9)
  cfg = data_config(tmp_path, random_documents(10), eval_docs=eval_docs, max_seq_length=16,
                    docs_per_chunk=5)
  iterator = make_iterator(cfg, 'eval', seed=1)
  rows = [next(iterator)['input_ids'], next(iterator)['input_ids']]
  while iterator.get_state() != {'epoch': 0, 'chunk': 0, 'offset': 1}:  # back at the first row
    rows.append(next(iterator)['input_ids'])
  one_pass = np.concatenate(rows[:-1])
  words = [t for document in eval_docs for s in document for t in s]
  np.testing.assert_array_equal(np.sort(one_pass[one_pass >= 5]), words)
  np.testing.assert_array_equal(rows[-1], rows[0])
  other_seed = make_iterator(cfg, 'eval', batch_size=len(one_pass), seed=2)
  for _ in range(2):
    np.testing.assert_array_equal(next(other_seed)['input_ids'], one_pass)


@pytest.mark.parametrize('overrides, batch_size, match', [
    ({'max_seq_length': 1}, 4, 'max_seq_length=1'),
    ({'docs_per_chunk': 0}, 4, 'docs_per_chunk=0'),
    ({}, 0, 'host batch size is 0'),
])
def test_bad_config_is_one_line(tmp_path, overrides, batch_size, match):
  cfg = data_config(tmp_path, random_documents(3), **overrides)
  with pytest.raises(ValueError, match=match) as error:
    make_iterator(cfg, batch_size=batch_size)
  assert '\n' not in str(error.value)


def test_example_batch_follows_the_spec():
  cfg = gpt.get_config('tiny').data
  for length in (2, 8, 128):
    cfg.max_seq_length = length
    batch = packed_lm.example_batch(cfg, 300, 16)
    assert_valid_rows(batch, length)
    assert batch['input_ids'].shape == (16, length)
    ids = batch['input_ids']
    assert ((ids == EOT) | ((ids >= 5) & (ids < 300))).all()  # ids 0, 2, 3, 4 never appear
  # Long rows hold two whole documents and the start of a third.
  assert (batch['segment_ids'].max(axis=1) == 3).all()
  assert (batch['weights'].sum(axis=1) == length - 2).all()  # no target after the 2 trailing eots


def test_get_dataset_runs_the_pipeline_by_name(tmp_path):
  cfg = data_config(tmp_path, random_documents(20), max_seq_length=16, docs_per_chunk=7)
  cfg.pipeline = 'packed_lm'
  dataset = input_pipeline.get_dataset(cfg, 'train', tokenizer=FakeTokenizer(), batch_size=4,
                                       seed=0)
  plain = make_iterator(cfg, batch_size=4)
  for _ in range(5):
    want, got = next(plain), next(dataset)
    for name in FIELDS:
      np.testing.assert_array_equal(want[name], got[name])
  example = input_pipeline.example_batch(cfg, 300, batch_size=2)
  assert set(example) == set(FIELDS) and example['input_ids'].shape == (2, 16)


def test_embedded_corpus_with_learned_bpe(tmp_path, shared_data_dir):
  """The default setup end to end: a byte-level BPE learned on the embedded corpus, packed."""
  # The corpus as the run's data directory has it, built once for the tests (its building is
  # test_sources'), and the vocabulary learned here.
  corpus = sources.embedded_corpus(shared_data_dir)
  os.makedirs(tmp_path / 'embedded')
  shutil.copy(corpus, tmp_path / 'embedded' / os.path.basename(corpus))
  started = time.time()
  cfg = gpt.get_config('tiny').data
  cfg.update(dict(data_dir=str(tmp_path), max_seq_length=64, docs_per_chunk=50))
  tokenizer = sources.get_tokenizer(cfg, 1024)
  iterator = packed_lm.get_iterator(cfg, 'train', tokenizer=tokenizer, batch_size=64, seed=0)
  batch = next(iterator)
  print(f'BPE learned and first batch in {time.time() - started:.1f} s')
  assert_valid_rows(batch, 64)
  assert batch['weights'].mean() > 0.9
  # A piece that holds a whole document decodes to that document's text exactly.
  texts = {sources.document_text(d) for d in sources.documents(cfg, 'train')}
  whole = 0
  for ids, segments in zip(batch['input_ids'], batch['segment_ids']):
    for segment in range(1, segments.max() + 1):
      piece = ids[segments == segment]
      if len(piece) > 2 and piece[0] == piece[-1] == tokenizer.eot_id:
        whole += 1
        assert tokenizer.decode(piece) in texts
  assert whole > 0
