"""CVT's model: restricted views, the fixed teacher and where dropout applies (Clark et al. 2018)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cvt
from objectives import consistency

TINY = dict(vocab_size=30, num_labels=(5, 3), word_dim=6, char_dim=4, filters=((2, 4),),
            max_characters_per_token=5, first_lstm_dim=7, second_lstm_dim=6, projection_dim=5)
B, L, W = 2, 7, 5
LENGTHS = np.array([7, 5], np.int32)


def _batch(labeled: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  real_BL = np.arange(L)[None] < LENGTHS[:, None]
  batch = {'token_ids': np.where(real_BL, rng.integers(3, 30, (B, L)), 0).astype(np.int32),
           'char_ids': np.where(real_BL[..., None], rng.integers(1, 262, (B, L, W)), 0
                                ).astype(np.int32),
           'lengths': LENGTHS, 'example_weights': np.ones(B, np.float32)}
  if labeled:
    words_BL = real_BL & (np.arange(L)[None] >= 1) & (np.arange(L)[None] < LENGTHS[:, None] - 1)
    batch.update(labels=rng.integers(0, 3, (B, L)).astype(np.int32),
                 label_weights=words_BL.astype(np.float32), task_ids=np.zeros(B, np.int32))
  return jax.tree.map(jnp.asarray, batch)


@pytest.fixture(scope='module')
def setup():
  model = cvt.Model(cvt.Config(**TINY))
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), _batch(True))['params'])
  return model, params


def _apply(model):
  """The training forward, jitted; its outputs hold each prediction module's input as well
  ('module_inputs', by module name)."""
  @jax.jit
  def apply(params, batch, rng):
    inputs = {}

    def record(next_fun, args, kwargs, context):
      if isinstance(context.module, cvt.PredictionModule):
        inputs[context.module.name] = args[0]
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
      out = model.apply({'params': params}, batch, deterministic=False, rngs={'dropout': rng})
    return {**out, 'module_inputs': inputs}
  return apply


def _dropped(outputs, module_names):
  """The share of zeros in those modules' inputs over the real tokens of _batch."""
  real_BL = np.arange(L)[None] < LENGTHS[:, None]
  return np.mean([np.asarray(out['module_inputs'][name])[real_BL] == 0
                  for out in outputs for name in module_names])


def test_param_tree_and_output_shapes(setup):
  model, params = setup
  assert sorted(params) == sorted(
      ['encoder'] + [f'task_{t}_{m}' for t in (0, 1) for m in ('primary', *cvt.AUX_VIEWS)])
  assert sorted(params['encoder']) == ['char_cnn', 'emb_scale', 'first_backward',
                                       'first_forward', 'second_backward', 'second_forward',
                                       'word_embed']
  assert 'projection_kernel' not in params['encoder']['char_cnn']  # pooled filters only
  out = _apply(model)(params, _batch(False), jax.random.key(1))
  assert [x.shape for x in out['primary_logits']] == [(B, L, 5), (B, L, 3)]
  assert [sorted(a) for a in out['aux_logits']] == [sorted(cvt.AUX_VIEWS)] * 2
  assert out['aux_logits'][1]['past'].shape == (B, L, 3)
  evaluated = jax.jit(lambda p, b: model.apply({'params': p}, b))(params, _batch(True))
  assert 'aux_logits' not in evaluated


def test_word_vectors_are_scaled_by_a_learned_scalar_from_one(setup):
  # cvt_text's encoder.py: word_embeddings *= tf.get_variable('emb_scale', initializer=1.0).
  model, params = setup
  assert np.shape(params['encoder']['emb_scale']) == () and params['encoder']['emb_scale'] == 1
  primary = jax.jit(lambda p: model.apply({'params': p}, _batch(True))['primary_logits'][0])
  def encoder_with(**changes):
    return {**params, 'encoder': {**params['encoder'], **changes}}
  table = params['encoder']['word_embed']['embedding']
  no_scale = primary(encoder_with(emb_scale=jnp.zeros(())))
  np.testing.assert_allclose(
      no_scale, primary(encoder_with(word_embed={'embedding': jnp.zeros_like(table)})),
      atol=1e-6)
  assert not np.allclose(no_scale, primary(params), atol=1e-4)


def _view_sensitivity(model, params, view):
  """|d aux logits of row 0 at position i / d word vector at position j|, summed over features."""
  batch = _batch(False)
  vectors_BLD = jnp.take(params['encoder']['word_embed']['embedding'], batch['token_ids'], axis=0)
  # Token (b, i) gets its own row of the embedding table, so each word vector is an input.
  position_ids = jnp.arange(B * L, dtype=jnp.int32).reshape(B, L)

  def logits_of_row0(words_LD):
    table = vectors_BLD.at[0].set(words_LD).reshape(B * L, -1)
    table = jnp.concatenate([table, jnp.zeros((TINY['vocab_size'] - B * L, table.shape[1]))])
    p = {**params, 'encoder': {**params['encoder'], 'word_embed': {'embedding': table}}}
    out = model.apply({'params': p}, {**batch, 'token_ids': position_ids}, deterministic=False,
                      rngs={'dropout': jax.random.key(0)})
    return out['aux_logits'][0][view][0].sum(-1)
  jacobian = jax.jit(jax.jacobian(logits_of_row0))(vectors_BLD[0])  # (L outputs, L inputs, D)
  return np.abs(np.asarray(jacobian)).sum(-1)


@pytest.mark.parametrize('view', cvt.AUX_VIEWS)
def test_each_auxiliary_module_sees_only_its_view(setup, view):
  model, params = setup
  model = cvt.Model(cvt.Config(**TINY, unlabeled_dropout_rate=0.0))
  seen = _view_sensitivity(model, params, view) > 0
  i, j = np.meshgrid(np.arange(L), np.arange(L), indexing='ij')  # output i, input j
  allowed = {'forward': j <= i, 'backward': j >= i, 'future': j < i, 'past': j > i}[view]
  assert not seen[~allowed].any(), f'{view} sees tokens outside its view'
  # ... and it does see every token its view allows (row 0 has no padding).
  assert seen[allowed].all()


def test_unlabeled_loss_moves_no_primary_parameter_and_the_targets_are_fixed(setup):
  model, params = setup
  batch = _batch(False)

  def loss(p):
    out = model.apply({'params': p}, batch, deterministic=False,
                      rngs={'dropout': jax.random.key(3)})
    return consistency.loss_fn(out, batch, tasks=('a', 'b'))[0]
  grads = jax.jit(jax.grad(loss))(params)
  for t in (0, 1):
    for leaf in jax.tree.leaves(grads[f'task_{t}_primary']):
      assert not np.any(leaf)
    for view in cvt.AUX_VIEWS:
      assert np.any(grads[f'task_{t}_{view}']['output']['kernel'])
  assert np.any(grads['encoder']['first_forward']['input_kernel'])
  assert np.any(grads['encoder']['word_embed']['embedding'])
  # The objective alone: no gradient flows into the soft targets.
  out = _apply(model)(params, batch, jax.random.key(3))
  target_grads = jax.grad(lambda primary: consistency.loss_fn(
      {**out, 'primary_logits': primary}, batch, tasks=('a', 'b'))[0])(out['primary_logits'])
  assert all(not np.any(g) for g in target_grads)


def test_teacher_has_no_dropout_and_students_do(setup):
  model, params = setup
  apply, batch = _apply(model), _batch(False)
  first, second = apply(params, batch, jax.random.key(1)), apply(params, batch, jax.random.key(2))
  clean = jax.jit(lambda p, b: model.apply({'params': p}, b))(params, batch)
  for t in (0, 1):
    np.testing.assert_array_equal(first['primary_logits'][t], clean['primary_logits'][t])
    np.testing.assert_array_equal(second['primary_logits'][t], clean['primary_logits'][t])
    assert not np.allclose(first['aux_logits'][t]['forward'], second['aux_logits'][t]['forward'])
  # Once, at the unlabeled rate 0.2 (cvt_text: keep 0.8 on each LSTM's output, none at the
  # modules' input; a second dropout there made it 0.36). 240 values.
  assert abs(_dropped([first, second], ('task_0_forward', 'task_0_backward')) - 0.2) < 0.1


def test_primary_dropout_only_on_labeled_batches(setup):
  model, params = setup
  apply, batch = _apply(model), _batch(True)
  first, second = apply(params, batch, jax.random.key(1)), apply(params, batch, jax.random.key(2))
  assert 'aux_logits' not in first
  assert not np.allclose(first['primary_logits'][0], second['primary_logits'][0])
  # Once, at the labeled rate 0.5 (a second dropout at the module's input made it 0.75). 360 values.
  assert abs(_dropped([first, second], ('task_0_primary',)) - 0.5) < 0.1


def test_config_errors_are_one_line():
  with pytest.raises(ValueError, match='num_labels'):
    cvt.Config(**{**TINY, 'num_labels': (1,)})
  with pytest.raises(ValueError, match='wider than'):
    cvt.Config(**{**TINY, 'filters': ((9, 4),)})
  assert cvt.Config(**{**TINY, 'num_labels': [5, 3], 'filters': [[2, 4]]}).num_labels == (5, 3)
