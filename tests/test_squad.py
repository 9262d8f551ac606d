"""Tests of the SQuAD v1.1 span pipeline for BERT fine-tuning (Devlin et al. 2018, sec. 4.2)."""

import re

import ml_collections
import numpy as np
import pytest

from input_pipeline import squad
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.tasks import offline_tasks

FIELDS = {'input_ids': np.int32, 'segment_ids': np.int32, 'input_mask': np.int32,
          'start_positions': np.int32, 'end_positions': np.int32,
          'example_weights': np.float32, 'example_index': np.int32}


def data_config(data_dir, **overrides):
  cfg = ml_collections.ConfigDict(dict(
      pipeline='squad', task='offline_span', tokenizer='wordpiece', lower_case=True,
      max_seq_length=128, doc_stride=32, max_query_length=64, n_best_size=20,
      max_answer_length=30, tfds_data_dir='', data_dir=str(data_dir), eval_holdout=10,
      max_train_examples=300, max_eval_examples=200))
  cfg.update(overrides)
  return cfg


@pytest.fixture(scope='module')
def tokenizer(shared_data_dir, tmp_path_factory):
  corpus = offline_tasks.corpus_config(data_config(shared_data_dir))
  sentences = [s for doc in sources.documents(corpus, 'train') for s in doc][:3000]
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  return tokenizer_lib.WordPieceTokenizer(
      tokenizer_lib.learn_vocab(sentences, 1000, True, str(path)), True)


# Windows (run_squad.py's doc spans) and where a token has its most context.


def test_windows_cover_every_context_token():
  assert squad.windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
  assert squad.windows(11, 4, 3) == [(0, 4), (3, 4), (6, 4), (9, 2)]
  assert squad.windows(4, 4, 3) == [(0, 4)]
  assert squad.windows(0, 4, 3) == [(0, 0)]  # every question has a row
  rng = np.random.default_rng(0)
  for _ in range(500):
    room = int(rng.integers(2, 40))
    stride = int(rng.integers(1, room))
    num_tokens = int(rng.integers(1, 300))
    spans = squad.windows(num_tokens, room, stride)
    covered = np.zeros(num_tokens, np.int64)
    for start, length in spans:
      assert 1 <= length <= room
      covered[start:start + length] += 1
    assert covered.min() >= 1
    assert [start for start, _ in spans] == list(range(0, stride * len(spans), stride))
    assert sum(spans[-1]) == num_tokens  # the last window ends at the context's end
    assert all(length == room for _, length in spans[:-1])


def test_max_context_is_run_squads():
  # Scores min(left, right) + 0.01 * length; tokens 3 and 6 tie between two windows: the earlier.
  spans = squad.windows(10, 4, 3)
  assert squad.max_context(spans, 0).tolist() == [True, True, True, True]
  assert squad.max_context(spans, 1).tolist() == [False, True, True, True]
  assert squad.max_context(spans, 2).tolist() == [False, True, True, True]
  # Token 3: 0 + 0.04 in the first window beats 0 + 0.02 in the short last one.
  assert squad.max_context([(0, 4), (3, 2)], 1).tolist() == [False, True]
  # Token 1: 0 + 0.02 in (0, 2) loses to 0 + 0.04 in (1, 4): the longer window.
  assert squad.max_context([(0, 2), (1, 4)], 0).tolist() == [True, False]


# A context of 12 words, one token each; windows of 6 tokens every 3: (0, 6), (3, 6), (6, 6).
# Token 3 and 4 have their most context in window 0, tokens 5 to 7 in window 1 (4 and 7 tie).
CONTEXT = 'Zero one Two  three four. Five  SIX seven, eight nine ten eleven'
WORDS = [m.span() for m in re.finditer(r'\S+', CONTEXT)]
SHIFT = 4  # [CLS] and a question of 2 tokens and [SEP] come before the window


def _boundary_examples():
  """Question 0's answer is tokens 5..6 (whole in window 1 only), question 1's 3..4 (both)."""
  questions = [squad.Question('q0', 'q', CONTEXT, ('Five  SIX',), (WORDS[5][0], WORDS[6][1])),
               squad.Question('q1', 'q', CONTEXT, ('three four.',), (WORDS[3][0], WORDS[4][1]))]
  offsets = np.array(WORDS)
  answers = [squad.token_span(offsets, q.answer_span) for q in questions]
  assert answers == [(5, 6), (3, 4)]
  return squad.assemble(questions, [[50, 51], [52, 53]], [list(range(100, 112))], [offsets],
                        [0, 0], answers, max_seq_length=2 + 3 + 6, doc_stride=3)


def _logits(pointers):
  """A row of logits per window: -5 everywhere, `score` at each (start, end) pointed at."""
  start, end = np.full((len(pointers), 11), -5.0), np.full((len(pointers), 11), -5.0)
  for row, pointed in enumerate(pointers):
    for (first, last), score in pointed:
      start[row, first + SHIFT] = end[row, last + SHIFT] = score
  return start.astype(np.float32), end.astype(np.float32)


def test_answer_across_a_window_boundary_comes_from_its_most_central_window(monkeypatch):
  examples = _boundary_examples()
  assert examples.spans(0) == examples.spans(1) == [(0, 6), (3, 6), (6, 6)]
  # Targets: the window holding the whole answer points at it, the others at [CLS].
  assert examples.start_positions.tolist() == [0, 5 - 3 + SHIFT, 0, 3 + SHIFT, SHIFT, 0]
  assert examples.end_positions.tolist() == [0, 6 - 3 + SHIFT, 0, 4 + SHIFT, 1 + SHIFT, 0]
  # Window-relative (start, end) tokens and logits. Question 0: window 0 points at 'Five'
  # (token 5) harder, but token 5 has its most context in window 1, which points at the answer.
  # Question 1: window 1 points at 'four. Five' (token 4, most central in window 0) harder
  # than window 0 points at the answer.
  pointers = [[((5, 5), 9.0)], [((2, 3), 4.0), ((4, 4), 1.0)], [((0, 0), 2.0)],
              [((3, 4), 3.0)], [((1, 2), 8.0), ((4, 4), 2.0)], [((5, 5), 1.0)]]
  start, end = _logits(pointers)
  predictions = {'example_index': np.arange(6), 'start_logits': start, 'end_logits': end}
  found = squad.best_answers(examples, predictions, n_best_size=20, max_answer_length=30)
  # The context's own text: its spacing and case.
  assert found == {0: 'Five  SIX', 1: 'three four.'}
  # Rows in any order, repeated, give the same; a question without rows has no answer.
  rows = [2, 1, 0, 1]
  shuffled = {'example_index': np.array(rows), 'start_logits': start[rows],
              'end_logits': end[rows]}
  assert squad.best_answers(examples, shuffled, n_best_size=20, max_answer_length=30) == {
      0: 'Five  SIX'}
  # n_best_size 1 keeps only the top start and end of each row.
  assert squad.best_answers(examples, predictions, n_best_size=1, max_answer_length=30) == {
      0: 'Five  SIX', 1: 'three four.'}
  # One token at most: 'seven,' (token 7, most central in window 1) scores 1 + 1 for question
  # 0 and 2 + 2 for question 1, more than any other single token of theirs.
  assert squad.best_answers(examples, predictions, n_best_size=20, max_answer_length=1) == {
      0: 'seven,', 1: 'seven,'}
  # Without the max-context rule the harder pointers win: 9 + 9 and 8 + 8.
  monkeypatch.setattr(squad, 'max_context', lambda spans, index: np.ones(spans[index][1], bool))
  assert squad.best_answers(examples, predictions, n_best_size=20, max_answer_length=30) == {
      0: 'Five', 1: 'four. Five'}


# The official SQuAD v1.1 metrics.


def test_exact_match_and_f1_match_a_hand_count():
  assert squad.normalize_answer('The  Cat, sat!') == 'cat sat'
  assert squad.normalize_answer('An apple a day; the END.') == 'apple day end'
  assert squad.normalize_answer('Theatre') == 'theatre'  # only whole words are articles
  assert squad.normalize_answer("U.S.-born") == 'usborn'
  assert squad.exact_match('the Cat.', 'cat') == 1.0
  assert squad.exact_match('cats', 'cat') == 0.0
  # pred cat sat on mat, gold cat on mat: precision 3/4, recall 1.
  assert squad.f1_score('the cat sat on the mat', 'a cat on a mat') == pytest.approx(6 / 7)
  # Common words with multiplicity: cat once, dog once: precision = recall = 2/3.
  assert squad.f1_score('cat cat dog', 'cat dog dog') == pytest.approx(2 / 3)
  assert squad.f1_score('the', 'a') == 0.0 and squad.exact_match('the', 'a') == 1.0
  gold = {'q1': ['Denver Broncos', 'The Denver Broncos'],
          'q2': ['Santa Clara, California', "Levi's Stadium"],
          'q3': ['gold'],
          'q4': ['1990s']}
  predicted = {'q1': 'the Denver Broncos!', 'q2': 'Stadium in Santa Clara', 'q3': 'golden'}
  # q1 exact; q2 best F1 against 'santa clara california': P 2/4, R 2/3 -> 4/7 ("levis
  # stadium": P 1/4, R 1/2 -> 1/3); q3 no common word; q4 unanswered.
  scores = squad.evaluate(predicted, gold)
  assert scores['exact_match'] == pytest.approx(25.0)
  assert scores['f1'] == pytest.approx(100 * (1 + 4 / 7) / 4)


# The batch spec.


def _assert_rows(batch, examples, tokenizer, indices, length):
  """Rows 0, 1, ... of windows `indices` are [CLS] question [SEP] window [SEP] [PAD]..."""
  assert {k: v.dtype for k, v in batch.items()} == FIELDS
  batch_size = len(batch['example_weights'])
  for key in ('input_ids', 'segment_ids', 'input_mask'):
    assert batch[key].shape == (batch_size, length)
  for key in ('start_positions', 'end_positions', 'example_index'):
    assert batch[key].shape == (batch_size,)
  col = np.arange(length)
  for row, window in enumerate(indices):
    q = examples.question[window]
    query = examples.query_tokens[examples.query_starts[q]:][:examples.query_lengths[q]]
    context = examples.context_tokens[examples.context_starts[q] + examples.start[window]:]
    context = context[:examples.length[window]]
    want = [tokenizer.cls_id, *query, tokenizer.sep_id, *context, tokenizer.sep_id]
    ids = batch['input_ids'][row]
    assert ids[:len(want)].tolist() == want
    assert (ids[len(want):] == tokenizer.pad_id).all()
    assert batch['input_mask'][row].tolist() == (col < len(want)).astype(int).tolist()
    second = (col >= len(query) + 2) & (col < len(want))
    assert batch['segment_ids'][row].tolist() == second.astype(int).tolist()


def test_batch_rows_and_answer_positions(tokenizer):
  context = ('Python is a programming language. It was created by Guido van Rossum in 1991, '
             'and its name comes from a comedy group rather than from the snake.')
  answer = 'Guido van Rossum'
  start = context.index(answer)
  question = squad.Question('q', 'Who created Python, and when was it first released?',
                            context, (answer,), (start, start + len(answer)))
  examples = squad.make_examples([question], tokenizer, max_seq_length=24, doc_stride=4,
                                 max_query_length=6, training=True)
  assert examples.query_lengths.tolist() == [6]  # cut to max_query_length
  assert len(examples) > 3
  indices = np.arange(len(examples))
  batch = squad.batch_arrays(examples, indices, np.ones(len(indices), np.float32), max_length=24,
                             cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id,
                             pad_id=tokenizer.pad_id)
  _assert_rows(batch, examples, tokenizer, indices, 24)
  ids, offsets = tokenizer.encode_with_offsets([context])[0]
  first = next(i for i, (s, _) in enumerate(offsets) if s == start)
  last = next(i for i, (_, e) in enumerate(offsets) if e == start + len(answer))
  answer_ids = tokenizer.encode(answer)
  assert ids[first:last + 1] == answer_ids
  holding = 0
  for row, (window_start, window_length) in enumerate(examples.spans(0)):
    starts, ends = batch['start_positions'][row], batch['end_positions'][row]
    if window_start <= first and last < window_start + window_length:
      holding += 1
      assert batch['input_ids'][row, starts:ends + 1].tolist() == answer_ids
      assert examples.text(row, starts - 8, ends - 8) == answer  # [CLS] 6 [SEP] = 8
    else:
      assert starts == ends == 0
  assert 1 <= holding < len(examples)
  np.testing.assert_array_equal(batch['example_index'], indices)


def test_example_batch_has_the_spec(shared_data_dir):
  cfg = data_config(shared_data_dir, max_seq_length=32, max_query_length=8, doc_stride=6)
  batch = squad.example_batch(cfg, 50, 6)
  assert {k: v.dtype for k, v in batch.items()} == FIELDS
  assert batch['input_ids'].shape == (6, 32)
  assert (batch['input_ids'][:, 0] == 2).all()
  lengths = batch['input_mask'].sum(1)
  np.testing.assert_array_equal(batch['input_ids'][np.arange(6), lengths - 1], 3)
  assert ((batch['input_ids'] >= 5) == ((batch['input_mask'] == 1)
                                        & (batch['input_ids'] != 2)
                                        & (batch['input_ids'] != 3))).all()
  assert (batch['input_ids'] < 50).all()
  real = batch['start_positions'] > 0
  assert real.any() and (batch['end_positions'][~real] == 0).all()
  rows = np.arange(6)
  assert (batch['segment_ids'][rows[real], batch['start_positions'][real]] == 1).all()
  assert (batch['end_positions'] >= batch['start_positions']).all()
  assert (batch['end_positions'] < lengths - 1).all()


# offline_span.


def test_offline_span_is_deterministic_and_its_answers_are_in_their_contexts(shared_data_dir,
                                                                            tokenizer):
  cfg = data_config(shared_data_dir, max_train_examples=0, max_eval_examples=0)
  train = squad.offline_span(cfg, 'train')
  assert train == squad.offline_span(cfg, 'train')
  evaluation = squad.offline_span(cfg, 'eval')
  assert len(evaluation) > 500 and len(train) > 5 * len(evaluation)
  assert {q.id.rsplit('-', 1)[0] for q in evaluation} == {'offline_span-eval'}
  for q in train + evaluation:
    start, end = q.answer_span
    assert q.context[start:end] == q.answers[0] and len(q.answers) == 1
    assert 1 <= len(re.findall(r'\w+', q.answers[0])) <= squad.MAX_ANSWER_WORDS
    assert len(re.findall(r'\w+', q.question)) == squad.QUESTION_WORDS
    # The question is copied from the context right before the answer, and its words occur once.
    at = q.context.rindex(q.question, 0, start)
    assert not re.search(r'\w', q.context[at + len(q.question):start])
    words = re.findall(r'\w+', q.context.lower())
    question = re.findall(r'\w+', q.question.lower())
    assert sum(words[i:i + len(question)] == question for i in range(len(words))) == 1
    assert squad.normalize_answer(q.answers[0])
  # The caps take the first questions of the same shuffled order.
  capped = squad.offline_span(data_config(shared_data_dir), 'train')
  assert capped == train[:300]
  # Some contexts need more than one window at max_seq_length 128 with doc_stride 32.
  examples = squad.make_examples(evaluation, tokenizer, max_seq_length=128, doc_stride=32,
                                 max_query_length=64, training=False)
  windows_per_question = np.diff(examples.first_window)
  assert 0.02 < (windows_per_question > 1).mean() < 0.5


def test_offline_span_targets_give_back_the_answers(shared_data_dir, tokenizer):
  cfg = data_config(shared_data_dir)
  it = squad.get_iterator(cfg, 'eval', tokenizer=tokenizer, batch_size=16, seed=0)
  examples = it.examples
  batches = [next(it) for _ in range(it.steps_per_epoch)]
  answered = set()
  for batch in batches:
    for row, window in enumerate(batch['example_index']):
      if window < 0:
        continue
      start, end = batch['start_positions'][row], batch['end_positions'][row]
      if start:
        shift = examples.query_lengths[examples.question[window]] + 2
        q = examples.question[window]
        answer = examples.questions[q].answers[0]
        assert examples.text(window, start - shift, end - shift) == answer
        answered.add(int(q))
  assert answered == set(range(len(examples.questions)))
  # Logits that point at the targets score 100; a question without rows counts 0.
  index = np.concatenate([b['example_index'] for b in batches])
  keep = index >= 0
  predictions = {'example_index': index[keep]}
  for name in ('start', 'end'):
    positions = np.concatenate([b[f'{name}_positions'] for b in batches])[keep]
    logits = np.zeros((keep.sum(), cfg.max_seq_length), np.float32)
    logits[np.arange(len(positions)), positions] = 10.0
    predictions[f'{name}_logits'] = logits
  assert it.score(predictions) == {'exact_match': 100.0, 'f1': 100.0}
  texts = it.predictions_text(predictions)
  assert texts == {q.id: q.answers[0] for q in examples.questions}
  dropped = examples.question[predictions['example_index']] < 20
  partial = {k: v[~dropped] for k, v in predictions.items()}
  assert it.score(partial)['exact_match'] == pytest.approx(100 * (1 - 20 / len(texts)))
  assert set(v for k, v in it.predictions_text(partial).items()
             if k in {q.id for q in examples.questions[:20]}) == {''}


# Order and resume.


def test_train_resumes_exactly_and_eval_pads_with_weight_zero(shared_data_dir, tokenizer):
  cfg = data_config(shared_data_dir, max_train_examples=40, max_eval_examples=60)
  train = squad.get_iterator(cfg, 'train', tokenizer=tokenizer, batch_size=8, seed=3)
  for _ in range(4):
    next(train)
  state = train.get_state()
  expected = [next(train) for _ in range(8)]  # crosses an epoch
  resumed = squad.get_iterator(cfg, 'train', tokenizer=tokenizer, batch_size=8, seed=3)
  resumed.set_state(state)
  np.testing.assert_equal([next(resumed) for _ in expected], expected)
  assert resumed.get_state()['epoch'] >= 1
  assert all((b['example_weights'] == 1).all() and (b['example_index'] >= 0).all()
             for b in expected)

  hosts = [squad.get_iterator(cfg, 'eval', tokenizer=tokenizer, batch_size=8, seed=0,
                              process_index=i, process_count=2) for i in range(2)]
  num_windows = len(hosts[0].examples)
  assert num_windows > 60  # some questions have two windows
  seen = []
  for i, host in enumerate(hosts):
    own = len(range(i, num_windows, 2))
    assert host.steps_per_epoch == -(-((num_windows + 1) // 2) // 8)
    batches = [next(host) for _ in range(host.steps_per_epoch)]
    again = [next(host) for _ in range(host.steps_per_epoch)]  # the next pass is the same
    np.testing.assert_equal(again, batches)
    weights = np.concatenate([b['example_weights'] for b in batches])
    index = np.concatenate([b['example_index'] for b in batches])
    assert set(weights.tolist()) <= {0.0, 1.0} and weights.sum() == own
    assert (index[weights == 0] == -1).all() and (index[weights == 1] >= 0).all()
    seen += index[weights == 1].tolist()
  assert sorted(seen) == list(range(num_windows))


# TFDS squad/v1.1, through tfds.testing.mock_data.

SQUAD = {
    'train': [
        ('t0', 'Where is the tower?', 'The tower stands in Paris, France.', ['Paris'], [20]),
        # Not at its answer_start: the span given there is the answer.
        ('t1', 'What stands?', 'The tower stands in Paris, France.', ['France'], [4]),
        # Outside the context: left out of training.
        ('t2', 'What?', 'Short.', ['nothing'], [40]),
    ],
    'validation': [
        ('v0', 'Which city?', 'The tower stands in Paris, France.',
         ['Paris', 'Paris, France', 'in Paris'], [20, 20, 17]),
        ('v1', 'What?', 'Short.', ['nothing'], [40]),
    ],
}


def _fake_squad(self, split, **kwargs):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  del self, kwargs
  rows = SQUAD[str(split)]
  return tf.data.Dataset.from_generator(
      lambda: ({'id': i, 'title': 'T', 'context': c, 'question': q,
                'answers': {'text': texts, 'answer_start': starts}}
               for i, q, c, texts, starts in rows),
      output_signature={'id': tf.TensorSpec([], tf.string), 'title': tf.TensorSpec([], tf.string),
                        'context': tf.TensorSpec([], tf.string),
                        'question': tf.TensorSpec([], tf.string),
                        'answers': {'text': tf.TensorSpec([None], tf.string),
                                    'answer_start': tf.TensorSpec([None], tf.int32)}})


def test_tfds_squad(shared_data_dir, tokenizer):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  cfg = data_config(shared_data_dir, task='squad', max_seq_length=24, max_query_length=8,
                    doc_stride=4)
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_fake_squad):
    train = squad.get_iterator(cfg, 'train', tokenizer=tokenizer, batch_size=4, seed=0)
    evaluation = squad.get_iterator(cfg, 'eval', tokenizer=tokenizer, batch_size=4, seed=0)
  assert [q.id for q in train.examples.questions] == ['t0', 't1']
  first, misplaced = train.examples.questions
  assert first.context[slice(*first.answer_span)] == 'Paris'
  assert misplaced.answer_span == (4, 10)  # 'tower ', the span given
  assert [q.id for q in evaluation.examples.questions] == ['v0', 'v1']
  assert evaluation.examples.questions[0].answers == ('Paris', 'Paris, France', 'in Paris')
  batch = next(evaluation)
  rows = len(evaluation.examples)
  assert rows == 2 and batch['example_index'].tolist() == [0, 1, -1, -1]
  _assert_rows(batch, evaluation.examples, tokenizer, [0, 1], 24)
  # Logits at the first gold answer's tokens score 100 on v0; v1 has no answer to find.
  start, end = np.zeros((rows, 24), np.float32), np.zeros((rows, 24), np.float32)
  start[np.arange(rows), batch['start_positions'][:rows]] = 10.0
  end[np.arange(rows), batch['end_positions'][:rows]] = 10.0
  predictions = {'example_index': np.arange(rows), 'start_logits': start, 'end_logits': end}
  assert evaluation.predictions_text(predictions)['v0'] == 'Paris'
  assert evaluation.score(predictions)['exact_match'] == pytest.approx(50.0)
  # The mock's random examples (answers not in their contexts) load and score without error.
  with tfds.testing.mock_data(num_examples=5, policy=tfds.testing.MockPolicy.USE_CODE):
    mocked = squad.get_iterator(cfg, 'eval', tokenizer=tokenizer, batch_size=4, seed=0)
  assert len(mocked.examples.questions) == 5
  batches = [next(mocked) for _ in range(mocked.steps_per_epoch)]
  index = np.concatenate([b['example_index'] for b in batches])
  rng = np.random.default_rng(0)
  scores = mocked.score({'example_index': index[index >= 0],
                         'start_logits': rng.normal(size=((index >= 0).sum(), 24)),
                         'end_logits': rng.normal(size=((index >= 0).sum(), 24))})
  assert 0 <= scores['exact_match'] <= scores['f1'] <= 100


# Config errors, each in one line naming the fix.


def _config(shared_data_dir, **data):
  return ml_collections.ConfigDict(dict(
      data=data_config(shared_data_dir, **data),
      model=dict(head='span', num_labels=2, max_position_embeddings=512)))


@pytest.mark.parametrize('data, model, message', [
    (dict(task='sst2'), {}, 'Unknown SQuAD task .* data.pipeline=bert_finetune'),
    (dict(tokenizer='bpe'), {}, 'data.tokenizer=wordpiece'),
    (dict(max_query_length=0), {}, 'max_query_length=0'),
    (dict(max_seq_length=68), {}, 'max_seq_length=68 leaves 1 context .* use 69 or more'),
    (dict(max_seq_length=128, doc_stride=61), {}, 'doc_stride=61 must be between 1 and 60'),
    (dict(doc_stride=0), {}, 'doc_stride=0 must be'),
    (dict(n_best_size=0), {}, 'n_best_size=0'),
    (dict(max_answer_length=0), {}, 'max_answer_length=0'),
    ({}, dict(head='classify'), 'needs model.head=span'),
    (dict(max_seq_length=1024, doc_stride=128), {}, 'exceeds the model.s 512 positions'),
])
def test_check_config_errors(shared_data_dir, data, model, message):
  config = _config(shared_data_dir, **data)
  config.model.update(model)
  with pytest.raises(ValueError, match=message) as error:
    squad.check_config(config)
  assert '\n' not in str(error.value)


def test_check_config_accepts_the_reference_sizes(shared_data_dir):
  squad.check_config(_config(shared_data_dir, max_seq_length=384, doc_stride=128))
  squad.check_config(_config(shared_data_dir))  # offline_span's 128 with stride 32
