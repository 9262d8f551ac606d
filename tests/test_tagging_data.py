"""Tests of the tagging pipeline for ELMo's task models (Peters et al. 2018, sec. 3.3, 5.1 NER)."""

import collections

import ml_collections
import numpy as np
import pytest

from input_pipeline import tagging
import input_pipeline
from input_pipeline.common import sources
from input_pipeline.common import words as words_lib

FIELDS = {'token_ids': np.int32, 'char_ids': np.int32, 'lengths': np.int32, 'labels': np.int32,
          'label_weights': np.float32, 'example_weights': np.float32}
HOLDOUT = 4  # documents 0, 4, 8, ... of the corpus are eval documents


def data_config(tmp_path, **overrides):
  cfg = ml_collections.ConfigDict(dict(
      pipeline='tagging', task='offline_replaced', source='embedded', files='', eval_files='',
      data_dir=str(tmp_path / 'cache'), eval_holdout=HOLDOUT, tfds_data_dir='',
      tokenizer='words', vocab_file='', lower_case=False, max_seq_length=12,
      max_characters_per_token=8, max_train_examples=0, max_eval_examples=0))
  cfg.update(overrides)
  return cfg


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Documents of 3 sentences of 2..12 words of a Zipfian 40-word language."""
  rng = np.random.default_rng(0)
  probs = 1 / np.arange(1, 41)
  probs /= probs.sum()
  documents = [[' '.join(f'w{i}' for i in rng.choice(40, rng.integers(2, 13), p=probs))
                for _ in range(3)] for _ in range(200)]
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  path.write_text(''.join(''.join(s + '\n' for s in doc) + '\n' for doc in documents))
  return str(path), documents


@pytest.fixture
def embedded(corpus, monkeypatch):
  """The offline task reads the corpus above as the embedded corpus."""
  monkeypatch.setattr(sources, 'embedded_corpus', lambda data_dir: corpus[0])
  return corpus[1]


@pytest.fixture(scope='module')
def vocab(corpus, tmp_path_factory):
  texts = [s for doc in corpus[1] for s in doc] + ['EU rejects German call to boycott British']
  path = tmp_path_factory.mktemp('vocab') / 'words.txt'
  return words_lib.WordVocab(words_lib.learn_word_vocab(texts, 100, str(path)))


def assert_valid_batch(batch, batch_size, length, width, num_labels):
  assert {k: v.dtype for k, v in batch.items()} == FIELDS
  assert batch['char_ids'].shape == (batch_size, length, width)
  for key in ('token_ids', 'labels', 'label_weights'):
    assert batch[key].shape == (batch_size, length)
  col = np.arange(length)
  real = col < batch['lengths'][:, None]
  words = (col >= 1) & (col < batch['lengths'][:, None] - 1)
  assert (batch['lengths'] >= 3).all() and (batch['lengths'] <= length).all()
  # Each row is <S> words </S>, then zeros.
  assert (batch['token_ids'][:, 0] == 0).all()
  np.testing.assert_array_equal(batch['token_ids'][np.arange(batch_size), batch['lengths'] - 1], 1)
  assert not batch['token_ids'][~real].any() and not batch['char_ids'][~real].any()
  assert not batch['labels'][~words].any()
  assert ((batch['labels'] >= 0) & (batch['labels'] < num_labels)).all()
  np.testing.assert_array_equal(batch['label_weights'],
                                words & (batch['example_weights'][:, None] > 0))


def _originals(examples, documents):
  """For each replaced sentence, the corpus sentence it was made from and its document index."""
  sentences = collections.defaultdict(list)
  for d, doc in enumerate(documents):
    for s in doc:
      sentences[len(s.split())].append((s.split(), d))
  found = []
  for words, tags in examples:
    matches = [(original, d) for original, d in sentences[len(words)]
               if all((o == w) != t for o, w, t in zip(original, words, tags))]
    assert len(matches) >= 1, words
    found.append(matches[0])
  return found


def test_offline_replaced_marks_exactly_the_replaced_words(tmp_path, embedded):
  cfg = data_config(tmp_path)
  for split in ('train', 'eval'):
    sentences, tags = tagging.offline_sentences(cfg, split, 0)
    assert len(sentences) > 50
    assert all(5 <= len(words) <= 10 for words in sentences)
    assert all(sum(t) == max(1, round(0.15 * len(t))) for t in tags)
    # Labels 1 exactly where the word differs from the original sentence's.
    originals = _originals(zip(sentences, tags), embedded)
    # Train and eval sentences come from their own documents.
    assert all((d % HOLDOUT == 0) == (split == 'eval') for _, d in originals)
  capped, _ = tagging.offline_sentences(cfg, 'train', 30)
  assert capped == tagging.offline_sentences(cfg, 'train', 30)[0] and len(capped) == 30


def test_replacements_follow_the_unigram_distribution(tmp_path, embedded):
  """Drawn by frequency, so that a frequent word is no sign of a replacement."""
  sentences, tags = tagging.offline_sentences(data_config(tmp_path), 'train', 0)
  unigram = collections.Counter(w for d, doc in enumerate(embedded) if d % HOLDOUT
                                for s in doc for w in s.split())
  p = {w: n / sum(unigram.values()) for w, n in unigram.items()}
  originals = _originals(zip(sentences, tags), embedded)
  count, expected, variance = 0, 0.0, 0.0
  for (original, _), words, t in zip(originals, sentences, tags):
    for o, w, replaced in zip(original, words, t):
      if replaced:
        # P(w0 | original o): unigram without o, renormalized.
        q = 0.0 if o == 'w0' else p['w0'] / (1 - p[o])
        count += w == 'w0'
        expected, variance = expected + q, variance + q * (1 - q)
  assert expected > 50
  assert abs(count - expected) < 4 * np.sqrt(variance), (count, expected)


def test_offline_batches_label_the_words(tmp_path, embedded, vocab):
  cfg = data_config(tmp_path, max_train_examples=40)
  it = input_pipeline.get_dataset(cfg, 'train', tokenizer=vocab, batch_size=8, seed=0)
  sentences, tags = tagging.offline_sentences(cfg, 'train', 40)
  by_words = {tuple(vocab.ids(words)): t for words, t in zip(sentences, tags)}
  for _ in range(6):  # more than an epoch of 40
    batch = next(it)
    assert_valid_batch(batch, 8, 12, 8, 2)
    assert batch['example_weights'].all()
    for ids, labels, chars, length in zip(batch['token_ids'], batch['labels'],
                                          batch['char_ids'], batch['lengths']):
      words = slice(1, length - 1)
      assert by_words[tuple(ids[words])] == labels[words].tolist()
      # The vocabulary knows every word of this corpus, so ids give back the words.
      np.testing.assert_array_equal(chars[words],
                                    vocab.char_ids([vocab.word(i) for i in ids[words]], 8))


def test_resume_is_exact(tmp_path, embedded, vocab):
  cfg = data_config(tmp_path, max_train_examples=30)
  it = tagging.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=7, seed=1)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]  # crosses into epoch 1
  resumed = tagging.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=7, seed=1)
  resumed.set_state(state)
  np.testing.assert_equal([next(resumed) for _ in expected], expected)
  assert resumed.get_state()['epoch'] == 1


# CoNLL 2003 through tfds.testing.mock_data, with hand-made sentences.

CONLL = {
    'train': [('EU rejects German call to boycott British lamb .', [3, 0, 7, 0, 0, 0, 7, 0, 0]),
              ('Peter Blackburn', [1, 2]),
              ('BRUSSELS 1996-08-22', [5, 0])],
    'dev': [('CRICKET - LEICESTERSHIRE TAKE OVER AT TOP AFTER INNINGS VICTORY .',
             [0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0]),
            ('LONDON 1996-08-30', [5, 0]),
            ('West Indian all-rounder Phil Simmons', [7, 8, 0, 1, 2]),
            ('Essex', [3]),
            ('Derbyshire kept up the hunt', [3, 0, 0, 0, 0])],
}


def _fake_conll(self, split, **kwargs):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  del self, kwargs
  examples = CONLL[str(split)]
  return tf.data.Dataset.from_generator(
      lambda: ({'tokens': text.split(), 'ner': tags} for text, tags in examples),
      output_signature={'tokens': tf.TensorSpec([None], tf.string),
                        'ner': tf.TensorSpec([None], tf.int64)})


def _spelled(chars):
  """The word whose char ids these are (utf-8 byte b is b + 1, between the word markers)."""
  return bytes(int(c) - 1 for c in chars[1:] if c < 257).decode()


def test_conll2003_batches(tmp_path, vocab):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  cfg = data_config(tmp_path, task='conll2003', max_seq_length=8)
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_fake_conll):
    train = tagging.get_iterator(cfg, 'train', tokenizer=vocab, batch_size=3, seed=0)
    hosts = [tagging.get_iterator(cfg, 'eval', tokenizer=vocab, batch_size=2, seed=0,
                                  process_index=i, process_count=2) for i in range(2)]
    # Random mock examples have as many tags as tokens only by chance.
    with pytest.raises(ValueError, match='tokens but .* tags'):
      with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
        tagging.load_examples(cfg, 'train', vocab)
  assert tagging.span_tags(tagging.task_spec('conll2003')) == ((1, 2), (3, 4), (5, 6), (7, 8))
  assert tagging.span_tags(tagging.task_spec('offline_replaced')) == ((1, 1),)
  batch = next(train)
  assert_valid_batch(batch, 3, 8, 8, 9)
  rows = {int(length): (ids, labels)
          for ids, labels, length in zip(batch['token_ids'], batch['labels'], batch['lengths'])}
  # The first sentence is cut to 8 - 2 words, and its tags with it.
  ids, labels = rows[8]
  assert [vocab.word(i) for i in ids] == ['<S>', 'EU', 'rejects', 'German', 'call', 'to',
                                          'boycott', '</S>']
  assert labels.tolist() == [0, 3, 0, 7, 0, 0, 0, 0]
  np.testing.assert_array_equal(rows[4][1], [0, 1, 2, 0, 0, 0, 0, 0])

  # One eval pass covers each dev sentence once, on one host or the other, whole: its batches
  # are as long as the longest dev sentence (11 words + 2), so no gold tag leaves the metric.
  assert [it.steps_per_epoch for it in hosts] == [2, 2]  # ceil(ceil(5 / 2) / 2)
  seen, tags = [], []
  for it in hosts:
    for _ in range(it.steps_per_epoch):
      batch = next(it)
      assert_valid_batch(batch, 2, 13, 8, 9)
      real = batch['example_weights'] == 1
      assert set(batch['example_weights'].tolist()) <= {0.0, 1.0}
      # The dev words are not in the vocabulary: read them from their characters.
      seen += [tuple(_spelled(c) for c in chars[1:n - 1])
               for chars, n in zip(batch['char_ids'][real], batch['lengths'][real])]
      tags += [tuple(t[1:n - 1]) for t, n in zip(batch['labels'][real], batch['lengths'][real])]
  # Words of 6 characters at most (W = 8), every word and tag of the sentence.
  assert sorted(seen) == sorted(tuple(w[:6] for w in text.split()) for text, _ in CONLL['dev'])
  assert sorted(tags) == sorted(tuple(t) for _, t in CONLL['dev'])


def test_check_config_errors_name_the_fix(tmp_path):
  config = ml_collections.ConfigDict(dict(
      data=data_config(tmp_path, task='conll2003'),
      model=dict(num_labels=9), train=dict(eval_steps=0)))
  input_pipeline.check_config(config)  # eval passes are allowed
  config.model.num_labels = 2
  with pytest.raises(ValueError, match='has 9 tags but config.model.num_labels=2: set'):
    input_pipeline.check_config(config)
  config.data.task = 'offline_replaced'
  input_pipeline.check_config(config)
  config.data.max_seq_length = 6
  with pytest.raises(ValueError, match='max_seq_length=6 leaves no room for 5 word.*use 7'):
    input_pipeline.check_config(config)
  config.data.task = 'conll2003'
  config.model.num_labels = 9
  config.data.max_seq_length = 2
  with pytest.raises(ValueError, match='use 3 or more'):
    input_pipeline.check_config(config)
  config.data.task = 'pos'
  with pytest.raises(ValueError, match='Unknown tagging task .*conll2003, .*offline_replaced'):
    input_pipeline.check_config(config)


def test_train_examples_size_the_runs(tmp_path):
  data = data_config(tmp_path, max_train_examples=300)
  assert tagging.task_spec('conll2003').train_examples(data) == 14_041
  assert tagging.task_spec('offline_replaced').train_examples(data) == 300
  data.max_train_examples = 0
  with pytest.raises(ValueError, match='set data.max_train_examples'):
    tagging.task_spec('offline_replaced').train_examples(data)


def test_example_batch_matches_the_spec(tmp_path):
  for task, num_labels in (('conll2003', 9), ('offline_replaced', 2)):
    batch = input_pipeline.example_batch(data_config(tmp_path, task=task), 30, batch_size=5)
    assert_valid_batch(batch, 5, 12, 8, num_labels)
    assert (batch['token_ids'] < 30).all() and batch['labels'].any()
    assert batch['example_weights'].all()
