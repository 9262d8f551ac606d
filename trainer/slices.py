"""This machine's accelerators cut into equal slices, one per process: sweep.py --parallel.

A slice is the environment a child process starts with, so that JAX in it sees
only its own devices:

- NVIDIA GPUs: `CUDA_VISIBLE_DEVICES`, a share of the GPUs.
- TPU chips (one JAX device per chip from v4 on, two on v2 and v3): libtpu's process
  variables. `TPU_VISIBLE_CHIPS` (and its older name `TPU_VISIBLE_DEVICES`)
  lists the slice's chips, `TPU_CHIPS_PER_PROCESS_BOUNDS` their shape,
  `TPU_PROCESS_BOUNDS=1,1,1` says the process is alone (it joins no other),
  and each slice gets its own mesh controller port. TPU v2 and v3 read
  `TPU_CHIPS_PER_HOST_BOUNDS` and `TPU_HOST_BOUNDS` instead; both are set.
- CPU: a share of the cores (the process's CPU affinity, which XLA's thread
  pools follow) and the host platform's device count
  (`--xla_force_host_platform_device_count`), kept at what this process
  would give a run, so a run sees the same devices, and the same mesh, as
  when it runs alone.

Nothing here starts JAX: the accelerators are counted by their device nodes,
and the parent must not take a GPU's memory or a TPU's lock that its
children need.
"""

import dataclasses
import glob
import math
import os
import re

# libtpu's first mesh controller port; each slice takes the next one.
TPU_PORT = 8476
# Chips per process -> TPU_CHIPS_PER_PROCESS_BOUNDS (x, y, z), for the 4-chip (2x2) and
# 8-chip (2x4) hosts of TPU v4, v5e, v5p and v6e.
TPU_CHIP_BOUNDS = {1: '1,1,1', 2: '1,2,1', 4: '2,2,1', 8: '2,4,1'}
_FORCE_DEVICES = re.compile(r'--xla_force_host_platform_device_count=(\d+)')


@dataclasses.dataclass(frozen=True)
class Slice:
  """One process's share of the machine."""
  index: int  # 1-based
  count: int  # how many slices the machine is cut into
  platform: str  # 'gpu', 'tpu' or 'cpu'
  devices: tuple[int, ...]  # GPU or TPU chip indices; on a CPU, the cores
  num_devices: int  # the JAX devices a process on this slice sees
  env: tuple[tuple[str, str], ...]  # set in the child's environment

  def describe(self) -> str:
    """E.g. 'slice 2/4 (GPUs 2,3)'."""
    ids = ','.join(map(str, self.devices))
    what = {'gpu': f'GPUs {ids}', 'tpu': f'TPU chips {ids}',
            'cpu': f'cores {ids}, {self.num_devices} CPU device'
                   + ('s' if self.num_devices != 1 else '')}[self.platform]
    return f'slice {self.index}/{self.count} ({what})'

  def environment(self, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(self.env)
    return env

  def pin(self) -> None:
    """In the child, before it runs anything: a CPU slice's cores."""
    if self.platform == 'cpu':
      os.sched_setaffinity(0, self.devices)


def platform() -> str:
  """The platform JAX will use, from JAX_PLATFORMS or else the device nodes (JAX not started)."""
  chosen = os.environ.get('JAX_PLATFORMS', '').split(',')[0].strip()
  if chosen:
    return {'cuda': 'gpu', 'rocm': 'gpu'}.get(chosen, chosen)
  if glob.glob('/dev/nvidia[0-9]*'):
    return 'gpu'
  if glob.glob('/dev/accel[0-9]*') or glob.glob('/dev/vfio/[0-9]*'):
    return 'tpu'
  return 'cpu'


def local_devices(kind: str) -> tuple[int, ...]:
  """The GPUs, TPU chips or cores this process may hand out."""
  if kind == 'gpu':
    visible = os.environ.get('CUDA_VISIBLE_DEVICES')
    if visible is not None:
      return tuple(int(d) for d in visible.split(',') if d.strip().isdigit())
    return tuple(range(len(glob.glob('/dev/nvidia[0-9]*'))))
  if kind == 'tpu':
    visible = os.environ.get('TPU_VISIBLE_CHIPS') or os.environ.get('TPU_VISIBLE_DEVICES')
    if visible:
      return tuple(int(d) for d in visible.split(','))
    nodes = glob.glob('/dev/accel[0-9]*') or glob.glob('/dev/vfio/[0-9]*')
    return tuple(range(len(nodes)))
  return tuple(sorted(os.sched_getaffinity(0)))


def tpu_devices_per_chip() -> int:
  """JAX devices per TPU chip: 2 on v2 and v3 (a device per core), else 1; the generation
  from the accelerator type a TPU VM names in its environment (v4 and later if it names none)."""
  kind = os.environ.get('TPU_ACCELERATOR_TYPE') or os.environ.get('ACCELERATOR_TYPE', '')
  return 2 if re.match(r'v[23]-', kind) else 1


def cpu_device_count(xla_flags: str | None = None) -> int:
  """The host platform's device count XLA_FLAGS gives (1 when it sets none)."""
  found = _FORCE_DEVICES.findall(os.environ.get('XLA_FLAGS', '') if xla_flags is None
                                 else xla_flags)
  return int(found[-1]) if found else 1


def with_cpu_devices(xla_flags: str, count: int) -> str:
  """`xla_flags` with the host platform's device count set to `count` (any earlier count dropped)."""
  return ' '.join(_FORCE_DEVICES.sub('', xla_flags).split()
                  + [f'--xla_force_host_platform_device_count={count}'])


def cut(parallel: int, kind: str | None = None,
        devices: tuple[int, ...] | None = None) -> list[Slice]:
  """`parallel` equal slices of the local devices; one line naming the fix if they don't divide."""
  kind = kind or platform()
  devices = local_devices(kind) if devices is None else devices
  noun = {'gpu': 'GPUs', 'tpu': 'TPU chips', 'cpu': 'CPU cores'}.get(kind)
  if noun is None:
    raise ValueError(f'--parallel: JAX_PLATFORMS names {kind!r}; slices are cut from GPUs, TPU '
                     'chips or CPU cores.')
  if parallel < 1 or not devices or len(devices) % parallel:
    divisors = [n for n in range(1, len(devices) + 1) if len(devices) % n == 0]
    raise ValueError(f'--parallel={parallel} does not divide the {len(devices)} {noun} of '
                     f'this machine into equal slices: pass one of {divisors}.')
  per = len(devices) // parallel
  if kind == 'tpu' and per not in TPU_CHIP_BOUNDS:
    raise ValueError(f'--parallel={parallel} gives {per} TPU chips a slice, which libtpu cannot '
                     f'bound: pass a --parallel that leaves {sorted(TPU_CHIP_BOUNDS)} chips.')
  slices = []
  for i in range(parallel):
    own = devices[i * per:(i + 1) * per]
    ids = ','.join(map(str, own))
    if kind == 'gpu':
      env, num_devices = {'CUDA_VISIBLE_DEVICES': ids}, per
    elif kind == 'tpu':
      port = str(TPU_PORT + i)
      num_devices = per * tpu_devices_per_chip()
      env = {'TPU_VISIBLE_CHIPS': ids, 'TPU_VISIBLE_DEVICES': ids,
             'TPU_CHIPS_PER_PROCESS_BOUNDS': TPU_CHIP_BOUNDS[per], 'TPU_PROCESS_BOUNDS': '1,1,1',
             'TPU_CHIPS_PER_HOST_BOUNDS': TPU_CHIP_BOUNDS[per], 'TPU_HOST_BOUNDS': '1,1,1',
             'TPU_MESH_CONTROLLER_ADDRESS': f'localhost:{port}',
             'TPU_MESH_CONTROLLER_PORT': port, 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}
    else:
      num_devices = cpu_device_count()
      env = {'XLA_FLAGS': with_cpu_devices(os.environ.get('XLA_FLAGS', ''), num_devices)}
    slices.append(Slice(i + 1, parallel, kind, own, num_devices, tuple(sorted(env.items()))))
  return slices


def mesh_refusal(mesh, num_devices: int) -> str | None:
  """Why config.mesh cannot be laid out on `num_devices` devices, or None."""
  sizes = [int(size) for _, size in mesh]
  fixed = math.prod(s for s in sizes if s != -1)
  if (-1 in sizes and num_devices % fixed) or (-1 not in sizes and fixed != num_devices):
    return (f'config.mesh {tuple(tuple(a) for a in mesh)} needs '
            f'{"a multiple of " if -1 in sizes else ""}{fixed} devices')
  return None

