"""Runs every test on 8 simulated CPU devices, with the project root importable.

Compiled programs go to a persistent compilation cache made for this pytest
run, shared by its xdist workers and the subprocesses they start: the resume,
parity and end-to-end tests compile the same train and eval steps many times
(the exact-resume tests took a third of the time with it). Likewise one data
directory (the `shared_data_dir` fixture) holds the embedded corpus and the
learned vocabularies for every test that does not test their building.

The tests' CPU programs are compiled for compile speed, not run speed: LLVM
without optimization and XLA's elemental emitters instead of its MLIR fusion
emitters (FAST_COMPILE). The same HLO, the same floating-point semantics (no
fast math either way); only the machine code differs, and the tests' steps are
tiny, so compiling is most of their time (the fast tier: 7m03s -> 4m15s on a
2-core Xeon; docs/testing.md). They are XLA flags of the pinned jaxlib, and XLA
stops a process on a flag it does not know, so under another jaxlib the tests
compile with XLA's defaults. The subprocesses that set XLA_FLAGS themselves
(train.py and the notebooks end to end, in the slow tier) compile with the defaults,
as users' runs do.
"""

from importlib import metadata
import os
import re
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_COMPILE = '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'


def _pinned_jaxlib() -> bool:
  """Whether the installed jaxlib is requirements.txt's, whose XLA knows FAST_COMPILE's flags."""
  with open(os.path.join(ROOT, 'requirements.txt')) as f:
    pinned = re.search(r'^jaxlib==(\S+)', f.read(), re.M)
  try:
    return bool(pinned) and metadata.version('jaxlib') == pinned.group(1)
  except metadata.PackageNotFoundError:
    return False


os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=8',
     FAST_COMPILE if _pinned_jaxlib() else '']).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, ROOT)

from trainer import host_memory  # pylint: disable=g-import-not-at-top,wrong-import-position

host_memory.keep_freed_memory()  # each worker's steps reuse freed memory, as train.py's do

# Made once by the controller, before the xdist workers start (they inherit it).
_OWN_CACHE = 'JAX_COMPILATION_CACHE_DIR' not in os.environ
if _OWN_CACHE:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='jax_cache_')
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0.2'


_OWN_DATA = 'LM_LINEAGE_TEST_DATA_DIR' not in os.environ
if _OWN_DATA:
  # Files in it are written atomically (tokenizer.write_lines_atomically), so workers may race.
  os.environ['LM_LINEAGE_TEST_DATA_DIR'] = tempfile.mkdtemp(prefix='lm_lineage_data_')


@pytest.fixture(scope='session')
def shared_data_dir() -> str:
  """config.data.data_dir for this run: the corpus and each vocabulary are built once."""
  return os.environ['LM_LINEAGE_TEST_DATA_DIR']


def pytest_configure(config):
  config.addinivalue_line('markers', 'slow: slower end-to-end tests (kept in CI)')


def pytest_collection_modifyitems(items):
  """Files with slow tests first: the xdist workers take files in this order (--dist loadfile),
  so the long end-to-end files start early and the quick ones fill in at the end."""
  slow_files = {item.path for item in items if item.get_closest_marker('slow')}
  items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept within


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE:
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
  if _OWN_DATA:
    shutil.rmtree(os.environ['LM_LINEAGE_TEST_DATA_DIR'], ignore_errors=True)
