"""Trains a model of the project with its objective on a device mesh.

    python train.py --config=configs/bert_base.py:tiny --workdir=runs/bert_tiny

Running the same command on the same workdir resumes from its last checkpoint.
"""

import dataclasses
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
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

import checkpoints
import cli
import input_pipeline
import metric_writer
import sharding


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


# ----------------------------------------------------------------------------
# Config checks: every mistake a user can make is caught here, before compiling.
# ----------------------------------------------------------------------------

def model_config(config, platform: str | None = None) -> Any:
  """The model's Config; dtype 'auto' resolves for `platform` (default: this process's backend)."""
  module = importlib.import_module(f'models.{config.model_name}')
  known = {f.name for f in dataclasses.fields(module.Config)}
  unknown = sorted(set(config.model.keys()) - known)
  if unknown:
    raise ValueError(f'config.model has unknown fields {unknown}: remove them or use one of '
                     f'{sorted(known)}.')
  fields = config.model.to_dict()
  platform = platform or jax.default_backend()
  if fields.get('dtype') == 'auto':  # bfloat16 matmuls are slower than float32 on CPUs
    fields['dtype'] = 'float32' if platform == 'cpu' else 'bfloat16'
  if fields.get('attention') == 'auto':  # the kernel has no dropout on attention probabilities
    fields['attention'] = ('flash' if platform == 'tpu' and not fields['attention_dropout_rate']
                           else 'xla')
  if fields.get('attention') == 'flash' and platform != 'tpu':
    raise ValueError(f'model.attention=flash is a TPU kernel and this runs on {platform}: use '
                     'model.attention=auto or xla.')
  return module.Config(**fields)


def validate(config, mesh, num_hosts: int | None = None) -> None:
  """Raises ValueError with one line naming the fix; `num_hosts` defaults to this job's."""
  num_hosts = num_hosts or jax.process_count()
  model_config(config, mesh.devices.flat[0].platform)  # the model's Config checks its own fields
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
  if tc.batch_size % num_hosts:
    raise ValueError(f'train.batch_size={tc.batch_size} is not divisible by the '
                     f'{num_hosts} hosts: use a multiple of {num_hosts}.')
  if tc.eval_steps and config.data.get('pipeline') in input_pipeline.SCORED:
    raise ValueError(f'train.eval_steps={tc.eval_steps}: a task is scored over its whole eval '
                     'split (EM/F1, span F1, MCC need every example): set train.eval_steps=0.')
  if tc.num_steps < 1 or min(tc.log_every, tc.eval_every, tc.checkpoint_every) < 1:
    raise ValueError('train.num_steps, log_every, eval_every and checkpoint_every must be '
                     'positive: set them to 1 or more.')
  if config.optimizer.warmup_steps > tc.num_steps:
    raise ValueError(f'optimizer.warmup_steps={config.optimizer.warmup_steps} exceeds '
                     f'train.num_steps={tc.num_steps}: lower the warmup.')
  if config.model.dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
    raise ValueError(f'model.dtype={config.model.dtype!r}: use auto, float32, bfloat16 or float16.')
  input_pipeline.check_config(config)
  if tc.eval_steps < 0:
    raise ValueError(f'train.eval_steps={tc.eval_steps}: use 0 for one pass of the eval split '
                     'or the number of eval batches.')
  if config.optimizer.get('schedule', 'linear') not in SCHEDULES:
    raise ValueError(f'optimizer.schedule={config.optimizer.schedule!r}: use one of '
                     f'{", ".join(SCHEDULES)}.')
  if config.optimizer.get('name', 'adamw') not in OPTIMIZERS:
    raise ValueError(f'optimizer.name={config.optimizer.name!r}: use one of '
                     f'{", ".join(OPTIMIZERS)}.')
  chars = (config.data.get('max_characters_per_token'),
           config.model.get('max_characters_per_token'))
  if None not in chars and chars[0] != chars[1]:
    raise ValueError(f'data.max_characters_per_token={chars[0]} but model.max_characters_per_token'
                     f'={chars[1]}: set both to the same value.')
  model_module = importlib.import_module(f'models.{config.model_name}')
  if hasattr(model_module, 'check_config'):
    model_module.check_config(config)
  if dp % num_hosts:
    raise ValueError(f'The data-parallel size {dp} (data x fsdp) is not a multiple of the '
                     f'{num_hosts} hosts, so hosts would share batch shards: '
                     'give data or fsdp more devices in config.mesh.')


# Fields of config.model that change parameter shapes or names, or what the loaded
# parameters compute (a frozen biLM with other clipping would give other features).
_SHAPE_FIELDS = ('vocab_size', 'hidden_size', 'num_layers', 'num_heads', 'mlp_dim',
                 'max_position_embeddings', 'type_vocab_size', 'scan_layers',
                 'char_dim', 'max_characters_per_token', 'filters', 'num_highway',
                 'projection_dim', 'lstm_dim', 'cell_clip', 'proj_clip')


def _as_json(value: Any) -> Any:
  """A config value as config.json holds it (tuples become lists)."""
  return json.loads(json.dumps(value))


def inherit_unset_fields(config, workdir: str | None) -> None:
  """Fills the model fields and data.lower_case left None (a fine-tuning config without a size)
  from the run the workdir resumes, or else from config.init_from, so that a converted or
  pretrained checkpoint needs no flag for its sizes or casing."""
  unset = [('model', k) for k, v in config.model.items() if v is None]
  unset += [('data', 'lower_case')] if 'lower_case' in config.data and (
      config.data.lower_case is None) else []
  if not unset:
    return
  source = workdir if workdir and checkpoints.exist(workdir) else config.get('init_from')
  path = os.path.join(source or '', 'config.json')
  if not source or not os.path.isfile(path):
    part, field = unset[0]
    raise ValueError(f'config.{part}.{field} is unset and taken from the pretrained run: set '
                     '--config.init_from to its workdir (or pick a size: <task>,<size>).')
  with open(path, encoding='utf-8') as f:
    saved = json.load(f)
  for part, field in unset:
    if saved.get(part, {}).get(field) is None:
      raise ValueError(f'{path} has no {part}.{field}: set --config.{part}.{field}.')
    config[part][field] = saved[part][field]


def check_init_from(config, workdir: str) -> None:
  """config.init_from names a finished run whose model this config can start from."""
  if os.path.abspath(config.init_from) == os.path.abspath(workdir):
    raise ValueError('config.init_from is the workdir itself: give the fine-tuning run a '
                     'workdir of its own.')
  saved_config = os.path.join(config.init_from, 'config.json')
  if not (checkpoints.exist(config.init_from) and os.path.isfile(saved_config)):
    raise ValueError(f'config.init_from={config.init_from!r} holds no checkpoint and '
                     'config.json: point it at the workdir of a pretraining run.')
  with open(saved_config, encoding='utf-8') as f:
    saved = json.load(f)
  # A task model may start from another model's run (the ELMo tagger from an ELMo biLM).
  module = importlib.import_module(f'models.{config.model_name}')
  starts_from = getattr(module, 'PRETRAINED_MODEL', config.model_name)
  if saved.get('model_name') not in (config.model_name, starts_from):
    raise ValueError(f'config.init_from is a {saved.get("model_name")!r} run and this config '
                     f'trains {config.model_name!r}: start from a {starts_from!r} run.')
  # Ours -> theirs, where a task model names the pretrained model's sizes otherwise
  # (the BCN's word vocabulary is CoVe's source_vocab_size).
  model_fields = getattr(module, 'INIT_FROM_FIELDS', {f: f for f in _SHAPE_FIELDS})
  fields = ([('model', f, theirs) for f, theirs in model_fields.items() if f in config.model] +
            [('data', f, f) for f in ('tokenizer', 'lower_case') if f in config.data])
  for part, field, their_field in fields:
    theirs = saved[part].get(their_field)
    if theirs != _as_json(config[part][field]):
      raise ValueError(f'config.{part}.{field}={config[part][field]} but the run in '
                       f'config.init_from has {part}.{their_field}={theirs}: pick the size it '
                       f'was trained with (the config argument <task>,<size>) or set '
                       f'--config.{part}.{field}={theirs}.')


# ----------------------------------------------------------------------------
# Optimizer: AdamW (or Adagrad, or SGD with momentum), warmup then a decay, clipping.
# ----------------------------------------------------------------------------

SCHEDULES = ('linear', 'cosine', 'constant', 'inverse_sqrt', 'rsqrt')
OPTIMIZERS = ('adamw', 'adagrad', 'sgd')


def learning_rate_schedule(opt_cfg, num_steps: int) -> optax.Schedule:
  """Linear warmup, then linear (BERT sec. A.2), cosine (GPT sec. 4.1), no decay (bilm-tf)
  or 1/sqrt(step) decay (the Transformer, sec. 5.3); or CVT's inverse square root.

  As the reference code computes them over the whole run: BERT's
  lr * (1 - step / num_steps), OpenAI's lr * (1 + cos(pi * step / num_steps)) / 2,
  cvt_text's lr * min(step / warmup, 1) / (1 + decay_rate * sqrt(step)) (the decay
  applies during the warmup too). 'rsqrt' is Vaswani et al.'s
  d^-0.5 min(step^-0.5, step warmup^-1.5) with its peak d^-0.5 warmup^-0.5 as
  optimizer.learning_rate: lr * min(step / warmup, sqrt(warmup / step)).
  """
  lr, warmup = opt_cfg.learning_rate, opt_cfg.warmup_steps
  kind = opt_cfg.get('schedule', 'linear')
  if kind == 'inverse_sqrt':
    decay_rate = opt_cfg.get('decay_rate', 0.005)
    ramp = (lambda step: 1.0) if warmup == 0 else (lambda step: jnp.minimum(step / warmup, 1.0))
    return lambda step: lr * ramp(step) / (1.0 + decay_rate * jnp.sqrt(step))

  if kind == 'rsqrt':
    return lambda step: lr * jnp.minimum(step / max(warmup, 1),
                                         jnp.sqrt(max(warmup, 1) / jnp.maximum(step, 1)))

  def schedule(step):
    done = jnp.minimum(step, num_steps) / num_steps
    decayed = {'cosine': lambda: lr * 0.5 * (1.0 + jnp.cos(jnp.pi * done)),
               'linear': lambda: lr * (1.0 - done),
               'constant': lambda: jnp.full_like(done, lr)}[kind]()
    return jnp.where(step < warmup, lr * step / max(warmup, 1), decayed)
  return schedule


def decay_mask(params: Any) -> Any:
  """Weight decay everywhere but LayerNorm parameters and biases (BERT's run_pretraining)."""
  def decayed(path, _):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return name not in ('bias', 'scale') and not name.endswith('_bias')
  return jax.tree_util.tree_map_with_path(decayed, params)


def param_name(path) -> str:
  """'a/b/c' for the parameter at params['a']['b']['c'] (boxes' attributes left out)."""
  return '/'.join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def frozen_labels(frozen: tuple[str, ...]) -> Callable[[Any], Any]:
  """Labels 'frozen' the params under the names in `frozen`, the others 'trained'.

  A name is a path of parameter names joined by '/': 'bilm' freezes all of
  it, 'word_vectors/table' that table alone (CoVe's GloVe, not its learned
  unknown-word vector). A name the model does not have freezes nothing (the
  ELMo tagger without ELMo has no 'bilm').
  """
  def label(path, _):
    name = param_name(path)
    return 'frozen' if any(name == f or name.startswith(f + '/') for f in frozen) else 'trained'

  def labels(params):  # a prefix of the params tree (boxed leaves stay whole)
    return jax.tree_util.tree_map_with_path(
        label, params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
  return labels


def make_optimizer(opt_cfg, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Clipping then AdamW (BERT, GPT), Adagrad (bilm-tf) or SGD with momentum (cvt_text);
  optimizer.frozen params never move."""
  name = opt_cfg.get('name', 'adamw')
  if name == 'sgd':
    # TF's MomentumOptimizer: v = momentum * v + g; param -= lr * v (optax's trace).
    update = optax.sgd(schedule, momentum=opt_cfg.get('momentum', 0.9))
  elif name == 'adagrad':
    # optax's defaults when the config leaves them out; bilm-tf starts the accumulators at 1.0.
    update = optax.adagrad(schedule,
                           initial_accumulator_value=opt_cfg.get('initial_accumulator_value', 0.1),
                           eps=opt_cfg.get('eps', 1e-7))
  else:
    update = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                         weight_decay=opt_cfg.weight_decay, mask=decay_mask)
  # clip_norm 0 clips nothing (the Transformer's recipe has no clipping).
  tx = (optax.chain(optax.clip_by_global_norm(opt_cfg.clip_norm), update) if opt_cfg.clip_norm
        else update)
  frozen = tuple(opt_cfg.get('frozen', ()))
  if not frozen:
    return tx
  # Frozen parameters get no update at all, not even weight decay (ELMo's frozen biLM, sec. 3.3).
  return optax.multi_transform({'trained': tx, 'frozen': optax.set_to_zero()},
                               frozen_labels(frozen))


# ----------------------------------------------------------------------------
# State, created already sharded.
# ----------------------------------------------------------------------------

def check_frozen(frozen: tuple[str, ...], params: Any) -> None:
  """Each optimizer.frozen path names parameters, so that a typo cannot freeze nothing; a
  single top-level name may be absent (the ELMo tagger without ELMo has no 'bilm')."""
  names = [param_name(path)
           for path, _ in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]]
  for name in frozen:
    if '/' not in name and name not in {n.split('/')[0] for n in names}:
      continue
    if not any(n == name or n.startswith(name + '/') for n in names):
      raise ValueError(f'optimizer.frozen names {name!r}, which is no parameter of the model: '
                       f'use a path of parameter names such as {names[0]!r} or a prefix of it.')


def create_state(model: nn.Module, tx, example_batch, seed: int, mesh, rules,
                 frozen: tuple[str, ...] = (), materialize: bool = True
                 ) -> tuple[TrainState, Any]:
  """Initializes params and optimizer state directly on their shards; without `materialize`,
  the state's shapes, dtypes and shardings only (jax.ShapeDtypeStruct leaves, nothing run)."""
  def init(rng):
    params = model.init({'params': rng}, example_batch, deterministic=True)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  rng = jax.random.key(seed)
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init, rng)
  check_frozen(frozen, abstract.params)  # before anything is compiled
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  if not materialize:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nn.meta.unbox(abstract), shardings), shardings
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


def make_eval_step(model, loss_fn, config, mesh, state_shardings, predict=None) -> Callable:
  """(params, global batch) -> (metric pairs, predictions); with `predict` (the objective's, for
  SCORED pipelines) the predictions of every row of the global batch, on every host."""
  rules = config.logical_axis_rules

  def eval_step(params, batch):
    with nn.logical_axis_rules(rules):
      outputs = model.apply({'params': params}, batch, deterministic=True)
      return loss_fn(outputs, batch)[1], predict(outputs, batch) if predict else {}

  return jax.jit(eval_step, in_shardings=(state_shardings.params, sharding.batch_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))


def accumulate(totals: dict[str, np.ndarray], metrics: dict[str, Any]) -> dict[str, np.ndarray]:
  for k, v in jax.device_get(metrics).items():
    totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
  return totals


def eval_batches(config, tokenizer):
  """The held-out split's iterator and its start; fine-tuning tasks (a fixed eval pass) read
  one batch now, so that a missing or empty eval split stops the run before it trains."""
  batches = input_pipeline.get_dataset(
      config.data, 'eval', tokenizer=tokenizer,
      batch_size=config.train.batch_size // jax.process_count(), seed=config.seed,
      process_index=jax.process_index(), process_count=jax.process_count())
  start = batches.get_state()
  if config.train.eval_steps == 0:
    next(batches)
    if not batches.steps_per_epoch:
      raise ValueError(f'data.pipeline={config.data.pipeline!r} has no fixed eval pass: set '
                       'train.eval_steps to the number of eval batches.')
    batches.set_state(start)
  return batches, start


def evaluate(run: 'Run', params) -> dict[str, float]:
  """Mean metrics over config.train.eval_steps batches of the held-out split (same every time);
  eval_steps=0 takes one pass of it, for pipelines that know its length (fine-tuning tasks)."""
  config, batches, mesh = run.config, run.eval_data, run.mesh
  batches.set_state(run.eval_start)
  steps = config.train.eval_steps or batches.steps_per_epoch
  # Scored on the host only over whole passes (fine-tuning's eval_steps=0): a task's metric
  # is over all of its examples, and an unseen SQuAD question would count as wrong.
  whole_pass = steps >= (batches.steps_per_epoch or steps + 1)
  totals, predicted = {}, []
  for _ in range(steps):
    metrics, predictions = run.eval_step(params, sharding.global_batch(next(batches), mesh))
    totals = accumulate(totals, metrics)
    if predictions and whole_pass:
      predicted.append(jax.device_get(predictions))
  summary = run.objective.summarize(totals)
  if predicted:
    # Every host holds every row's predictions (replicated) and scores the whole pass;
    # padding rows (example_index -1) are left out. The libraries' figures replace the
    # step's in-graph ones of the same name.
    joined = {k: np.concatenate([p[k] for p in predicted]) for k in predicted[0]}
    real = joined['example_index'] >= 0
    summary.update(batches.score({k: v[real] for k, v in joined.items()}))
  return summary


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

  def requested(self, step: int, every: int) -> bool:
    """Whether any host got SIGTERM; hosts agree every `every` steps (a collective)."""
    if jax.process_count() == 1:
      return self.flag
    if step % every:
      return False
    return bool(np.asarray(multihost_utils.process_allgather(np.array(self.flag))).any())


def write_workdir_files(config, workdir: str, tokenizer) -> None:
  if jax.process_index() != 0:
    return
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort(indent=2))
  # CoVe keeps two vocabularies (source words, target subwords); the others one.
  files = (tokenizer.files() if hasattr(tokenizer, 'files')
           else {type(tokenizer).FILE_NAME: tokenizer.vocab_file})
  for name, path in files.items():
    saved = os.path.join(workdir, name)
    if os.path.abspath(path) != os.path.abspath(saved):
      shutil.copyfile(path, saved)


@dataclasses.dataclass
class Run:
  """Everything a training run is made of, built by `setup`."""
  config: Any
  workdir: str
  mesh: jax.sharding.Mesh
  tokenizer: Any
  train_iter: Any
  data_shards: int
  objective: Any
  schedule: optax.Schedule
  state: TrainState
  train_step: Callable
  eval_step: Callable
  mngr: Any
  eval_data: Any
  eval_start: dict


def build(config, mesh, materialize: bool = True
          ) -> tuple[Any, optax.Schedule, TrainState, Callable, Callable]:
  """Objective, schedule, freshly initialized sharded state (abstract without `materialize`),
  and the jitted train/eval steps, for the platform of the mesh's devices."""
  platform = mesh.devices.flat[0].platform
  model = importlib.import_module(f'models.{config.model_name}').Model(
      model_config(config, platform))
  objective = importlib.import_module(f'objectives.{config.objective}')
  # Options of the objective (e.g. GPT's auxiliary LM weight) live in config.loss.
  loss_fn = functools.partial(objective.loss_fn, **config.get('loss', {}))
  schedule = learning_rate_schedule(config.optimizer, config.train.num_steps)
  tx = make_optimizer(config.optimizer, schedule)
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2)
  state, state_shardings = create_state(model, tx, example, config.seed, mesh,
                                        config.logical_axis_rules,
                                        tuple(config.optimizer.get('frozen', ())),
                                        materialize)
  predict = (objective.predict if config.data.pipeline in input_pipeline.SCORED
             and hasattr(objective, 'predict') else None)
  return (objective, schedule, state,
          make_train_step(model, loss_fn, tx, config, mesh, state_shardings),
          make_eval_step(model, loss_fn, config, mesh, state_shardings, predict))


def setup(config, workdir: str, mesh) -> Run:
  """Checks, data, model and state (restored if the workdir has a checkpoint)."""
  # Checks, before any data is read or anything compiled. A resumed run needs
  # nothing from init_from any more (it may have been moved).
  inherit_unset_fields(config, workdir)
  validate(config, mesh)
  if config.get('init_from') and not checkpoints.exist(workdir):
    check_init_from(config, workdir)
  os.makedirs(workdir, exist_ok=True)

  # Data. A resumed run keeps the vocabulary it started with, whatever the cache holds now,
  # and a run initialized from another one takes that run's vocabulary.
  resuming = checkpoints.exist(workdir)
  saved_dir = workdir if resuming else config.get('init_from') or None
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size, saved_dir)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f'The vocabulary has {tokenizer.vocab_size} tokens but model.vocab_size='
                     f'{config.model.vocab_size}: set --config.model.vocab_size='
                     f'{tokenizer.vocab_size}.')
  # The data shards are the hosts of the run's first job, whatever the hosts are now.
  data_shards = checkpoints.num_data_shards(workdir) or jax.process_count()
  train_iter = input_pipeline.get_train_stream(
      config.data, tokenizer=tokenizer, global_batch=config.train.batch_size, seed=config.seed,
      num_shards=data_shards, process_index=jax.process_index(),
      process_count=jax.process_count())
  eval_data, eval_start = eval_batches(config, tokenizer)

  # Model and state, restored with the data position when the workdir has a checkpoint.
  objective, schedule, state, train_step, eval_step = build(config, mesh)
  mngr = checkpoints.manager(workdir, config.train.keep_checkpoints)
  if mngr.latest_step() is not None:
    state, shards = checkpoints.restore(mngr, state, workdir)
    train_iter.set_state(dict(enumerate(shards)))
    if jax.process_index() == 0:
      print(f'Resuming from step {int(state.step)} in {workdir}.', flush=True)
  elif config.get('init_from'):
    state = state.replace(params=init_params(state.params, config))
  else:
    model_module = importlib.import_module(f'models.{config.model_name}')
    if hasattr(model_module, 'load_pretrained'):  # CoVe's GloVe vectors
      state = state.replace(params=model_module.load_pretrained(config, state.params, tokenizer))
  write_workdir_files(config, workdir, tokenizer)
  return Run(config, workdir, mesh, tokenizer, train_iter, data_shards, objective, schedule,
             state, train_step, eval_step, mngr, eval_data, eval_start)


def load_trained(workdir: str, model_names: str | tuple[str, ...], command: str
                 ) -> tuple[Any, nn.Module, Any, Any]:
  """The config, model, latest parameters (on one device) and tokenizer of a workdir that
  trained one of `model_names`."""
  names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
  path = os.path.join(workdir, 'config.json')
  if not (os.path.isfile(path) and checkpoints.exist(workdir)):
    raise ValueError(f'{workdir} holds no config.json and checkpoint: pass the --workdir of '
                     f'a {" or ".join(names)} training run.')
  with open(path, encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  if config.model_name not in names:
    raise ValueError(f'{workdir} trained {config.model_name!r}: {command} reads '
                     f'{" or ".join(names)} runs.')
  model = importlib.import_module(f'models.{config.model_name}').Model(model_config(config))
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=1)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.eval_shape(lambda: nn.meta.unbox(
      model.init(jax.random.key(0), example, deterministic=True)['params']))
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        abstract)
  params, new, _ = checkpoints.restore_params(workdir, target)
  if new:
    raise ValueError(f'The checkpoint in {workdir} lacks {", ".join(new)}: it does not match '
                     'its config.json.')
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size,
                                           saved_dir=workdir)
  return config, model, params, tokenizer


def init_params(params, config):
  """`params` with every array the run in config.init_from also has taken from its last
  checkpoint.

  A task model that holds the pretrained model as a submodule names it in
  PRETRAINED_PARAMS (BERT's feature-based tagger keeps BERT under 'bert'):
  the run's parameters then fill that subtree. The task heads a model names
  in TASK_HEADS start afresh when init_from was fine-tuned on another task
  (each task gets a new output layer, BERT sec. 4).
  """
  init_from, module = config.init_from, importlib.import_module(f'models.{config.model_name}')
  prefix = getattr(module, 'PRETRAINED_PARAMS', None)
  with open(os.path.join(init_from, 'config.json'), encoding='utf-8') as f:
    saved_task = json.load(f).get('data', {}).get('task')
  same_task = saved_task is not None and saved_task == config.data.get('task')
  fresh = () if same_task else tuple(getattr(module, 'TASK_HEADS', ()))
  if prefix:
    subtree, new, unused = checkpoints.restore_params(init_from, params[prefix], fresh)
    params = {**params, prefix: subtree}
    new = [f'{prefix}/{name}' for name in new] + [name for name in params if name != prefix]
  else:
    params, new, unused = checkpoints.restore_params(init_from, params, fresh)
  if jax.process_index() == 0:
    print(f'Initialized from {init_from}; new parameters: {", ".join(new) or "none"}; '
          f'unused: {", ".join(unused) or "none"}.', flush=True)
  return params


class Progress:
  """Sums step metrics, stops on a non-finite loss, and times the steps between logs."""

  def __init__(self, run: Run, step: int):
    self.run, self.totals = run, {}
    self.last_good_step = run.mngr.latest_step()
    self.last_step, self.last_time, self.paused = step, time.time(), 0.0

  def add(self, step: int, metrics) -> None:
    self.totals = accumulate(self.totals, metrics)
    # A finite loss with a non-finite gradient already spoils this step's parameters.
    loss, grad_norm = float(self.totals['loss'][0]), float(self.totals['grad_norm'][0])
    if not np.isfinite(loss + grad_norm):
      raise FloatingPointError(
          f'Loss is {loss} and gradient norm {grad_norm} at step {step}; the last good checkpoint is step '
          f'{self.last_good_step} in {self.run.workdir}. Lower optimizer.learning_rate or '
          'check the data.')

  def save(self, step: int, state: TrainState) -> None:
    """Starts the checkpoint of `step`; a non-finite state is never saved."""
    try:
      checkpoints.save(self.run.mngr, step, state, self.run.train_iter.get_state(),
                       self.run.data_shards)
    except FloatingPointError as e:
      raise FloatingPointError(
          f'{e}; the last good checkpoint is step {self.last_good_step} in {self.run.workdir}. '
          'Lower optimizer.learning_rate or check the data.') from None
    self.last_good_step = step

  def summary(self, step: int) -> tuple[dict[str, float], float]:
    """The metrics since the last call, and training steps per second (pauses excluded)."""
    now = time.time()
    steps_per_sec = (step - self.last_step) / max(now - self.last_time - self.paused, 1e-9)
    summary = self.run.objective.summarize(self.totals)
    summary['learning_rate'] = float(self.run.schedule(step - 1))
    summary['tokens_per_sec'] = (steps_per_sec * self.run.config.train.batch_size *
                                 self.run.config.data.max_seq_length *
                                 self.run.config.data.get('num_choices', 1))
    self.totals, self.last_step, self.last_time, self.paused = {}, step, now, 0.0
    return summary, steps_per_sec


def _agreed(flag: bool) -> bool:
  """Host 0's answer on every host (only host 0 writes metrics.jsonl)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.array(flag)))


def evaluate_and_write(run: Run, params, step: int, writer) -> None:
  """An eval line in metrics.jsonl; at train.num_steps also the run's results line."""
  metrics = evaluate(run, params)
  if run.config.get('decode', {}).get('bleu_examples'):  # translation models
    import translate  # pylint: disable=g-import-not-at-top (it imports train)
    metrics.update(translate.evaluate_bleu(run.config, params, run.tokenizer))
  writer.write(step, metrics, prefix='eval_')
  if step == run.config.train.num_steps:
    writer.results(step, {f'eval_{k}': v for k, v in metrics.items()}, run.workdir)


def train_loop(run: Run, stop: StopRequested, stop_after_steps: int | None) -> TrainState:
  """Steps until train.num_steps (or a stop); logs, evaluates and checkpoints on the way."""
  tc, state = run.config.train, run.state
  step = int(state.step)
  end = tc.num_steps if stop_after_steps is None else min(tc.num_steps, step + stop_after_steps)
  if jax.process_index() == 0:
    print(f'{run.config.model_name}: {sum(x.size for x in jax.tree.leaves(state.params)):,} '
          f'parameters; mesh {dict(run.mesh.shape)}; starting at step {step}/{tc.num_steps}.',
          flush=True)
  writer = metric_writer.MetricWriter(run.workdir, tc.num_steps)
  progress, pending, start_step = Progress(run, step), None, step
  try:
    if step == tc.num_steps and not _agreed(metric_writer.has_results(run.workdir)):
      evaluate_and_write(run, state.params, step, writer)  # stopped during its final eval
    elif step >= tc.num_steps and jax.process_index() == 0:
      print(f'Nothing to do: the run reached train.num_steps={tc.num_steps}; raise it to '
            'train further.', flush=True)
    while step < end and not stop.requested(step, tc.log_every):
      first = step == start_step
      start = time.time()
      state, metrics = run.train_step(state, sharding.global_batch(next(run.train_iter), run.mesh))
      if first:
        jax.block_until_ready(metrics)
        progress.paused += time.time() - start
        if jax.process_index() == 0:
          print(f'First step (with compilation) took {time.time() - start:.1f}s.', flush=True)
      step += 1
      # The previous step's metrics are read while this one runs; a non-finite
      # loss is still caught at its own step, and before any checkpoint.
      if pending is not None:
        progress.add(*pending)
      pending = (step, metrics)
      if step % tc.log_every and step % tc.checkpoint_every and step % tc.eval_every and step != end:
        continue
      progress.add(*pending)
      pending = None
      if step % tc.log_every == 0 or step == end:
        summary, steps_per_sec = progress.summary(step)
        writer.write(step, summary, steps_per_sec=steps_per_sec)
      pause = time.time()
      if step % tc.checkpoint_every == 0 or step == end:
        progress.save(step, state)
      if step % tc.eval_every == 0 or step == tc.num_steps:
        evaluate_and_write(run, state.params, step, writer)
      progress.paused += time.time() - pause
    if step < end:  # stopped by SIGTERM
      if pending is not None:
        progress.add(*pending)
      progress.save(step, state)
      logging.warning('SIGTERM: saved a checkpoint at step %d; the same command resumes.', step)
  finally:
    checkpoints.wait(run.mngr)
    writer.close()
  return state


def train_and_evaluate(config, workdir: str, *, stop_after_steps: int | None = None,
                       devices=None) -> TrainState:
  """Trains (or resumes) in `workdir`; `stop_after_steps` ends this run early, as a preemption
  would; `devices` (default: all) make the mesh."""
  stop = StopRequested()
  previous_handler = signal.signal(signal.SIGTERM, stop)
  try:
    mesh = sharding.make_mesh(config.mesh, devices)
    with jax.set_mesh(mesh):
      return train_loop(setup(config, workdir, mesh), stop, stop_after_steps)
  finally:
    signal.signal(signal.SIGTERM, previous_handler)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  sharding.initialize_hosts(flags.FLAGS.multihost)
  config, workdir = cli.loaded_config('train.py'), flags.FLAGS.workdir
  if not workdir or config is None:
    sys.exit('train.py: error: pass --config=configs/<file>.py[:variant] and --workdir=DIR.')
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    sys.exit(f'train.py: error: --workdir={workdir} is a file: pass a directory, new or a '
             'run\'s.')
  try:
    train_and_evaluate(config, workdir)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'train.py: error: {e}')
  except (FloatingPointError, checkpoints.WriteError) as e:
    sys.exit(f'train.py: stopped: {e}')


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints and logs.')
  flags.DEFINE_bool('multihost', False, 'Call jax.distributed.initialize() (TPU pods and '
                    'SLURM jobs are detected without it).')
  jax.config.config_with_absl()
  app.run(main, flags_parser=cli.parse_flags)
