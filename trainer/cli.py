"""Command-line helpers shared by the entry points (train.py, bench.py, ...)."""

import fcntl
import importlib.util
import os
import sys

from absl import flags
import jax

from trainer import host_memory


# The TPU and NVIDIA plugins JAX starts by itself, which print errors where their chips are not.
NOISY_PLUGINS = ('libtpu', 'jax_cuda12_plugin', 'jax_cuda13_plugin')


def skip_absent_accelerators() -> None:
  """JAX on the CPU alone when libtpu or the CUDA plugin is installed (requirements-dev.txt has
  both) but this machine has no TPU or GPU, and no platform was chosen.

  JAX would start each plugin to look for its chips, and each prints start-up
  errors when there are none (libtpu's E0000 lines, the plugin's cuInit
  traceback). Call before JAX's first device use; child processes inherit the
  choice. aot.py compiles for TPUs and GPUs all the same: its devices are
  compile-only.
  """
  if jax.config.jax_platforms or os.environ.get('JAX_PLATFORMS'):
    return
  if host_memory.cpu_backend_expected() and any(map(importlib.util.find_spec, NOISY_PLUGINS)):
    os.environ['JAX_PLATFORMS'] = 'cpu'
    os.environ[_CHOSE_CPU] = '1'
    jax.config.update('jax_platforms', 'cpu')


_CHOSE_CPU = 'LM_JAX_PLATFORMS_CPU_CHOSEN'  # JAX_PLATFORMS is skip_absent_accelerators' choice


def environment_elsewhere() -> dict[str, str]:
  """This process's environment for a job that runs on another machine (sbatch passes it on):
  without the CPU platform skip_absent_accelerators chose for this one (a login node without
  GPUs), which kept every job off its node's GPUs."""
  env = dict(os.environ)
  if env.pop(_CHOSE_CPU, None):
    env.pop('JAX_PLATFORMS', None)
  return env


def config_from_file(path: str, variant: str = ''):
  """get_config(variant) of a config file, loaded without the --config flag."""
  spec = importlib.util.spec_from_file_location('_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def bad_override(argv: list[str]) -> str | None:
  """The first --config.<path> override whose path the config file does not have."""
  config_arg = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  if config_arg is None:
    return None
  path, _, variant = config_arg.partition(':')
  node = config_from_file(path, variant)
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    field, here = arg[len('--config.'):].split('=', 1)[0], node
    for key in field.split('.'):
      if not hasattr(here, 'keys') or key not in here.keys():
        return f'--config.{field}: the config has no field {key!r}; check the spelling in {path}.'
      here = here[key]
  return None


def loaded_config(program: str):
  """The --config flag's ConfigDict (None if not given); a file that cannot be loaded is one
  line (the flag loads its file on first use)."""
  config = flags.FLAGS.config
  try:
    if config is not None:
      config.keys()
  except OSError as e:
    sys.exit(f'{program}: error: {_unloadable(e)}')
  return config


def _unloadable(error: Exception) -> str:
  reason = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
  return (f'--config cannot be loaded ({reason}): pass an existing '
          'configs/<file>.py[:variant].')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with one line instead of a traceback for a bad --config override."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    try:
      reason = bad_override(argv)
    except Exception:  # pylint: disable=broad-except
      reason = None
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    fallback = ' '.join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    if 'Failed loading config file' in str(e):  # an override of a file that is not there
      fallback = _unloadable(e)
    sys.exit(f'{os.path.basename(argv[0])}: error: {reason or fallback}')


def read_lines(path: str, flag: str) -> list[str]:
  """Every line of a UTF-8 text file, stripped (a byte-order mark too), or a ValueError in one
  line naming the flag and the fix."""
  if not os.path.isfile(path):
    raise ValueError(f'{flag}={path!r} does not exist: pass a text file, one sentence per line.')
  try:
    with open(path, encoding='utf-8-sig') as f:
      return [line.strip() for line in f]
  except UnicodeDecodeError as e:
    raise ValueError(f'{flag}={path!r} is not UTF-8 text ({e.reason} at byte {e.start}): '
                     f'convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 {path}.') from None
  except OSError as e:
    raise ValueError(f'{flag}={path!r}: {e.strerror}.') from None


def hold_directory(path: str) -> int:
  """An exclusive flock on the directory `path`, held until the returned descriptor is closed
  or the process ends, however it ends; a ValueError in one line if another process holds it
  (a run's workdir, a sweep's)."""
  handle = os.open(path, os.O_RDONLY)
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(handle)
    raise ValueError(f'{path} is in use by another training process (a train.py, sweep or '
                     'notebook still running there): wait for it or stop it, or pass another '
                     '--workdir.') from None
  return handle
