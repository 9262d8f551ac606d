"""BERT model: the paper's parameter counts, shapes, padding, attention paths, scanned layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from models import bert
from models import layers


def _batch(B=2, L=16, P=4, vocab=100, seed=0):
  rng = np.random.default_rng(seed)
  return {
      'input_ids': jnp.asarray(rng.integers(5, vocab, (B, L)), jnp.int32),
      'segment_ids': jnp.asarray(np.repeat([[0] * (L // 2) + [1] * (L - L // 2)], B, 0), jnp.int32),
      'input_mask': jnp.ones((B, L), jnp.int32),
      'masked_lm_positions': jnp.asarray(rng.integers(1, L, (B, P)), jnp.int32),
  }


def _expected_count(V, D, layers_, F, positions=512, types=2):
  embeddings = (V + positions + types) * D + 2 * D
  block = 4 * (D * D + D) + 2 * D + (D * F + F) + (F * D + D) + 2 * D
  pooler = D * D + D
  heads = (D * D + D) + 2 * D + V + (2 * D + 2)  # MLM transform, LN, output bias; NSP
  return embeddings + layers_ * block + pooler + heads


@pytest.mark.parametrize('name,kwargs,paper,reference', [
    ('base', {}, 110e6, 110_106_428),
    ('large', dict(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096), 340e6,
     336_226_108),
])
def test_parameter_count_matches_paper(name, kwargs, paper, reference):
  # Devlin et al. 2018, sec. 3: BERT-BASE 110M, BERT-LARGE 340M parameters.
  cfg = bert.Config(**kwargs)
  shapes = jax.eval_shape(lambda: bert.Model(cfg).init(jax.random.key(0), _batch(1, 8, 2)))
  count = layers.count_params(nn.meta.unbox(shapes['params']))
  print(f'BERT-{name}: {count:,} parameters')
  assert count == _expected_count(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.mlp_dim)
  assert count == reference  # HF BertForPreTraining, with its tied output layer
  assert abs(count - paper) / paper < 0.015


def _tiny(**kw):
  return bert.Config(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
                     max_position_embeddings=32, **kw)


def test_output_shapes():
  cfg = _tiny()
  model = bert.Model(cfg)
  batch = _batch()
  variables = model.init(jax.random.key(0), batch)
  out = model.apply(variables, batch)
  assert out['mlm_logits'].shape == (2, 4, 100)
  assert out['mlm_logits'].dtype == jnp.float32
  assert out['nsp_logits'].shape == (2, 2)
  assert out['pooled_output'].shape == (2, 32)
  assert len(out['hidden_states']) == cfg.num_layers + 1
  assert all(h.shape == (2, 16, 32) for h in out['hidden_states'])
  np.testing.assert_array_equal(out['sequence_output'], out['hidden_states'][-1])


def test_padding_does_not_change_real_positions():
  cfg = _tiny(dropout_rate=0.0, attention_dropout_rate=0.0)
  model = bert.Model(cfg)
  n, L = 10, 16
  short = _batch(2, n, 3)
  padded = {k: v for k, v in short.items()}
  rng = np.random.default_rng(1)
  padded['input_ids'] = jnp.concatenate(
      [short['input_ids'], jnp.asarray(rng.integers(5, 100, (2, L - n)), jnp.int32)], 1)
  padded['segment_ids'] = jnp.pad(short['segment_ids'], ((0, 0), (0, L - n)))
  padded['input_mask'] = jnp.pad(short['input_mask'], ((0, 0), (0, L - n)))
  variables = model.init(jax.random.key(0), padded)
  out_short = model.apply(variables, short)
  out_padded = model.apply(variables, padded)
  for h_short, h_padded in zip(out_short['hidden_states'], out_padded['hidden_states']):
    np.testing.assert_allclose(h_padded[:, :n], h_short, atol=2e-5)
  np.testing.assert_allclose(out_padded['mlm_logits'], out_short['mlm_logits'], atol=2e-4)
  np.testing.assert_allclose(out_padded['nsp_logits'], out_short['nsp_logits'], atol=2e-5)


def test_fused_attention_equals_explicit_path():
  # Training with attention dropout takes the explicit path; eval the fused one.
  attention = layers.MultiHeadAttention(num_heads=4, head_dim=8, dropout_rate=1e-9)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 6, 32)), jnp.float32)
  mask = layers.padding_mask(jnp.asarray([[1] * 6, [1] * 4 + [0] * 2]))
  variables = attention.init(jax.random.key(0), x, x, mask, deterministic=True)
  fused = attention.apply(variables, x, x, mask, deterministic=True)
  explicit = attention.apply(variables, x, x, mask, deterministic=False,
                             rngs={'dropout': jax.random.key(1)})
  np.testing.assert_allclose(explicit, fused, atol=1e-5)
  # Padded keys get no weight: changing them changes nothing.
  x_changed = x.at[1, 4:].set(7.0)
  np.testing.assert_allclose(
      attention.apply(variables, x_changed, x_changed, mask, deterministic=True)[1, :4],
      fused[1, :4], atol=1e-5)


def test_explicit_path_scores_in_float32_as_the_fused_one_in_bfloat16():
  # bfloat16 q and k: the scores before the softmax are float32 products on both paths
  # (rounded to bfloat16 first, the explicit path's probabilities were off by up to 11%).
  B, L, D, H = 2, 64, 256, 4
  attention = layers.MultiHeadAttention(H, D // H, dropout_rate=1e-9, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (B, L, D))
  mask = layers.padding_mask(jnp.ones((B, L), jnp.int32))
  params = nn.meta.unbox(
      attention.init(jax.random.key(0), x, x, mask, deterministic=True))['params']
  # Large scores (about 20, as after training) make bfloat16's rounding of them matter.
  params = {**params, **{n: {**params[n], 'kernel': params[n]['kernel'] * 8}
                         for n in ('query', 'key')}}
  run = lambda deterministic: attention.apply(  # noqa: E731
      {'params': params}, x, x, mask, deterministic=deterministic,
      rngs={'dropout': jax.random.key(2)}).astype(jnp.float32)
  np.testing.assert_allclose(run(False), run(True), atol=5e-4)


def test_scanned_layers_equal_unrolled_layers():
  batch = _batch()
  unrolled = bert.Model(_tiny(dropout_rate=0.0, attention_dropout_rate=0.0))
  scanned = bert.Model(_tiny(dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=True))
  params = nn.meta.unbox(unrolled.init(jax.random.key(0), batch)['params'])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), params['layer_0'], params['layer_1'])
  scan_params = {k: v for k, v in params.items() if not k.startswith('layer_')}
  scan_params['layers'] = {'block': stacked}
  expected = unrolled.apply({'params': params}, batch)
  got = scanned.apply({'params': scan_params}, batch)
  np.testing.assert_allclose(got['mlm_logits'], expected['mlm_logits'], atol=1e-4)
  for a, b in zip(got['hidden_states'], expected['hidden_states']):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_train_flops_per_example_by_hand():
  cfg = bert.Config(vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, mlp_dim=8)
  data = ml_collections.ConfigDict({'max_seq_length': 3, 'max_predictions_per_seq': 2})
  # Per layer, multiply-adds: q, k, v, out 4*(L*D*D), mlp 2*(L*D*F), scores and mixing
  # 2*(L*L*D); the pooler D*D and NSP D*2; per prediction the MLM transform D*D and the
  # output layer D*V. FLOPs: 2 per multiply-add, x3 for the backward.
  layer = 4 * 3 * 16 + 2 * 3 * 32 + 2 * 9 * 4
  macs = 2 * layer + (16 + 8) + 2 * (16 + 40)
  assert bert.train_flops_per_example(cfg, data) == 3 * 2 * macs
  # Fine-tuning: a classifier (D*labels) or a per-token head (L*D*labels) instead of the MLM.
  tuned = bert.Config(vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, mlp_dim=8,
                      num_labels=3)
  assert bert.train_flops_per_example(tuned, data) == 3 * 2 * (2 * layer + 24 + 12)
  tagger = bert.Config(vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, mlp_dim=8,
                       num_labels=3, head='tag')
  assert bert.train_flops_per_example(tagger, data) == 3 * 2 * (2 * layer + 24 + 36)


def test_invalid_config_is_refused():
  with pytest.raises(ValueError, match='not divisible by model.num_heads'):
    bert.Config(hidden_size=100, num_heads=12)
  with pytest.raises(ValueError, match='max_position_embeddings'):
    model = bert.Model(_tiny())
    batch = _batch(1, 40, 2)
    model.init(jax.random.key(0), batch)


def test_dtype_policy_float32_params_bfloat16_compute_float32_logits():
  # At 0.3 the layers move the logits (at 0.02, zeroing a layer's attention output moved them
  # by 0.001, under bfloat16's own error): logits of std 1.39, bfloat16 within 0.058 of
  # float32, that zeroed projection 4.2 away.
  model = bert.Model(_tiny(dtype='bfloat16', initializer_range=0.3))
  batch = _batch()
  variables = model.init(jax.random.key(0), batch)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.meta.unbox(variables)))
  out = model.apply(variables, batch)
  assert out['hidden_states'][-1].dtype == jnp.bfloat16
  assert out['mlm_logits'].dtype == jnp.float32 and out['nsp_logits'].dtype == jnp.float32
  reference = bert.Model(_tiny(initializer_range=0.3)).apply(variables, batch)
  np.testing.assert_allclose(out['mlm_logits'], reference['mlm_logits'], atol=0.2)
