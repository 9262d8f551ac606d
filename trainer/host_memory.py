"""glibc's malloc set to keep freed memory, for a step that runs on the CPU.

XLA:CPU takes a step's temporary buffers from malloc and frees them when the
step ends. With glibc's defaults, large blocks go back to the kernel when they
are freed (blocks above the mmap threshold are unmapped, the heap top is
trimmed, a thread's arena deletes its empty heaps), so every step touches
fresh pages again: the kernel zeroes each one on a page fault. Here (2-core
EPYC, BERT mini, 32 x 128) that was ~200,000 faults and 0.6-0.7 s of system
time in a 1.8 s step. One arena for all threads, no mmap'd blocks and no
trimming keep the freed pages in the process for the next step. The price:
the resident size stays at its peak, and the heap can fragment and grow past
what glibc's defaults would hold (ELMo at the paper's size, 128 x 20: 23.4 GB
against 11.7). So the setting lasts while the process's peak resident size
stays under `GIVE_BACK_AT` of the machine's memory: past it, the loops call
give_back_if_over(), which restores glibc's defaults and returns the free
pages. The one arena also halves a threaded input pipeline's rate (BERT tiny:
4,350 examples/s against 8,100); train.py and bench.py take
--nokeep_freed_memory.

The options only help when they are set before JAX starts its backend: its
threads pick their arenas then, and a thread's own arena maps its large blocks
whatever the options say. Accelerator hosts keep glibc's defaults: their step
memory is on the device, and their input pipelines' threads keep their own
arenas.
"""

import ctypes
import functools
import glob
import os
import platform
import resource
import sys

from absl import logging

# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# glibc's defaults for the two options given back (malloc/malloc.c: DEFAULT_MMAP_MAX,
# DEFAULT_TRIM_THRESHOLD).
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
# The share of the machine's memory the peak resident size may reach with freed memory kept.
GIVE_BACK_AT = 0.5
_kept = False  # whether keep_freed_memory() set the options and they have not been given back
# Device nodes of TPUs (/dev/accel*, /dev/vfio/N on v5 and later), NVIDIA and AMD GPUs.
_ACCELERATOR_NODES = ('/dev/accel[0-9]*', '/dev/vfio/[0-9]*', '/dev/nvidia[0-9]*', '/dev/kfd')


def _platforms() -> str:
  # jax's setting differs from the variable's only once jax is imported and told otherwise; read
  # without importing jax, which a process that sets the options first need not pay for yet
  # (test_host_memory's processes: 2.2 -> 0.5 s each).
  jax = sys.modules.get('jax')
  configured = jax.config.jax_platforms if jax is not None else None
  return configured or os.environ.get('JAX_PLATFORMS', '')


def cpu_backend_expected() -> bool:
  """Whether JAX will run on its CPU backend: the first of --jax_platforms / JAX_PLATFORMS
  when it is set, else no accelerator device on this machine."""
  platforms = _platforms()
  if platforms:
    return platforms.split(',')[0].strip() == 'cpu'
  return not any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES)


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to reuse freed memory when JAX will run on the CPU; whether it did.

  Call it before anything initializes JAX's backend (jax.devices(), the first array).
  Memory freed by the process stays mapped to it: its resident size stays at its peak.
  """
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return False
  if not cpu_backend_expected():
    return False
  global _kept
  libc = ctypes.CDLL('libc.so.6')
  # A trim threshold of -1 is SIZE_MAX to glibc (its size_t parameter): never trim. The largest
  # positive int, 2**31 - 1, still trimmed a free heap top above 2 GiB, every BERT-base step.
  _kept = all(libc.mallopt(option, value) == 1 for option, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
  return _kept


def kept() -> bool:
  """Whether freed memory is being kept now (set and not given back)."""
  return _kept


@functools.cache
def memory_limit_bytes() -> int:
  """The machine's physical memory, or its cgroup's limit when that is lower (read once)."""
  limit = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  for path in ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes'):
    try:
      with open(path, encoding='ascii') as f:
        value = f.read().strip()
    except OSError:
      continue
    if value.isdigit():
      limit = min(limit, int(value))
  return limit


def give_back_if_over(fraction: float = GIVE_BACK_AT) -> bool:
  """With freed memory kept, once the peak resident size passes `fraction` of
  memory_limit_bytes(): glibc's defaults again (large blocks mapped and unmapped, the heap top
  trimmed) and the free pages returned now. Whether it did so at this call; call it between
  steps (it reads one counter)."""
  global _kept
  if not _kept:
    return False
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
  limit = memory_limit_bytes()
  if peak <= fraction * limit:
    return False
  libc = ctypes.CDLL('libc.so.6')
  libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
  libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
  libc.malloc_trim(ctypes.c_size_t(0))
  _kept = False
  logging.warning('Peak resident memory %.1f GB is past %.0f%% of this machine\'s %.1f GB: freed '
                  'memory goes back to the system from here (steps on the CPU may be slower).',
                  peak / 1e9, fraction * 100, limit / 1e9)
  return True
