"""The optimizer: AdamW (or Adagrad, or SGD with momentum), warmup then a decay, clipping,
frozen and decay masks."""

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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
  optimizer.learning_rate: lr * min(step / warmup, sqrt(warmup / step)), its step_num
  counting from 1 (optax's count + 1).
  """
  lr, warmup = opt_cfg.learning_rate, opt_cfg.warmup_steps
  kind = opt_cfg.get('schedule', 'linear')
  if kind == 'inverse_sqrt':
    decay_rate = opt_cfg.get('decay_rate', 0.005)
    ramp = (lambda step: 1.0) if warmup == 0 else (lambda step: jnp.minimum(step / warmup, 1.0))
    return lambda step: lr * ramp(step) / (1.0 + decay_rate * jnp.sqrt(step))

  if kind == 'rsqrt':
    # optax counts updates from 0, eq. 3 its step_num from 1 (tensor2tensor's noam: step + 1):
    # the first update is at step_num 1, not at rate 0.
    return lambda step: lr * jnp.minimum((step + 1) / max(warmup, 1),
                                         jnp.sqrt(max(warmup, 1) / (step + 1)))

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


def _select_per_parameter(new: Any, old: Any, live: Any, structure) -> Any:
  """`new` state, with its parameter-shaped parts (those of the params' `structure`, such as
  a momentum) taken from `old` where `live` is False."""
  if jax.tree.structure(new) == structure:
    return jax.tree.map(lambda n, o, alive: jnp.where(alive, n, o), new, old, live)
  if isinstance(new, tuple):  # optax's states: (named) tuples of states
    parts = [_select_per_parameter(n, o, live, structure) for n, o in zip(new, old)]
    return type(new)(*parts) if hasattr(new, '_fields') else type(new)(parts)
  return new


def skip_without_gradient(inner: optax.GradientTransformation, rows: tuple[str, ...] = ()
                          ) -> optax.GradientTransformation:
  """`inner`, except that a parameter whose gradient is all zero in a step neither moves nor
  has its state (a momentum) change in it, as TF's apply_gradients leaves a variable that the
  step's loss has no gradient for (cvt_text's modules outside the step's loss: the primary
  ones on an unlabeled batch, the auxiliary ones on a labeled one). Without it, SGD's momentum
  moves them on every step and decays per global step.

  The tables named in `rows` (optimizer.sparse_rows) are held row by row: a row with no
  gradient (a word not in the batch) keeps its value and momentum, as TF's sparse update of a
  table read by embedding_lookup (SparseApplyMomentum) does.
  """
  def liveness(path, g):
    if param_name(path) in rows:
      return jnp.any(g != 0, axis=tuple(range(1, g.ndim)), keepdims=True)
    return jnp.any(g != 0)

  def update(updates, state, params=None):
    new_updates, new_state = inner.update(updates, state, params)
    live = jax.tree_util.tree_map_with_path(liveness, updates)
    new_state = _select_per_parameter(new_state, state, live, jax.tree.structure(updates))
    return jax.tree.map(lambda u, alive: jnp.where(alive, u, jnp.zeros_like(u)),
                        new_updates, live), new_state
  return optax.GradientTransformation(inner.init, update)


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
  rows = tuple(opt_cfg.get('sparse_rows', ()))
  if rows and not opt_cfg.get('skip_without_gradient'):
    raise ValueError(f'optimizer.sparse_rows={rows} holds rows without gradient only with '
                     'optimizer.skip_without_gradient=True: set it, or sparse_rows=().')
  if opt_cfg.get('skip_without_gradient'):
    tx = skip_without_gradient(tx, rows)
  frozen = tuple(opt_cfg.get('frozen', ()))
  if not frozen:
    return tx
  # Frozen parameters get no update at all, not even weight decay (ELMo's frozen biLM, sec. 3.3).
  return optax.multi_transform({'trained': tx, 'frozen': optax.set_to_zero()},
                               frozen_labels(frozen))


def check_sparse_rows(rows: tuple[str, ...], params: Any) -> None:
  """Each optimizer.sparse_rows name is a table of the model (a parameter's whole path, at
  least two-dimensional), so that a typo cannot hold nothing."""
  shapes = {param_name(path): x.shape
            for path, x in jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]}
  for name in rows:
    if len(shapes.get(name, ())) < 2:
      tables = [n for n, shape in shapes.items() if len(shape) >= 2]
      raise ValueError(f'optimizer.sparse_rows names {name!r}, which is no table of the model: '
                       f'use the whole path of a parameter read by rows, such as {tables[0]!r}.')


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
