"""Peer: BERT pretraining's train step (MLM + NSP) with transformers 4.57.6's Flax classes.

transformers 5 dropped its Flax classes, so this runs in its own venv
(peers/requirements-hf-flax.txt; docs/benchmarks.md has the two commands that make it):

    peers/.venv-hf-flax/bin/python peers/bert_hf_flax.py --shape=mini --variant=gathered
    peers/.venv-hf-flax/bin/python peers/bert_hf_flax.py --shape=mini --variant=gathered --profile=/tmp/hf_profile

'stock' is FlaxBertForPreTraining as is (MLM logits at every position, the
loss weighted to the masked ones); 'gathered' applies the same heads, with the
same params, to the hidden states at the max_predictions_per_seq masked
positions only, as BERT's reference run_pretraining.py does.
"""

import glob
import os
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from transformers import BertConfig, FlaxBertForPreTraining
from transformers.models.bert.modeling_flax_bert import FlaxBertModule, FlaxBertPreTrainingHeads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# configs/bert_base.py's VARIANTS, with bench-sized batches.
SHAPES = {
    'mini': dict(num_layers=4, hidden_size=256, num_heads=4, mlp_dim=1024, vocab_size=30522,
                 seq_len=128, batch_size=32),
    'base': dict(num_layers=12, hidden_size=768, num_heads=12, mlp_dim=3072, vocab_size=30522,
                 seq_len=128, batch_size=8),
}
MAX_PREDICTIONS = 20  # configs/bert_base.py: data.max_predictions_per_seq
PEERS = {'stock': 'HF Flax 4.57.6 stock', 'gathered': 'HF Flax 4.57.6, gathered'}


class GatheredPreTraining(nn.Module):
  """FlaxBertForPreTrainingModule with the MLM head applied at `positions` (B, P) only."""
  config: BertConfig

  def setup(self):  # the same submodule names, so the same params tree as the stock model
    self.bert = FlaxBertModule(self.config)
    self.cls = FlaxBertPreTrainingHeads(self.config)

  def __call__(self, input_ids, attention_mask, token_type_ids, positions, head_mask,
               deterministic=True):
    hidden, pooled = self.bert(input_ids, attention_mask, token_type_ids, None, head_mask,
                               deterministic=deterministic, return_dict=False)[:2]
    hidden = jnp.take_along_axis(hidden, positions[..., None], axis=1)  # (B, P, D)
    shared = self.bert.variables['params']['embeddings']['word_embeddings']['embedding']
    return self.cls(hidden, pooled, shared_embedding=shared)


def make_batch(rng, batch_size, seq_len, vocab_size):
  """Random inputs: two segments, 20 distinct masked positions per sequence."""
  k_ids, k_pos, k_lab, k_nsp = jax.random.split(rng, 4)
  predictions = min(MAX_PREDICTIONS, seq_len)
  pos = jax.vmap(lambda k: jax.random.permutation(k, seq_len)[:predictions])(
      jax.random.split(k_pos, batch_size))
  return dict(
      input_ids=jax.random.randint(k_ids, (batch_size, seq_len), 0, vocab_size),
      token_type_ids=jnp.broadcast_to(jnp.arange(seq_len) >= seq_len // 2,
                                      (batch_size, seq_len)).astype(jnp.int32),
      attention_mask=jnp.ones((batch_size, seq_len), jnp.int32),
      masked_lm_positions=pos.astype(jnp.int32),
      masked_lm_ids=jax.random.randint(k_lab, (batch_size, predictions), 0, vocab_size),
      next_sentence_labels=jax.random.randint(k_nsp, (batch_size,), 0, 2))


def make_loss(model, variant):
  """loss(params, batch, dropout_rng or None) = mean masked-LM NLL + mean NSP NLL."""
  head_mask = jnp.ones((model.config.num_hidden_layers, model.config.num_attention_heads))
  gathered = GatheredPreTraining(model.config)

  def loss_fn(params, batch, dropout_rng):
    train = dropout_rng is not None
    if variant == 'stock':
      mlm, nsp = model(batch['input_ids'], batch['attention_mask'], batch['token_type_ids'],
                       params=params, dropout_rng=dropout_rng, train=train, return_dict=False)
      rows = jnp.arange(mlm.shape[0])[:, None]
      pos = batch['masked_lm_positions']
      labels = jnp.zeros(mlm.shape[:2], jnp.int32).at[rows, pos].set(batch['masked_lm_ids'])
      weights = jnp.zeros(mlm.shape[:2]).at[rows, pos].set(1.0)  # 1 at the masked positions
    else:
      rngs = {'dropout': dropout_rng} if train else {}
      mlm, nsp = gathered.apply({'params': params}, batch['input_ids'], batch['attention_mask'],
                                batch['token_type_ids'], batch['masked_lm_positions'], head_mask,
                                deterministic=not train, rngs=rngs)
      labels, weights = batch['masked_lm_ids'], jnp.ones(batch['masked_lm_ids'].shape)
    mlm_nll = optax.softmax_cross_entropy_with_integer_labels(mlm, labels)
    nsp_nll = optax.softmax_cross_entropy_with_integer_labels(nsp, batch['next_sentence_labels'])
    return jnp.sum(mlm_nll * weights) / jnp.sum(weights) + jnp.mean(nsp_nll)
  return loss_fn


def decay_mask(params):
  """Weight decay everywhere but LayerNorm parameters and biases (trainer/optimizer.py)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key not in ('bias', 'scale'), params)


def build(shape, batch_size, seq_len, seed):
  """The HF model, its params and a fixed random batch."""
  s = SHAPES[shape]
  config = BertConfig(vocab_size=s['vocab_size'], hidden_size=s['hidden_size'],
                      num_hidden_layers=s['num_layers'], num_attention_heads=s['num_heads'],
                      intermediate_size=s['mlp_dim'], hidden_dropout_prob=0.1,
                      attention_probs_dropout_prob=0.1, max_position_embeddings=512,
                      type_vocab_size=2, layer_norm_eps=1e-12, initializer_range=0.02)
  model = FlaxBertForPreTraining(config, _do_init=False)
  k_init, k_data = jax.random.split(jax.random.PRNGKey(seed))
  params = jax.jit(model.init_weights, static_argnums=1)(k_init, (1, seq_len))
  return model, flax.core.unfreeze(params), make_batch(k_data, batch_size, seq_len, s['vocab_size'])


def profile(step, hlo_text: str, directory: str, step_seconds: float, steps: int = 3) -> None:
  """bench.py --profile's trace and summary, for this step."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import bench  # noqa: E402  (the project's, for its trace summary)
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(steps):
      out = step()
    jax.block_until_ready(out)
  with open(os.path.join(directory, 'train_step.hlo.txt'), 'w') as f:
    f.write(hlo_text)
  trace = max(glob.glob(os.path.join(directory, 'plugins', 'profile', '*',
                                     'perfetto_trace.json.gz')), key=os.path.getmtime)
  bench.print_ops(bench.top_ops(trace, hlo_text, steps), step_seconds,
                  bench.matmul_share(trace, hlo_text), bench.ops_by_jax_op(trace, hlo_text, steps))


def main():
  args = common.parse_flags(__doc__.splitlines()[0], SHAPES, tuple(PEERS), profile=True)
  batch_size = args.batch_size or SHAPES[args.shape]['batch_size']
  seq_len = args.seq_len or SHAPES[args.shape]['seq_len']
  model, params, batch = build(args.shape, batch_size, seq_len, args.seed)
  loss_fn = make_loss(model, args.variant)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                               mask=decay_mask))
  opt_state = tx.init(params)

  def train_step(params, opt_state, batch, rng):
    rng, dropout_rng = jax.random.split(rng)  # a fresh dropout rng each step
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, rng, loss

  rng = jax.random.PRNGKey(args.seed + 1)
  start = time.perf_counter()
  step_fn = jax.jit(train_step, donate_argnums=(0, 1)).lower(
      params, opt_state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  state = (params, opt_state, rng, None)

  def step():  # returns all of the step's outputs, so the wait covers the optimizer update too
    nonlocal state
    state = step_fn(state[0], state[1], batch, state[2])
    return state

  seconds, state = common.seconds_per_step(step, args.steps, args.warmup,
                                           wait=jax.block_until_ready)
  if args.profile:
    profile(step, step_fn.as_text(), args.profile, seconds)
  common.report(PEERS[args.variant], batch_size, seq_len, seconds,
                final_loss=round(float(state[3]), 4), compile_seconds=round(compile_seconds, 2))


if __name__ == '__main__':
  main()
