"""CVT's data: BIOES, the labeled/unlabeled schedule, task sampling, resume, eval passes, tasks."""

import numpy as np
import pytest

from configs import cvt as cvt_configs
from input_pipeline import cvt
from input_pipeline import tagging
from input_pipeline.common import example_iterator
import input_pipeline
from input_pipeline.common import words as words_lib
from input_pipeline.tasks import synthetic_tagging


@pytest.fixture(scope='module')
def config(tmp_path_factory):
  config = cvt_configs.get_config('tiny_multitask')
  config.data.data_dir = str(tmp_path_factory.mktemp('data'))
  config.data.update(max_train_examples=50, max_eval_examples=7, max_seq_length=24,
                     docs_per_chunk=5)
  return config


@pytest.fixture(scope='module')
def vocab(config):
  return input_pipeline.get_tokenizer(config.data, config.model.vocab_size)


def _iterator(config, vocab, split='train', **kwargs):
  return input_pipeline.get_dataset(config.data, split, tokenizer=vocab, batch_size=4, seed=0,
                                    **kwargs)


def test_bio_to_bioes_on_hand_made_sentences():
  task = tagging.TASKS['conll2003']  # O B-PER I-PER B-ORG I-ORG B-LOC I-LOC B-MISC I-MISC
  names = tagging.label_names(task, 'BIOES')
  as_names = lambda ids: [names[i] for i in tagging.bio_to_bioes(ids, task)]  # noqa: E731
  assert as_names([1, 2, 2, 0, 5, 0]) == ['B-PER', 'I-PER', 'E-PER', 'O', 'S-LOC', 'O']
  # conlleval: I-X after O, or after another type, starts a chunk; B-X after I-X too.
  assert as_names([2, 2, 4, 1, 1, 2]) == ['B-PER', 'E-PER', 'S-ORG', 'S-PER', 'B-PER', 'E-PER']
  bio = tagging.to_bio_ids(task, 'BIOES')
  assert [task.label_names[bio[i]] for i in tagging.bio_to_bioes([1, 2, 2, 0, 5], task)] == [
      'B-PER', 'I-PER', 'I-PER', 'O', 'B-LOC']
  assert tagging.num_labels(task, 'BIOES') == 17  # cvt_text's CoNLL NER label set
  assert tagging.label_names(tagging.TASKS['conll2003_pos'], 'BIOES') == (
      tagging.CONLL2003_POS_TAGS)  # no chunks: nothing to add


def test_word_ids_are_normalized_and_characters_are_not(config, vocab, tmp_path):
  """cvt_text looks words up by normalize_word (lower-cased, each digit 0) and spells them
  as written for the char CNN, up to max_word_length = 20 characters."""
  assert config.data.normalize_words and vocab.normalize
  assert all(w == words_lib.normalize_word(w) for w in vocab.words)
  path = words_lib.learn_word_vocab(['Paris in 1996 .', 'paris 2001 said'], 20,
                                str(tmp_path / 'words_lib.txt'), normalize=True)
  learned = words_lib.WordVocab(path, normalize=True)
  assert {'paris', '0000'} <= set(learned.words) and 'Paris' not in learned.words
  W = cvt_configs.get_config('tiny').data.max_characters_per_token
  ids_a, chars_a = learned.sentence(['Paris', '1996'], W)
  ids_b, chars_b = learned.sentence(['paris', '2001'], W)
  np.testing.assert_array_equal(ids_a, ids_b)
  assert ids_a[0] == words_lib.BOS_ID and ids_a[-1] == words_lib.EOS_ID
  assert (chars_a != chars_b).any()
  letters = words_lib.char_ids(['abcdefghijklmnopqrst'], W)[0]
  assert ((letters >= 1) & (letters <= 256)).sum() == 20
  cased = words_lib.learn_word_vocab(['Paris in 1996 .'], 20, str(tmp_path / 'cased.txt'))
  with pytest.raises(ValueError, match='normalize_words') as error:
    words_lib.WordVocab(cased, normalize=True)
  assert '\n' not in str(error.value)


def test_labeled_and_unlabeled_batches_alternate_with_the_ratio():
  pattern = lambda r: [cvt.is_unlabeled_step(n, r) for n in range(6)]  # noqa: E731
  assert pattern(1.0) == [False, True] * 3
  assert pattern(0.0) == [False] * 6
  assert pattern(2.0) == [False, True, True] * 2
  assert pattern(0.5) == [False, False, True] * 2


def test_batches_follow_the_spec_and_resume_exactly(config, vocab):
  data = _iterator(config, vocab)
  labeled, unlabeled = next(data), next(data)
  L, W = config.data.max_seq_length, config.data.max_characters_per_token
  assert sorted(labeled) == sorted(['token_ids', 'char_ids', 'lengths', 'labels',
                                    'label_weights', 'example_weights', 'task_ids'])
  assert sorted(unlabeled) == sorted(['token_ids', 'char_ids', 'lengths', 'example_weights'])
  assert labeled['char_ids'].shape == unlabeled['char_ids'].shape == (4, L, W)
  assert len(set(labeled['task_ids'].tolist())) == 1
  assert (unlabeled['token_ids'][:, 0] == 0).all()  # <S> opens every sentence
  ends = unlabeled['token_ids'][np.arange(4), unlabeled['lengths'] - 1]
  assert (ends == 1).all()  # and </S> closes it
  for _ in range(5):
    next(data)
  state = data.get_state()
  expected = [next(data) for _ in range(6)]
  resumed = _iterator(config, vocab)
  resumed.set_state(state)
  for want, got in zip(expected, [next(resumed) for _ in range(6)]):
    np.testing.assert_equal(got, want)


def test_tasks_are_drawn_by_the_square_root_of_their_sizes(config, vocab):
  np.testing.assert_allclose(cvt.task_probabilities([100, 400]), [1 / 3, 2 / 3])
  config = config.copy_and_resolve_references()
  config.data.unlabeled_ratio = 0.0
  config.data.max_train_examples = 40
  data = _iterator(config, vocab)
  draws = np.array([int(next(data)['task_ids'][0]) for _ in range(400)])
  assert abs(draws.mean() - 0.5) < 0.08  # equal sizes: half and half
  again = _iterator(config, vocab)
  assert [int(next(again)['task_ids'][0]) for _ in range(50)] == draws[:50].tolist()
  # Tasks of 100 and 900 sentences: 1/4 and 3/4 of the labeled steps (equal draws would give
  # 1/2, draws by size 9/10).
  labeled = [example_iterator.ExampleIterator(
      size, lambda indices, weights, t=t: {'task_ids': np.full(len(indices), t)},
      split='train', batch_size=4, seed=t) for t, size in enumerate([100, 900])]
  data = cvt.TrainIterator(config.data, labeled, unlabeled=None, seed=0)
  draws = np.array([int(next(data)['task_ids'][0]) for _ in range(2000)])
  for iterator in labeled:
    iterator.close()
  assert abs(draws.mean() - 0.75) < 0.03  # 3 standard errors


def test_eval_covers_every_sentence_of_every_task_once(config, vocab):
  data = _iterator(config, vocab, split='eval')
  start = data.get_state()
  assert data.steps_per_epoch == 2 * 2  # ceil(7 / 4) batches per task
  batches = [next(data) for _ in range(data.steps_per_epoch)]
  for task in (0, 1):
    rows = [b for b in batches if b['task_ids'][0] == task]
    weights = np.concatenate([b['example_weights'] for b in rows])
    assert weights.sum() == 7 and sorted(set(weights.tolist())) == [0.0, 1.0]
    sentences = {tuple(ids[:n]) for b in rows for ids, n, w in
                 zip(b['token_ids'], b['lengths'], b['example_weights']) if w}
    assert len(sentences) == 7
  np.testing.assert_equal(next(data), batches[0])  # then the pass repeats
  # Every eval starts over (evaluation.evaluate sets the start): the tasks' batches rewound too.
  next(data)
  data.set_state(start)
  np.testing.assert_equal([next(data) for _ in range(data.steps_per_epoch)], batches)
  data.set_state({'step': 3})
  np.testing.assert_equal(next(data), batches[3])


def test_config_errors_are_one_line(config):
  bad = config.copy_and_resolve_references()
  bad.model.num_labels = (5, 10)
  with pytest.raises(ValueError, match=r'have \(9, 10\) tags'):
    cvt.check_config(bad)
  bad = config.copy_and_resolve_references()
  bad.data.tasks = ('offline_names', 'nope')
  with pytest.raises(ValueError, match='Unknown tagging task'):
    cvt.check_config(bad)
  bad = config.copy_and_resolve_references()
  bad.data.tokenizer = 'wordpiece'
  with pytest.raises(ValueError, match='words'):
    cvt.check_config(bad)


def test_synthetic_language_needs_the_unlabeled_text():
  sentences = [synthetic_tagging.sentence('train', i) for i in range(200)]
  evals = [synthetic_tagging.sentence('eval', i) for i in range(1000)]
  assert synthetic_tagging.sentence('eval', 3) == evals[3]  # a pure function of its index
  seen = {w for words, tags, _ in sentences for w, t in zip(words, tags) if t != 'O'}
  mentions = unseen = uncued = 0
  for words, tags, pos in evals:
    assert len(words) == len(tags) == len(pos) and 4 <= len(words) <= 20
    for k, (word, tag) in enumerate(zip(words, tags)):
      assert (tag != 'O') == (pos[k] == 'PROPN')
      if tag.startswith('I-'):
        assert tags[k - 1][2:] == tag[2:]  # valid BIO
      if tag.startswith('B-'):
        mentions += 1
        unseen += word not in seen
        uncued += words[k - 1] in ('about', 'of') or k == 0
  print(f'{mentions} eval mentions: {uncued / mentions:.2f} in uncued clauses, '
        f'{unseen / mentions:.2f} of names never labeled in 200 sentences')
  assert 0.3 < uncued / mentions < 0.7
  assert unseen / mentions > 0.2
  # PER and LOC names share their spelling: same syllable pool, same lengths.
  lexicon = synthetic_tagging.lexicon()
  lengths = {kind: np.mean([len(n) for n in names]) for kind, names in lexicon.items()}
  assert abs(lengths['PER'] - lengths['LOC']) < 0.5
  # The unlabeled text is the same language, without tags.
  document = next(synthetic_tagging.documents('train'))
  assert len(document) == synthetic_tagging.SENTENCES_PER_DOCUMENT
  assert all(isinstance(s, str) and s.endswith(' .') for s in document)


def test_conll2003_columns_through_tfds(config, vocab, tmp_path):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sentences = [('Peter Blackburn runs', [1, 2, 0], [22, 22, 42], [11, 12, 21]),
               ('EU rejects lamb', [3, 0, 0], [22, 42, 21], [11, 21, 11])]

  def fake(self, split, **kwargs):
    del self, split, kwargs
    return tf.data.Dataset.from_generator(
        lambda: ({'tokens': s.split(), 'ner': n, 'pos': p, 'chunks': c}
                 for s, n, p, c in sentences),
        output_signature={'tokens': tf.TensorSpec([None], tf.string),
                          **{k: tf.TensorSpec([None], tf.int64) for k in ('ner', 'pos', 'chunks')}})
  data = config.data.copy_and_resolve_references()
  data.update(tasks=('conll2003', 'conll2003_pos', 'conll2003_chunk'), max_train_examples=0,
              tfds_data_dir=str(tmp_path))
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=fake):
    loaded = {task: cvt.load_task(data, task, 'train', vocab) for task in data.tasks}
  bioes = lambda task: tagging.label_names(tagging.TASKS[task], 'BIOES')  # noqa: E731
  first = lambda task: [bioes(task)[i] for i in loaded[task].labels[1:4]]  # noqa: E731
  assert first('conll2003') == ['B-PER', 'E-PER', 'O']
  assert first('conll2003_pos') == ['NNP', 'NNP', 'VBZ']
  assert first('conll2003_chunk') == ['B-NP', 'E-NP', 'S-VP']
