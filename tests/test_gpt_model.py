"""GPT model: GPT-1's parameter count, causality, tied embeddings, packing, multi-sequence heads."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from models import gpt
from models import layers

V = 50


def _tiny(**kw):
  kw = {'vocab_size': V, 'hidden_size': 32, 'num_layers': 2, 'num_heads': 4, 'mlp_dim': 64,
        'max_position_embeddings': 16, 'dropout_rate': 0.0, 'attention_dropout_rate': 0.0, **kw}
  return gpt.Config(**kw)


def _ids(*shape, seed=0, low=5):
  return jnp.asarray(np.random.default_rng(seed).integers(low, V, shape), jnp.int32)


def _init(cfg, batch):
  return nn.meta.unbox(gpt.Model(cfg).init(jax.random.key(0), batch)['params'])


def test_parameter_count_matches_openai_gpt():
  # Radford et al. 2018, sec. 4.1: 12 layers, 768 wide, 12 heads, 3072 inner, 512 positions.
  # The reference, counted on HF's `openai-gpt` (OpenAIGPTModel) module by module:
  V_, D, F = 40478, 768, 3072
  tokens_embed, positions_embed = V_ * D, 512 * D
  c_attn, attn_c_proj, ln_1 = D * 3 * D + 3 * D, D * D + D, 2 * D
  c_fc, mlp_c_proj, ln_2 = D * F + F, F * D + D, 2 * D
  reference = tokens_embed + positions_embed + 12 * (
      c_attn + attn_c_proj + ln_1 + c_fc + mlp_c_proj + ln_2)
  assert reference == 116_534_784

  shapes = jax.eval_shape(lambda: gpt.Model(gpt.Config()).init(
      jax.random.key(0), {'input_ids': jnp.zeros((1, 8), jnp.int32)}))
  params = nn.meta.unbox(shapes['params'])
  print(f'GPT-1: {layers.count_params(params):,} parameters')
  assert layers.count_params(params) == 116_534_784
  assert params['token_embed']['embedding'].shape == (40478, 768)
  assert params['position_embed']['embedding'].shape == (512, 768)
  # Sec. 4.1: dropout 0.1 on residuals, embeddings and attention; N(0, 0.02); OpenAI's LN eps.
  cfg = gpt.Config()
  assert (cfg.dropout_rate, cfg.attention_dropout_rate, cfg.initializer_range,
          cfg.layer_norm_eps) == (0.1, 0.1, 0.02, 1e-5)


def test_every_parameter_has_logical_axis_names():
  cfg = _tiny(num_labels=3)
  batch = {'input_ids': _ids(2, 2, 8), 'extract_positions': jnp.full((2, 2), 7)}
  boxed = gpt.Model(cfg).init(jax.random.key(0), batch)['params']
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
  assert all(len(x.names) == x.value.ndim for x in leaves)
  assert boxed['layer_0']['attention']['query']['kernel'].names == ('embed', 'heads', 'kv')


def test_output_shapes_and_dtypes():
  cfg = _tiny()
  batch = {'input_ids': _ids(2, 8)}
  variables = gpt.Model(cfg).init(jax.random.key(0), batch)
  out = gpt.Model(cfg).apply(variables, batch)
  assert out['lm_logits'].shape == (2, 8, V) and out['lm_logits'].dtype == jnp.float32
  assert len(out['hidden_states']) == cfg.num_layers + 1
  assert all(h.shape == (2, 8, 32) for h in out['hidden_states'])
  np.testing.assert_array_equal(out['sequence_output'], out['hidden_states'][-1])
  assert 'logits' not in out
  # bfloat16 compute keeps float32 parameters and logits.
  out16 = gpt.Model(_tiny(dtype='bfloat16')).apply(variables, batch)
  assert out16['hidden_states'][-1].dtype == jnp.bfloat16
  assert out16['lm_logits'].dtype == jnp.float32
  np.testing.assert_allclose(out16['lm_logits'], out['lm_logits'], atol=0.05)


def _reference_forward(params, ids, eps=1e-5):
  """OpenAI's GPT (train.py: model, block, attn, mlp) in numpy, for one sequence."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  L = len(ids)
  h = p['token_embed']['embedding'][ids] + p['position_embed']['embedding'][:L]  # no LayerNorm

  def norm(x, ln):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * ln['scale'] + ln['bias']

  for i in range(2):
    lp = p[f'layer_{i}']
    att = lp['attention']
    q, k, v = (np.einsum('ld,dhk->hlk', h, att[n]['kernel']) + att[n]['bias'][:, None]
               for n in ('query', 'key', 'value'))
    w = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    w = np.where(np.tril(np.ones((L, L))) > 0, w, -1e9)  # mask_attn_weights
    w = np.exp(w - w.max(-1, keepdims=True))
    a = np.einsum('hls,hsk->lhk', w / w.sum(-1, keepdims=True), v)
    a = np.einsum('lhk,hkd->ld', a, att['out']['kernel']) + att['out']['bias']
    h = norm(h + a, lp['attention_ln'])  # n = norm(x + a): post-LN
    x = h @ lp['mlp']['wi']['kernel'] + lp['mlp']['wi']['bias']
    x = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # tanh GELU
    m = x @ lp['mlp']['wo']['kernel'] + lp['mlp']['wo']['bias']
    h = norm(h + m, lp['mlp_ln'])
  return h @ p['token_embed']['embedding'].T  # tied output layer


def test_forward_matches_a_hand_written_reference():
  # Sec. 3.1 and OpenAI's code: h0 = U We + Wp (no LayerNorm); post-LN blocks with
  # masked self-attention and the tanh GELU, LayerNorm eps 1e-5; P(u) = softmax(h_n We^T).
  cfg = _tiny(initializer_range=0.3)  # large weights, so GELU's form and the eps matter
  batch = {'input_ids': _ids(1, 7)}
  params = _init(cfg, batch)
  out = gpt.Model(cfg).apply({'params': params}, batch)
  np.testing.assert_allclose(out['lm_logits'][0], _reference_forward(params, batch['input_ids'][0]),
                             rtol=1e-4, atol=1e-4)


def test_masks_by_hand():
  np.testing.assert_array_equal(layers.causal_mask(3)[0, 0],
                                [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
  got = layers.segment_causal_mask(jnp.asarray([[1, 1, 2, 2, 0]]))
  assert got.shape == (1, 1, 5, 5)
  np.testing.assert_array_equal(got[0, 0], [[1, 0, 0, 0, 0],
                                            [1, 1, 0, 0, 0],
                                            [0, 0, 1, 0, 0],
                                            [0, 0, 1, 1, 0],
                                            [0, 0, 0, 0, 0]])


def test_causality():
  # Sec. 3.1: P(u_i | u_<i). Logits at t depend on the inputs at <= t only. The
  # position table's row s is added to the input embedding at s and nowhere else.
  cfg = _tiny()
  L = 8
  batch = {'input_ids': _ids(1, L)}
  params = _init(cfg, batch)
  r = jnp.asarray(np.random.default_rng(1).normal(size=V), jnp.float32)

  def projected_logits(table):
    p = {**params, 'position_embed': {'embedding': table}}
    return gpt.Model(cfg).apply({'params': p}, batch)['lm_logits'][0] @ r  # (L,)

  jac_LPD = jax.jit(jax.jacrev(projected_logits))(params['position_embed']['embedding'])
  norms_LP = np.abs(np.asarray(jac_LPD)).sum(-1)[:, :L]
  future = np.triu(np.ones((L, L), bool), k=1)
  assert (norms_LP[future] == 0).all()
  assert (norms_LP[~future] > 0).all()


def test_output_layer_is_tied_to_token_embedding():
  # Sec. 3.1, eq. 2: P(u) = softmax(h_n W_e^T), W_e the token embedding.
  cfg = _tiny()
  batch = {'input_ids': _ids(2, 8, low=10)}  # tokens 0..9 never appear in the input
  params = _init(cfg, batch)
  vocab_sized = [x for x in jax.tree.leaves(params) if V in x.shape]
  assert len(vocab_sized) == 1 and vocab_sized[0].shape == (V, 32)
  model = gpt.Model(cfg)

  def grad_of(loss):
    return jax.jit(jax.grad(lambda p: loss(model.apply({'params': p}, batch))))(params)

  r = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 32)), jnp.float32)
  through_lookup = grad_of(lambda out: (out['hidden_states'][0] * r).sum())
  table_grad = through_lookup['token_embed']['embedding']
  assert np.abs(table_grad[10:]).sum() > 0 and np.abs(table_grad[:10]).sum() == 0

  through_output = grad_of(lambda out: out['lm_logits'][..., 3].sum())
  h = model.apply({'params': params}, batch)['sequence_output']
  row = through_output['token_embed']['embedding'][3]
  # Row 3 is only reachable through the output layer, whose gradient there is sum_t h_t.
  assert np.abs(row).sum() > 0
  np.testing.assert_allclose(row, h.sum((0, 1)), rtol=1e-4, atol=1e-5)


def test_packed_documents_do_not_see_each_other():
  cfg = _tiny()
  model = gpt.Model(cfg)
  ids = _ids(1, 6)
  packed = {'input_ids': ids, 'segment_ids': jnp.asarray([[1, 1, 1, 2, 2, 0]]),
            'positions': jnp.asarray([[0, 1, 2, 0, 1, 0]])}
  alone = {'input_ids': jnp.concatenate([ids[:, 3:5], _ids(1, 4, seed=3)], 1),
           'segment_ids': jnp.asarray([[1, 1, 0, 0, 0, 0]]),
           'positions': jnp.asarray([[0, 1, 0, 0, 0, 0]])}
  params = _init(cfg, packed)
  out_packed = model.apply({'params': params}, packed)
  out_alone = model.apply({'params': params}, alone)
  for h_packed, h_alone in zip(out_packed['hidden_states'], out_alone['hidden_states']):
    np.testing.assert_allclose(h_packed[0, 3:5], h_alone[0, :2], atol=1e-5)
  np.testing.assert_allclose(out_packed['lm_logits'][0, 3:5], out_alone['lm_logits'][0, :2],
                             atol=1e-4)
  # Padding changes nothing.
  repadded = {**packed, 'input_ids': packed['input_ids'].at[0, 5].set(7)}
  np.testing.assert_allclose(model.apply({'params': params}, repadded)['lm_logits'][0, :5],
                             out_packed['lm_logits'][0, :5], atol=1e-6)
  # Without segment ids document 2 attends to document 1: the check above can fail.
  unsegmented = {k: v for k, v in packed.items() if k != 'segment_ids'}
  leaked = model.apply({'params': params}, unsegmented)['sequence_output']
  assert np.abs(leaked[0, 3:5] - out_alone['sequence_output'][0, :2]).max() > 1e-2


def _multi_batch(B=2, C=3, L=8, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(4, L + 1, (B, C))
  segment_ids = (np.arange(L) < lengths[..., None]).astype(np.int32)
  return {'input_ids': _ids(B, C, L, seed=seed), 'segment_ids': jnp.asarray(segment_ids),
          'positions': jnp.asarray(np.broadcast_to(np.arange(L), (B, C, L)) * segment_ids),
          'extract_positions': jnp.asarray(lengths - 1, jnp.int32)}


def test_sequences_per_example_equal_flattened_batch():
  cfg = _tiny()
  model = gpt.Model(cfg)
  batch = _multi_batch()
  flat = {k: v.reshape((6, 8)) for k, v in batch.items() if k != 'extract_positions'}
  params = _init(cfg, flat)
  out = model.apply({'params': params}, batch)
  out_flat = model.apply({'params': params}, flat)
  assert out['lm_logits'].shape == (2, 3, 8, V)
  np.testing.assert_allclose(out['lm_logits'].reshape(6, 8, V), out_flat['lm_logits'], atol=1e-5)
  for h, h_flat in zip(out['hidden_states'], out_flat['hidden_states']):
    assert h.shape == (2, 3, 8, 32)
    np.testing.assert_allclose(h.reshape(6, 8, 32), h_flat, atol=1e-6)


def test_classify_head_adds_the_extract_states():
  # Sec. 3.3, similarity: both orderings' h_l^m are added before the linear layer.
  cfg = _tiny(num_labels=3, head='classify')
  model = gpt.Model(cfg)
  batch = _multi_batch(C=2)
  params = _init(cfg, batch)
  out = model.apply({'params': params}, batch)
  assert out['logits'].shape == (2, 3) and out['logits'].dtype == jnp.float32
  h = out['sequence_output']
  ext = batch['extract_positions']
  summed = h[0, 0, ext[0, 0]] + h[0, 1, ext[0, 1]]
  w = params['classifier']
  np.testing.assert_allclose(out['logits'][0], summed @ w['kernel'] + w['bias'], atol=1e-5)
  swapped = jax.tree.map(lambda x: x[:, ::-1], batch)
  np.testing.assert_allclose(model.apply({'params': params}, swapped)['logits'], out['logits'],
                             atol=1e-6)
  # A (B, L) batch is one sequence per example.
  single = {k: v[:, 0] for k, v in batch.items()}
  np.testing.assert_allclose(
      model.apply({'params': params}, single)['logits'][0],
      h[0, 0, ext[0, 0]] @ w['kernel'] + w['bias'], atol=1e-5)


def test_choice_head_scores_each_sequence():
  # Sec. 3.3, multiple choice: each sequence is scored, softmax over choices in the loss.
  cfg = _tiny(num_labels=1, head='choice')
  model = gpt.Model(cfg)
  batch = _multi_batch(C=4)
  params = _init(cfg, batch)
  out = model.apply({'params': params}, batch)
  assert out['logits'].shape == (2, 4)
  h = out['sequence_output']
  w = params['classifier']
  for b in range(2):
    for c in range(4):
      expected = h[b, c, batch['extract_positions'][b, c]] @ w['kernel'][:, 0] + w['bias'][0]
      np.testing.assert_allclose(out['logits'][b, c], expected, atol=1e-5)


def test_embedding_dropout_drops_table_rows_as_openais_code():
  """OpenAI drops elements of the token and position tables before the lookup: one mask per
  row for the step, the same wherever the row is read; 'tokens' (HF's) draws per occurrence."""
  ids = jnp.array([[7, 8, 7, 9, 7, 8], [9, 7, 8, 7, 9, 9]], jnp.int32)
  batch = {'input_ids': ids}
  for mode in ('table', 'tokens'):
    cfg = _tiny(dropout_rate=0.5, embedding_dropout=mode)
    params = _init(cfg, batch)
    # Position rows of ones, token rows of twos: each part's mask shows in the sum's values.
    params['position_embed']['embedding'] = jnp.ones_like(params['position_embed']['embedding'])
    params['token_embed']['embedding'] = jnp.full_like(params['token_embed']['embedding'], 2.0)
    out = gpt.Model(cfg).apply({'params': params}, batch, deterministic=False,
                               rngs={'dropout': jax.random.key(3)})
    x = np.asarray(out['hidden_states'][0])
    token_kept, position_kept = np.isin(x, (4.0, 6.0)), np.isin(x, (2.0, 6.0))  # scale 2
    # The tied output layer: OpenAI's logits read the dropped table, so the same masks.
    output_kept = np.asarray(out['lm_output']['table']) == 4.0
    assert np.all(np.isin(np.asarray(out['lm_output']['table']), (0.0, 4.0) if mode == 'table'
                          else (2.0,)))
    np.testing.assert_allclose(out['lm_logits'], jnp.einsum(
        'NLD,VD->NLV', out['sequence_output'], out['lm_output']['table']), rtol=1e-5)
    same_token = [np.array_equal(token_kept[0, 0], token_kept[r, c])
                  for r, c in ((0, 2), (0, 4), (1, 1), (1, 3))]
    same_position = [np.array_equal(position_kept[0, c], position_kept[1, c]) for c in range(6)]
    if mode == 'table':
      assert all(same_token) and all(same_position)
      assert all(np.array_equal(output_kept[i], token_kept[r, c])
                 for i, (r, c) in ((7, (0, 0)), (8, (0, 1)), (9, (0, 3))))
      assert 0.3 < output_kept.mean() < 0.7
      assert not np.array_equal(token_kept[0, 0], token_kept[0, 1])  # another token's row
      assert 0.3 < token_kept.mean() < 0.7
    else:
      assert not any(same_token) and not any(same_position)
  with pytest.raises(ValueError, match="model.embedding_dropout='rows' is unknown"):
    _tiny(embedding_dropout='rows')


def test_classifier_dropout_applies_in_training_only():
  cfg = _tiny(num_labels=2, classifier_dropout_rate=0.5)
  model = gpt.Model(cfg)
  batch = _multi_batch(C=1)
  params = _init(cfg, batch)
  run = lambda seed: model.apply({'params': params}, batch, deterministic=False,  # noqa: E731
                                 rngs={'dropout': jax.random.key(seed)})['logits']
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(model.apply({'params': params}, batch)['logits'],
                                model.apply({'params': params}, batch)['logits'])
  # Multiple choice: one mask for all choices of an example (finetune-transformer-lm's noise
  # shape [B, 1, D]), so three equal choices keep equal scores; different examples differ.
  cfg = _tiny(num_labels=1, head='choice', classifier_dropout_rate=0.5)
  model = gpt.Model(cfg)
  same = {k: jnp.repeat(v[:, :1], 3, axis=1) for k, v in _multi_batch(C=3).items()}
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), same)['params'])
  logits, clean = jax.jit(lambda p: [model.apply({'params': p}, same, deterministic=not train,
                                                 rngs={'dropout': jax.random.key(0)})['logits']
                                     for train in (True, False)])(params)
  np.testing.assert_array_equal(logits, np.asarray(logits)[:, :1].repeat(3, axis=1))
  assert not np.allclose(logits, clean)


def test_scanned_layers_equal_unrolled_layers():
  batch = {'input_ids': _ids(2, 8)}
  params = _init(_tiny(), batch)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), params['layer_0'], params['layer_1'])
  scan_params = {k: v for k, v in params.items() if not k.startswith('layer_')}
  scan_params['layers'] = {'block': stacked}
  expected = gpt.Model(_tiny()).apply({'params': params}, batch)
  got = gpt.Model(_tiny(scan_layers=True)).apply({'params': scan_params}, batch)
  np.testing.assert_allclose(got['lm_logits'], expected['lm_logits'], atol=1e-4)


def test_train_flops_per_example_by_hand():
  cfg = gpt.Config(vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, mlp_dim=8)
  data = ml_collections.ConfigDict({'max_seq_length': 3})
  # Per layer: q, k, v, out 4*(L*D*D) + mlp 2*(L*D*F) + scores and mixing 2*(L*L*D) MACs.
  macs = 2 * (4 * 3 * 16 + 2 * 3 * 32 + 2 * 9 * 4) + 3 * 4 * 10
  assert gpt.train_flops_per_example(cfg, data) == 3 * 2 * macs
  data.num_choices = 4
  assert gpt.train_flops_per_example(cfg, data) == 4 * 3 * 2 * macs
  # A fine-tuning without the auxiliary LM loss runs the LM head (L*D*V MACs) forward only.
  loss = ml_collections.ConfigDict({'lm_coef': 0.5})
  assert gpt.train_flops_per_example(cfg, data, loss) == 4 * 3 * 2 * macs
  loss.lm_coef = 0.0
  assert gpt.train_flops_per_example(cfg, data, loss) == 4 * 2 * (3 * macs - 2 * 3 * 4 * 10)


def test_user_errors_are_one_line():
  with pytest.raises(ValueError, match='not divisible by model.num_heads'):
    gpt.Config(hidden_size=100, num_heads=12)
  with pytest.raises(ValueError, match='model.head'):
    gpt.Config(head='span')
  with pytest.raises(ValueError, match='max_position_embeddings'):
    gpt.Model(_tiny()).init(jax.random.key(0), {'input_ids': _ids(1, 17)})
  with pytest.raises(ValueError, match='extract_positions'):
    gpt.Model(_tiny(num_labels=2)).init(jax.random.key(0), {'input_ids': _ids(1, 8)})


@pytest.mark.slow  # the fast tier's 1-vs-8-device check is BERT's (test_train.py)
def test_sharded_gradients_and_sampling_equal_single_device():
  # A data x fsdp x tensor mesh over the 8 simulated devices, packed rows.
  from models import decoding  # pylint: disable=g-import-not-at-top
  from trainer import sharding  # pylint: disable=g-import-not-at-top
  from objectives import lm  # pylint: disable=g-import-not-at-top
  rules = (('batch', ('data', 'fsdp')), ('vocab', 'tensor'), ('embed', 'fsdp'),
           ('mlp', 'tensor'), ('heads', 'tensor'), ('kv', None), ('length', None),
           ('act_embed', None), ('act_mlp', 'tensor'), ('act_heads', 'tensor'))
  mesh = sharding.make_mesh((('data', 2), ('fsdp', 2), ('tensor', 2)))
  cfg = _tiny(vocab_size=64, scan_layers=True)
  model = gpt.Model(cfg)
  rng = np.random.default_rng(0)
  batch = {'input_ids': rng.integers(0, 64, (8, 16)).astype(np.int32),
           'targets': rng.integers(0, 64, (8, 16)).astype(np.int32),
           'weights': np.ones((8, 16), np.float32),
           'segment_ids': np.repeat([[1] * 10 + [2] * 6], 8, 0).astype(np.int32),
           'positions': np.repeat([list(range(10)) + list(range(6))], 8, 0).astype(np.int32)}
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), batch))['params']
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  params = _init(cfg, batch)
  grad_fn = jax.grad(lambda p, b: lm.loss_fn(model.apply({'params': p}, b), b)[0])
  expected = grad_fn(params, batch)
  prompts, lengths = jnp.asarray(batch['input_ids'][:, :4]), jnp.arange(8) % 4 + 1
  sample = lambda p: decoding.sample(model, p, prompts, lengths, max_new_tokens=4,  # noqa: E731
                                     rng=jax.random.key(0), temperature=1.0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    sharded = jax.device_put(params, shardings)
    got = jax.jit(grad_fn)(sharded, sharding.global_batch(batch, mesh))
    sampled = sample(sharded)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  np.testing.assert_array_equal(sampled, sample(params))
