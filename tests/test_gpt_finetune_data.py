"""Tests of GPT's fine-tuning examples, Radford et al. 2018 sec. 3.3 and figure 1."""

import collections
import dataclasses

import ml_collections
import numpy as np
import pytest

from input_pipeline import gpt_finetune
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.tasks import offline_tasks

S = gpt_finetune.Specials(start=2, delim=3, extract=4)
OFFLINE = ('offline_shuffled', 'offline_next', 'offline_same_doc', 'offline_cloze')
# WordPiece's GPT roles (input_pipeline/common/tokenizer.py), for a tokenizer that lacks them.
ROLES = {'pad_id': '[PAD]', 'eot_id': '[SEP]', 'start_id': '[CLS]', 'delim_id': '[SEP]',
         'extract_id': '[MASK]'}


def _data_cfg(data_dir, **overrides):
  data_cfg = ml_collections.ConfigDict(dict(
      task='offline_next', max_seq_length=48, data_dir=str(data_dir), tfds_data_dir='',
      eval_holdout=10, max_examples=400, lower_case=True))
  data_cfg.update(overrides)
  return data_cfg


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('cache')


@pytest.fixture(scope='module')
def tokenizer(data_dir):
  corpus = offline_tasks.corpus_config(_data_cfg(data_dir))
  sentences = [s for doc in sources.documents(corpus, 'train') for s in doc][:4000]
  path = tokenizer_lib.learn_vocab(sentences, 600, True, str(data_dir / 'vocab.txt'))
  tok = tokenizer_lib.WordPieceTokenizer(path, True)
  ids = {t: i for i, t in enumerate(tok.convert_ids_to_tokens(range(tok.vocab_size)))}
  for role, token in ROLES.items():
    if not hasattr(tok, role):
      setattr(tok, role, ids[token])
  return tok


# The input transformations (figure 1).


def test_each_transformation_gives_the_papers_sequences():
  assert gpt_finetune.classification([10, 11, 12], S, 16) == [[2, 10, 11, 12, 4]]
  assert gpt_finetune.entailment([10, 11], [20, 21, 22], S, 16) == [[2, 10, 11, 3, 20, 21, 22, 4]]
  assert gpt_finetune.similarity([10, 11], [20], S, 16) == [[2, 10, 11, 3, 20, 4],
                                                             [2, 20, 3, 10, 11, 4]]
  assert gpt_finetune.multiple_choice([10, 11], [[20], [30, 31], [40]], S, 16) == [
      [2, 10, 11, 3, 20, 4], [2, 10, 11, 3, 30, 31, 4], [2, 10, 11, 3, 40, 4]]
  # The dispatch by kind gives the same.
  assert gpt_finetune.task_sequences('multiple_choice', [[10], [20], [30]], S, 8) == [
      [2, 10, 3, 20, 4], [2, 10, 3, 30, 4]]
  assert gpt_finetune.task_sequences('similarity', [[10], [20]], S, 8) == [
      [2, 10, 3, 20, 4], [2, 20, 3, 10, 4]]


def test_truncation_keeps_the_specials_and_shortens_the_longer_text():
  long, short = list(range(100, 110)), [20, 21, 22]
  # Budget 10 - 3 = 7: the premise loses 6 of its 10 tokens, from its end.
  assert gpt_finetune.entailment(long, short, S, 10) == [[2, 100, 101, 102, 103, 3, 20, 21, 22, 4]]
  assert gpt_finetune.classification(long, S, 6) == [[2, 100, 101, 102, 103, 4]]
  a, b = gpt_finetune.similarity(short, long, S, 9)
  assert a == [2, 20, 21, 22, 3, 100, 101, 102, 4] and b == [2, 100, 101, 102, 3, 20, 21, 22, 4]
  # Equal lengths: the later text loses the odd token.
  assert gpt_finetune.entailment([10, 11, 12], [20, 21, 22], S, 8) == [
      [2, 10, 11, 12, 3, 20, 21, 4]]
  # Each answer's sequence is cut on its own.
  assert gpt_finetune.multiple_choice(long, [[20], [30, 31, 32, 33]], S, 9) == [
      [2, 100, 101, 102, 103, 104, 3, 20, 4], [2, 100, 101, 102, 3, 30, 31, 32, 4]]


def _one_at_a_time(lengths, budget):
  """The reference rule: remove a token from the longest text (the later on ties)."""
  lengths = list(lengths)
  while sum(lengths) > budget:
    longest = max(lengths)
    lengths[max(i for i, n in enumerate(lengths) if n == longest)] -= 1
  return lengths


def test_kept_lengths_equal_removing_one_token_at_a_time():
  rng = np.random.default_rng(0)
  for _ in range(500):
    lengths = rng.integers(0, 30, rng.integers(1, 5)).tolist()
    budget = int(rng.integers(0, 60))
    assert gpt_finetune.kept_lengths(lengths, budget) == _one_at_a_time(lengths, budget), (
        lengths, budget)


def test_batch_arrays_on_a_hand_made_example():
  sequences = [[[2, 10, 11, 4]], [[2, 20, 3, 21, 22, 4]]]
  examples = gpt_finetune.make_examples(sequences, [1, 0])
  batch = gpt_finetune.batch_arrays(examples, np.array([1, 0]), np.ones(2), 7, pad_id=9)
  np.testing.assert_array_equal(batch['input_ids'][:, 0], [[2, 20, 3, 21, 22, 4, 9],
                                                           [2, 10, 11, 4, 9, 9, 9]])
  np.testing.assert_array_equal(batch['targets'][:, 0], [[20, 3, 21, 22, 4, 0, 0],
                                                         [10, 11, 4, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch['weights'][:, 0], [[1, 1, 1, 1, 1, 0, 0],
                                                         [1, 1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch['segment_ids'][:, 0], [[1, 1, 1, 1, 1, 1, 0],
                                                             [1, 1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch['positions'][:, 0], [[0, 1, 2, 3, 4, 5, 0],
                                                           [0, 1, 2, 3, 0, 0, 0]])
  np.testing.assert_array_equal(batch['extract_positions'], [[5], [3]])
  np.testing.assert_array_equal(batch['labels'], [0, 1])
  expected = {'input_ids': np.int32, 'segment_ids': np.int32, 'positions': np.int32,
              'targets': np.int32, 'weights': np.float32, 'extract_positions': np.int32,
              'labels': np.int32, 'example_weights': np.float32, 'example_index': np.int32}
  assert {k: v.dtype for k, v in batch.items()} == expected
  # A padding example keeps its tokens (finite model outputs) but trains nothing.
  padded = gpt_finetune.batch_arrays(examples, np.array([0]), np.zeros(1), 7, pad_id=9)
  assert not padded['weights'].any() and not padded['targets'].any()
  assert batch['example_index'].tolist() == [1, 0] and padded['example_index'].tolist() == [-1]
  regression = gpt_finetune.make_examples(sequences, [0.5, 4.25])
  assert regression.labels.dtype == np.float32


# Iteration, on examples whose label is their index.


def _indexed(monkeypatch, n):
  """Makes the task's examples n one-sequence examples labelled 0..n-1."""
  sequences = [[[2] + [5 + i % 50] * (1 + i % 7) + [4]] for i in range(n)]
  examples = gpt_finetune.make_examples(sequences, list(range(n)))
  monkeypatch.setattr(gpt_finetune, 'load_examples', lambda *args: examples)


class _Roles:
  pad_id = 0


def _iterator(split, batch_size=8, host=0, hosts=1, seed=0):
  return gpt_finetune.get_iterator(_data_cfg('unused', max_seq_length=12), split,
                                   tokenizer=_Roles(), batch_size=batch_size, seed=seed,
                                   process_index=host, process_count=hosts)


def test_eval_pass_pads_with_weight_zero_and_covers_every_example_once(monkeypatch):
  _indexed(monkeypatch, 37)
  hosts = [_iterator('eval', host=i, hosts=2) for i in range(2)]
  # ceil(ceil(37 / 2) / 8) batches on both hosts.
  assert [it.steps_per_epoch for it in hosts] == [3, 3]
  seen, padding = [], 0
  for it in hosts:
    batches = [next(it) for _ in range(it.steps_per_epoch)]
    for batch in batches:
      real = batch['example_weights'] == 1
      assert set(np.unique(batch['example_weights'])) <= {0.0, 1.0}
      seen += batch['labels'][real].tolist()
      padding += int((~real).sum())
      assert not batch['weights'][~real].any()
      assert batch['example_weights'][-1] == 0 or batch is not batches[-1]
    # Then the pass starts over.
    np.testing.assert_array_equal(next(it)['labels'], batches[0]['labels'])
  assert sorted(seen) == list(range(37))
  assert padding == 2 * 3 * 8 - 37
  # The real examples are in a fixed order, not shuffled.
  assert seen[:8] == list(range(0, 16, 2))


def test_train_resume_is_exact(monkeypatch):
  _indexed(monkeypatch, 37)
  it = _iterator('train')
  for _ in range(6):
    next(it)
  state = it.get_state()
  assert state == {'epoch': 1, 'offset': 48 - 37}
  expected = [next(it) for _ in range(5)]  # crosses into epoch 2
  resumed = _iterator('train')
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_train_epochs_are_reshuffled_permutations(monkeypatch):
  _indexed(monkeypatch, 40)
  it = _iterator('train', batch_size=10)
  epochs = [np.concatenate([next(it)['labels'] for _ in range(4)]) for _ in range(2)]
  for epoch in epochs:
    assert sorted(epoch) == list(range(40))
  assert not np.array_equal(epochs[0], epochs[1])
  other_seed = _iterator('train', batch_size=10, seed=1)
  assert not np.array_equal(next(other_seed)['labels'], epochs[0][:10])


def test_train_hosts_are_disjoint(monkeypatch):
  _indexed(monkeypatch, 41)
  hosts = [_iterator('train', batch_size=4, host=i, hosts=2) for i in range(2)]
  # 20 examples per host and epoch (41 mod 2 left out): 5 batches.
  epoch = [np.concatenate([next(it)['labels'] for _ in range(5)]) for it in hosts]
  assert len(set(epoch[0])) == len(set(epoch[1])) == 20
  assert not set(epoch[0]) & set(epoch[1])
  assert [it.get_state() for it in hosts] == [{'epoch': 0, 'offset': 20}] * 2


# Offline tasks from the embedded corpus.


def _corpus(data_dir, split):
  return list(sources.documents(offline_tasks.corpus_config(_data_cfg(data_dir)), split))


def _normalized(documents):
  return [[' '.join(s.split()) for s in doc] for doc in documents]


@pytest.mark.parametrize('name', OFFLINE)
def test_offline_tasks_are_deterministic_balanced_and_capped(data_dir, name):
  data_cfg = _data_cfg(data_dir, max_examples=2000)
  texts, labels = offline_tasks.offline_examples(name, data_cfg, 'train')
  assert (texts, labels) == offline_tasks.offline_examples(name, data_cfg, 'train')
  assert len(labels) == 2000
  counts = collections.Counter(labels)
  num_labels = gpt_finetune.TASKS[name].num_labels
  # Exactly balanced: the labels are a shuffled 0, 1, ..., 0, 1, ...
  assert counts == {label: 2000 // num_labels for label in range(num_labels)}
  # The order of the labels is random, not alternating.
  assert labels[:12] != [i % num_labels for i in range(12)]
  eval_texts, _ = offline_tasks.offline_examples(name, data_cfg, 'eval')
  assert 0 < len(eval_texts) < len(texts)
  width = {'classification': 1, 'multiple_choice': 5}.get(gpt_finetune.TASKS[name].kind, 2)
  assert all(len(t) == width for t in texts)


@pytest.mark.parametrize('split', ['train', 'eval'])
def test_offline_tasks_are_made_from_the_splits_documents(data_dir, split):
  documents = _normalized(_corpus(data_dir, split))
  sentences = {s for doc in documents for s in doc}
  next_pairs = {(doc[j], doc[j + 1]) for doc in documents for j in range(len(doc) - 1)}
  docs_of = collections.defaultdict(set)
  for d, doc in enumerate(documents):
    for s in doc:
      docs_of[s].add(d)
  data_cfg = _data_cfg(data_dir, max_examples=300)

  texts, labels = offline_tasks.offline_examples('offline_shuffled', data_cfg, split)
  originals = {tuple(sorted(s.split())) for s in sentences}
  for (text,), label in zip(texts, labels):
    assert len(text.split()) >= 4
    if label:
      assert text in sentences
    else:  # the words of a sentence, reordered
      assert tuple(sorted(text.split())) in originals
  shuffled = [t for (t,), label in zip(texts, labels) if not label]
  assert sum(t in sentences for t in shuffled) <= 2  # a reordering that is another sentence

  firsts = {a for a, _ in next_pairs}
  texts, labels = offline_tasks.offline_examples('offline_next', data_cfg, split)
  for (premise, hypothesis), label in zip(texts, labels):
    assert premise in firsts and hypothesis in sentences
    if label:
      assert (premise, hypothesis) in next_pairs
    else:  # from another document
      assert docs_of[hypothesis] - docs_of[premise] or len(docs_of[premise]) > 1

  texts, labels = offline_tasks.offline_examples('offline_same_doc', data_cfg, split)
  for (a, b), label in zip(texts, labels):
    if label:  # two different sentences of one document
      assert docs_of[a] & docs_of[b] and a != b
    else:
      assert a != b and (docs_of[b] - docs_of[a] or len(docs_of[a]) > 1)

  texts, labels = offline_tasks.offline_examples('offline_cloze', data_cfg, split)
  for (context, *answers), label in zip(texts, labels):
    answer = answers[label]
    assert len(set(answers)) == 4
    assert any(doc[j] == answer and ' '.join(doc[max(0, j - 4):j]) == context
               for d in docs_of[answer] for doc in [documents[d]] for j in range(1, len(doc)))
    for k, distractor in enumerate(answers):
      if k != label:
        assert distractor in sentences


def test_offline_splits_are_disjoint_by_document(data_dir):
  data_cfg = _data_cfg(data_dir, max_examples=0)
  eval_sentences = {s for doc in _normalized(_corpus(data_dir, 'eval')) for s in doc}
  train_sentences = {s for doc in _normalized(_corpus(data_dir, 'train')) for s in doc}
  texts, _ = offline_tasks.offline_examples('offline_next', data_cfg, 'eval')
  # Sentences that appear only in train documents never reach eval.
  assert not {t for pair in texts for t in pair} & (train_sentences - eval_sentences)
  assert len(texts) == sum(len(doc) - 1 for doc in _corpus(data_dir, 'eval'))


def test_offline_cloze_answer_position_is_uniform(data_dir):
  _, labels = offline_tasks.offline_examples('offline_cloze', _data_cfg(data_dir, max_examples=0),
                                            'train')
  counts = np.bincount(labels, minlength=4)
  assert counts.max() - counts.min() <= 1 and counts.sum() > 5000


@pytest.mark.parametrize('name', OFFLINE)
def test_offline_batches_follow_the_spec(data_dir, tokenizer, name):
  task = gpt_finetune.task_spec(name)
  data_cfg = _data_cfg(data_dir, task=name, max_examples=64, max_seq_length=40)
  it = gpt_finetune.get_iterator(data_cfg, 'train', tokenizer=tokenizer, batch_size=8, seed=0)
  batch = next(it)
  c = task.num_choices
  assert batch['input_ids'].shape == (8, c, 40) and batch['extract_positions'].shape == (8, c)
  ids = batch['input_ids']
  np.testing.assert_array_equal(ids[:, :, 0], tokenizer.start_id)
  extract = np.take_along_axis(ids, batch['extract_positions'][..., None], axis=-1)[..., 0]
  np.testing.assert_array_equal(extract, tokenizer.extract_id)
  # One extract token per sequence; one delimiter unless classification.
  assert ((ids == tokenizer.extract_id) & (batch['segment_ids'] == 1)).sum(-1).max() == 1
  # The WordPiece delimiter is [SEP]; no text token is [SEP].
  delims = ((ids == tokenizer.delim_id) & (batch['segment_ids'] == 1)).sum(-1)
  np.testing.assert_array_equal(delims, 0 if task.kind == 'classification' else 1)
  np.testing.assert_array_equal(batch['segment_ids'].sum(-1), batch['extract_positions'] + 1)
  assert batch['labels'].dtype == np.int32 and batch['labels'].max() < task.num_labels
  if task.kind == 'similarity':  # both orders
    first, second = (np.where(batch['segment_ids'][:, k] == 1, ids[:, k], -1) for k in (0, 1))
    np.testing.assert_array_equal(np.sort(first, -1), np.sort(second, -1))


def test_example_batch_has_the_spec_of_every_task():
  for name, task in gpt_finetune.TASKS.items():
    data_cfg = _data_cfg('unused', task=name, max_seq_length=16)
    batch = gpt_finetune.example_batch(data_cfg, 100, 4)
    c = task.num_choices
    assert {k: v.shape for k, v in batch.items()} == {
        'input_ids': (4, c, 16), 'segment_ids': (4, c, 16), 'positions': (4, c, 16),
        'targets': (4, c, 16), 'weights': (4, c, 16), 'extract_positions': (4, c),
        'labels': (4,), 'example_weights': (4,), 'example_index': (4,)}, name
    assert batch['labels'].dtype == (np.float32 if task.regression else np.int32)
    extract = np.take_along_axis(batch['input_ids'], batch['extract_positions'][..., None], -1)
    assert (extract == 4).all() and (batch['input_ids'][:, :, 0] == 2).all()
  assert gpt_finetune.task_spec('stsb').regression
  assert gpt_finetune.task_spec('qqp').num_choices == 2
  assert gpt_finetune.task_spec('offline_cloze').head == 'choice'
  assert gpt_finetune.task_spec('mnli').head == 'classify'


def test_errors_are_one_line_and_name_the_fix(tmp_path):
  with pytest.raises(ValueError, match="Unknown task 'glue': use "
                     r"--config=configs/gpt_finetune.py:<task>\[,size\] with one of "
                     'sst2, cola, mnli') as error:
    gpt_finetune.task_spec('glue')
  assert '\n' not in str(error.value)
  with pytest.raises(ValueError, match='max_seq_length=4 .*use 5 or more'):
    gpt_finetune.example_batch(_data_cfg(tmp_path, task='rte', max_seq_length=4), 100, 2)
  gpt_finetune.example_batch(_data_cfg(tmp_path, task='sst2', max_seq_length=3), 100, 2)
  with pytest.raises(ValueError, match="Unknown split 'test'"):
    gpt_finetune.load_examples(_data_cfg(tmp_path), 'test', None)


@pytest.mark.parametrize('name', list(gpt_finetune.TASKS))
def test_the_config_of_every_task_builds_and_passes_check_config(name):
  from configs import gpt_finetune as cfgs  # pylint: disable=g-import-not-at-top
  config = cfgs.get_config(f'{name},tiny')
  assert config.data.task == name
  gpt_finetune.check_config(config)


def test_check_config_refuses_a_task_overridden_alone():
  from configs import gpt_finetune as cfgs  # pylint: disable=g-import-not-at-top
  config = cfgs.get_config('sst2,tiny')
  config.data.task = 'offline_cloze'  # what --config.data.task=offline_cloze would do
  with pytest.raises(ValueError) as error:
    gpt_finetune.check_config(config)
  assert str(error.value) == (
      'config.data.task=offline_cloze needs model.num_labels=4, model.head=choice, '
      'data.num_choices=4: choose the task with --config=configs/gpt_finetune.py:offline_cloze'
      '[,size].')
  # Any one field off is refused too.
  for field, value in (('model.num_labels', 2), ('model.head', 'choice'),
                       ('data.num_choices', 2)):
    config = cfgs.get_config('mnli,tiny')
    group, key = field.split('.')
    config[group][key] = value
    with pytest.raises(ValueError, match=r'config.data.task=mnli needs model.num_labels=3, '
                       'model.head=classify, data.num_choices=1: '):
      gpt_finetune.check_config(config)


class _FakeBuilder:
  """What prepare_tfds uses of a TFDS builder, recording the calls."""

  def __init__(self, data_path):
    self.data_path, self.data_dir, self.calls = data_path, str(data_path), []
    self.info = self

  full_name = 'fake/1.0.0'

  def download_and_prepare(self):
    self.calls.append('prepare')

  def read_from_directory(self, path):
    self.calls.append(('read', path))


@pytest.mark.parametrize('index', [0, 1])
@pytest.mark.parametrize('shared', [True, False])
def test_prepare_tfds_prepares_on_process_0_then_waits(tmp_path, monkeypatch, index, shared):
  barriers = []
  monkeypatch.setattr(sources.jax, 'process_index', lambda: index)
  monkeypatch.setattr(sources.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(sources.multihost_utils, 'sync_global_devices', barriers.append)
  builder = _FakeBuilder(tmp_path if shared else tmp_path / 'not_on_this_host')
  sources.prepare_tfds(builder)
  assert barriers == ['prepare_tfds fake/1.0.0']
  if index == 0:
    assert builder.calls == ['prepare']
  elif shared:  # process 0 wrote it: read the split sizes it recorded
    assert builder.calls == [('read', str(tmp_path))]
  else:  # a host-local directory: no other host writes there
    assert builder.calls == ['prepare']
  # One process: it prepares, and there is no barrier.
  monkeypatch.setattr(sources.jax, 'process_count', lambda: 1)
  monkeypatch.setattr(sources.jax, 'process_index', lambda: 0)
  builder = _FakeBuilder(tmp_path)
  sources.prepare_tfds(builder)
  assert builder.calls == ['prepare'] and len(barriers) == 1


# TFDS, through tfds.testing.mock_data (random strings of ' abcdefghij').


def _mock(tfds):
  return tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE)


def test_tfds_glue_task(tmp_path, tokenizer):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  data_cfg = _data_cfg(tmp_path, task='mrpc', max_seq_length=24)
  with _mock(tfds):
    expected = list(tfds.as_numpy(tfds.load('glue/mrpc', split='validation',
                                            shuffle_files=False)))
    texts, labels = gpt_finetune.tfds_examples('mrpc', data_cfg, 'eval')
    it = gpt_finetune.get_iterator(data_cfg, 'eval', tokenizer=tokenizer, batch_size=4, seed=0)
    batches = [next(it) for _ in range(it.steps_per_epoch)]
  assert texts == [(e['sentence1'].decode(), e['sentence2'].decode()) for e in expected]
  assert labels == [int(e['label']) for e in expected]
  assert it.steps_per_epoch == 2 and batches[1]['example_weights'].tolist() == [1, 1, 0, 0]
  first = batches[0]
  assert first['input_ids'].shape == (4, 2, 24)
  np.testing.assert_array_equal(first['labels'], labels[:4])
  want = gpt_finetune.similarity(tokenizer.encode(texts[0][0]), tokenizer.encode(texts[0][1]),
                                 gpt_finetune.Specials.of(tokenizer), 24)
  for k in range(2):
    n = len(want[k])
    assert first['input_ids'][0, k, :n].tolist() == want[k]
    assert (first['input_ids'][0, k, n:] == tokenizer.pad_id).all()


def test_tfds_regression_and_split_names(tmp_path):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  seen = []
  with _mock(tfds):
    mocked = tfds.core.DatasetBuilder.as_dataset  # the mock's

    def spy(self, *args, split=None, **kwargs):
      seen.append(str(split))
      return mocked(self, *args, split=split, **kwargs)
    tfds.core.DatasetBuilder.as_dataset = spy
    try:
      _, stsb = gpt_finetune.tfds_examples('stsb', _data_cfg(tmp_path), 'train')
      gpt_finetune.tfds_examples('mnli', _data_cfg(tmp_path), 'eval')
      piqa, _ = gpt_finetune.tfds_examples('piqa', _data_cfg(tmp_path), 'eval')
    finally:
      tfds.core.DatasetBuilder.as_dataset = mocked
  assert seen == ['train', 'validation_matched', 'validation']
  assert all(isinstance(label, float) for label in stsb)
  assert all(len(t) == 3 for t in piqa)  # goal, sol1, sol2


def test_tfds_drops_examples_without_a_gold_label_and_checks_features(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  rows = [{'premise': b'p0', 'hypothesis': b'h0', 'label': np.int64(2)},
          {'premise': b'p1', 'hypothesis': b'h1', 'label': np.int64(-1)},
          {'premise': b'p2', 'hypothesis': b'h2', 'label': np.int64(0)}]
  with _mock(tfds):
    monkeypatch.setattr(tfds, 'as_numpy', lambda dataset: iter(rows))
    texts, labels = gpt_finetune.tfds_examples('snli', _data_cfg(tmp_path), 'train')
    assert texts == [('p0', 'h0'), ('p2', 'h2')] and labels == [2, 0]
    monkeypatch.setitem(gpt_finetune.TASKS, 'sst2', gpt_finetune.Task(
        'classification', 2, tfds_name='glue/sst2', text_fields=('text',)))
    with pytest.raises(ValueError, match="no feature 'text' for task 'sst2'.*sentence, label, idx"):
      gpt_finetune.tfds_examples('sst2', _data_cfg(tmp_path), 'train')


def test_snli_test_scores_the_papers_split_and_snli_the_dev_one():
  """GPT (table 2), ELMo and CoVe report SNLI's test accuracy; its TFDS test split has labels."""
  tasks = gpt_finetune.TASKS
  assert tasks['snli'].eval_split == 'validation' and tasks['snli_test'].eval_split == 'test'
  assert dataclasses.replace(tasks['snli_test'], eval_split='validation') == tasks['snli']
  from configs import bert_finetune as bert_configs  # pylint: disable=import-outside-toplevel
  from configs import gpt_finetune as gpt_configs  # pylint: disable=import-outside-toplevel
  for configs in (gpt_configs, bert_configs):
    assert configs.TRAIN_EXAMPLES['snli_test'] == configs.TRAIN_EXAMPLES['snli']
