"""Tests of the tests' persistent compilation cache (tests/compile_cache.py, tests/conftest.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import compile_cache


def test_this_runs_programs_are_written_to_the_cache_and_read_back():
  """A program compiled for the first time (its constant new to every run) leaves an entry in the
  run's cache, and the same program traced and lowered again comes from that entry."""
  path = os.environ['JAX_COMPILATION_CACHE_DIR']
  scale = 1.0 + int.from_bytes(os.urandom(3), 'little')  # a constant in the HLO: a new key
  # A program of milliseconds (the eager ops' are cached too), made twice: two functions, so
  # that the second is traced and lowered again, and jax's in-memory caches do not have it.
  program = lambda: lambda x: x * scale + 1.0  # noqa: E731
  x = jnp.arange(4.0)  # before the listing: its own one-op program may be new too
  before = set(os.listdir(path))
  expected = np.asarray(jax.jit(program())(x))
  assert set(os.listdir(path)) - before  # written
  events = []
  listener = lambda event, **kwargs: events.append(event)  # noqa: E731
  jax.monitoring.register_event_listener(listener)
  try:
    got = np.asarray(jax.jit(program())(x))
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert '/jax/compilation_cache/cache_hits' in events
  np.testing.assert_array_equal(got, expected)


def _file(directory, name: str, size: int, read: float) -> str:
  path = os.path.join(directory, name)
  with open(path, 'wb') as f:
    f.write(b'x' * size)
  os.utime(path, (read, read - 100))  # (atime, mtime): read after it was written
  return path


def test_prune_deletes_the_entries_read_longest_ago_down_to_half_the_limit(tmp_path):
  sizes = {'a': 300, 'b': 200, 'c': 250, 'd': 150, 'e': 100}  # read in this order: a first
  for i, (name, size) in enumerate(sizes.items()):
    _file(tmp_path, name, size, read=1e9 + 1000 * i)
  os.utime(tmp_path / 'b', (1e9 + 9000, 1e9 + 9000))  # b read last after all
  assert compile_cache.prune(str(tmp_path), limit=1000) == 0  # 1000 bytes: at the limit
  assert sorted(os.listdir(tmp_path)) == sorted(sizes)
  # Over a limit of 900: a (300), c (250) go, which leaves 450, under half of 900 (450).
  assert compile_cache.prune(str(tmp_path), limit=900) == 550
  assert sorted(os.listdir(tmp_path)) == ['b', 'd', 'e']


def test_prune_reads_the_write_time_of_a_file_never_read(tmp_path):
  """On a file system mounted noatime, or a file not read since it was written, the atime is
  the write's: the mtime orders it."""
  old = _file(tmp_path, 'old', 100, read=1e9)
  os.utime(old, (1e9 - 5000, 1e9 + 5000))  # written after its recorded read
  _file(tmp_path, 'new', 150, read=1e9 + 1000)
  assert compile_cache.prune(str(tmp_path), limit=200) == 150
  assert os.listdir(tmp_path) == ['old']
