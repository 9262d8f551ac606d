"""Runs every test on 8 simulated CPU devices, with the project root importable.

Compiled programs go to a persistent compilation cache made for this pytest
run, shared by its xdist workers and the subprocesses they start: the resume,
parity and end-to-end tests compile the same train and eval steps many times
(the exact-resume tests took a third of the time with it). Likewise one data
directory (the `shared_data_dir` fixture) holds the embedded corpus and the
learned vocabularies for every test that does not test their building.
"""

import os
import shutil
import sys
import tempfile

import pytest

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
