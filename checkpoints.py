"""Orbax checkpoints of the train state together with every host's data-iterator position."""

import os
from typing import Any

from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp


def _directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), 'checkpoints')


def exist(workdir: str) -> bool:
  """Whether the workdir holds a finished checkpoint (without creating anything)."""
  directory = _directory(workdir)
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                         create=True)
  return ocp.CheckpointManager(_directory(workdir), options=options, item_names=('state', 'data'))


def _all_hosts(data_state: dict[str, int]) -> list[dict[str, int]]:
  """Every host's iterator position, so that each can resume its own stream."""
  if jax.process_count() == 1:
    return [dict(data_state)]
  keys = sorted(data_state)
  rows = multihost_utils.process_allgather(np.array([data_state[k] for k in keys], np.int64))
  return [dict(zip(keys, map(int, row))) for row in np.asarray(rows).reshape(-1, len(keys))]


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict[str, int]) -> None:
  """Starts an async save; device buffers are copied before this returns."""
  if step in mngr.all_steps():
    return
  mngr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave({'hosts': _all_hosts(data_state)})), force=True)


def restore(mngr: ocp.CheckpointManager, abstract_state: Any) -> tuple[Any, dict | None]:
  """The latest (state, this host's data position), restored onto the given shardings."""
  step = mngr.latest_step()
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
  hosts = restored['data']['hosts']
  if len(hosts) != jax.process_count():
    raise ValueError(f'The checkpoint was written by {len(hosts)} hosts and this run has '
                     f'{jax.process_count()}: resume with the same number of hosts.')
  return restored['state'], hosts[jax.process_index()]


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', k)) for k in path)


def restore_params(workdir: str, target_params: Any, fresh: tuple[str, ...] = ()
                   ) -> tuple[Any, list[str], list[str]]:
  """`target_params` with every array that the latest checkpoint of `workdir` also has replaced.

  The arrays are read straight onto the target's shardings; the top-level
  modules named in `fresh` (another task's head) are never read. Returns the
  params, the names only the target has (new heads) and the names only the
  checkpoint has (unused pretraining heads).
  """
  directory = _directory(workdir)
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if exist(workdir) else []
  if not steps:
    raise ValueError(f'{workdir} has no checkpoint: point config.init_from (or --workdir) at the '
                     'workdir of a finished run.')
  item = os.path.join(directory, str(steps[-1]), 'state')
  saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree['params']
  saved_shapes = {_path_name(p): tuple(m.shape)
                  for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
  unused_heads = sorted(n for n in saved_shapes if n.split('/')[0] in fresh)
  saved_shapes = {n: s for n, s in saved_shapes.items() if n.split('/')[0] not in fresh}
  target, treedef = jax.tree_util.tree_flatten_with_path(target_params)
  names = [_path_name(p) for p, _ in target]
  for name, (_, array) in zip(names, target):
    if name in saved_shapes and saved_shapes[name] != tuple(array.shape):
      raise ValueError(f'Parameter {name} has shape {saved_shapes[name]} in {workdir} but '
                       f'{tuple(array.shape)} here: make config.model match {workdir}/config.json.')
  shared = [(path, array) for name, (path, array) in zip(names, target) if name in saved_shapes]
  if not shared:
    raise ValueError(f'{workdir} shares no parameter with this model: config.init_from must be a '
                     f'run of the same architecture (config.model_name).')
  # A nested-dict target of only the shared arrays: orbax reads just those.
  partial = {}
  for path, array in shared:
    node = partial
    for key in path[:-1]:
      node = node.setdefault(key.key, {})
    node[path[-1].key] = jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)
  restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
      item={'params': partial}, restore_args=ocp.checkpoint_utils.construct_restore_args(
          {'params': partial}), partial_restore=True))['params']
  loaded = {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
  leaves = [loaded.get(name, array) for name, (_, array) in zip(names, target)]
  new = [name for name in names if name not in saved_shapes]
  unused = sorted(set(saved_shapes) - set(names)) + unused_heads
  return jax.tree_util.tree_unflatten(treedef, leaves), new, unused
