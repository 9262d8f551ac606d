"""The train state, created already sharded; building a run's model, objective and steps;
loading trained parameters (init_from, and the other programs)."""

import functools
import importlib
import json
import os
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

import input_pipeline
from trainer import checkpoints
from trainer import sharding
from trainer.checks import model_config
from trainer.optimizer import check_frozen, check_sparse_rows, learning_rate_schedule
from trainer.optimizer import make_optimizer
from trainer.steps import make_eval_step, make_train_step


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def create_state(model: nn.Module, tx, example_batch, seed: int, mesh, rules,
                 frozen: tuple[str, ...] = (), materialize: bool = True,
                 sparse_rows: tuple[str, ...] = ()) -> tuple[TrainState, Any]:
  """Initializes params and optimizer state directly on their shards; without `materialize`,
  the state's shapes, dtypes and shardings only (jax.ShapeDtypeStruct leaves, nothing run)."""
  def init(rng):
    params = model.init({'params': rng}, example_batch, deterministic=True)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  rng = jax.random.key(seed)
  with nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(init, rng)
  check_frozen(frozen, abstract.params)  # before anything is compiled
  check_sparse_rows(sparse_rows, abstract.params)
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  if not materialize:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nn.meta.unbox(abstract), shardings), shardings

  def initialize(rng):  # the init program's name in XLA's dumps and jax's compile events
    return nn.meta.unbox(init(rng))

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = jax.jit(initialize, out_shardings=shardings)(rng)
  return state, shardings


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
                                        materialize,
                                        tuple(config.optimizer.get('sparse_rows', ())))
  predict = (objective.predict if config.data.pipeline in input_pipeline.SCORED
             and hasattr(objective, 'predict') else None)
  return (objective, schedule, state,
          make_train_step(model, loss_fn, tx, config, mesh, state_shardings),
          make_eval_step(model, loss_fn, config, mesh, state_shardings, predict))


def initial_state(config, mesh, tokenizer) -> TrainState:
  """A fresh run's state on its shards: initialized, then given the parameters of
  config.init_from, or the model's pretrained part (CoVe's GloVe vectors)."""
  _, _, state, _, _ = build(config, mesh)
  if config.get('init_from'):
    return state.replace(params=init_params(state.params, config))
  model_module = importlib.import_module(f'models.{config.model_name}')
  if hasattr(model_module, 'load_pretrained'):
    return state.replace(params=model_module.load_pretrained(config, state.params, tokenizer))
  return state


def abstract_batch(config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes (every feature is batch-first), without making its examples."""
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2)
  batch_sharding = sharding.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((config.train.batch_size,) + v.shape[1:], v.dtype,
                                  sharding=batch_sharding)
          for k, v in example.items()}


def load_trained(workdir: str, model_names: str | tuple[str, ...], command: str
                 ) -> tuple[Any, nn.Module, Any, Any]:
  """The config, model, latest parameters (on one device) and tokenizer of a workdir that
  trained one of `model_names`."""
  names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
  path = os.path.join(workdir, 'config.json')
  if not (os.path.isfile(path) and checkpoints.exist(workdir)):
    what = 'a config.json but no checkpoint' if os.path.isfile(path) else 'no config.json'
    raise ValueError(f'{workdir} holds {what}: pass the --workdir of a '
                     f'{" or ".join(names)} training run.')
  with open(path, encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  if 'model_name' not in config:
    raise ValueError(f'{path} is no train.py config (it has no model_name; an HF export\'s?): '
                     f'pass the --workdir of a {" or ".join(names)} training run.')
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
  params, new, unused = checkpoints.restore_params(workdir, target)
  if new:
    raise ValueError(f'The checkpoint in {workdir} lacks {", ".join(new)}: it does not match '
                     'its config.json.')
  if unused:  # the model computed without them: not what was trained
    raise ValueError(f'The checkpoint in {workdir} holds {", ".join(unused[:3])}, which '
                     f'models/{config.model_name}.py no longer has: it was trained by an earlier '
                     'version of the model (see git log models/); use that version for it.')
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
