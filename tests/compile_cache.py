"""The tests' persistent compilation cache, kept from one pytest run to the next.

Its entries are jax's: a compiled program under a key of its HLO, its compile options, the
devices, jaxlib's version and XLA_FLAGS, so a run reads back only programs that nothing has
changed, and compiles what a change touched. It lives in pytest's own cache directory
(`.pytest_cache/d/jax_compilation_cache` in the checkout): `pytest --cache-clear` empties it,
`-p no:cacheprovider` gives a run a fresh one of its own, removed at its end, and a clean clone
(CI's) starts with it empty. A JAX_COMPILATION_CACHE_DIR already set is used as it is (neither
pruned nor removed).

Every program is written, the eager ops' one-op programs too (min compile time 0): read back in
a later run, one takes about 3 ms against 11-17 ms to compile (docs/testing.md).
"""

import os
import tempfile

# When the entries take more than this, the run's start deletes those read longest ago until
# they take half of it. A fast-tier run with the cache empty writes about 40 MB, the slow tier
# after it 80 MB more, and a run of unchanged code one entry (test_compile_cache's new program).
LIMIT_BYTES = 1 << 30


def directory(config) -> tuple[str, bool]:
  """The cache's directory for this run, and whether it is a temporary one (to remove)."""
  cache = getattr(config, 'cache', None)  # None under -p no:cacheprovider
  if cache is None:
    return tempfile.mkdtemp(prefix='jax_cache_'), True
  return str(cache.mkdir('jax_compilation_cache')), False


def prune(path: str, limit: int = LIMIT_BYTES) -> int:
  """Deletes the files read longest ago (atime, else mtime: Linux's relatime updates a file's
  atime on its first read after a write and then once a day) until the rest take at most half
  of `limit`, when all of them take more. Returns the bytes deleted."""
  entries = []
  with os.scandir(path) as scan:
    for entry in scan:
      if entry.is_file(follow_symlinks=False):
        stat = entry.stat(follow_symlinks=False)
        entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry.path))
  total = sum(size for _, size, _ in entries)
  if total <= limit:
    return 0
  deleted = 0
  for _, size, file in sorted(entries):
    if total - deleted <= limit // 2:
      break
    try:
      os.remove(file)
    except FileNotFoundError:  # another run's prune got there first
      pass
    deleted += size
  return deleted
