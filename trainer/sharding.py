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

from trainer import slices

BATCH_AXES = ('data', 'fsdp')


MESH_AXES = ('data', 'fsdp', 'tensor')


def check_mesh_config(mesh_cfg: Sequence[tuple[str, int]]) -> None:
  """config.mesh names each axis once with a size of 1 or more, or -1 once (the rest)."""
  if not all(isinstance(axis, (tuple, list)) and len(axis) == 2 for axis in mesh_cfg):
    raise ValueError(f'config.mesh={tuple(mesh_cfg)!r}: write it as (("data", -1), ("fsdp", 1), '
                     '("tensor", 1)).')
  names = [name for name, _ in mesh_cfg]
  if sorted(names) != sorted(MESH_AXES):
    raise ValueError(f'config.mesh names {names}: use exactly the axes {", ".join(MESH_AXES)}.')
  sizes = [size for _, size in mesh_cfg]
  if not all(isinstance(s, int) and (s >= 1 or s == -1) for s in sizes):
    raise ValueError(f'config.mesh={tuple(mesh_cfg)!r} has a size that is not 1 or more, or -1: '
                     'give each axis a device count, and -1 to the one that takes the rest.')
  if sizes.count(-1) > 1:
    raise ValueError(f'config.mesh {tuple(mesh_cfg)} has more than one -1: give all sizes but one.')


def check_axis_rules(rules: Sequence[tuple[str, Any]]) -> None:
  """config.logical_axis_rules maps logical names to mesh axes (one, several or None)."""
  for rule in rules:
    axes = rule[1] if isinstance(rule, (tuple, list)) and len(rule) == 2 else ()
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
            and isinstance(axes, (tuple, list)) and all(a in MESH_AXES for a in axes)):
      raise ValueError(f'config.logical_axis_rules has {rule!r}: write each rule as (logical '
                       f'name, mesh axis or axes or None), mesh axes from {", ".join(MESH_AXES)}.')


def mesh_shape(mesh_cfg: Sequence[tuple[str, int]], num_devices: int) -> dict[str, int]:
  """Resolves the single -1 in config.mesh to the remaining devices."""
  check_mesh_config(mesh_cfg)
  names = [name for name, _ in mesh_cfg]
  sizes = [int(size) for _, size in mesh_cfg]
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


# What srun gives each task of a step (jax's SLURM detection reads these): a batch script's own
# shell has SLURM_NTASKS too, but is no task of a multi-process step.
_SLURM_TASK = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID',
               'SLURM_LOCALID')


def initialize_hosts(force: bool = False) -> None:
  """Joins the other hosts of a TPU pod or multi-node job, before any device is touched."""
  tpu_hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '').count(',') + 1
  slurm_tasks = int(os.environ.get('SLURM_NTASKS', '1'))
  srun_task = all(name in os.environ for name in _SLURM_TASK)
  if slurm_tasks > 1 and not srun_task and not force and tpu_hosts == 1:
    print(f'SLURM_NTASKS={slurm_tasks}, but this process is no task of an srun step: it runs '
          'alone (start the job\'s command with srun to run it on every task).', flush=True)
    return
  if force or tpu_hosts > 1 or slurm_tasks > 1:
    # jax gives each SLURM task one GPU, that of its local task id; a task per node (ours,
    # trainer/slurm.py) takes all of its node's.
    local = _gpus_of_one_task_per_node() if srun_task else None
    jax.distributed.initialize(local_device_ids=local)


def _gpus_of_one_task_per_node() -> list[int] | None:
  """All of this node's GPU ids when SLURM started one task on it, else None (jax's choice)."""
  tasks_here = os.environ.get('SLURM_NTASKS_PER_NODE',
                              os.environ.get('SLURM_STEP_TASKS_PER_NODE', '')).split('(')[0]
  if tasks_here != '1':
    return None
  visible = os.environ.get('CUDA_VISIBLE_DEVICES')
  count = len(visible.split(',')) if visible else len(slices.local_devices('gpu'))
  return list(range(count)) or None


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


def batch_shards_by_process(mesh) -> dict[int, set[int]]:
  """The data-parallel shards of the batch (data x fsdp) that each process's devices hold."""
  dp = data_parallel_size(mesh)
  held = {}
  for device, index in batch_sharding(mesh).devices_indices_map((dp,)).items():
    held.setdefault(device.process_index, set()).update(range(dp)[index[0]])
  return held


def process_rows(mesh, batch_size: int, process_index: int) -> list[tuple[int, int]]:
  """The rows [start, stop) of a global batch that process `process_index` feeds, in the order
  global_batch reads its local batch (make_array_from_process_local_data: its devices' batch
  shards by ascending row). A host's shards are side by side on GPUs; a TPU slice's mesh follows
  the chips' layout, where a host's can be every other one (v4 2x2x2, mesh data=8: 0, 2, 4, 6)."""
  blocks = sorted(batch_shards_by_process(mesh).get(process_index, ()))
  return _row_ranges(blocks, batch_size // data_parallel_size(mesh))


def batch_layout(mesh) -> dict[str, Any] | None:
  """A new run's data layout (saved with its checkpoints): the blocks of the batch (its data x
  fsdp shards, by row) that data shard s fills, those process s feeds, so that each host reads
  its own shard alone; None where each process's blocks are side by side in process order (any
  GPU or CPU mesh), ShardedStream's default layout."""
  held = batch_shards_by_process(mesh)
  shards = [sorted(held[p]) for p in sorted(held)]
  if all(blocks == list(range(p * len(blocks), (p + 1) * len(blocks)))
         for p, blocks in enumerate(shards)):
    return None
  return {'blocks': data_parallel_size(mesh), 'shards': shards}


def shard_rows(layout: dict[str, Any] | None, num_shards: int, batch_size: int
               ) -> list[list[tuple[int, int]]] | None:
  """The global rows each data shard fills under a run's `layout` at this batch size; None
  (side by side in shard order) without one, or at a batch size its blocks do not divide."""
  if not layout or len(layout['shards']) != num_shards or batch_size % layout['blocks']:
    return None
  block = batch_size // layout['blocks']
  return [_row_ranges(blocks, block) for blocks in layout['shards']]


def _row_ranges(blocks: Sequence[int], block: int) -> list[tuple[int, int]]:
  """Rows [start, stop) of the ascending `blocks` of `block` rows each, neighbours merged."""
  rows = []
  for b in blocks:
    if rows and rows[-1][1] == b * block:
      rows[-1] = (rows[-1][0], (b + 1) * block)
    else:
      rows.append((b * block, (b + 1) * block))
  return rows


def check_processes_split_the_batch(held: dict[int, set[int]], mesh_cfg) -> None:
  """Each process holds shards of the batch of its own, as many as every other (its local
  batch is the rows process_rows names). An axis that spans the hosts but splits
  no batch, first in config.mesh, gave every host every shard, and the global batch was one
  host's worth with other rows on each host, silently."""
  if len(held) < 2:
    return
  counts = [len(shards) for shards in held.values()]
  if len(set(counts)) > 1 or sum(counts) != len(set().union(*held.values())):
    raise ValueError(
        f'config.mesh={tuple(map(tuple, mesh_cfg))!r} gives the {len(held)} hosts the same shards '
        'of the batch (an axis that spans the hosts comes before the batch axes): put data '
        "(or fsdp) first in config.mesh, e.g. (('data', -1), ('fsdp', 1), ('tensor', 1)).")


def global_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """Assembles host-local numpy batches into one global array per feature."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v)
          for k, v in local_batch.items()}
