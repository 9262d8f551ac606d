"""glibc's malloc set to keep freed memory, for a step that runs on the CPU.

XLA:CPU takes a step's temporary buffers from malloc and frees them when the
step ends. With glibc's defaults, large blocks go back to the kernel when they
are freed (blocks above the mmap threshold are unmapped, the heap top is
trimmed, a thread's arena deletes its empty heaps), so every step touches
fresh pages again: the kernel zeroes each one on a page fault. Here (2-core
EPYC, BERT mini, 32 x 128) that was ~200,000 faults and 0.6-0.7 s of system
time in a 1.8 s step. One arena for all threads, no mmap'd blocks and no
trimming keep the freed pages in the process for the next step. The price:
the resident size stays at its peak (GPT-1 4 x 512: 15.3 GB against 8.0), and
the one arena halves a threaded input pipeline's rate (BERT tiny: 4,350
examples/s against 8,100); train.py and bench.py take --nokeep_freed_memory.

The options only help when they are set before JAX starts its backend: its
threads pick their arenas then, and a thread's own arena maps its large blocks
whatever the options say. Accelerator hosts keep glibc's defaults: their step
memory is on the device, and their input pipelines' threads keep their own
arenas.
"""

import ctypes
import glob
import os
import platform

import jax

# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Device nodes of TPUs (/dev/accel*, /dev/vfio/N on v5 and later), NVIDIA and AMD GPUs.
_ACCELERATOR_NODES = ('/dev/accel[0-9]*', '/dev/vfio/[0-9]*', '/dev/nvidia[0-9]*', '/dev/kfd')


def _platforms() -> str:
  return jax.config.jax_platforms or os.environ.get('JAX_PLATFORMS', '')


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
  libc = ctypes.CDLL('libc.so.6')
  # A trim threshold of -1 is SIZE_MAX to glibc (its size_t parameter): never trim. The largest
  # positive int, 2**31 - 1, still trimmed a free heap top above 2 GiB, every BERT-base step.
  return all(libc.mallopt(option, value) == 1 for option, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
