"""The environment of the slow tier's end-to-end programs: train.py, the notebooks' kernels and
the sweeps, started as subprocesses that train for tens to thousands of steps.

They compile with XLA's LLVM at -O1 instead of its default -O2: the same HLO and the same
floating-point semantics (no fast math either way), their compiles about a third shorter and their
steps as fast (BERT tiny 285 against 299 ms a step, its compile 5.5 against 8.0 s; the same final
loss; docs/testing.md). The flag is the pinned jaxlib's (XLA stops a process on a flag it does not
know), so under another jaxlib they compile with XLA's defaults.
"""

from importlib import metadata
import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned_jaxlib() -> bool:
  """Whether the installed jaxlib is requirements.txt's, whose XLA knows the tests' flags."""
  with open(os.path.join(ROOT, 'requirements.txt')) as f:
    pinned = re.search(r'^jaxlib==(\S+)', f.read(), re.M)
  try:
    return bool(pinned) and metadata.version('jaxlib') == pinned.group(1)
  except metadata.PackageNotFoundError:
    return False


COMPILE = '--xla_backend_optimization_level=1' if pinned_jaxlib() else ''


def xla_flags(devices: int = 1) -> str:
  """XLA_FLAGS for an end-to-end program on `devices` CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {COMPILE}'.strip()


def env(devices: int = 1) -> dict[str, str]:
  """os.environ for an end-to-end program on `devices` CPU devices."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS='cpu')


def unigram_baseline(train_targets, eval_targets, vocab_size: int,
                     left_out=()) -> tuple[float, float]:
  """What a model that ignores the context scores on the eval targets: the perplexity of the
  add-one unigram model of the train targets (ids `left_out` are never targets), and the
  accuracy of always the most frequent one. The learning tests' bar."""
  counts = np.bincount(train_targets, minlength=vocab_size) + 1.0
  counts[list(left_out)] = 0
  eval_targets = np.asarray(eval_targets)
  perplexity = np.exp(-np.log(counts[eval_targets] / counts.sum()).mean())
  return float(perplexity), float((eval_targets == counts.argmax()).mean())


# The start of input_pipeline/common/chunked.py's warning that an eval read its split more than
# once: a learning test's eval must read each held-out example once at most, as its config's.
EVAL_WRAPPED = 'An eval read all'
