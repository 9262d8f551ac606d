"""trainer/host_memory.py: glibc's malloc keeps freed memory on a CPU backend, and only there."""

import os
import platform
import subprocess
import sys

import jax
import pytest

from trainer import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mallopt's options are glibc's; elsewhere keep_freed_memory() does nothing.
_GLIBC_ONLY = pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='glibc malloc options')

# Allocates, touches and frees a block of the given MiB with malloc, as XLA:CPU's buffers are,
# the given number of rounds; prints whether the options were set, the page faults of all rounds
# but the first and whether jax was imported. glibc's defaults map and unmap a 64 MiB block each
# round (16,384 fresh 4 KiB pages); kept, the first round's pages serve the others.
_ROUNDS = """
import ctypes, resource, sys
from trainer import host_memory
applied = host_memory.keep_freed_memory() if sys.argv[1] == 'keep' else False
mib, rounds = int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def round_trip():
  block = libc.malloc(mib << 20)
  ctypes.memset(block, 1, mib << 20)
  libc.free(block)
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds - 1):
  round_trip()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, 'jax' in sys.modules)
"""


def _rounds(mode: str, platforms: str, mib: int = 64, rounds: int = 10) -> tuple[str, int, str]:
  env = dict(os.environ, JAX_PLATFORMS=platforms)
  out = subprocess.run([sys.executable, '-c', _ROUNDS, mode, str(mib), str(rounds)], cwd=ROOT,
                       env=env, check=True, capture_output=True, text=True,
                       timeout=120).stdout.split()
  return out[0], int(out[1]), out[2]


@_GLIBC_ONLY
def test_freed_memory_is_reused_on_cpu_and_glibc_defaults_kept_elsewhere():
  applied, faults, jax_imported = _rounds('keep', 'cpu')
  assert applied == 'True' and faults < 2000, faults
  assert jax_imported == 'False'  # set before jax starts, without importing it
  default_applied, default_faults, _ = _rounds('default', 'cpu')
  assert default_applied == 'False' and default_faults > 9 * 16000, default_faults
  # A TPU or GPU run keeps glibc's defaults.
  assert _rounds('keep', 'tpu')[0] == 'False'


@pytest.mark.slow  # 2.3 GiB written and freed three times: 9 s
@_GLIBC_ONLY
def test_a_free_block_above_2_gib_is_kept_too():
  # BERT-base's step frees more than 2 GiB at once: a trim threshold of 2**31 - 1 (mallopt's
  # largest positive value) gave the heap back every step, 356,000 page faults per step.
  applied, faults, _ = _rounds('keep', 'cpu', mib=2304, rounds=3)
  assert applied == 'True' and faults < 2000, faults


# Keeps a freed 512 MiB block, then asks for it back below and above the threshold; prints
# each answer, whether memory is still kept and how many bytes of resident memory went back.
_GIVE_BACK = """
import ctypes, os
from trainer import host_memory
assert host_memory.keep_freed_memory()
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(512 << 20)
ctypes.memset(block, 1, 512 << 20)
libc.free(block)
def resident():
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
kept = resident()
under = host_memory.give_back_if_over(fraction=1.0)
host_memory.memory_limit_bytes = lambda: 2 << 20  # 2 MiB: any peak is past half of it
over = host_memory.give_back_if_over(fraction=0.5)
again = host_memory.give_back_if_over(fraction=0.5)
print(under, over, again, host_memory.kept(), kept - resident())
"""


@_GLIBC_ONLY
def test_kept_memory_is_given_back_once_the_peak_passes_the_threshold():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', _GIVE_BACK], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=120).stdout.split()
  under, over, again, still_kept, released = out
  assert (under, over, again, still_kept) == ('False', 'True', 'False', 'False'), out
  assert int(released) > 400 << 20, out  # the freed block's pages went back


def test_the_machine_memory_limit_is_positive_and_at_most_physical_memory():
  physical = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  assert 0 < host_memory.memory_limit_bytes() <= physical


def test_the_cpu_backend_is_expected_from_the_platforms_flag_or_the_devices(monkeypatch):
  for platforms, expected in [('cuda,cpu', False), ('cpu', True), ('tpu', False)]:
    monkeypatch.setattr(host_memory, '_platforms', lambda p=platforms: p)
    assert host_memory.cpu_backend_expected() == expected, platforms
  # Unset: the CPU unless the machine has an accelerator's device node.
  monkeypatch.setattr(host_memory, '_platforms', lambda: '')
  monkeypatch.setattr(host_memory.glob, 'glob',
                      lambda pattern: ['/dev/accel0'] if 'accel' in pattern else [])
  assert not host_memory.cpu_backend_expected()
  monkeypatch.setattr(host_memory.glob, 'glob', lambda pattern: [])
  assert host_memory.cpu_backend_expected()


def test_jax_platforms_set_through_jax_config_wins_once_jax_is_imported(monkeypatch):
  previous = jax.config.jax_platforms
  try:
    for configured, variable, expected in [('tpu', 'cpu', False), ('cpu', 'tpu', True)]:
      monkeypatch.setenv('JAX_PLATFORMS', variable)
      jax.config.update('jax_platforms', configured)
      assert host_memory.cpu_backend_expected() == expected, (configured, variable)
  finally:
    jax.config.update('jax_platforms', previous)
