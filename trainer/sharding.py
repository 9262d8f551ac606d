"""Device mesh, logical-axis shardings and global batches, shared by every model.

Parameters carry logical axis names (vocab, embed, mlp, heads, kv, layers);
config.logical_axis_rules maps them to the mesh axes (data, fsdp, tensor).
"""

import math
import os
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

BATCH_AXES = ('data', 'fsdp')


def mesh_shape(mesh_cfg: Sequence[tuple[str, int]], num_devices: int) -> dict[str, int]:
  """Resolves the single -1 in config.mesh to the remaining devices."""
  names = [name for name, _ in mesh_cfg]
  if sorted(names) != sorted(['data', 'fsdp', 'tensor']):
    raise ValueError(f'config.mesh names {names}: use exactly the axes data, fsdp, tensor.')
  sizes = [int(size) for _, size in mesh_cfg]
  if sizes.count(-1) > 1:
    raise ValueError(f'config.mesh {tuple(mesh_cfg)} has more than one -1: give all sizes but one.')
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise ValueError(f'config.mesh fixes {fixed} devices, which does not divide the '
                       f'{num_devices} available: change the fixed axis sizes.')
    sizes[sizes.index(-1)] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ValueError(f'config.mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices '
                     f'but {num_devices} are available: set one size to -1.')
  return dict(zip(names, sizes))


def initialize_hosts(force: bool = False) -> None:
  """Joins the other hosts of a TPU pod or multi-node job, before any device is touched."""
  tpu_hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '').count(',') + 1
  slurm_tasks = int(os.environ.get('SLURM_NTASKS', '1'))
  if force or tpu_hosts > 1 or slurm_tasks > 1:
    jax.distributed.initialize()  # jax reads the cluster's addresses from its environment


def make_mesh(mesh_cfg, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(mesh_cfg, len(devices))
  # Auto axes: linen's logical constraints and the embedding gather need them.
  return jax.make_mesh(tuple(shape.values()), tuple(shape.keys()),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def logical_shardings(abstract_boxed: Any, mesh, rules) -> Any:
  """NamedShardings for a tree whose leaves may be logically partitioned boxes.

  Raises a one-line ValueError when a dimension does not divide over its mesh axes.
  """
  logical = nn.get_partition_spec(abstract_boxed)
  shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)

  def check(path, leaf, names, named_sharding):
    for dim, name, axes in zip(leaf.shape, names, named_sharding.spec):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      ways = math.prod(mesh.shape[a] for a in axes)
      if dim % ways:
        raise ValueError(
            f'{jax.tree_util.keystr(path)} has {dim} entries along {name!r}, which the mesh '
            f'axes {axes} split {ways} ways: change config.mesh or map {name!r} elsewhere '
            'in config.logical_axis_rules.')

  jax.tree_util.tree_map_with_path(check, nn.meta.unbox(abstract_boxed), logical, shardings,
                                   is_leaf=lambda x: isinstance(x, P))
  return shardings


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """Assembles host-local numpy batches into one global array per feature."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v)
          for k, v in local_batch.items()}
