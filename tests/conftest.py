"""Runs every test on 8 simulated CPU devices, with the project root importable.

Compiled programs go to a persistent compilation cache that the xdist workers
and the subprocesses they start share, and that later runs read
(tests/compile_cache.py): the resume, parity and end-to-end tests compile the
same train and eval steps many times (the exact-resume tests took a third of
the time with it), and a run after a change compiles only what it touched
(the fast tier on a 2-core Xeon: 3m23s with the cache empty, 2m34s with it
warm; docs/testing.md). One data directory (the `shared_data_dir` fixture)
holds the embedded corpus and the learned vocabularies for every test that
does not test their building; it is made for each run.

The tests' CPU programs are compiled for compile speed, not run speed: LLVM
without optimization, XLA's elemental emitters instead of its MLIR fusion
emitters, and each program's code made as one LLVM module, not split into pieces
for threads that a worker pinned to one core lacks (FAST_COMPILE). The same HLO,
the same floating-point semantics (no fast math either way); only the machine
code differs, and the tests' steps are tiny, so compiling is most of their time
(the fast tier: 7m03s -> 4m15s on a 2-core Xeon with the first two flags; the
third, with two smaller changes, 6-8% off its test time; docs/testing.md). They
are XLA flags of the pinned jaxlib, and XLA stops a process on a flag it does
not know, so under another jaxlib the tests compile with XLA's defaults.
Programs that train for minutes run FAST_COMPILE's code too slowly: the slow
tier's end-to-end subprocesses (train.py, the notebooks' kernels, the sweeps)
take tests/end_to_end.py's environment instead, LLVM at -O1, whose steps run as
fast as XLA's default -O2 (test_multihost's 2-4-step hosts keep FAST_COMPILE).
"""

import collections
import gc
import os
import shutil
import sys
import tempfile

import pytest

import compile_cache  # tests/, on sys.path for its conftest
import end_to_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_COMPILE = ('--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                '--xla_cpu_parallel_codegen_split_count=1')

os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=8',
     FAST_COMPILE if end_to_end.pinned_jaxlib() else '']).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, ROOT)

# Each xdist worker, and every process it starts, on its own share of the cores (2 workers
# on 2 cores: one each). Unpinned, each worker's XLA thread pools and subprocesses spanned both
# cores and took turns with the other's: the learning tests' processes spent 4% more CPU time
# and took 3% longer (docs/testing.md). Tests whose processes need the whole machine widen it
# again with the `all_cores` fixture.
ALL_CORES = frozenset(os.sched_getaffinity(0))
if os.environ.get('PYTEST_XDIST_WORKER', '').startswith('gw'):
  _workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
  if len(ALL_CORES) % _workers == 0:
    os.sched_setaffinity(0, sorted(ALL_CORES)[int(os.environ['PYTEST_XDIST_WORKER'][2:])::_workers])

from trainer import host_memory  # pylint: disable=g-import-not-at-top,wrong-import-position

host_memory.keep_freed_memory()  # each worker's steps reuse freed memory, as train.py's do

# Python's cyclic collector scans every tracked object in a full collection, and jax's tracing
# makes many short-lived containers: with the default thresholds (700, 10, 10) one worker ran 22
# full collections of about 0.35 s each in test_cove, test_gpt_model, test_transformer and
# test_train (9.3 s of its 100 s in the collector). With a young generation of 50,000 objects it
# collects a dozen times in those files, in about 1 s. Tests that need a collection call
# gc.collect() themselves.
gc.set_threshold(50_000, 20, 100)

_OWN_DATA = 'LM_LINEAGE_TEST_DATA_DIR' not in os.environ
if _OWN_DATA:
  # Files in it are written atomically (tokenizer.write_lines_atomically), so workers may race.
  os.environ['LM_LINEAGE_TEST_DATA_DIR'] = tempfile.mkdtemp(prefix='lm_lineage_data_')


@pytest.fixture(scope='session')
def shared_data_dir() -> str:
  """config.data.data_dir for this run: the corpus and each vocabulary are built once."""
  return os.environ['LM_LINEAGE_TEST_DATA_DIR']


_temporary_cache = None  # the compilation cache's directory when this process made a fresh one


def pytest_configure(config):
  config.addinivalue_line('markers', 'slow: slower end-to-end tests (kept in CI)')
  global _temporary_cache
  # The controller chooses the compilation cache before the xdist workers start (they inherit it)
  # and before anything imports jax, which reads these at its import.
  if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    path, temporary = compile_cache.directory(config)
    if temporary:
      _temporary_cache = path
    else:
      compile_cache.prune(path)
    os.environ['JAX_COMPILATION_CACHE_DIR'] = path
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')  # every program


@pytest.fixture
def all_cores():
  """This worker, and the processes it starts meanwhile, on every core of the machine for a
  test whose processes need them (sweep.py --parallel cuts the cores into slices)."""
  pinned = os.sched_getaffinity(0)
  os.sched_setaffinity(0, ALL_CORES)
  yield
  os.sched_setaffinity(0, pinned)


@pytest.fixture(scope='session')
def default_compile_env() -> dict[str, str]:
  """os.environ for programs that train for minutes (sweeps of micro GPTs): XLA_FLAGS with
  tests/end_to_end.py's compile instead of FAST_COMPILE. FAST_COMPILE's code ran a micro GPT's
  3,000 steps at 10.6k tokens/s against 27.0k with XLA's defaults."""
  flags = [f for f in os.environ['XLA_FLAGS'].split() if f not in FAST_COMPILE.split()]
  return dict(os.environ, XLA_FLAGS=' '.join(flags + [end_to_end.COMPILE]).strip())


# Seconds of test time each file took in the fast and the slow tier. The fast tier's: a 2-core AMD
# EPYC at f7f803f's code (699 passed in 7m40s), test_train's and test_faults' from 5e383c8's run,
# test_phases' from its tests alone at 79bc188 (the slow one halved for the Xeon). The slow
# tier's: a 2-core Xeon's run of 22m10s once test_sweep_cluster's sweeps slept in their steps
# (test_sweep_cluster's own figure from its 260 steps, alone), test_aot.py's and test_aot_gpu.py's
# from the EPYC scaled to the Xeon (which took a little under half the EPYC's time). Only a
# schedule: files not listed take under 8 s in the fast tier and 20 s or less in the slow.
FILE_SECONDS = {
    'test_notebooks.py': (0, 365), 'test_sweep_cluster.py': (0, 329), 'test_faults.py': (1, 282),
    'test_bert_finetune_train.py': (0, 179), 'test_elmo_train.py': (4, 166),
    'test_aot.py': (29, 140), 'test_cove_train.py': (0, 150), 'test_gpt_train.py': (0, 142),
    'test_train.py': (41, 83), 'test_preemption.py': (0, 118), 'test_cvt_train.py': (0, 113),
    'test_multihost.py': (0, 110), 'test_fused_attention.py': (38, 70),
    'test_translation.py': (13, 82), 'test_flash_dropout.py': (65, 14), 'test_sweep.py': (1, 75),
    'test_workers.py': (29, 44), 'test_transformer.py': (32, 21), 'test_aot_gpu.py': (27, 22),
    'test_gpt_model.py': (32, 8), 'test_decoding.py': (35, 5), 'test_cove.py': (34, 4),
    'test_convert_checkpoint.py': (37, 0), 'test_bert_features.py': (31, 3),
    'test_phases.py': (23, 17), 'test_newer_jax.py': (10, 22), 'test_lm_objective.py': (32, 0),
    'test_cvt_model.py': (23, 0), 'test_convert_cove.py': (19, 0),
    'test_bilm_objective.py': (19, 0), 'test_elmo_model.py': (19, 0), 'test_bad_input.py': (19, 0),
    'test_bert_model.py': (17, 0), 'test_sweep_slices.py': (15, 0), 'test_lstm.py': (15, 0),
    'test_bert_finetune.py': (15, 0), 'test_bench.py': (0, 15), 'test_dropout.py': (14, 0),
    'test_layers.py': (14, 0), 'test_convert_elmo.py': (14, 0), 'test_elmo_tagger.py': (14, 0),
    'test_bcn.py': (13, 0), 'test_consistency_objective.py': (13, 0),
    'test_bert_pretraining.py': (13, 0), 'test_gpt_finetune_loss.py': (11, 0),
    'test_tokenizer.py': (10, 0), 'test_host_memory.py': (10, 0), 'test_squad.py': (10, 0),
    'test_gpt_finetune_data.py': (9, 0),
}


@pytest.hookimpl(trylast=True)  # after -m has deselected: the tiers of the tests that run
def pytest_collection_modifyitems(items):
  """The longest files first: the xdist workers take whole files in this order (--dist
  loadfile), so the long ones start early and the quick ones fill in at the end, and neither
  worker waits long for the other."""
  tiers = collections.defaultdict(set)
  for item in items:
    tiers[item.path.name].add(1 if item.get_closest_marker('slow') else 0)
  seconds = {name: sum(FILE_SECONDS.get(name, (0, 0))[t] for t in ts)
             for name, ts in tiers.items()}
  items.sort(key=lambda item: -seconds[item.path.name])  # stable: the tests' order within a file


def pytest_unconfigure(config):
  del config
  if _temporary_cache:
    shutil.rmtree(_temporary_cache, ignore_errors=True)
  if _OWN_DATA:
    shutil.rmtree(os.environ['LM_LINEAGE_TEST_DATA_DIR'], ignore_errors=True)
