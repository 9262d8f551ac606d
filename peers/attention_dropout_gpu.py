"""On an NVIDIA GPU: cuDNN's fused attention with dropout (model.attention=cudnn) against the kernel's
own forward masks and against XLA's attention in whole training runs. Prints JSON lines.

    python peers/attention_dropout_gpu.py kernel
    python peers/attention_dropout_gpu.py rates
    python peers/attention_dropout_gpu.py options compile|environ|none
    python peers/attention_dropout_gpu.py curve configs/bert_base.py:base 200 \
        --config.train.batch_size=256 --config.model.attention=cudnn [--step_seed=1] \
        [--flash_dropout.EXP2_PTX=True]

Inside CUDA graphs (command buffers) cuDNN's dropout aborted the process on an H200 (jax
0.11.2). The train step's compile keeps cuDNN out of them (trainer.steps.CUDNN_DROPOUT_OPTIONS),
as do `rates` and `options compile`; `kernel` sets XLA_FLAGS to the same effect before its
first compile; `options none` shows the abort.

kernel: with the values the identity (v[b, s, h] = e_s), the kernel's output is its dropped
attention probabilities, so each call shows its mask. Checked: the dropout rate and the kept
values' scale; whether two seeds, or two calls with one seed, draw other masks (and the first
call's mask as a hash, to compare across processes: a resumed run); and whether the
backward pass used the forward pass's mask: the output and the gradients of q, k and v against
XLA's attention given the mask the forward showed, for a lone call, two calls under lax.scan (one
call site run twice forward and backward) and a rematerialized call (jax.checkpoint).

rates: 16 seeds' masks (_rates). options: one forward and backward, cuDNN kept out of CUDA
graphs by the per-compile option, by XLA_FLAGS set in the process, or not at all.

curve: train.py's step of the config (trainer.state.build, seed 0) run STEPS steps on bench.py's
synthetic batch (--step_seed=N: the step's dropout RNG from seed N, the weights still from
seed 0; --flash_dropout.NAME=VALUE sets one of models/flash_dropout.py's module settings for
model.attention=triton); the loss of every step and the seconds per step (steps 20 to STEPS,
run ahead as train.py runs them), with progress lines (the compile's seconds, the first step's
loss, the seconds every 50 steps) before the last line, so that a run its deadline stops still
shows where it was.
"""

import ast
import collections
import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import layers  # noqa: E402  pylint: disable=wrong-import-position

RATE = 0.1


def _identity_values(b: int, s: int, h: int) -> jax.Array:
  return jnp.broadcast_to(jnp.eye(s, dtype=jnp.bfloat16)[None, :, None, :], (b, s, h, s))


def _mask(b: int, length: int, causal: bool, lengths=None) -> layers.SegmentMask:
  lengths = jnp.full((b,), length) if lengths is None else lengths
  ids = (jnp.arange(length)[None] < lengths[:, None]).astype(jnp.int32)
  return layers.SegmentMask(ids, ids, causal=causal, kernel='cudnn', right_padded=True)


def _reference(q, k, v, mask: layers.SegmentMask, keep_BHLS):
  """XLA's attention with dropout given the mask (float32)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  logits = jnp.einsum('BLHK,BSHK->BHLS', q, k) * q.shape[-1] ** -0.5
  logits = jnp.where(mask.dense(), logits, layers.NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1) * keep_BHLS / (1 - RATE)
  return jnp.einsum('BHLS,BSHK->BLHK', probs, v)


def _kernel_checks() -> dict:
  b, s, h = 4, 64, 2
  v = _identity_values(b, s, h)
  key = jax.random.key(0)
  found = {}

  # The rate and the scale, on uniform probabilities (q = k = 0).
  zeros = jnp.zeros((b, s, h, s), jnp.bfloat16)
  attend = jax.jit(lambda q, k, v, seed: layers.cudnn_dropout_attention(
      q, k, v, _mask(b, s, False), RATE, seed), static_argnums=3)
  out1 = np.asarray(attend(zeros, zeros, v, 1), np.float32)
  out1_again = np.asarray(attend(zeros, zeros, v, 1), np.float32)
  out2 = np.asarray(attend(zeros, zeros, v, 2), np.float32)
  kept = out1 > 0
  found['rate'] = float(1 - kept.mean())
  found['kept_value_over_expected'] = float(out1[kept].mean() * s * (1 - RATE))
  found['same_mask_fraction_two_seeds'] = float((kept == (out2 > 0)).mean())
  found['same_mask_fraction_one_seed_two_calls'] = float((kept == (out1_again > 0)).mean())
  found['independent_masks_would_agree'] = (1 - RATE) ** 2 + RATE ** 2
  # The same in another process: whether a resumed run draws the first run's masks again.
  found['first_mask_sha256'] = hashlib.sha256(np.packbits(kept).tobytes()).hexdigest()[:16]

  # The backward pass against the forward's mask.
  def checked(name, run, causal, lengths=None):
    kq, kk, kr = jax.random.split(jax.random.fold_in(key, len(found)), 3)
    q = (jax.random.normal(kq, (b, s, h, s)) * 0.5).astype(jnp.bfloat16)
    k = (jax.random.normal(kk, (b, s, h, s)) * 0.5).astype(jnp.bfloat16)
    r = jax.random.normal(kr, (b, s, h, s), jnp.float32)
    mask = _mask(b, s, causal, lengths)
    out, grads = run(q, k, v, r, mask)
    out = np.asarray(out, np.float32)
    valid = np.asarray(mask.dense())  # (B, 1, L, S)
    keep = np.transpose(out > 0, (0, 2, 1, 3)) | ~valid  # (B, H, L, S); masked keys: any
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, mask, keep), q, k, v)
    ref_grads = ref_vjp(r * np.asarray(mask.q_BL > 0)[:, :, None, None])
    rel = lambda a, e: float(np.abs(np.asarray(a, np.float32) - np.asarray(e, np.float32)).max()
                             / max(np.abs(np.asarray(e, np.float32)).max(), 1e-9))  # noqa: E731
    real = np.asarray(mask.q_BL > 0)[:, :, None, None]
    found[name] = {'out': rel(out * real, np.asarray(ref_out) * real),
                   **{f'd{n}': rel(g, e) for n, g, e in zip('qkv', grads, ref_grads)},
                   'rate_seen': float(1 - (out > 0)[np.broadcast_to(
                       np.transpose(valid, (0, 2, 1, 3)), out.shape)].mean())}

  def lone(q, k, v, r, mask):
    def f(q, k, v):
      out = layers.cudnn_dropout_attention(q, k, v, mask, RATE, 7)
      return (out.astype(jnp.float32) * r * (mask.q_BL > 0)[:, :, None, None]).sum(), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  checked('lone_call', lone, False)
  checked('lone_call_causal', lone, True)
  checked('lone_call_padded', lone, False, jnp.array([64, 40, 17, 64]))

  def under_scan(q, k, v, r, mask):
    # Two calls of one call site (lax.scan; their backward passes run in reverse order): the
    # first on q and k swapped, out of the loss; checked: the second.
    def f(q, k, v):
      def body(carry, xs):
        qk, weight = xs
        out = layers.cudnn_dropout_attention(qk[0], qk[1], v, mask, RATE, 7)
        return carry + weight * (out.astype(jnp.float32) * r).sum(), out
      total, outs = jax.lax.scan(
          body, 0.0, (jnp.stack([jnp.stack([k, q]), jnp.stack([q, k])]), jnp.array([0.0, 1.0])))
      return total, outs[1]
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  def rematerialized(q, k, v, r, mask):
    attend = jax.checkpoint(lambda q, k, v: layers.cudnn_dropout_attention(q, k, v, mask, RATE, 7))
    def f(q, k, v):
      out = attend(q, k, v)
      return (out.astype(jnp.float32) * r).sum(), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads

  try:
    checked('scan_second_call', under_scan, False)
  except Exception as e:  # pylint: disable=broad-except
    found['scan_second_call'] = f'{type(e).__name__}: {str(e)[:300]}'
  try:
    checked('remat', rematerialized, False)
  except Exception as e:  # pylint: disable=broad-except
    found['remat'] = f'{type(e).__name__}: {str(e)[:300]}'
  return found


TIMED_FROM = 20  # curve times the steps after this many (compiles and warm-up before)


def _curve(config_arg: str, steps: int, overrides: list[str]) -> dict:
  if steps <= TIMED_FROM:
    sys.exit(f'attention_dropout_gpu.py: curve times steps {TIMED_FROM + 1} to STEPS: give '
             f'STEPS above {TIMED_FROM}, not {steps}.')
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  import input_pipeline  # pylint: disable=g-import-not-at-top
  from trainer import sharding  # pylint: disable=g-import-not-at-top
  import trainer.checks  # pylint: disable=g-import-not-at-top
  import trainer.loop  # pylint: disable=g-import-not-at-top
  import trainer.state  # pylint: disable=g-import-not-at-top

  # --step_seed=N: the same initial weights (config.seed) with the step's RNG of seed N, so other
  # dropout masks everywhere: a control for the gap between two runs that differ in their masks.
  step_seed = [int(a.split('=', 1)[1]) for a in overrides if a.startswith('--step_seed=')]
  # --flash_dropout.NAME=VALUE: one of models/flash_dropout.py's module settings (its opt-in
  # changes, EXP2_PTX and WHOLE_QUERIES, or its tiles) for this run, set before the step traces.
  settings = _flash_dropout_settings([a for a in overrides if a.startswith('--flash_dropout.')])
  overrides = [a for a in overrides if not a.startswith(('--step_seed=', '--flash_dropout.'))]
  config_flags.DEFINE_config_file('config', None, '')
  flags.FLAGS([sys.argv[0], f'--config={config_arg}'] + overrides)
  config = flags.FLAGS.config
  mesh = sharding.make_mesh(config.mesh)
  trainer.checks.inherit_unset_fields(config, None)
  trainer.checks.validate(config, mesh)
  model_cfg = trainer.checks.model_config(config)
  _, _, state, step_fn, _ = trainer.state.build(config, mesh)
  if step_seed:
    config.seed = step_seed[0]
    _, _, _, step_fn, _ = trainer.state.build(config, mesh, materialize=False)
  local = input_pipeline.example_batch(config.data, model_cfg.vocab_size,
                                       batch_size=config.train.batch_size)
  with jax.set_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_seconds = time.perf_counter() - start
    # Progress lines, so that a run cut by its deadline still shows where its time went.
    print(json.dumps({'compile_seconds': round(compile_seconds, 1)}), flush=True)
    losses, in_flight = [], collections.deque()
    started = time.perf_counter()
    for step in range(steps):
      if step == TIMED_FROM:
        jax.block_until_ready(state)
        start = time.perf_counter()
      state, metrics = compiled(state, batch)
      losses.append(metrics['loss'])
      in_flight.append(metrics)
      trainer.loop.wait_for_room(in_flight)
      if step == 0:  # the first step waited for, the others not (the timed ones run ahead)
        print(json.dumps({'step': 1, 'loss': float(np.divide(*jax.device_get(metrics['loss']))),
                          'seconds': round(time.perf_counter() - started, 2)}), flush=True)
      elif (step + 1) % 50 == 0:
        print(json.dumps({'step': step + 1, 'seconds': round(time.perf_counter() - started, 2)}),
              flush=True)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / (steps - TIMED_FROM)
  losses = [float(np.divide(*pair)) for pair in jax.device_get(losses)]
  return {'config': config_arg, 'overrides': overrides, 'step_seed': step_seed,
          'flash_dropout': settings,
          'attention': model_cfg.attention,
          'dropout': model_cfg.attention_dropout_rate, 'device': jax.devices()[0].device_kind,
          'jax': jax.__version__, 'step_seconds': round(seconds, 5),
          'compile_seconds': round(compile_seconds, 1), 'losses': [round(x, 4) for x in losses]}


def _flash_dropout_settings(arguments: list[str]) -> dict:
  """Sets models/flash_dropout.py's module settings from --flash_dropout.NAME=VALUE arguments
  (VALUE a Python literal); returns them. An unknown NAME stops the run before any compile."""
  from models import flash_dropout  # pylint: disable=g-import-not-at-top
  settings = {}
  for argument in arguments:
    name, _, value = argument[len('--flash_dropout.'):].partition('=')
    if not name.isupper() or not hasattr(flash_dropout, name):
      raise SystemExit(f'{argument}: flash_dropout has no setting {name!r} (its upper-case '
                       'module settings: EXP2_PTX, WHOLE_QUERIES, FORWARD_BLOCKS, ...)')
    settings[name] = ast.literal_eval(value)
    setattr(flash_dropout, name, settings[name])
  return settings


def _cudnn_out_of_cuda_graphs_by_environ() -> None:
  """XLA_FLAGS for every later compile of this process, as CUDNN_DROPOUT_OPTIONS for one: read
  when jax first compiles, so set before that."""
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' '
                             + '--xla_gpu_enable_command_buffer=-CUDNN').strip()


def _options_probe(how: str) -> dict:
  """One jitted forward and backward of cuDNN's attention with dropout, with cuDNN kept out of
  CUDA graphs by `how`: 'none' (XLA's defaults: aborted on an H200), 'compile' (the per-compile
  option of trainer.steps, no XLA_FLAGS), 'environ' (XLA_FLAGS set by this process after
  importing jax, before its first compile). Run each in a process of its own: an abort ends it."""
  from trainer import steps  # pylint: disable=g-import-not-at-top
  options = None
  if how == 'compile':
    options = dict(steps.CUDNN_DROPOUT_OPTIONS)
  elif how == 'environ':
    _cudnn_out_of_cuda_graphs_by_environ()
  b, s, h = 4, 64, 2
  q = jnp.zeros((b, s, h, s), jnp.bfloat16)
  v = _identity_values(b, s, h)
  def f(q):
    out = layers.cudnn_dropout_attention(q, q, v, _mask(b, s, False), RATE, 3)
    return out.astype(jnp.float32).sum(), out
  (_, out), grad = jax.jit(jax.value_and_grad(f, has_aux=True), compiler_options=options)(q)
  kept = np.asarray(out, np.float32) > 0
  return {'how': how, 'options': options, 'ran': True, 'rate': float(1 - kept.mean()),
          'grad_finite': bool(np.isfinite(np.asarray(grad, np.float32)).all())}


def _rates() -> dict:
  """The dropout rate of 16 seeds' masks, each over 8 x 128 queries x 4 heads x 128 keys
  (uniform probabilities), against a binomial's spread: whether the masks' elements are drawn
  independently at the configured rate, or share their draws (a wider spread: an H200 showed
  twice a binomial's); and which elements of a mask agree more often than independent ones."""
  from trainer import steps  # pylint: disable=g-import-not-at-top
  b, s, h = 8, 128, 4
  zeros = jnp.zeros((b, s, h, s), jnp.bfloat16)
  v = _identity_values(b, s, h)
  attend = jax.jit(lambda q, k, v, seed: layers.cudnn_dropout_attention(
      q, k, v, _mask(b, s, False), RATE, seed), static_argnums=3,
                   compiler_options=dict(steps.CUDNN_DROPOUT_OPTIONS))
  masks = [np.asarray(attend(zeros, zeros, v, seed), np.float32) > 0 for seed in range(1, 17)]
  rates = [float(1 - kept.mean()) for kept in masks]
  n = b * s * h * s
  # Where the spread comes from: how often two elements of one mask agree, by how they lie to
  # each other (independent draws agree on (1 - rate)^2 + rate^2 = 0.82 of them).
  kept = masks[0]  # (batch, query, head, key)
  agree = lambda a, b: round(float((a == b).mean()), 4)  # noqa: E731
  pairs = {f'key_k_and_k+{d}': agree(kept[..., :-d], kept[..., d:]) for d in (1, 2, 4, 8, 16)}
  pairs.update({'query_q_and_q+1': agree(kept[:, :-1], kept[:, 1:]),
                'head_0_and_1': agree(kept[:, :, 0], kept[:, :, 1]),
                'batch_0_and_1': agree(kept[0], kept[1])})
  return {'elements_per_mask': n, 'rates': [round(r, 5) for r in rates],
          'mean': float(np.mean(rates)), 'sd_between_seeds': float(np.std(rates, ddof=1)),
          'binomial_sd': float(np.sqrt(RATE * (1 - RATE) / n)),
          'independent_would_agree': (1 - RATE) ** 2 + RATE ** 2, 'agreement': pairs}


def main():
  if sys.argv[1] == 'rates':
    print(json.dumps({'rates': _rates(), 'device': jax.devices()[0].device_kind,
                      'jax': jax.__version__}), flush=True)
  elif sys.argv[1] == 'options':
    print(json.dumps({'options_probe': _options_probe(sys.argv[2]),
                      'device': jax.devices()[0].device_kind, 'jax': jax.__version__}), flush=True)
  elif sys.argv[1] == 'kernel':
    _cudnn_out_of_cuda_graphs_by_environ()
    print(json.dumps({'kernel_checks': _kernel_checks(), 'device': jax.devices()[0].device_kind,
                      'jax': jax.__version__}), flush=True)
  else:
    print(json.dumps(_curve(sys.argv[2], int(sys.argv[3]), sys.argv[4:])), flush=True)


if __name__ == '__main__':
  main()
