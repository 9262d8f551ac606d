"""Runs every test on 8 simulated CPU devices, with the project root importable.

Compiled programs go to a persistent compilation cache made for this pytest
run, shared by its xdist workers and the subprocesses they start: the resume,
parity and end-to-end tests compile the same train and eval steps many times
(the exact-resume tests took a third of the time with it).
"""

import os
import shutil
import sys
import tempfile

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Made once by the controller, before the xdist workers start (they inherit it).
_OWN_CACHE = 'JAX_COMPILATION_CACHE_DIR' not in os.environ
if _OWN_CACHE:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='jax_cache_')
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0.2'


def pytest_configure(config):
  config.addinivalue_line('markers', 'slow: slower end-to-end tests (kept in CI)')


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE:
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
