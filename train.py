"""Trains a model of the project with its objective on a device mesh.

    python train.py --config=configs/bert_base.py:tiny --workdir=runs/bert_tiny

Running the same command on the same workdir resumes from its last checkpoint.
"""

import functools
import importlib
import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from ml_collections import config_flags
import numpy as np
import optax

import checkpoints
import input_pipeline
import metric_writer
import sharding

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints and logs.')


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


# ----------------------------------------------------------------------------
# Config checks: every mistake a user can make is caught here, before compiling.
# ----------------------------------------------------------------------------

def model_config(config) -> Any:
  module = importlib.import_module(f'models.{config.model_name}')
  fields = {f.name for f in module.Config.__dataclass_fields__.values()}
  unknown = sorted(set(config.model.keys()) - fields)
  if unknown:
    raise ValueError(f'config.model has unknown fields {unknown}: remove them or use one of '
                     f'{sorted(fields)}.')
  return module.Config(**config.model.to_dict())


def validate(config, mesh) -> None:
  """Raises ValueError with one line naming the fix."""
  model_config(config)  # the model's Config checks its own fields
  seq_len = config.data.get('max_seq_length')
  positions = config.model.get('max_position_embeddings')
  if seq_len and positions and seq_len > positions:
    raise ValueError(f'data.max_seq_length={seq_len} is above model.max_position_embeddings='
                     f'{positions}: lower data.max_seq_length or raise the position table.')
  tc = config.train
  dp = sharding.data_parallel_size(mesh)
  if tc.batch_size % (dp * tc.grad_accum_steps):
    raise ValueError(f'train.batch_size={tc.batch_size} is not divisible by the data-parallel '
                     f'size {dp} (data x fsdp) times train.grad_accum_steps='
                     f'{tc.grad_accum_steps}: use a multiple of {dp * tc.grad_accum_steps}.')
  if tc.batch_size % jax.process_count():
    raise ValueError(f'train.batch_size={tc.batch_size} is not divisible by the '
                     f'{jax.process_count()} hosts: use a multiple of {jax.process_count()}.')
  if config.optimizer.warmup_steps > tc.num_steps:
    raise ValueError(f'optimizer.warmup_steps={config.optimizer.warmup_steps} exceeds '
                     f'train.num_steps={tc.num_steps}: lower the warmup.')
  if config.model.dtype not in ('float32', 'bfloat16', 'float16'):
    raise ValueError(f'model.dtype={config.model.dtype!r}: use float32, bfloat16 or float16.')


# ----------------------------------------------------------------------------
# Optimizer: AdamW as in BERT, linear warmup then linear decay, clipping.
# ----------------------------------------------------------------------------

def learning_rate_schedule(opt_cfg, num_steps: int) -> optax.Schedule:
  warmup = optax.linear_schedule(0.0, opt_cfg.learning_rate, opt_cfg.warmup_steps)
  decay = optax.linear_schedule(opt_cfg.learning_rate, 0.0,
                                max(num_steps - opt_cfg.warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [opt_cfg.warmup_steps])


def decay_mask(params: Any) -> Any:
  """Weight decay everywhere but LayerNorm parameters and biases (BERT's run_pretraining)."""
  def decayed(path, _):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return name not in ('bias', 'scale') and not name.endswith('_bias')
  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(opt_cfg, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(opt_cfg.clip_norm),
      optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                  weight_decay=opt_cfg.weight_decay, mask=decay_mask))


# ----------------------------------------------------------------------------
# State, created already sharded.
# ----------------------------------------------------------------------------

def create_state(model: nn.Module, tx, example_batch, seed: int, mesh, rules
                 ) -> tuple[TrainState, Any]:
  """Initializes params and optimizer state directly on their shards."""
  def init(rng):
    params = model.init({'params': rng}, example_batch, deterministic=True)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  rng = jax.random.key(seed)
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init, rng)
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(rng)
  return state, shardings


# ----------------------------------------------------------------------------
# The train and eval steps.
# ----------------------------------------------------------------------------

def make_train_step(model, loss_fn, tx, config, mesh, state_shardings) -> Callable:
  """One jitted step: (state, global batch) -> (state, metric pairs); state donated."""
  accum = config.train.grad_accum_steps
  base_rng = jax.random.key(config.seed + 1)
  rules = config.logical_axis_rules

  def compute_loss(params, batch, rng):
    outputs = model.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': rng})
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
        def micro_step(micro, micro_rng):
          (_, m), g = grad_fn(state.params, micro, micro_rng)
          return g, m
        micros = micro_batches(batch)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
            micro_step, jax.tree.map(lambda x: x[0], micros), rng))
        def body(carry, xs):
          i, micro = xs
          return jax.tree.map(jnp.add, carry, micro_step(micro, jax.random.fold_in(rng, i))), None
        (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micros))
        grads = jax.tree.map(lambda g: g / accum, grads)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics['grad_norm'] = jnp.stack([optax.global_norm(grads), 1.0])
      new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
      return new_state, metrics

  return jax.jit(train_step, in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(state_shardings, sharding.replicated(mesh)),
                 donate_argnums=(0,))


def make_eval_step(model, loss_fn, config, mesh, state_shardings) -> Callable:
  rules = config.logical_axis_rules

  def eval_step(params, batch):
    with nn.logical_axis_rules(rules):
      return loss_fn(model.apply({'params': params}, batch, deterministic=True), batch)[1]

  return jax.jit(eval_step, in_shardings=(state_shardings.params, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def accumulate(totals: dict[str, np.ndarray], metrics: dict[str, Any]) -> dict[str, np.ndarray]:
  for k, v in jax.device_get(metrics).items():
    totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
  return totals


def evaluate(eval_step, params, config, tokenizer, mesh, summarize) -> dict[str, float]:
  """Mean metrics over config.train.eval_steps batches of the held-out split (same every time)."""
  batches = input_pipeline.get_dataset(
      config.data, 'eval', tokenizer=tokenizer,
      batch_size=config.train.batch_size // jax.process_count(), seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  totals = {}
  for _ in range(config.train.eval_steps):
    totals = accumulate(totals, eval_step(params, sharding.global_batch(next(batches), mesh)))
  return summarize(totals)


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------

class StopRequested:
  """Set by SIGTERM; the loop checkpoints and exits at the next step boundary."""

  def __init__(self):
    self.flag = False

  def __call__(self, signum, frame):
    del signum, frame
    self.flag = True

  def any_host(self) -> bool:
    if jax.process_count() == 1:
      return self.flag
    return bool(np.asarray(multihost_utils.process_allgather(np.array(self.flag))).any())


def write_workdir_files(config, workdir: str, tokenizer) -> None:
  if jax.process_index() != 0:
    return
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort(indent=2))
  if getattr(tokenizer, 'vocab_file', None):
    shutil.copyfile(tokenizer.vocab_file, os.path.join(workdir, 'vocab.txt'))


def train_and_evaluate(config, workdir: str, *, stop_after_steps: int | None = None
                       ) -> TrainState:
  """Trains (or resumes) in `workdir`; `stop_after_steps` ends this run early, as a preemption would."""
  # Mesh and checks, before any data is read or anything compiled.
  mesh = sharding.make_mesh(config.mesh)
  validate(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  rules = config.logical_axis_rules
  tc = config.train

  # Data.
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f'The vocabulary has {tokenizer.vocab_size} tokens but model.vocab_size='
                     f'{config.model.vocab_size}: set --config.model.vocab_size='
                     f'{tokenizer.vocab_size}.')
  local_batch = tc.batch_size // jax.process_count()
  train_iter = input_pipeline.get_dataset(
      config.data, 'train', tokenizer=tokenizer, batch_size=local_batch, seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  write_workdir_files(config, workdir, tokenizer)

  # Model, objective, optimizer, state.
  model = importlib.import_module(f'models.{config.model_name}').Model(model_config(config))
  objective = importlib.import_module(f'objectives.{config.objective}')
  schedule = learning_rate_schedule(config.optimizer, tc.num_steps)
  tx = make_optimizer(config.optimizer, schedule)
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2)
  state, state_shardings = create_state(model, tx, example, config.seed, mesh, rules)
  mngr = checkpoints.manager(workdir, tc.keep_checkpoints)
  if mngr.latest_step() is not None:
    state, data_state = checkpoints.restore(mngr, state)
    train_iter.set_state(data_state)
    if jax.process_index() == 0:
      print(f'Resuming from step {int(state.step)} in {workdir}.', flush=True)
  train_step = make_train_step(model, objective.loss_fn, tx, config, mesh, state_shardings)
  eval_step = make_eval_step(model, objective.loss_fn, config, mesh, state_shardings)

  step = int(state.step)
  if jax.process_index() == 0:
    print(f'{config.model_name}: {sum(x.size for x in jax.tree.leaves(state.params)):,} '
          f'parameters; mesh {dict(mesh.shape)}; starting at step {step}/{tc.num_steps}.',
          flush=True)
  writer = metric_writer.MetricWriter(workdir, tc.num_steps)
  stop = StopRequested()
  previous_handler = signal.signal(signal.SIGTERM, stop)
  tokens_per_step = tc.batch_size * config.data.max_seq_length
  last_good_step = mngr.latest_step()
  totals, pending = {}, None
  last_time, last_step = time.time(), step
  run_end = tc.num_steps if stop_after_steps is None else min(tc.num_steps, step + stop_after_steps)

  def finish(pending_step, metrics):
    # Reading the previous step's metrics while the next one runs keeps the
    # device busy; a non-finite loss is still caught at its own step.
    nonlocal totals
    totals = accumulate(totals, metrics)
    loss = float(jax.device_get(metrics['loss'])[0])
    if not np.isfinite(loss):
      raise FloatingPointError(
          f'Loss is {loss} at step {pending_step}; the last good checkpoint is step '
          f'{last_good_step} in {workdir}. Lower optimizer.learning_rate or check the data.')

  try:
    with jax.set_mesh(mesh):
      while step < run_end and not stop.any_host():
        batch = sharding.global_batch(next(train_iter), mesh)
        if step == last_step and pending is None:
          compile_start = time.time()
          state, metrics = train_step(state, batch)
          jax.block_until_ready(metrics)
          if jax.process_index() == 0:
            print(f'First step (with compilation) took {time.time() - compile_start:.1f}s.',
                  flush=True)
          last_time = time.time()
        else:
          state, metrics = train_step(state, batch)
        step += 1
        if pending is not None:
          finish(*pending)
        pending = (step, metrics)

        is_last = step == run_end
        if step % tc.log_every == 0 or step % tc.checkpoint_every == 0 or is_last:
          finish(*pending)
          pending = None
        if step % tc.log_every == 0 or is_last:
          now = time.time()
          steps_per_sec = (step - last_step) / max(now - last_time, 1e-9)
          summary = objective.summarize(totals)
          summary['learning_rate'] = float(schedule(step - 1))
          summary['tokens_per_sec'] = steps_per_sec * tokens_per_step
          writer.write(step, summary, steps_per_sec=steps_per_sec)
          totals, last_time, last_step = {}, now, step
        pause_start = time.time()  # checkpoints and evals do not count against tokens/s
        if step % tc.checkpoint_every == 0 or is_last:
          checkpoints.save(mngr, step, state, train_iter.get_state())
          last_good_step = step
        if step % tc.eval_every == 0 or step == tc.num_steps:
          writer.write(step, evaluate(eval_step, state.params, config, tokenizer, mesh,
                                      objective.summarize), prefix='eval_')
        last_time += time.time() - pause_start
      if step < run_end:  # stopped by SIGTERM
        if pending is not None:
          finish(*pending)
        checkpoints.save(mngr, step, state, train_iter.get_state())
        logging.warning('SIGTERM: saved a checkpoint at step %d; the same command resumes.', step)
  finally:
    mngr.wait_until_finished()
    signal.signal(signal.SIGTERM, previous_handler)
    writer.close()
  return state


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  if not _WORKDIR.value or _CONFIG.value is None:
    sys.exit('train.py: error: pass --config=configs/<file>.py[:variant] and --workdir=DIR.')
  try:
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'train.py: error: {e}')
  except FloatingPointError as e:
    sys.exit(f'train.py: stopped: {e}')


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main)
