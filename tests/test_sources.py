"""Tests of the document sources: text files, TFDS (mocked), the embedded corpus, vocabularies."""

import os
import sys
import time
import types

import pytest

from configs import bert_base
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib

# Documents 0..4 across two files in the reference format.
A_TXT = ('Doc zero, sentence one.\nDoc zero, sentence two.\n\n\n'
         '  Doc one has one sentence.  \n\nDoc two, first.\nDoc two, second.\n'
         'Doc two, third.\n')
B_TXT = 'Doc three.\n\nDoc four, a.\nDoc four, b.\n\n'
DOCS = [['Doc zero, sentence one.', 'Doc zero, sentence two.'],
        ['Doc one has one sentence.'],
        ['Doc two, first.', 'Doc two, second.', 'Doc two, third.'],
        ['Doc three.'],
        ['Doc four, a.', 'Doc four, b.']]


def _data_cfg(tmp_path, **overrides):
  data_cfg = bert_base.get_config('tiny').data
  data_cfg.data_dir = str(tmp_path / 'cache')
  data_cfg.update(overrides)
  return data_cfg


@pytest.fixture
def corpus(tmp_path):
  (tmp_path / 'a.txt').write_text(A_TXT, encoding='utf-8')
  (tmp_path / 'b.txt').write_text(B_TXT, encoding='utf-8')
  return str(tmp_path / '*.txt')


def test_files_holdout_is_disjoint_and_covering(tmp_path, corpus):
  data_cfg = _data_cfg(tmp_path, source='files', files=corpus, eval_holdout=2)
  assert list(sources.documents(data_cfg, 'eval')) == [DOCS[0], DOCS[2], DOCS[4]]
  assert list(sources.documents(data_cfg, 'train')) == [DOCS[1], DOCS[3]]
  # A fresh pass on every call.
  assert list(sources.documents(data_cfg, 'train')) == [DOCS[1], DOCS[3]]


def test_files_explicit_eval_files(tmp_path, corpus):
  (tmp_path / 'eval.text').write_text('Held out.\n', encoding='utf-8')
  data_cfg = _data_cfg(tmp_path, source='files', files=corpus,
                       eval_files=str(tmp_path / 'eval.text'))
  assert list(sources.documents(data_cfg, 'train')) == DOCS
  assert list(sources.documents(data_cfg, 'eval')) == [['Held out.']]


def test_files_hosts_get_disjoint_documents(tmp_path, corpus):
  data_cfg = _data_cfg(tmp_path, source='files', files=corpus, eval_holdout=5)
  hosts = [list(sources.documents(data_cfg, 'train', i, 2)) for i in range(2)]
  assert hosts == [[DOCS[1], DOCS[3]], [DOCS[2], DOCS[4]]]


def test_files_errors_name_the_fix(tmp_path, corpus):
  with pytest.raises(ValueError, match='data.files=.*matches no files'):
    sources.documents(_data_cfg(tmp_path, source='files',
                                files=str(tmp_path / 'nope*.txt')), 'train')
  (tmp_path / 'empty.txt').write_text('\n\n', encoding='utf-8')
  with pytest.raises(ValueError, match="no 'train' documents") as error:
    sources.documents(_data_cfg(tmp_path, source='files',
                                files=str(tmp_path / 'empty.txt')), 'train')
  assert '\n' not in str(error.value)
  with pytest.raises(ValueError, match='use one of embedded, files, tfds'):
    sources.documents(_data_cfg(tmp_path, source='wiki'), 'train')
  with pytest.raises(ValueError, match='eval_holdout=1'):
    sources.documents(_data_cfg(tmp_path, source='files', files=corpus,
                                eval_holdout=1), 'train')
  with pytest.raises(ValueError, match="use 'train' or 'eval'"):
    sources.documents(_data_cfg(tmp_path, source='files', files=corpus), 'test')


def test_files_keep_undecodable_lines_as_the_reference_and_warn(tmp_path, monkeypatch):
  # Its convert_to_unicode drops the bad bytes; U+FFFD marks them (WordPiece drops it too).
  path = tmp_path / 'bad.txt'
  path.write_bytes(b'\xef\xbb\xbfGood one.\nBad \xff\xfe line.\nGood two.\n\nAlso \xc3.\n\n'
                   b'Next doc.\n')
  warnings = []
  monkeypatch.setattr(sources.logging, 'warning',
                      lambda msg, *args: warnings.append(msg % args))
  data_cfg = _data_cfg(tmp_path, source='files', files=str(path), eval_files=str(path))
  assert list(sources.documents(data_cfg, 'train')) == [
      ['Good one.', 'Bad \ufffd\ufffd line.', 'Good two.'], ['Also \ufffd.'], ['Next doc.']]
  assert warnings == [f'2 lines of {path} are not UTF-8: read with U+FFFD for their bad bytes.']


@pytest.mark.parametrize('text, expected', [
    ('Dr. Smith went home. He slept! Did he? Yes.',
     ['Dr. Smith went home.', 'He slept!', 'Did he?', 'Yes.']),
    ('J. R. R. Tolkien wrote it, e.g. The Hobbit. In 1937 it sold.',
     ['J. R. R. Tolkien wrote it, e.g. The Hobbit.', 'In 1937 it sold.']),
    ('He said "Stop." Then he left.  ', ['He said "Stop."', 'Then he left.']),
    ('Version 3.11 is out. it is lower case after.',
     ['Version 3.11 is out. it is lower case after.']),
    ('   ', []),
])
def test_split_sentences(text, expected):
  assert sources.split_sentences(text) == expected


# TFDS, through tfds.testing.mock_data: examples are random strings of
# ' abcdefghij', the same ones for every split and slice.


def _tfds_cfg(tmp_path, **overrides):
  return _data_cfg(tmp_path, source='tfds', tfds_name='lm1b',
                   tfds_split='train', **overrides)


def _mock_texts(tfds, n):
  with tfds.testing.mock_data(num_examples=n,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    dataset = tfds.load('lm1b', split='train', shuffle_files=False)
    return [ex['text'].decode().strip() for ex in tfds.as_numpy(dataset)]


def test_tfds_documents(tmp_path):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  texts = _mock_texts(tfds, 6)
  data_cfg = _tfds_cfg(tmp_path, eval_holdout=3)
  with tfds.testing.mock_data(num_examples=6,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    train = list(sources.documents(data_cfg, 'train'))
    eval_ = list(sources.documents(data_cfg, 'eval'))
    data_cfg.tfds_eval_split = 'test'
    explicit = [list(sources.documents(data_cfg, 'eval', i, 2)) for i in range(2)]
    data_cfg.tfds_text_feature = 'body'
    with pytest.raises(ValueError, match="no feature 'body'.*one of text"):
      sources.documents(data_cfg, 'train')
  for doc in train + eval_:
    assert doc and all(isinstance(s, str) and s == s.strip() and s for s in doc)
  assert [d[0] for d in eval_] == [texts[0], texts[3]]
  assert [d[0] for d in train] == [texts[i] for i in (1, 2, 4, 5)]
  assert [d[0] for d in explicit[0]] == texts  # mock slices ignore the bounds


def test_tokenized_tfds_text_is_one_sentence_a_line(tmp_path, monkeypatch):
  # lm1b read as bilm-tf reads it (data.split_words=spaces): 'Sen. Barack Obama , D-Ill. ,
  # said .' is one sentence, where the split for raw text would end one at 'Sen.'. Here a
  # splitter that cuts at every space stands in for it (the mock's texts have no sentence end).
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  monkeypatch.setattr(sources, 'split_sentences', str.split)
  texts = _mock_texts(tfds, 3)
  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    raw = list(sources.documents(_tfds_cfg(tmp_path, eval_holdout=100), 'train'))
    tokenized = list(sources.documents(_tfds_cfg(tmp_path, eval_holdout=100,
                                                 split_words='spaces'), 'train'))
  assert tokenized == [[t] for t in texts[1:]]  # the first is held out for eval
  assert raw == [t.split() for t in texts[1:]] != tokenized


def test_a_tfds_name_tfds_does_not_know_is_one_line_with_the_nearest_name(tmp_path):
  """Before the model is built (input_pipeline.check_source, called by trainer.loop.setup);
  TFDS's own error lists every dataset it has, 457 lines."""
  import input_pipeline  # pylint: disable=g-import-not-at-top
  for name, near in (('lm1bb', " (did you mean 'lm1b'?)"), ('no_such_dataset_xyz', '')):
    with pytest.raises(ValueError) as error:
      input_pipeline.check_source(_data_cfg(tmp_path, source='tfds', tfds_name=name))
    assert str(error.value) == (
        f'data.tfds_name={name!r} is no TFDS dataset{near}: set --config.data.tfds_name to a name '
        'of tfds.list_builders() (e.g. lm1b, wikipedia/20230601.en), or to one prepared in '
        'data.tfds_data_dir.')
  input_pipeline.check_source(_tfds_cfg(tmp_path))  # lm1b: known, nothing read


class _FiveExamplesPerSlice(dict):
  """The mock has no split sizes: this claims 5 examples for any slice."""

  def __getitem__(self, split):
    return types.SimpleNamespace(num_examples=5)


def test_tfds_holdout_index_counts_from_the_start_of_the_split(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  texts = _mock_texts(tfds, 5)
  monkeypatch.setattr(tfds.core.DatasetInfo, 'splits',
                      property(lambda self: _FiveExamplesPerSlice()))
  data_cfg = _tfds_cfg(tmp_path, eval_holdout=2)
  with tfds.testing.mock_data(num_examples=5,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    host1_eval = list(sources.documents(data_cfg, 'eval', 1, 2))
  # Host 1 reads examples 5..9 of the split; the even ones are eval.
  assert [d[0] for d in host1_eval] == [texts[1], texts[3]]



def test_tfds_hosts_read_disjoint_slices(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  monkeypatch.setattr(tfds.core.DatasetInfo, 'splits',
                      property(lambda self: _FiveExamplesPerSlice()))
  data_cfg = _tfds_cfg(tmp_path, eval_holdout=3)
  seen = []
  with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
    mocked = tfds.core.DatasetBuilder.as_dataset

    def spy(self, *args, split=None, **kwargs):
      seen.append(str(split))
      return mocked(self, *args, split=split, **kwargs)
    tfds.core.DatasetBuilder.as_dataset = spy
    try:
      for host in range(2):
        sources.documents(data_cfg, 'train', host, 2)
    finally:
      tfds.core.DatasetBuilder.as_dataset = mocked
  assert seen == [str(s) for s in tfds.even_splits('train', n=2)]
  assert seen[0] != seen[1]


def test_a_prepared_tfds_source_is_read_without_waiting_for_the_other_hosts(tmp_path,
                                                                           monkeypatch):
  # Each shard reads its documents again at its own step of a pass, in a data thread or worker
  # process; a wait for the other hosts there met their other collectives. train.py prepares
  # (and waits) once, at its start, on every host: input_pipeline.prepare_source.
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  import input_pipeline  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(tfds.core.DatasetInfo, 'splits',
                      property(lambda self: _FiveExamplesPerSlice()))
  waits = []
  monkeypatch.setattr(sources.multihost_utils, 'sync_global_devices', waits.append)
  monkeypatch.setattr(sources.jax, 'process_count', lambda: 2)
  data_cfg = _tfds_cfg(tmp_path, tfds_data_dir=str(tmp_path / 'tfds'))
  with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
    input_pipeline.prepare_source(data_cfg)
    assert waits == ['prepare_tfds lm1b/1.1.0']
    monkeypatch.setattr(sources, '_is_prepared', lambda builder: True)  # what it leaves
    for host in range(2):  # each shard's next pass reads its documents so again
      assert list(sources.documents(data_cfg, 'train', host, 2))
  assert waits == ['prepare_tfds lm1b/1.1.0']


# The embedded corpus and vocabularies.


def test_embedded_corpus_is_built_once(tmp_path, monkeypatch):
  started = time.time()
  path = sources.embedded_corpus(str(tmp_path))
  print(f'embedded corpus built in {time.time() - started:.1f} s')
  assert path == str(tmp_path / 'embedded' / f'corpus-py{sys.version_info.major}'
                     f'{sys.version_info.minor}.txt')
  assert 'antigravity' not in sys.modules  # parsed, never imported
  docs = list(sources._read_documents([path]))
  assert len(docs) > 1000
  assert sum(len(s) for doc in docs for s in doc) > 500_000
  assert all(any(len(s.split()) >= 3 for s in doc) for doc in docs)
  assert not any(s.startswith(('>>>', '...')) for doc in docs for s in doc)
  monkeypatch.setattr(sources, '_stdlib_documents', None)  # must not rebuild
  assert sources.embedded_corpus(str(tmp_path)) == path
  data_cfg = _data_cfg(tmp_path, source='embedded', data_dir=str(tmp_path))
  assert len(list(sources.documents(data_cfg, 'eval'))) == len(docs[::data_cfg.eval_holdout])


def test_get_tokenizer_learns_and_caches(tmp_path, corpus, monkeypatch):
  data_cfg = _data_cfg(tmp_path, source='files', files=corpus, eval_holdout=5)
  tok = sources.get_tokenizer(data_cfg, 200)
  [path] = os.listdir(tmp_path / 'cache' / 'vocab')
  assert path.startswith('files-a-') and path.endswith('-200-uncased.txt')
  assert tok.vocab_size == 200 and tok.unk_id not in tok.encode('Doc two, third.')
  monkeypatch.setattr(tokenizer_lib, 'learn_vocab', None)  # must reuse the cache
  assert sources.get_tokenizer(data_cfg, 200).vocab_file == tok.vocab_file
  data_cfg.vocab_file = tok.vocab_file
  assert sources.get_tokenizer(data_cfg, 200).vocab_size == 200
  data_cfg.vocab_file = str(tmp_path / 'missing.txt')
  with pytest.raises(ValueError, match='data.vocab_file=.*does not exist'):
    sources.get_tokenizer(data_cfg, 200)


def test_a_vocabulary_learned_from_another_holdout_is_not_reused(tmp_path, corpus):
  """The training text, and so the vocabulary learned from it, changes with data.eval_holdout
  (not with it where the eval text is a source of its own)."""
  learned = {n: sources.get_tokenizer(_data_cfg(tmp_path, source='files', files=corpus,
                                                eval_holdout=n), 200) for n in (2, 5)}
  paths = {n: os.path.basename(tok.vocab_file) for n, tok in learned.items()}
  assert '-holdout2-' in paths[2] and '-holdout5-' in paths[5]
  # Documents 0, 2, 4 are eval at 2, only document 0 at 5: 'third' is in one training text.
  assert learned[2].unk_id in learned[2].encode('third')
  assert learned[5].unk_id not in learned[5].encode('third')
  whole = [_data_cfg(tmp_path, source='files', files=corpus, eval_files=corpus, eval_holdout=n)
           for n in (2, 5)]
  assert len({sources.get_tokenizer(cfg, 200).vocab_file for cfg in whole}) == 1
  assert '-holdout' not in sources.get_tokenizer(whole[0], 200).vocab_file


@pytest.mark.parametrize('pieces, lower_case, refused', [
    (['the', 'cat'], True, ''), (['The', 'cat'], False, ''),
    (['the', 'cat'], False, r"is uncased \(no capitalized piece\) but data.lower_case=False: "
                            'set --config.data.lower_case=True'),
    (['The', 'cat'], True, r'is cased \(it has capitalized pieces\) but data.lower_case=True'),
    (['हिंदी', '中文'], False, ''), (['हिंदी', '中文'], True, ''),  # scripts without case
])
def test_a_vocabulary_of_the_other_casing_is_refused(tmp_path, pieces, lower_case, refused):
  vocab = tmp_path / 'vocab.txt'
  vocab.write_text('\n'.join(list(tokenizer_lib.SPECIAL_TOKENS) + pieces) + '\n',
                   encoding='utf-8')
  data_cfg = _data_cfg(tmp_path, vocab_file=str(vocab), lower_case=lower_case)
  if not refused:
    assert sources.get_tokenizer(data_cfg, 200).vocab_size == 7
    return
  with pytest.raises(ValueError, match=refused):
    sources.get_tokenizer(data_cfg, 200)


def test_undecodable_tfds_documents_are_kept_as_text_files_lines_and_counted(caplog):
  texts = ['First doc. Second sentence.'.encode(), b'\xff\xfe broken', 'Third doc.'.encode()]
  with caplog.at_level('WARNING'):
    docs = list(sources._decoded_documents(texts, 'fake:train'))
  assert docs == [['First doc.', 'Second sentence.'], ['\ufffd\ufffd broken'], ['Third doc.']]
  assert '1 documents of fake:train are not UTF-8: read with U+FFFD' in caplog.text
