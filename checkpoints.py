"""Orbax checkpoints of the train state together with every host's data-iterator position."""

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


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
