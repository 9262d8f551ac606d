"""Orbax checkpoints of the train state together with every data shard's position."""

import contextlib
import gc
import os
import re
import time
import traceback
from typing import Any

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from trainer import restore_log


def _directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), 'checkpoints')


def _complete_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in a checkpoint directory, in order (a save under
  way is a temporary directory); none if it does not exist. Creates nothing."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def exist(workdir: str) -> bool:
  """Whether the workdir holds a finished checkpoint (without creating anything)."""
  return bool(_complete_steps(_directory(workdir)))


def newest_step(workdir: str) -> int | None:
  """The newest complete checkpoint's step; None without one."""
  return max(_complete_steps(_directory(workdir)), default=None)


def manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                         create=True)
  return ocp.CheckpointManager(_directory(workdir), options=options, item_names=('state', 'data'))


def _all_shards(shard_states: dict[int, dict[str, int]], num_shards: int
                ) -> list[dict[str, int]]:
  """Every data shard's position; a host knows those of the shards it reads."""
  if jax.process_count() == 1:
    return [dict(shard_states[s]) for s in range(num_shards)]
  keys = sorted(next(iter(shard_states.values())))
  table = np.zeros((num_shards, 1 + len(keys)), np.int64)  # column 0: this host reads it
  for shard, state in shard_states.items():
    table[shard] = [1] + [state[k] for k in keys]
  tables = np.asarray(multihost_utils.process_allgather(table)).reshape(-1, *table.shape)
  rows = [next(t[s] for t in tables if t[s, 0]) for s in range(num_shards)]
  return [dict(zip(keys, map(int, row[1:]))) for row in rows]


def save(mngr: ocp.CheckpointManager, step: int, state: Any,
         shard_states: dict[int, dict[str, int]], num_shards: int, *, phase: int = 0,
         positions: int | None = None, eot_trained: bool | None = None,
         layout: dict[str, Any] | None = None) -> None:
  """Starts an async save; device buffers are copied before this returns. With the data
  shards' positions go the training phase they are in (trainer/phases.py), the positions
  the parameters have trained (the longest sequence so far; None: not known) and whether the
  end-of-text token's embedding was ever trained (False: a converted openai-gpt, which had
  none; None: not known) and the rows of the batch each data shard fills
  (sharding.batch_layout; None: side by side).

  Refuses (FloatingPointError) a state with a non-finite array: a checkpoint
  is always one to resume from.
  """
  if step in mngr.all_steps():
    return
  bad = non_finite(state)
  if bad:
    raise FloatingPointError(f'{bad[0]} is not finite at step {step}, so it was not saved')
  with _write_errors(mngr):  # the previous save's error, if any, comes out here
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({'shards': _all_shards(shard_states, num_shards), 'phase': phase,
                                'positions': positions, 'eot_trained': eot_trained,
                                'layout': layout, 'checksums': checksums(state)})),
              force=True)


def wait(mngr: ocp.CheckpointManager) -> None:
  """Until the async save is written; WriteError if it could not be."""
  with _write_errors(mngr):
    mngr.wait_until_finished()


class WriteError(Exception):
  """A checkpoint could not be written (disk full, ...); the message names the newest kept one."""


@contextlib.contextmanager
def _write_errors(mngr: ocp.CheckpointManager):
  try:
    yield
  except Exception as error:  # pylint: disable=broad-except (orbax re-raises the writer's)
    directory = str(mngr.directory)
    steps = _complete_steps(directory)
    kept = f'step {steps[-1]}' if steps else 'none'
    raise WriteError(f'A checkpoint could not be written ({_reason(error)}); the newest complete '
                     f'one in {directory} is {kept}: free disk space (or lower '
                     'train.keep_checkpoints) and run the same command to resume.') from error


@jax.jit
def _finite(arrays: list[jax.Array]) -> list[jax.Array]:
  return [jnp.all(jnp.isfinite(x)) for x in arrays]


def non_finite(tree: Any) -> list[str]:
  """The names of the floating-point arrays of `tree` that hold a NaN or an infinity."""
  floats = [(_path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(getattr(x, 'dtype', np.int32), jnp.inexact)]
  checks = _finite([x for _, x in floats])
  return [name for (name, _), ok in zip(floats, checks) if not bool(ok)]


def _word_sums(x: jax.Array) -> jax.Array:
  """Two sums of the array's words (its elements' bits, as unsigned integers) modulo 2^32:
  plain, and each word times its position + 1 (a flipped, lost or moved byte changes one of
  them). Made where the array lies: a sharded array is summed shard by shard, never
  gathered."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
  words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: (..., 2)
  position, stride = jnp.zeros(words.shape, jnp.uint32), 1
  for axis in reversed(range(words.ndim)):
    position += jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride)
    stride = stride * words.shape[axis] % 2**32
  return jnp.stack([words.sum(dtype=jnp.uint32), (words * (position + 1)).sum(dtype=jnp.uint32)])


@jax.jit
def _all_word_sums(arrays: list[jax.Array]) -> list[jax.Array]:
  return [_word_sums(x) for x in arrays]


def checksums(tree: Any) -> dict[str, list[int]]:
  """Each array's sums (_word_sums) by name: saved with a checkpoint and compared when it
  is restored, so that bytes changed on disk where the files still decode (a flipped byte in a
  stored block of a compressed file) are found, not trained on."""
  named = [(_path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  sums = jax.device_get(_all_word_sums([x for _, x in named]))
  return {name: [int(v) for v in np.asarray(pair)] for (name, _), pair in zip(named, sums)}


def _changed(tree: Any, saved: dict[str, list[int]]) -> list[str]:
  """The names of `tree`'s arrays whose byte sums differ from those `saved` with them."""
  return [name for name, pair in checksums(tree).items()
          if name in saved and list(saved[name]) != pair]


def _reason(error: BaseException) -> str:
  """The innermost cause's first line (TensorStore names the array and the file there)."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0] if text else ""}'.strip()


_TENSORSTORE_READ = re.compile(r'Error reading "([^"]+)" in \w+ database at [^"]*"[^"]*":? ?'
                               r'(.*?)(?:; at (?:uncompressed )?byte \d+)*$')


def _unreadable_reason(error: BaseException) -> str:
  """Why a checkpoint cannot be read, in a few words: the array and TensorStore's cause
  ('params.layer_0.mlp.wi.kernel: ZSTD_decompressStream() failed: Data corruption detected'),
  else the innermost error's first line."""
  reason = _reason(error)
  read = _TENSORSTORE_READ.search(reason)
  return f'{re.sub(r"/[0-9.]+$", "", read.group(1))}: {read.group(2)}' if read else reason


def _set_aside(workdir: str, step: int) -> str:
  """Moves checkpoint `step` to workdir/unreadable_checkpoints/ (never deletes); its new path."""
  target = os.path.join(os.path.abspath(workdir), 'unreadable_checkpoints', str(step))
  suffix = 0
  while os.path.exists(target + (f'.{suffix}' if suffix else '')):
    suffix += 1
  target += f'.{suffix}' if suffix else ''
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(os.path.join(_directory(workdir), str(step)), target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'set aside checkpoint {step}')
  return target


def _restore_step(mngr: ocp.CheckpointManager, step: int, abstract_state: Any, log: str
                  ) -> tuple[Any, dict[str, Any] | None, str | None]:
  """(state, data, None), or (None, None, why step cannot be resumed from), agreed. A read that
  fails leaves its full error, and whatever the reads it abandoned print, in `log` alone."""
  why = None
  try:
    try:
      restored = _read(mngr, step, abstract_state, log)
    except _Unreadable:
      # A read can fail for a while (a network file system's timeout, a busy disk): once more
      # before the step counts as unreadable and is set aside, the run going back to an older.
      time.sleep(RETRY_SECONDS)
      restored = _read(mngr, step, abstract_state, log)
    data = restored['data']
    shards = data.get('shards', data.get('hosts'))  # 'hosts': checkpoints of before elastic resume
    bad = non_finite(restored['state'])
    changed = _changed(restored['state'], data.get('checksums') or {})  # none before checksums
    why = (f'{bad[0]} is not finite' if bad else
           f'{changed[0]} does not match the checksum saved with it' if changed else
           None if isinstance(shards, list) and shards else 'its data position is missing')
  except _Unreadable as error:
    why = str(error)
  # Every host falls back if one finds its part not finite or changed. A read that raises on
  # one host alone leaves the others in orbax's restore barrier: the job fails (not covered).
  if jax.process_count() > 1:
    failed = multihost_utils.process_allgather(np.array(why is not None))
    if why is None and np.asarray(failed).any():
      why = 'another host could not read it'
  if why:
    return None, None, why
  return restored['state'], {'shards': shards, 'phase': data.get('phase', 0),
                             'positions': data.get('positions'),
                             'eot_trained': data.get('eot_trained'),
                             'layout': data.get('layout')}, None


class _Unreadable(Exception):
  """A checkpoint's read failed (its error is in the restore log); the message says why."""


RETRY_SECONDS = 2.0  # before a failed read is tried again


def _read(mngr: ocp.CheckpointManager, step: int, abstract_state: Any, log: str) -> Any:
  """Checkpoint `step` as read; _Unreadable (why, in a few words) where the read fails."""
  with restore_log.held_stderr(log):
    try:
      return mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    except Exception as error:  # pylint: disable=broad-except (any unreadable file)
      why = _unreadable_reason(error)
      with open(log, 'a', encoding='utf-8') as f:
        f.write(f'Checkpoint step {step} in {mngr.directory}:\n'
                + ''.join(traceback.format_exception(error)))
      restore_log.log_abandoned_reads(log)
      del error  # its frames hold the abandoned reads: they are collected, and say so, here
      time.sleep(1)
      gc.collect()
  raise _Unreadable(why)


def newest_data(workdir: str, step: int | None = None) -> dict[str, Any] | None:
  """The data item of the workdir's newest readable checkpoint (data shards' positions, phase,
  trained positions, eot_trained, checksums), or of checkpoint `step`; None without one that
  reads. Creates nothing."""
  if not exist(workdir):
    return None
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # orbax warns at each read-only manager it makes
  try:
    mngr = ocp.CheckpointManager(_directory(workdir), item_names=('data',),
                                 options=ocp.CheckpointManagerOptions(read_only=True))
  finally:
    logging.set_verbosity(verbosity)
  for candidate in sorted(mngr.all_steps(), reverse=True) if step is None else [step]:
    try:
      return mngr.restore(candidate,
                          args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']
    except Exception:  # pylint: disable=broad-except (restore() reports unreadable steps)
      continue
  return None


def num_data_shards(workdir: str) -> int | None:
  """How many data shards the workdir's checkpoints hold (its run's first host count); None
  without a checkpoint."""
  data = newest_data(workdir)
  return len(data.get('shards', data.get('hosts'))) if data else None


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, workdir: str
            ) -> tuple[Any, dict[str, Any]]:
  """The newest checkpoint that restores: (state on the given shardings, its data: every data
  shard's position under 'shards', the phase under 'phase', the trained positions under
  'positions', whether eot was trained under 'eot_trained', the data layout under 'layout').

  A checkpoint that cannot be read, holds a non-finite array or an array whose bytes no
  longer match the checksums saved with it is reported in one line and moved to
  workdir/unreadable_checkpoints/ once an older one has restored; when none restores,
  nothing is moved and ValueError says why for each.
  """
  failures, log = [], restore_log.path(workdir)
  logged = os.path.getsize(log) if os.path.exists(log) else 0  # what earlier restores wrote
  for step in sorted(mngr.all_steps(), reverse=True):
    state, data, why = _restore_step(mngr, step, abstract_state, log)
    if why is None:
      for bad_step, bad_why in failures:
        moved = _set_aside(workdir, bad_step)
        if jax.process_index() == 0:
          print(f'Checkpoint step {bad_step} cannot be resumed from ({bad_why}): moved it to '
                f'{moved}; resuming from step {step}{restore_log.named_if_grown(log, logged)}.',
                flush=True)
      if failures:
        mngr.reload()
      return state, data
    failures.append((step, why))
  reasons = '; '.join(f'step {s}: {why}' for s, why in failures)
  raise ValueError(f'No checkpoint in {_directory(workdir)} restores ({reasons}'
                   f'{restore_log.named_if_grown(log, logged)}): fix what that names, or move '
                   'the directory aside to start afresh, or use a new --workdir.')


def saved_param_shapes(workdir: str, step: int | None = None) -> dict[str, tuple[int, ...]]:
  """Each parameter's shape in checkpoint `step` (default: the newest) of `workdir`, by name
  ('a/b/kernel'), from its metadata (no array is read)."""
  step = newest_step(workdir) if step is None else step
  item = os.path.join(_directory(workdir), str(step), 'state')
  return shapes_by_name(ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree['params'])


def readable_param_shapes(workdir: str) -> dict[str, tuple[int, ...]] | None:
  """saved_param_shapes of the newest checkpoint whose metadata reads; None if none does
  (restore() then says why for each)."""
  for step in reversed(_complete_steps(_directory(workdir))):
    try:
      return saved_param_shapes(workdir, step)
    except Exception:  # pylint: disable=broad-except (a damaged checkpoint: restore() reports it)
      continue
  return None


def shapes_by_name(tree: Any) -> dict[str, tuple[int, ...]]:
  """Each array's (or array metadata's) shape in `tree`, by its name ('a/b/kernel')."""
  return {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def restore_params(workdir: str, target_params: Any, fresh: tuple[str, ...] = ()
                   ) -> tuple[Any, list[str], list[str]]:
  """`target_params` with every array that the latest checkpoint of `workdir` also has replaced.

  The arrays are read straight onto the target's shardings; the top-level
  modules named in `fresh` (another task's head) are never read. Returns the
  params, the names only the target has (new heads) and the names only the
  checkpoint has (unused pretraining heads).
  """
  newest = newest_step(workdir)
  if newest is None:
    raise ValueError(f'{workdir} has no checkpoint: point config.init_from (or --workdir) at the '
                     'workdir of a finished run.')
  item = os.path.join(_directory(workdir), str(newest), 'state')
  saved_shapes = saved_param_shapes(workdir)
  unused_heads = sorted(n for n in saved_shapes if n.split('/')[0] in fresh)
  saved_shapes = {n: s for n, s in saved_shapes.items() if n.split('/')[0] not in fresh}
  target, treedef = jax.tree_util.tree_flatten_with_path(target_params)
  names = [_path_name(p) for p, _ in target]
  for name, (_, array) in zip(names, target):
    if name in saved_shapes and saved_shapes[name] != tuple(array.shape):
      raise ValueError(f'Parameter {name} has shape {saved_shapes[name]} in {workdir} but '
                       f'{tuple(array.shape)} here: make config.model match {workdir}/config.json.')
  shared = [(path, array) for name, (path, array) in zip(names, target) if name in saved_shapes]
  if not shared:
    raise ValueError(f'{workdir} shares no parameter with this model: config.init_from must be a '
                     f'run of the same architecture (config.model_name).')
  # A nested-dict target of only the shared arrays: orbax reads just those.
  partial = {}
  for path, array in shared:
    node = partial
    for key in path[:-1]:
      node = node.setdefault(key.key, {})
    node[path[-1].key] = jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)
  restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
      item={'params': partial}, restore_args=ocp.checkpoint_utils.construct_restore_args(
          {'params': partial}), partial_restore=True))['params']
  # Checked as a resume checks its state (which would set this checkpoint aside).
  bad = non_finite({'params': restored})
  changed = _changed({'params': restored},
                     (newest_data(workdir, newest) or {}).get('checksums') or {})
  if bad or changed:
    why = (f'{bad[0]} is not finite' if bad else
           f'{changed[0]} does not match the checksum saved with it')
    raise ValueError(f'Checkpoint step {newest} of {workdir} cannot be started from ({why}): '
                     f'resume that run (train.py with its --workdir sets the checkpoint aside '
                     'and goes on from an older one), or point config.init_from at another run.')
  loaded = {_path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
  leaves = [loaded.get(name, array) for name, (_, array) in zip(names, target)]
  new = [name for name in names if name not in saved_shapes]
  unused = sorted(set(saved_shapes) - set(names))
  # A module read in part: the checkpoint has arrays of it this model has no place for (a
  # layer since removed), and it would compute without them.
  read_modules = {name.rsplit('/', 1)[0] for name in loaded}
  partial_reads = [name for name in unused if name.rsplit('/', 1)[0] in read_modules]
  if partial_reads:
    raise ValueError(f'{workdir} holds {", ".join(partial_reads[:3])}, which this model\'s '
                     f'{partial_reads[0].rsplit("/", 1)[0]} has no place for: the run was '
                     'trained by an earlier version of the model (see git log models/); use '
                     'that version, or train it again.')
  return jax.tree_util.tree_unflatten(treedef, leaves), new, unused + unused_heads
