"""The jitted train and eval steps."""

import re
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jaxlib
import jax.numpy as jnp
import numpy as np
import optax

from trainer import sharding

# XLA's options for a step compiled for NVIDIA GPUs: the passes its GPU optimization level O1
# turns on, named one by one (openxla.org/xla/gpu_optimization_levels; JAX's GPU performance
# tips): collectives scheduled to overlap compute, the data-parallel ones pipelined across
# scanned layers, and a scan's loop unrolled twice so one layer's collectives overlap the next.
# And no merging of matrix products that share an operand: jaxlib 0.11.2's XLA merges attention's
# query and key projections into one product and then copies the halves apart for our attention
# kernel (a Pallas call takes whole arrays), 1.2 ms a step of BERT-base (256 x 128) and of GPT-1
# (64 x 512) on an H100 by aot.py's estimate (45.9 -> 44.7 and 59.8 -> 58.6 ms); the pinned
# jaxlib merged nothing there (44.7 and 58.7 ms either way).
GPU_COMPILER_OPTIONS = {
    'xla_gpu_enable_latency_hiding_scheduler': True,
    'xla_gpu_enable_pipelined_all_gather': True,
    'xla_gpu_enable_pipelined_reduce_scatter': True,
    'xla_gpu_enable_pipelined_all_reduce': True,
    'xla_gpu_enable_while_loop_double_buffering': True,
    'xla_gpu_dot_merger_threshold_mb': 0,
}
# Of each GPU's memory, what JAX's allocator may take (its default, 0.75, leaves a quarter
# unused; NVIDIA's JAX guide runs at 0.8-0.9). train.py sets it unless the user did; aot.py
# tests a step's fit against it.
GPU_MEMORY_FRACTION = 0.9


# cuDNN's attention with dropout (model.attention=cudnn) aborted the process inside CUDA graphs
# (command buffers) on an H200 with jax 0.11.2, and ran outside them (docs/accelerators.md). This
# option of the train step's compile keeps cuDNN's calls out of the graphs: the kinds XLA puts in
# them by default less CUDNN (XLA_FLAGS="--xla_gpu_enable_command_buffer=-CUDNN" does the same for
# every compile of a process).
CUDNN_DROPOUT_OPTIONS = {
    'xla_gpu_enable_command_buffer': 'FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,DYNAMIC_SLICE_FUSION'}

# Each platform's options for the steps (none on CPU and TPU; a test adds some for CPU).
PLATFORM_OPTIONS = {'gpu': GPU_COMPILER_OPTIONS}
_REFUSED = re.compile(r"No such compile option: '([\w.]+)'")
_BAD_VALUE = re.compile(r"While setting option ([\w.]+), '(\w+)' is not a valid enum value")
_said: set[tuple[str, str]] = set()  # (platform, what was dropped), said once a process
# What this process's jaxlib accepted of each platform's options, found once (a newer jaxlib
# than the pin drops options it no longer knows, and refuses the compile that names them).
_accepted: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] = {}


def compiler_options(mesh, cudnn_dropout: bool = False) -> dict[str, Any] | None:
  """XLA options for steps on the mesh's platform (GPU_COMPILER_OPTIONS on GPUs; with
  `cudnn_dropout`, a step that runs cuDNN's attention with dropout, CUDNN_DROPOUT_OPTIONS too),
  less any that the installed jaxlib refuses: each of those is named in one line, once a process."""
  device = mesh.devices.flat[0]
  wanted = dict(PLATFORM_OPTIONS.get(device.platform) or {})
  if cudnn_dropout and device.platform == 'gpu':
    wanted.update(CUDNN_DROPOUT_OPTIONS)
  if not wanted:
    return None
  key = (device.platform, tuple(wanted.items()))
  if key not in _accepted:
    _accepted[key] = accepted_options(mesh, dict(wanted))
  return dict(_accepted[key])


def accepted_options(mesh, options: dict[str, Any]) -> dict[str, Any]:
  """`options` less those the compiler refuses, found by compiling x + 1 for the mesh's devices
  (real or compile-only ones) until it compiles; each dropped option is said in one line."""
  platform = mesh.devices.flat[0].platform
  probe = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding.replicated(mesh))
  options = dict(options)
  while options:
    try:
      jax.jit(lambda x: x + 1, compiler_options=options).lower(probe).compile()
      break
    except Exception as e:  # pylint: disable=broad-except
      refused, bad = _REFUSED.search(str(e)), _BAD_VALUE.search(str(e))
      if refused and refused.group(1) in options:
        del options[refused.group(1)]
        line = (f'XLA option {refused.group(1)} is not known to this jaxlib '
                f'({jaxlib.__version__}, {platform}): the steps compile without it.')
      elif bad and isinstance(options.get(bad.group(1)), str):  # a list of enum names
        name, value = bad.groups()
        options[name] = ','.join(v for v in options[name].split(',') if v != value)
        line = (f'XLA option {name}: this jaxlib ({jaxlib.__version__}, {platform}) knows no '
                f'{value}; the steps compile with {name}={options[name]!r}.')
      else:
        break  # another reason: the step's own compile will say it
      if (platform, line) not in _said:
        _said.add((platform, line))
        print(line, file=sys.stderr, flush=True)
  return options


def runs_cudnn_dropout(model_config) -> bool:
  """Whether a model of this Config runs cuDNN's attention with dropout in its train step."""
  return (getattr(model_config, 'attention', None) == 'cudnn'
          and bool(getattr(model_config, 'attention_dropout_rate', 0)))


def make_train_step(model, loss_fn, tx, config, mesh, state_shardings) -> Callable:
  """One jitted step: (state, global batch) -> (state, metric pairs); state donated."""
  accum = config.train.grad_accum_steps
  base_rng = jax.random.key(config.seed + 1)
  rules = config.logical_axis_rules

  def compute_loss(params, batch, rng):
    # 'sampling' draws the sampled softmax's classes (ELMo); other models ignore it.
    outputs = model.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': rng, 'sampling': jax.random.fold_in(rng, 1 << 30)})
    return loss_fn(outputs, batch)

  grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

  def micro_batches(batch):
    # Strided split: every micro-batch keeps an equal share on every data shard.
    def split(x):
      x = x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1)
      return nn.with_logical_constraint(x, (None, 'batch') + (None,) * (x.ndim - 2))
    return jax.tree.map(split, batch)

  def train_step(state, batch):
    with nn.logical_axis_rules(rules):
      rng = jax.random.fold_in(base_rng, state.step)
      if accum == 1:
        (_, metrics), grads = grad_fn(state.params, batch, rng)
      else:
        # Each micro-batch's gradient weighs by the count n of its metrics['loss'] pair
        # (objectives/__init__.py): sum_i n_i grad(loss_i) / sum_i n_i is the gradient of the
        # whole batch's mean when the loss is one mean over n (tokens of a translation or a
        # tagging batch, whose micro-batches hold different numbers); a sum of means (MLM +
        # NSP) reports n = 1, the mean of the micro-batches' gradients, as BERT's reference
        # averages its TPU cores'.
        def micro_step(micro, micro_rng):
          (_, m), g = grad_fn(state.params, micro, micro_rng)
          n = m['loss'][1]
          return jax.tree.map(lambda x: x * n.astype(x.dtype), g), m
        micros = micro_batches(batch)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
            micro_step, jax.tree.map(lambda x: x[0], micros), rng))
        def body(carry, xs):
          i, micro = xs
          return jax.tree.map(jnp.add, carry, micro_step(micro, jax.random.fold_in(rng, i))), None
        (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micros))
        total = jnp.maximum(metrics['loss'][1], 1e-6)
        grads = jax.tree.map(lambda g: g / total.astype(g.dtype), grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics['grad_norm'] = jnp.stack([optax.global_norm(grads), 1.0])
      new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
      return new_state, metrics

  options = compiler_options(mesh, runs_cudnn_dropout(model.config))
  return jax.jit(train_step, in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(state_shardings, sharding.replicated(mesh)),
                 donate_argnums=(0,), compiler_options=options)


def make_eval_step(model, loss_fn, config, mesh, state_shardings, predict=None) -> Callable:
  """(params, global batch) -> (metric pairs, predictions); with `predict` (the objective's, for
  SCORED pipelines) the predictions of every row of the global batch, on every host."""
  rules = config.logical_axis_rules

  def eval_step(params, batch):
    with nn.logical_axis_rules(rules):
      outputs = model.apply({'params': params}, batch, deterministic=True)
      return loss_fn(outputs, batch)[1], predict(outputs, batch) if predict else {}

  return jax.jit(eval_step, in_shardings=(state_shardings.params, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh), compiler_options=compiler_options(mesh))


def accumulate(totals: dict[str, np.ndarray], metrics: dict[str, Any]) -> dict[str, np.ndarray]:
  for k, v in jax.device_get(metrics).items():
    totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
  return totals
