"""Tests of the Biattentive Classification Network on CoVe, its pipeline and loss (McCann et al. 2017, sec. 5)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import cove as cove_configs
from configs import cove_classifier
from input_pipeline import word_classification
from input_pipeline.common import sources
from input_pipeline.common import words as words_lib
from input_pipeline.tasks import offline_tasks
from models import bcn
from models import cove
from objectives import gpt_finetune as classification
import trainer.checks

TINY = dict(vocab_size=30, word_dim=6, hidden_size=5, num_encoder_layers=2, num_labels=3,
            feedforward_dim=7, bilstm_dim=4, integrator_dim=3, maxout_dims=(8, 6))
B = 3
X_LENGTHS, Y_LENGTHS = np.array([5, 2, 1], np.int32), np.array([3, 4, 1], np.int32)


def _batch(length: int, seed: int = 0):
  """Word ids of lengths X_LENGTHS and Y_LENGTHS padded to `length`; the same words at any length."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(2, TINY['vocab_size'], (2, B, 5))
  col = np.arange(length)
  return {'x_ids': np.where(col < X_LENGTHS[:, None], np.pad(ids[0], ((0, 0), (0, length - 5))),
                            0).astype(np.int32),
          'y_ids': np.where(col < Y_LENGTHS[:, None], np.pad(ids[1], ((0, 0), (0, length - 5))),
                            0).astype(np.int32),
          'x_lengths': X_LENGTHS, 'y_lengths': Y_LENGTHS,
          'labels': np.array([0, 2, 1], np.int32), 'example_weights': np.ones(B, np.float32)}


def _random_params(model, batch, seed=0):
  """Params of the model's shapes, drawn in numpy: no compile for the init."""
  abstract = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), batch)))['params']
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.normal(0.0, 0.5, x.shape).astype(np.float32), abstract)


# The biattention and the pooling (sec. 5), against NumPy on a case with padding.


def _softmax(z, axis):
  z = np.exp(z - z.max(axis=axis, keepdims=True))
  return z / z.sum(axis=axis, keepdims=True)


def test_biattention_and_pooling_match_numpy_and_ignore_padding():
  rng = np.random.default_rng(0)
  L, S, D = 6, 5, 4
  # Padding positions hold garbage: only the masks may keep it out.
  X, Y = rng.normal(size=(B, L, D)), rng.normal(size=(B, S, D))
  v = rng.normal(size=D)
  x_mask, y_mask = np.arange(L) < X_LENGTHS[:, None], np.arange(S) < Y_LENGTHS[:, None]
  Cx, Cy = bcn.biattention(jnp.asarray(X, jnp.float32), jnp.asarray(Y, jnp.float32),
                           jnp.asarray(x_mask), jnp.asarray(y_mask))
  pooled = bcn.pool(jnp.asarray(X, jnp.float32), jnp.asarray(x_mask),
                    jnp.asarray(X @ v, jnp.float32))
  for b in range(B):
    n, m = X_LENGTHS[b], Y_LENGTHS[b]
    x, y = X[b, :n], Y[b, :m]
    A = x @ y.T  # (n, m)
    Ax, Ay = _softmax(A, 0), _softmax(A.T, 0)  # the paper's column-wise softmax
    np.testing.assert_allclose(Cx[b, :m], Ax.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(Cy[b, :n], Ay.T @ y, rtol=1e-5, atol=1e-6)
    beta = _softmax(x @ v, 0)
    want = np.concatenate([x.max(0), x.mean(0), x.min(0), x.T @ beta])
    np.testing.assert_allclose(pooled[b], want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope='module')
def model_and_params():
  model = bcn.Model(bcn.Config(**TINY))
  return model, _random_params(model, _batch(5))


def test_outputs_and_padding_changes_nothing(model_and_params):
  model, params = model_and_params
  apply = jax.jit(model.apply)  # eager LSTM scans would dispatch every op
  short, long = apply({'params': params}, _batch(5)), apply({'params': params}, _batch(9))
  assert short['logits'].shape == (B, 3) and short['logits'].dtype == jnp.float32
  assert short['pooled'].shape == (B, 2 * 4 * 2 * TINY['integrator_dim'])
  np.testing.assert_allclose(long['logits'], short['logits'], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(long['pooled'], short['pooled'], rtol=1e-5, atol=1e-5)
  # The two inputs play different parts: swapping them changes the logits.
  assert np.abs(short['logits'] - apply({'params': params}, {
      **_batch(5), 'x_ids': _batch(5)['y_ids'], 'y_ids': _batch(5)['x_ids'],
      'x_lengths': Y_LENGTHS, 'y_lengths': X_LENGTHS})['logits']).max() > 1e-4


def test_gradients_skip_the_frozen_glove_and_cove(model_and_params):
  model, params = model_and_params
  batch = _batch(5)

  def loss(params):
    outputs = model.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': jax.random.key(1)})
    return classification.loss_fn(outputs, batch)[0]

  grads = jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(params))
  for name in ('word_vectors', 'encoder'):
    assert all(not g.any() for g in jax.tree.leaves(grads[name])), name
  for name in ('feedforward', 'bilstm_forward', 'integrator_backward', 'x_self_attention',
               'y_self_attention', 'maxout_0', 'maxout_2'):
    assert any(g.any() for g in jax.tree.leaves(grads[name])), name
  # optimizer.frozen without 'encoder' fine-tunes CoVe, as the docs say: its gradient flows.
  config = cove_classifier.get_config('offline_shuffled,tiny')
  config.model.update({k: v for k, v in model.config.__dict__.items() if k != 'frozen'})
  config.optimizer.frozen = ('word_vectors',)  # the model takes it (trainer.checks.model_config)
  tuned = bcn.Model(trainer.checks.model_config(config))
  assert tuned.config.frozen == ('word_vectors',)

  def tuned_loss(params):
    outputs = tuned.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': jax.random.key(1)})
    return classification.loss_fn(outputs, batch)[0]

  grads = jax.tree.map(np.asarray, jax.jit(jax.grad(tuned_loss))(params))
  assert all(not g.any() for g in jax.tree.leaves(grads['word_vectors']))
  assert all(g.any() for g in jax.tree.leaves(grads['encoder']))
  frozen_flops = bcn.train_flops_per_example(model.config, config.data)
  assert bcn.train_flops_per_example(tuned.config, config.data) > frozen_flops
  # A frozen encoder over trained word vectors passes their gradient through.
  config.optimizer.frozen = ('encoder',)
  under = bcn.Model(trainer.checks.model_config(config))

  def under_loss(params):
    outputs = under.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': jax.random.key(1)})
    return classification.loss_fn(outputs, batch)[0]

  grads = jax.tree.map(np.asarray, jax.jit(jax.grad(under_loss))(params))
  # Through CoVe: its weights' gradient is computed on the way (the optimizer drops it).
  assert all(g.any() for g in jax.tree.leaves(grads['encoder']))


def test_glove_and_cove_params_are_the_cove_models():
  """train.py's init_from fills them by name from a CoVe run's checkpoint."""
  cfg = bcn.Config(**TINY)
  params = nn.unbox(jax.eval_shape(lambda: bcn.Model(cfg).init(jax.random.key(0), _batch(5))))
  cove_batch = {'source_ids': _batch(5)['x_ids'], 'target_input_ids': np.ones((B, 4), np.int32)}
  pretrained = nn.unbox(jax.eval_shape(lambda: cove.Model(bcn.cove_config(cfg)).init(
      jax.random.key(0), cove_batch)))
  shapes = lambda tree: jax.tree.map(lambda x: x.shape, tree)  # noqa: E731
  for name in ('word_vectors', 'encoder'):
    assert shapes(params['params'][name]) == shapes(pretrained['params'][name])
  # No BCN parameter may collide with another of CoVe's (its decoder, its 'output').
  assert set(params['params']) & set(pretrained['params']) == {'word_vectors', 'encoder'}


def test_without_cove_the_bcn_reads_glove_alone():
  cfg = bcn.Config(**TINY, use_cove=False)
  outputs, variables = nn.unbox(jax.eval_shape(
      lambda: bcn.Model(cfg).init_with_output(jax.random.key(0), _batch(5))))
  assert 'encoder' not in variables['params']
  assert variables['params']['feedforward']['kernel'].shape == (TINY['word_dim'],
                                                                TINY['feedforward_dim'])
  assert outputs['logits'].shape == (B, 3)
  with_cove = bcn.Config(**TINY)
  data_cfg = ml_collections.ConfigDict({'max_seq_length': 16})
  assert 0 < bcn.train_flops_per_example(cfg, data_cfg) < bcn.train_flops_per_example(
      with_cove, data_cfg)


# The pipeline.


DOCUMENTS = [['The cat sat on the mat today .', 'A dog ran in the park fast .', 'Birds sing .'],
             ['Rain fell all day long here .', 'The sun came out at last .'],
             ['Cats and dogs play well together .', 'Fish swim in the cold sea .', 'End .']] * 8
WORDS = ('the', 'cat', 'sat', 'on', 'mat', 'dog', 'ran', 'in', 'park', '.', 'rain', 'sun', 'sea')


@pytest.fixture
def words_dir(tmp_path, monkeypatch):
  """A hand-made words.txt, and the documents above as the embedded corpus."""
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(''.join(''.join(s + '\n' for s in doc) + '\n' for doc in DOCUMENTS))
  monkeypatch.setattr(sources, 'embedded_corpus', lambda data_dir: str(corpus))
  (tmp_path / 'words.txt').write_text('\n'.join(words_lib.SPECIAL_WORDS + WORDS) + '\n')
  return str(tmp_path)


def _data_cfg(tmp_path, **overrides):
  cfg = ml_collections.ConfigDict(dict(
      pipeline='word_classification', task='offline_next', max_seq_length=6, lower_case=True,
      data_dir=str(tmp_path), eval_holdout=4, max_examples=0, tfds_data_dir=''))
  cfg.update(overrides)
  return cfg


FIELDS = {'x_ids': np.int32, 'y_ids': np.int32, 'x_lengths': np.int32, 'y_lengths': np.int32,
          'labels': np.int32, 'example_weights': np.float32}


def _expected_ids(text, lower_case, length):
  ids = {w: i for i, w in enumerate(words_lib.SPECIAL_WORDS + WORDS)}
  words = words_lib.word_tokens(text.lower() if lower_case else text)
  return [ids.get(w, 2) for w in words][:length] or [2]


@pytest.mark.parametrize('task, lower_case', [('offline_next', True), ('offline_shuffled', False)])
def test_batches_follow_the_spec(words_dir, task, lower_case):
  data_cfg = _data_cfg(words_dir, task=task, lower_case=lower_case)
  tokenizer = word_classification.get_tokenizer(data_cfg, 100, saved_dir=words_dir)
  texts, labels = offline_tasks.offline_examples(task, data_cfg, 'eval')
  data = word_classification.get_iterator(data_cfg, 'eval', tokenizer=tokenizer, batch_size=4,
                                          seed=0)
  rows = []
  for _ in range(data.steps_per_epoch):
    batch = next(data)
    assert {k: v.dtype for k, v in batch.items()} == FIELDS
    assert batch['x_ids'].shape == batch['y_ids'].shape == (4, 6)
    for b in range(4):
      if batch['example_weights'][b]:
        rows.append({k: v[b] for k, v in batch.items()})
  assert len(rows) == len(texts)
  for row, example, label in zip(rows, texts, labels):  # eval keeps the split's order
    x_text, y_text = example if task == 'offline_next' else example * 2  # y = x when alone
    for side, text in (('x', x_text), ('y', y_text)):
      want = _expected_ids(text, lower_case, 6)
      assert row[f'{side}_lengths'] == len(want)
      assert row[f'{side}_ids'].tolist() == want + [0] * (6 - len(want))
    assert row['labels'] == label
  # Cased text meets an uncased vocabulary: capitalized words are unknown.
  if not lower_case:
    assert any(2 in r['x_ids'] for r in rows)


def test_cut_and_empty_texts():
  vocab = type('Vocab', (), {'encode_batch': lambda self, texts: [
      [3 + i for i, _ in enumerate(t.split())] for t in texts]})()
  assert word_classification.word_ids(['a b c d', '', 'A'], vocab, True, 3) == [
      [3, 4, 5], [2], [3]]


def test_training_batches_resume_exactly(words_dir):
  data_cfg = _data_cfg(words_dir, task='offline_same_doc')
  tokenizer = word_classification.get_tokenizer(data_cfg, 100, saved_dir=words_dir)
  make = lambda: word_classification.get_iterator(  # noqa: E731
      data_cfg, 'train', tokenizer=tokenizer, batch_size=8, seed=3)
  first = make()
  for _ in range(first.num_examples // 8 + 1):  # into the second epoch: a new order
    next(first)
  state = first.get_state()
  want = [next(first) for _ in range(4)]
  resumed = make()
  resumed.set_state(state)
  for expected in want:
    got = next(resumed)
    assert all(np.array_equal(got[k], expected[k]) for k in FIELDS)
  assert state['epoch'] >= 1


def test_example_batch_has_the_spec():
  for task in ('offline_shuffled', 'snli'):
    data_cfg = ml_collections.ConfigDict({'task': task, 'max_seq_length': 5})
    batch = word_classification.example_batch(data_cfg, 30, 4)
    assert {k: v.dtype for k, v in batch.items()} == FIELDS
    assert (batch['x_lengths'] >= 1).all() and (batch['x_ids'] < 30).all()
    assert (batch['x_ids'] == batch['y_ids']).all() == (task == 'offline_shuffled')


# The loss: the classification loss of objectives/gpt_finetune.py, without an LM.


def test_loss_is_the_mean_cross_entropy_of_the_weighted_examples():
  outputs = {'logits': jnp.array([[0.0, 0.0], [np.log(3.0), 0.0], [np.nan, np.nan]])}
  batch = {'labels': jnp.array([1, 0, 0]), 'example_weights': jnp.array([1.0, 1.0, 0.0])}
  loss, metrics = classification.loss_fn(outputs, batch)
  want = (np.log(2.0) + np.log(4.0 / 3.0)) / 2  # -log 1/2, -log 3/4; the padding row is out
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  summary = classification.summarize(jax.tree.map(np.asarray, metrics))
  np.testing.assert_allclose(summary['loss'], want, rtol=1e-6)
  assert summary['accuracy'] == 0.5  # the tie goes to label 0


# Config errors, each in one line.


def _one_line_error(fn, match):
  with pytest.raises(ValueError, match=match) as error:
    fn()
  assert '\n' not in str(error.value)


def test_config_errors_are_one_line(tmp_path):
  config = cove_classifier.get_config('offline_shuffled,tiny')
  _one_line_error(lambda: bcn.check_config(config), 'init_from')
  config.model.use_cove = False
  _one_line_error(lambda: bcn.check_config(config), 'baseline too')
  config.init_from = 'runs/cove_tiny'
  bcn.check_config(config)
  config.model.num_labels = 3
  _one_line_error(lambda: word_classification.check_config(config), 'num_labels=2')
  _one_line_error(lambda: cove_classifier.get_config('piqa'), 'multiple choice')
  _one_line_error(lambda: cove_classifier.get_config('stsb'), 'regression')
  _one_line_error(lambda: cove_classifier.get_config('sst2,huge'), 'tiny, base')
  _one_line_error(lambda: word_classification.get_tokenizer(config.data, 4000), 'init_from')
  _one_line_error(lambda: word_classification.get_tokenizer(config.data, 4000, str(tmp_path)),
                  'words.txt')
  _one_line_error(lambda: bcn.Config(**{**TINY, 'maxout_dropout_rates': (0.1,)}), 'one rate')


def test_tiny_cove_sizes_are_configs_coves():
  """check_init_from compares these with the CoVe run; a mismatch would refuse every tiny run."""
  config = cove_classifier.get_config('offline_shuffled,tiny')
  theirs = cove_configs.get_config('tiny').model
  for ours, their_field in bcn.INIT_FROM_FIELDS.items():
    assert config.model[ours] == theirs[their_field], ours
  # The casing, as the word split, is the CoVe run's (the release's and base's lower-case).
  assert config.data.lower_case is None
  tiny_run, base_run = cove_configs.get_config('tiny'), cove_configs.get_config('base')
  assert tiny_run.data.lower_case is False and base_run.data.lower_case is True


def test_the_word_split_comes_from_init_from_and_defaults_without_a_run():
  # bench.py and aot.py read no run: the split for raw text (the BCN's sizes are its own).
  config = cove_classifier.get_config('offline_shuffled,tiny')
  assert config.data.split_words is None
  trainer.checks.inherit_unset_fields(config, None)
  assert config.data.split_words == 'punctuation' and config.data.lower_case is False
