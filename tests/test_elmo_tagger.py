"""Tests of ELMo's task model, a tagger over a frozen biLM (Peters et al. 2018, sec. 3.3)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import elmo
from models import elmo_tagger
from objectives import tagging
import trainer.optimizer

TINY = dict(vocab_size=40, char_dim=4, max_characters_per_token=6, filters=((1, 4), (2, 6)),
            num_highway=1, projection_dim=8, lstm_dim=12, num_layers=2, num_sampled=0,
            num_labels=3, word_dim=5, task_lstm_dim=7, task_num_layers=2)
B, L, W = 2, 5, 6
LENGTHS = np.array([5, 3], np.int32)


def _config(**overrides):
  return elmo_tagger.Config(**{**TINY, **overrides})


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  real_BL = np.arange(L)[None] < LENGTHS[:, None]
  return {'token_ids': jnp.asarray(np.where(real_BL, rng.integers(3, 40, (B, L)), 0), jnp.int32),
          'char_ids': jnp.asarray(np.where(real_BL[..., None], rng.integers(1, 262, (B, L, W)), 0),
                                  jnp.int32),
          'lengths': jnp.asarray(LENGTHS),
          'labels': jnp.asarray(rng.integers(0, 3, (B, L)), jnp.int32),
          'label_weights': jnp.asarray(real_BL, jnp.float32),
          'example_weights': jnp.ones((B,), jnp.float32)}


def _abstract_init(model, batch):
  """(outputs, variables) as shapes only: nothing is compiled."""
  return nn.unbox(jax.eval_shape(lambda: model.init_with_output(jax.random.key(0), batch)))


def test_config_carries_the_bilm_fields():
  tagger_fields = {f.name for f in dataclasses.fields(elmo_tagger.Config)}
  for field in dataclasses.fields(elmo.Config):
    assert field.name in tagger_fields
    assert getattr(elmo_tagger.Config(), field.name) == getattr(elmo.Config(), field.name)
  # The parent's checks and normalization still run (ml_collections may give lists).
  cfg = _config(filters=[[1, 4], [2, 6]])
  assert cfg.filters == ((1, 4), (2, 6))
  assert elmo_tagger.bilm_config(cfg) == elmo.Config(**{
      k: v for k, v in TINY.items() if k in {f.name for f in dataclasses.fields(elmo.Config)}})
  with pytest.raises(ValueError, match='task_lstm_dim'):
    _config(task_lstm_dim=0)
  with pytest.raises(ValueError, match='elmo_dropout_rate'):
    _config(elmo_dropout_rate=1.0)
  with pytest.raises(ValueError):
    _config(num_layers=0)  # a biLM field, checked by elmo.Config
  with pytest.raises(ValueError, match='elmo_layer=9'):
    _config(elmo_layer=9)


@pytest.mark.parametrize('overrides, output_mix', [
    ({}, False), ({'use_elmo': False}, False), ({'elmo_at_output': True}, True),
    ({'elmo_top_only': True, 'elmo_at_output': True}, True), ({'elmo_layer': 1}, False)])
def test_output_shapes_and_params(overrides, output_mix):
  cfg = _config(**overrides)
  outputs, variables = _abstract_init(elmo_tagger.Model(cfg), _batch())
  params = variables['params']
  assert outputs['logits'].shape == (B, L, 3) and outputs['logits'].dtype == jnp.float32
  assert outputs['mix_l2'].shape == ()
  assert ('bilm' in params) == cfg.use_elmo and ('input_mix' in params) == cfg.use_elmo
  assert ('output_mix' in params) == output_mix
  for name in ('input_mix', 'output_mix'):
    if name in params:  # gamma * top layer: no mix weights to learn
      assert ('scalar_weights' in params[name]) != (cfg.elmo_top_only or cfg.elmo_layer >= 0)
  width = 2 * cfg.task_lstm_dim + (2 * cfg.projection_dim if output_mix else 0)
  assert params['classifier']['kernel'].shape == (width, 3)


def test_bilm_params_are_the_pretraining_models():
  cfg = _config()
  _, tagger = _abstract_init(elmo_tagger.Model(cfg), _batch())
  pretraining = nn.unbox(jax.eval_shape(lambda: elmo.Model(elmo_tagger.bilm_config(cfg)).init(
      jax.random.key(0), _batch(), deterministic=True)))
  want, got = pretraining['params']['bilm'], tagger['params']['bilm']
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.map(lambda x: x.shape, got) == jax.tree.map(lambda x: x.shape, want)


def test_gradients_skip_the_frozen_bilm():
  model = elmo_tagger.Model(_config(elmo_at_output=True))
  batch = _batch()
  # Random params from the shapes: one compile (the step's), not two.
  _, variables = _abstract_init(model, batch)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32),
                        variables['params'])
  params['input_mix']['scalar_weights'] = np.array([0.5, -1.0, 2.0], np.float32)

  def loss(params):
    outputs = model.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': jax.random.key(1)})
    return tagging.loss_fn(outputs, batch, mix_l2_coef=0.1)[0], outputs

  (_, outputs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  grads = jax.tree.map(np.asarray, grads)
  assert all(not g.any() for g in jax.tree.leaves(grads['bilm']))
  # Everything else learns; gamma's gradient is 0 unless ELMo reaches the tags.
  for name in ('word_embed', 'task_forward_0', 'task_backward_1', 'classifier'):
    assert all(g.any() for g in jax.tree.leaves(grads[name])), name
  for name in ('input_mix', 'output_mix'):
    assert grads[name]['gamma'] != 0 and grads[name]['scalar_weights'].all(), name
  want_l2 = 0.25 + 1.0 + 4.0 + (params['output_mix']['scalar_weights'] ** 2).sum()
  np.testing.assert_allclose(outputs['mix_l2'], want_l2, rtol=1e-6)


def test_frozen_parameters_get_no_update_even_with_weight_decay():
  """optimizer.frozen: the biLM stays as pretrained (sec. 3.3), whatever its gradient."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  opt_cfg = ml_collections.ConfigDict(dict(
      name='adamw', learning_rate=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5,
      clip_norm=1.0, frozen=('bilm',)))
  params = {'bilm': {'kernel': jnp.ones((3, 2))}, 'classifier': {'kernel': jnp.ones((2, 2))}}
  grads = jax.tree.map(jnp.ones_like, params)  # a gradient the stop-gradient would have zeroed

  def first_update(cfg):  # one compiled program, not the optimizer op by op
    tx = trainer.optimizer.make_optimizer(cfg, optax.constant_schedule(0.1))
    return jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)

  updates = first_update(opt_cfg)
  assert not np.asarray(updates['bilm']['kernel']).any()
  assert np.asarray(updates['classifier']['kernel']).all()
  opt_cfg.frozen = ()
  assert np.asarray(first_update(opt_cfg)['bilm']['kernel']).all()


def test_eval_padding_rows_do_not_change_the_layer_norm_mix():
  """Eval pads its last batch with copies of a sentence (example_weights 0); the mix ignores them."""
  model = elmo_tagger.Model(_config(elmo_layer_norm=True))
  batch = _batch()
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  padded = {k: jnp.concatenate([v, v[1:]]) for k, v in batch.items()}
  padded['example_weights'] = padded['example_weights'].at[-1].set(0.0)
  apply = jax.jit(model.apply)  # eager scans dispatch every op: 20 s instead of 2
  alone = apply(variables, batch)['logits']
  with_padding = apply(variables, padded)['logits'][:B]
  np.testing.assert_allclose(with_padding, alone, atol=1e-5)


def test_the_task_model_reads_the_words_alone():
  """bilm-tf hands the task model the words without <S> and </S>: what stands at the
  boundaries changes no word's logits (each direction starts from zeros at a word)."""
  model = elmo_tagger.Model(_config(use_elmo=False))
  batch = _batch()
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  apply = jax.jit(model.apply)
  logits = apply(variables, batch)['logits']
  ends = LENGTHS - 1
  changed = dict(batch, token_ids=batch['token_ids'].at[:, 0].set(39).at[
      jnp.arange(B), ends].set(38))
  np.testing.assert_array_equal(apply(variables, changed)['logits'][0, 1:ends[0]],
                                logits[0, 1:ends[0]])
  np.testing.assert_array_equal(apply(variables, changed)['logits'][1, 1:ends[1]],
                                logits[1, 1:ends[1]])
  assert logits.shape == (B, L, TINY['num_labels'])
