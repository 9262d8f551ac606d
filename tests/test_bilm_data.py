"""Tests of ELMo's words, char ids and biLM pretraining windows (Peters et al. 2018, sec. 3)."""

import collections
import os

import ml_collections
import numpy as np
import pytest

from input_pipeline import bilm
import input_pipeline
from input_pipeline.common import sources
from input_pipeline.common import words as words_lib

FIELDS = {'token_ids': np.int32, 'char_ids': np.int32, 'lengths': np.int32,
          'next_ids': np.int32, 'prev_ids': np.int32}
UNK = 2
# bilm-tf's first three words, then 'the' (3 times), 'cat' (2) and the rest once, in order.
TEXTS = ['The cat sat on the mat.', 'the cat, the end']
VOCAB = ['<S>', '</S>', '<UNK>', 'the', 'cat', 'The', 'sat', 'on', 'mat', '.', ',', 'end']


def write_documents(path, documents) -> str:
  """The reference format: one sentence per line, a blank line after each document."""
  path.write_text(''.join(''.join(s + '\n' for s in doc) + '\n' for doc in documents),
                  encoding='utf-8')
  return str(path)


def data_config(tmp_path, documents=(), **overrides):
  """A bilm data config reading `documents` (lists of sentences) from a text file."""
  cfg = ml_collections.ConfigDict(dict(
      pipeline='bilm', source='files', files=write_documents(tmp_path / 'train.txt', documents),
      eval_files=write_documents(tmp_path / 'eval.txt', [['An eval sentence.']]), tfds_name='',
      tfds_split='train', tfds_eval_split='', tfds_text_feature='text', tfds_data_dir='',
      eval_holdout=100, data_dir=str(tmp_path / 'cache'), tokenizer='words', vocab_file='',
      lower_case=False, max_seq_length=5, max_characters_per_token=8, docs_per_chunk=100))
  cfg.update(overrides)
  return cfg


@pytest.fixture
def vocab(tmp_path):
  return words_lib.WordVocab(words_lib.learn_word_vocab(TEXTS, 100, str(tmp_path / 'words.txt')))


# Words and character ids (words.py).


def test_word_tokens_split_punctuation_and_keep_pretokenized_words():
  assert words_lib.word_tokens('Dr. Smith\'s "state-of-the-art" os.path (v3.11), e.g. 50%!') == [
      'Dr', '.', "Smith's", '"', 'state-of-the-art', '"', 'os.path', '(', 'v3.11', ')', ',',
      'e.g.', '50', '%', '!']
  # Some pre-tokenized tokens stay whole, others not: such text is read with 'spaces'.
  text = "The U.S.-based firm ca n't say it 's 1,000 ... in the '90s -- done ."
  assert words_lib.word_tokens(text) == [
      'The', 'U.S.', '-', 'based', 'firm', 'ca', "n't", 'say', 'it', "'s", '1', ',', '000', '.',
      '.', '.', 'in', 'the', "'", '90s', '-', '-', 'done', '.']
  assert words_lib.word_tokens(text, 'spaces') == text.split()


def test_learned_vocab_has_the_specials_then_words_by_frequency(vocab, tmp_path):
  with open(vocab.vocab_file, encoding='utf-8') as f:
    assert f.read().splitlines() == VOCAB
  assert vocab.vocab_size == len(VOCAB)
  assert (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id) == (0, 1, 2, 0)
  # Asked for fewer: the most frequent words.
  small = words_lib.learn_word_vocab(TEXTS, 5, str(tmp_path / 'small.txt'))
  assert words_lib.WordVocab(small).vocab_size == 5 and open(small).read().split()[3:] == [
      'the', 'cat']
  with pytest.raises(ValueError, match='vocab_size=3 leaves no room'):
    words_lib.learn_word_vocab(TEXTS, 3, str(tmp_path / 'tiny.txt'))


def test_unknown_words_are_unk(vocab):
  np.testing.assert_array_equal(vocab.ids(['the', 'dog', 'The', 'THE', '<S>']), [3, 2, 5, 2, 0])
  assert vocab.encode('The dog sat.') == [5, 2, 6, 9]
  assert vocab.word(4) == 'cat'


def test_char_ids_follow_the_table():
  ids = words_lib.char_ids(['ab', '<S>', '</S>', 'é', 'abcdefgh', 'ab'], 6)
  np.testing.assert_array_equal(ids, [
      [259, 98, 99, 260, 261, 261],  # bytes + 1 between begin and end of word
      [259, 257, 260, 261, 261, 261],
      [259, 258, 260, 261, 261, 261],
      [259, 0xC3 + 1, 0xA9 + 1, 260, 261, 261],  # two utf-8 bytes
      [259, 98, 99, 100, 101, 260],  # cut to W - 2 bytes, the end marker kept
      [259, 98, 99, 260, 261, 261]])
  assert ids.dtype == np.int32
  assert words_lib.char_ids([], 6).shape == (0, 6)


def test_frame_sentences(vocab):
  token_ids, char_ids, lengths = vocab.frame_sentences([['the', 'dog'], ['end']], 8)
  np.testing.assert_array_equal(token_ids, [0, 3, 2, 1, 0, 11, 1])
  np.testing.assert_array_equal(lengths, [4, 3])
  # The unknown word keeps its own characters.
  np.testing.assert_array_equal(char_ids[2], [259, 101, 112, 104, 260, 261, 261, 261])
  np.testing.assert_array_equal(char_ids[[0, 3]], words_lib.char_ids(['<S>', '</S>'], 8))
  one_ids, one_chars = vocab.sentence(['the', 'dog'], 8)
  np.testing.assert_array_equal(one_ids, token_ids[:4])
  np.testing.assert_array_equal(one_chars, char_ids[:4])


def test_bad_vocabulary_files_are_rejected(tmp_path):
  wordpiece = tmp_path / 'vocab.txt'
  wordpiece.write_text('[PAD]\n[UNK]\n[CLS]\nthe\n')
  with pytest.raises(ValueError, match='is not a word vocabulary'):
    words_lib.WordVocab(str(wordpiece))
  repeated = tmp_path / 'repeated.txt'
  repeated.write_text('<S>\n</S>\n<UNK>\nthe\ncat\nthe\n')
  with pytest.raises(ValueError, match="lists 'the' twice"):
    words_lib.WordVocab(str(repeated))
  with pytest.raises(ValueError, match='not found'):
    words_lib.WordVocab(str(tmp_path / 'missing.txt'))


def test_get_tokenizer_learns_caches_and_reloads_words(tmp_path, monkeypatch):
  cfg = data_config(tmp_path, [[TEXTS[0]], [TEXTS[1]]])
  vocab = sources.get_tokenizer(cfg, 50)
  assert isinstance(vocab, words_lib.WordVocab) and vocab.vocab_size == len(VOCAB)
  [name] = os.listdir(tmp_path / 'cache' / 'vocab')
  assert name.startswith('files-train-') and name.endswith('-words-50-cased.txt')
  monkeypatch.setattr(words_lib, 'learn_word_vocab', None)  # must reuse the cache
  cfg.lower_case = True  # ignored: ELMo is cased
  assert sources.get_tokenizer(cfg, 50).vocab_file == vocab.vocab_file
  saved = tmp_path / 'run'
  saved.mkdir()
  (saved / 'words.txt').write_text('<S>\n</S>\n<UNK>\nzebra\n')
  assert input_pipeline.get_tokenizer(cfg, 50, str(saved)).word(3) == 'zebra'
  cfg.tokenizer = 'wordpiece'
  with pytest.raises(ValueError, match='has no vocab.txt'):
    sources.get_tokenizer(cfg, 50, str(saved))
  cfg.tokenizer = 'chars'
  with pytest.raises(ValueError, match="or 'words' \\(ELMo\\)"):
    sources.get_tokenizer(cfg, 50)


def test_text_tokenized_already_keeps_its_tokens_in_the_vocabulary_and_the_rows(tmp_path):
  # lm1b's '1,000' is one word to bilm-tf: data.split_words='spaces' learns it as one, in a
  # vocabulary cached apart from the punctuation-split one, and reads the rows the same way.
  cfg = data_config(tmp_path, [['It cost 1,000 dollars .'], ['1,000 more .']],
                    split_words='spaces')
  vocab = sources.get_tokenizer(cfg, 50)
  assert vocab.vocab_file.endswith('-words-50-cased-spaces.txt') and '1,000' in vocab.words
  rows = bilm.build_rows([['1,000 more .']], _InOrder(), vocab=vocab, length=5,
                         max_characters=8)
  assert [vocab.word(i) for i in rows['token_ids'][0]] == ['<S>', '1,000', 'more', '.', '</S>']
  saved = tmp_path / 'run'
  saved.mkdir()
  (saved / 'words.txt').write_text('<S>\n</S>\n<UNK>\n1,000\n')
  assert input_pipeline.get_tokenizer(cfg, 50, str(saved)).encode('1,000 x') == [3, 2]
  cfg.split_words = 'regex'
  with pytest.raises(ValueError, match="data.split_words='regex': use 'punctuation'"):
    bilm.check_config(ml_collections.ConfigDict({'data': cfg, 'train': {'batch_size': 2}}))


# Windows of the sentence stream (bilm.py).


class _InOrder:
  """An rng whose permutations are the identity, to see the rows before shuffling."""

  def permutation(self, n):
    return np.arange(n)


def test_rows_are_the_framed_stream_cut_in_order(vocab):
  documents = [['The cat sat.', 'the end'], ['', 'cat dog']]
  rows = bilm.build_rows(documents, _InOrder(), vocab=vocab, length=5, max_characters=8)
  # <S> The cat sat . </S> <S> the end </S> <S> cat dog </S>: 14 tokens.
  np.testing.assert_array_equal(rows['token_ids'], [[0, 5, 4, 6, 9],
                                                    [1, 0, 3, 11, 1],
                                                    [0, 4, 2, 1, 0]])
  np.testing.assert_array_equal(rows['lengths'], [5, 5, 4])
  # Each row's neighbours in the stream, -1 at the chunk's ends.
  np.testing.assert_array_equal(rows['next_ids'], [1, 0, -1])
  np.testing.assert_array_equal(rows['prev_ids'], [-1, 9, 1])
  assert {k: v.dtype for k, v in rows.items()} == FIELDS
  np.testing.assert_array_equal(rows['char_ids'][2, 2], words_lib.char_ids(['dog'], 8)[0])
  assert not rows['char_ids'][2, 4].any()
  empty = bilm.build_rows([['']], _InOrder(), vocab=vocab, length=5, max_characters=8)
  assert empty['char_ids'].shape == (0, 5, 8) and empty['lengths'].shape == (0,)


def assert_valid_rows(batch, length, width):
  """The spec: dtypes, shapes, zeros at padding, the same chars for the same word id."""
  assert {k: v.dtype for k, v in batch.items()} == FIELDS
  size = len(batch['lengths'])
  assert batch['token_ids'].shape == (size, length)
  assert batch['char_ids'].shape == (size, length, width)
  real = np.arange(length) < batch['lengths'][:, None]
  assert (batch['lengths'] >= 1).all() and (batch['lengths'] <= length).all()
  assert not batch['token_ids'][~real].any() and not batch['char_ids'][~real].any()
  assert (batch['char_ids'][real][:, 0] == words_lib.BOW_CHAR).all()
  chars_of = {}
  for token, chars in zip(batch['token_ids'][real], batch['char_ids'][real]):
    if token != UNK:  # different words
      np.testing.assert_array_equal(chars_of.setdefault(int(token), chars), chars)


def _sentences(num_docs, seed=0):
  """Documents of 1..3 sentences of 1..9 words of a 30-word language."""
  rng = np.random.default_rng(seed)
  return [[' '.join(f'w{i}' for i in rng.integers(0, 30, rng.integers(1, 10)))
           for _ in range(rng.integers(1, 4))] for _ in range(num_docs)]


def test_an_epoch_inputs_every_token_of_the_stream_once(tmp_path):
  documents = _sentences(40)
  cfg = data_config(tmp_path, documents, max_seq_length=7, docs_per_chunk=15)
  vocab = sources.get_tokenizer(cfg, 25)  # some of the 30 words are <UNK>
  it = bilm.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=1, seed=0)
  rows = []
  while it.get_state()['epoch'] == 0:
    rows.append(next(it))
  rows = {k: np.concatenate([row[k] for row in rows[:-1]]) for k in rows[0]}
  assert_valid_rows(rows, 7, 8)
  stream = [w for doc in documents for s in doc for w in ['<S>', *s.split(), '</S>']]
  real = np.arange(7) < rows['lengths'][:, None]
  assert collections.Counter(rows['token_ids'][real].tolist()) == collections.Counter(
      vocab.ids(stream).tolist())
  # Rows are full but the last of each of the 3 chunks.
  assert (rows['lengths'] < 7).sum() <= 3


def test_rows_are_shuffled_within_a_chunk_by_the_seed(tmp_path, vocab):
  documents = _sentences(20)
  build = dict(vocab=vocab, length=4, max_characters=8)
  in_order = bilm.build_rows(documents, _InOrder(), **build)['token_ids']
  shuffled = [bilm.build_rows(documents, np.random.default_rng(seed), **build)['token_ids']
              for seed in (0, 1)]
  for rows in shuffled:
    assert sorted(map(tuple, rows)) == sorted(map(tuple, in_order))
    assert not np.array_equal(rows, in_order)
  assert not np.array_equal(*shuffled)
  cfg = data_config(tmp_path, documents, max_seq_length=4)
  first = [next(bilm.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=8, seed=seed))
           for seed in (0, 1)]
  assert not np.array_equal(first[0]['token_ids'], first[1]['token_ids'])


def test_resume_gives_the_same_batches(tmp_path):
  cfg = data_config(tmp_path, _sentences(12), max_seq_length=6, docs_per_chunk=5)
  vocab = sources.get_tokenizer(cfg, 40)
  it = bilm.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=4, seed=3)
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(12)]  # crosses chunks and an epoch
  resumed = bilm.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=4, seed=3)
  resumed.set_state(state)
  np.testing.assert_equal([next(resumed) for _ in expected], expected)
  assert resumed.get_state()['epoch'] == 1


def test_example_batch_matches_the_spec(tmp_path):
  cfg = data_config(tmp_path, max_seq_length=9, max_characters_per_token=6)
  batch = input_pipeline.example_batch(cfg, 50, batch_size=6)
  assert_valid_rows(batch, 9, 6)
  assert batch['lengths'][0] == 9 and (batch['lengths'] < 9).any()
  real = np.arange(9) < batch['lengths'][:, None]
  assert (batch['token_ids'][real] < 50).all()
  assert (batch['token_ids'][:, 0] == 0).all()  # rows start with <S>
  np.testing.assert_array_equal(batch['char_ids'][0, 0], [259, 257, 260, 261, 261, 261])


def test_bad_settings_name_the_fix(tmp_path):
  with pytest.raises(ValueError, match='max_seq_length=1 .*use 2 or more'):
    bilm.example_batch(data_config(tmp_path, max_seq_length=1), 50, 2)
  with pytest.raises(ValueError, match='max_characters_per_token=2 .*use 3 or more'):
    bilm.example_batch(data_config(tmp_path, max_characters_per_token=2), 50, 2)
  with pytest.raises(ValueError, match='vocab_size=3 leaves no ids'):
    bilm.example_batch(data_config(tmp_path), 3, 2)
