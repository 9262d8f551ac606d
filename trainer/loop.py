"""The training loop: setup (data, state, restore), steps, logs, evals, checkpoints, stops."""

import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax

import input_pipeline
from input_pipeline.common import tokenizer as tokenizer_lib
from trainer import checkpoints
from trainer import cli
from trainer import evaluation
from trainer import host_memory
from trainer import metric_writer
from trainer import phases as phases_lib
from trainer import ranges
from trainer import runner
from trainer import sharding
from trainer.stop import StopRequested, signals_to_handle
from trainer.checks import check_init_from, check_resumable_params, check_run_directories
from trainer.checks import inherit_unset_fields, validate
from trainer.state import TrainState, abstract_batch, build, initial_state
from trainer.steps import accumulate


def write_workdir_files(config, workdir: str, tokenizer, started_from: int | None = None
                        ) -> None:
  """config.json, the vocabulary, and for a run starting from config.init_from, the step of
  the checkpoint it started from (runner.STARTED_FROM: a sweep then knows a fine-tuning of an
  earlier state of its pretraining)."""
  if jax.process_index() != 0:
    return
  # Replaced whole: a resume that cannot write it (a full disk) keeps the run's record readable.
  tokenizer_lib.write_lines_atomically([config.to_json_best_effort(indent=2)],
                                       os.path.join(workdir, 'config.json'))
  if started_from is not None:
    tokenizer_lib.write_lines_atomically(
        [json.dumps({'init_from': config.init_from, 'step': started_from})],
        os.path.join(workdir, runner.STARTED_FROM))
  # CoVe keeps two vocabularies (source words, target subwords); the others one.
  files = (tokenizer.files() if hasattr(tokenizer, 'files')
           else {type(tokenizer).FILE_NAME: tokenizer.vocab_file})
  for name, path in files.items():
    saved = os.path.join(workdir, name)
    if os.path.abspath(path) != os.path.abspath(saved):
      shutil.copyfile(path, saved)


@dataclasses.dataclass
class Run:
  """Everything a training run is made of, built by `setup`; the train and eval data and steps
  are the current phase's (enter_phase)."""
  config: Any
  workdir: str
  mesh: jax.sharding.Mesh
  tokenizer: Any
  data_shards: int
  objective: Any
  schedule: optax.Schedule
  state: TrainState
  mngr: Any
  phases: list[phases_lib.Phase]
  positions: int  # the longest sequence the parameters have trained on, before this run's phases
  eot_trained: bool | None  # end-of-text's embedding trained, by this run or before (None: unknown)
  layout: dict[str, Any] | None = None  # the rows each data shard fills (sharding.batch_layout)
  phase: phases_lib.Phase | None = None
  train_iter: Any = None
  train_step: Callable | None = None
  eval_step: Callable | None = None
  eval_data: Any = None
  eval_start: dict | None = None
  later_steps: dict[int, tuple[Callable, Callable]] = dataclasses.field(default_factory=dict)

  def row_fields(self) -> dict[str, int]:
    """What every metrics row of this phase says besides its metrics: the sequence length."""
    length = self.phase.config.data.get('max_seq_length')
    return {'max_seq_length': length} if length else {}

  def trained_positions(self) -> int:
    """The positions trained up to the current phase, this run's or those it started from."""
    reached = self.phases[:self.phase.index + 1]
    return max([self.positions] + [p.max_seq_length or 0 for p in reached])


def has_trained_eot(config, before: dict | None) -> bool | None:
  """Whether the end-of-text token's embedding has trained, in this run or (`before`: the
  checkpoint data of the run it resumes or starts from) earlier; None: not known."""
  return True if input_pipeline.trains_eot(config.data) else (before or {}).get('eot_trained')


def setup(config, workdir: str, mesh, take_workdir: Callable[[], None] | None = None) -> Run:
  """Checks, model and state (restored if the workdir has a checkpoint), and the data of the
  phase the run is in; `take_workdir` (workdir_lock's) is called once the workdir exists, after
  the checks and before anything is written or built."""
  # Checks, before any data is read or anything compiled. A resumed run needs
  # nothing from init_from any more (it may have been moved).
  ranges.check(config)  # first: the checks below read model_name and init_from
  check_run_directories(config, workdir)
  inherit_unset_fields(config, workdir)
  validate(config, mesh)
  input_pipeline.check_source(config.data)  # TFDS's own error would list every dataset it has
  if config.get('init_from') and not checkpoints.exist(workdir):
    check_init_from(config)
  os.makedirs(workdir, exist_ok=True)
  if take_workdir:
    take_workdir()
  resuming = checkpoints.exist(workdir)
  # The state's shapes and shardings by tracing alone, so that a mesh that cannot split a
  # parameter is named before the vocabulary and the data are built. A restored state is read
  # into these (no init program, no second copy of the state on the devices meanwhile).
  objective, schedule, state, train_step, eval_step = build(config, mesh, materialize=False)

  # The vocabulary: a resumed run keeps the one it started with, whatever the cache holds now,
  # and a run initialized from another one takes that run's vocabulary.
  saved_dir = workdir if resuming else config.get('init_from') or None
  # A TFDS text source is prepared here, by every host at this point (they wait for host 0),
  # never later in the data threads, where the hosts come to it at different steps.
  input_pipeline.prepare_source(config.data)
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size, saved_dir)
  if tokenizer.vocab_size > config.model.vocab_size:
    raise ValueError(f'The vocabulary has {tokenizer.vocab_size} tokens but model.vocab_size='
                     f'{config.model.vocab_size}: set --config.model.vocab_size='
                     f'{tokenizer.vocab_size}.')
  # The data shards are the hosts of the run's first job, whatever the hosts are now.
  data_shards = checkpoints.num_data_shards(workdir) or jax.process_count()

  # The state: restored with the data position below; a fresh run's is initialized on its
  # shards once its data is built (below), so that a bad split stops it before the init
  # program compiles.
  mngr = checkpoints.manager(workdir, config.train.keep_checkpoints)
  data, positions, before = None, 0, None
  if resuming:
    check_resumable_params(config, workdir, state.params)
    state, data = checkpoints.restore(mngr, state, workdir)
    positions, before = data['positions'] or 0, data
    if jax.process_index() == 0:
      print(f'Resuming from step {int(state.step)} in {workdir}.', flush=True)
  elif config.get('init_from'):
    before = checkpoints.newest_data(config.init_from)  # read once: positions, eot_trained
    positions = phases_lib.positions_in(before) or 0
  eot_trained = has_trained_eot(config, before)
  started_from = (checkpoints.newest_step(config.init_from)
                  if config.get('init_from') and not resuming else None)
  # The rows each data shard fills: the first job's hosts' (a run saved before layouts: side by
  # side, as every GPU and CPU mesh has them).
  layout = data.get('layout') if resuming else sharding.batch_layout(mesh)
  run = Run(config, workdir, mesh, tokenizer, data_shards, objective, schedule, state, mngr,
            phases_lib.of(config), positions, eot_trained, layout)
  step = int(state.step) if resuming else 0
  phase = phases_lib.at(run.phases, step)
  if data and data['phase'] != phase.index:
    # Saved at the end of the previous phase, the next starts at its first example; anything
    # else means the phases moved (data.later_phases or train.num_steps changed).
    if not (data['phase'] == phase.index - 1 and step == phase.start):
      raise ValueError(
          f'The checkpoint of step {step} is in phase {data["phase"] + 1} of its run, and this '
          f'config puts step {step} in phase {phase.index + 1}: keep data.later_phases and '
          'train.num_steps as the run started (a run from before phases: '
          "--config.data.later_phases='()'), or start a new --workdir.")
    data = None
  steps = (train_step, eval_step) if phase.index == 0 else None
  try:
    enter_phase(run, phase, data, steps)
    if not resuming:
      run.state = initial_state(config, mesh, tokenizer)
    compile_later_phases(run)
    # After the checks of a resume (the phases, the data shards, the eval split, the later
    # phases' steps): a resume refused leaves the run's config.json as it was.
    write_workdir_files(config, workdir, tokenizer, started_from)
  except BaseException:  # a step too large, Ctrl-C: no input worker stays behind
    for stream in (run.train_iter, run.eval_data):
      if stream is not None:
        stream.close()
    raise
  return run


def compile_later_phases(run: Run) -> None:
  """Compiles the steps of the phases still to come now, so that one that does not compile or
  fit in device memory stops the run at its start rather than at its boundary (90% in); the
  phase then runs the step compiled here."""
  for phase in run.phases[run.phase.index + 1:]:
    start = time.time()
    _, _, abstract_state, train_step, eval_step = build(phase.config, run.mesh, materialize=False)
    try:
      compiled = train_step.lower(abstract_state, abstract_batch(phase.config, run.mesh)).compile()
    except Exception as e:  # pylint: disable=broad-except (XLA's error for a step too large)
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      raise ValueError(
          f'In phase {phase.index + 1} (data.later_phases[{phase.index - 1}]) the step does not '
          f'fit in device memory ({str(e).splitlines()[0][:200]}): set that phase\'s remat '
          '(its last field) to True, or raise train.grad_accum_steps; python aot.py --phase='
          f'{phase.index + 1} shows its fit.') from None
    run.later_steps[phase.index] = (compiled, eval_step)
    if jax.process_index() == 0:
      print(f'Compiled the step of phase {phase.index + 1} ahead in {time.time() - start:.1f}s.',
            flush=True)


def enter_phase(run: Run, phase: phases_lib.Phase, data: dict[str, Any] | None = None,
                steps: tuple[Callable, Callable] | None = None) -> None:
  """Makes `phase` the run's: its train data (at `data`'s shard positions, else from its
  start), its eval data and its steps (built unless given); closes the previous phase's data."""
  if run.train_iter is not None:
    run.train_iter.close()
    run.eval_data.close()
  config = phase.config
  if steps is None:  # the same state and shardings; the phase's shapes and remat
    _, _, _, *steps = build(config, run.mesh, materialize=False)
  run.phase, (run.train_step, run.eval_step) = phase, steps
  workers = input_pipeline.num_workers(config.data, jax.default_backend(),
                                       jax.local_device_count())
  run.train_iter = input_pipeline.get_train_stream(
      config.data, tokenizer=run.tokenizer, global_batch=config.train.batch_size,
      seed=phases_lib.data_seed(config.seed, phase.index), num_shards=run.data_shards,
      process_index=jax.process_index(), process_count=jax.process_count(), workers=workers,
      rows=sharding.process_rows(run.mesh, config.train.batch_size, jax.process_index()),
      shard_rows=sharding.shard_rows(run.layout, run.data_shards, config.train.batch_size))
  if data:
    run.train_iter.set_state(dict(enumerate(data['shards'])))
  run.eval_data, run.eval_start = evaluation.eval_batches(config, run.tokenizer, run.mesh)
  if len(run.phases) > 1 and jax.process_index() == 0:
    print(f'Training {phase.describe(len(run.phases))}.', flush=True)


@jax.jit
def _add_on_device(window: dict[str, Any] | None, metrics: dict[str, jax.Array], step
                   ) -> dict[str, Any]:
  """Adds a step's metric pairs to the window's sums (None: a new window); keeps the first
  step whose loss or gradient norm is not finite (0: none yet) and those two values."""
  if window is None:  # made here, so it lives where the metrics do, on every host
    window = {'sums': {}, 'bad_step': jnp.int32(0), 'bad_values': jnp.zeros(2, jnp.float32)}
  # Steps may report different metrics (CVT's labeled and unlabeled batches).
  sums = dict(window['sums'])
  for name, value in metrics.items():
    sums[name] = sums[name] + value if name in sums else value
  # A loss pair is (loss x n, n): objectives/__init__.py.
  loss = metrics['loss'][0] / jnp.maximum(metrics['loss'][1], 1e-6)
  grad_norm = metrics['grad_norm'][0]
  first = (window['bad_step'] == 0) & ~jnp.isfinite(loss + grad_norm)
  return {'sums': sums,
          'bad_step': jnp.where(first, step, window['bad_step']),
          'bad_values': jnp.where(first, jnp.stack([loss, grad_norm]), window['bad_values'])}


class Progress:
  """Sums step metrics on the device, reads them at log, checkpoint and eval steps (stopping on
  a non-finite loss), and times the steps between logs.

  Nothing is read back per step, so the host dispatches the next step while the
  device runs this one; at most `max_ahead()` steps are in flight.
  """
  MAX_AHEAD = 2  # on an accelerator

  @classmethod
  def max_ahead(cls) -> int:
    """Steps dispatched beyond the one running: none on a CPU backend. There the "device" is
    the host's own cores, so dispatching early hides nothing, and a step dispatched while
    another runs takes its buffers beside that step's: the two steps' temporaries fragment
    malloc's heap, which grows by a step's temporaries every few steps (GPT-1 4 x 512: a peak
    resident size of 7.0 GB waiting for each step; 16.1 GB after 4 steps with 1 or 2 ahead)."""
    return 0 if jax.default_backend() == 'cpu' else cls.MAX_AHEAD

  def __init__(self, run: Run, step: int, stop: StopRequested):
    self.run, self.stop = run, stop
    self.totals, self.window, self.in_flight = {}, None, collections.deque()
    self.last_good_step = run.mngr.latest_step()
    self.last_step, self.last_time, self.paused = step, time.time(), 0.0

  def add(self, step: int, metrics) -> None:
    self.window = _add_on_device(self.window, metrics, step)
    self.in_flight.append(self.window['bad_step'])
    wait_for_room(self.in_flight)

  def check(self) -> None:
    """Reads the sums since the last check; FloatingPointError at a non-finite loss."""
    if self.window is None:
      return
    window = jax.device_get(self.window)
    self.window = None
    self.in_flight.clear()
    if window['bad_step']:
      loss, grad_norm = window['bad_values']
      # A finite loss with a non-finite gradient already spoils that step's parameters.
      raise FloatingPointError(
          f'Loss is {loss} and gradient norm {grad_norm} at step {window["bad_step"]}; the last '
          f'good checkpoint is step {self.last_good_step} in {self.run.workdir}. Lower '
          'optimizer.learning_rate or check the data.')
    self.totals = accumulate(self.totals, window['sums'])

  def save(self, step: int, state: TrainState) -> None:
    """Starts the checkpoint of `step`; a non-finite state is never saved."""
    try:
      with self.stop.deferred():
        checkpoints.save(self.run.mngr, step, state, self.run.train_iter.get_state(),
                         self.run.data_shards, phase=self.run.phase.index,
                         positions=self.run.trained_positions(),
                         eot_trained=self.run.eot_trained, layout=self.run.layout)
    except FloatingPointError as e:
      raise FloatingPointError(
          f'{e}; the last good checkpoint is step {self.last_good_step} in {self.run.workdir}. '
          'Lower optimizer.learning_rate or check the data.') from None
    self.last_good_step = step

  def summary(self, step: int) -> tuple[dict[str, float], float]:
    """The metrics since the last call, and training steps per second (pauses excluded)."""
    now = time.time()
    steps_per_sec = (step - self.last_step) / max(now - self.last_time - self.paused, 1e-9)
    summary = self.run.objective.summarize(self.totals)
    summary['learning_rate'] = float(self.run.schedule(step - 1))
    data = self.run.phase.config.data
    summary['tokens_per_sec'] = (steps_per_sec * self.run.config.train.batch_size *
                                 data.max_seq_length * data.get('num_choices', 1))
    self.totals, self.last_step, self.last_time, self.paused = {}, step, now, 0.0
    return summary, steps_per_sec


def wait_for_room(in_flight: collections.deque) -> None:
  """Waits for the oldest outputs of `in_flight` (one per dispatched step) until at most
  Progress.max_ahead() remain; after each wait, between steps, kept host memory may be given
  back (trainer/host_memory.py)."""
  while len(in_flight) > Progress.max_ahead():
    jax.block_until_ready(in_flight.popleft())
    host_memory.give_back_if_over()


def _agreed(flag: bool) -> bool:
  """Host 0's answer on every host (only host 0 writes metrics.jsonl)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.array(flag)))


def _ended_a_phase(run: Run, step: int) -> bool:
  """Whether `step`, where a run resumes, is the last of a phase (evaluated, as every phase's
  end is: the model each sequence length trained, e.g. BERT's at 128 tokens before 512)."""
  return run.phase.index > 0 and step == run.phase.start


def _evaluate_again(run: Run, params, step: int, writer) -> None:
  """The eval of `step` that a kill interrupted, as the killed run made it: at the end of a
  phase (the resumed run is in the next one) with that phase's eval data and step."""
  if not _ended_a_phase(run, step):
    evaluation.evaluate_and_write(run, params, step, writer)
    return
  ended = run.phases[run.phase.index - 1]  # its eval step compiles again: a rare resume's cost
  eval_data, eval_start = evaluation.eval_batches(ended.config, run.tokenizer, run.mesh)
  try:
    evaluation.evaluate_and_write(dataclasses.replace(
        run, phase=ended, eval_step=build(ended.config, run.mesh, materialize=False)[-1],
        eval_data=eval_data, eval_start=eval_start), params, step, writer)
  finally:
    eval_data.close()


def train_loop(run: Run, stop: StopRequested, stop_after_steps: int | None) -> TrainState:
  """Steps until train.num_steps (or a stop); logs, evaluates and checkpoints on the way."""
  tc, state = run.config.train, run.state
  step = int(state.step)
  end = tc.num_steps if stop_after_steps is None else min(tc.num_steps, step + stop_after_steps)
  writer = None
  try:  # from here the input workers are stopped however the loop ends
    if jax.process_index() == 0:
      print(f'{run.config.model_name}: {sum(x.size for x in jax.tree.leaves(state.params)):,} '
            f'parameters; mesh {dict(run.mesh.shape)}; starting at step {step}/{tc.num_steps}.',
            flush=True)
    writer = metric_writer.MetricWriter(run.workdir, tc.num_steps, step)
    progress, start_step = Progress(run, step, stop), step
    if step == tc.num_steps and not _agreed(metric_writer.has_results(run.workdir, step)):
      evaluation.evaluate_and_write(run, state.params, step, writer)  # stopped during its final eval
    elif (0 < step < tc.num_steps and (step % tc.eval_every == 0 or _ended_a_phase(run, step))
          and not _agreed(metric_writer.has_eval(run.workdir, step))):
      _evaluate_again(run, state.params, step, writer)  # stopped during that eval
    elif step >= tc.num_steps and jax.process_index() == 0:
      print(f'Nothing to do: the run reached train.num_steps={tc.num_steps}; raise it to '
            'train further.', flush=True)
    while step < end and not stop.requested(step, tc.log_every):
      first = 'with compilation' if step == start_step else ''
      if step == run.phase.end:  # the previous phase's last step was logged and saved
        pause = time.time()
        following = run.phases[run.phase.index + 1]
        enter_phase(run, following, steps=run.later_steps.pop(following.index))
        progress.paused += time.time() - pause
        first = 'compiled at the start'
      start = time.time()
      state, metrics = run.train_step(state, sharding.global_batch(next(run.train_iter), run.mesh))
      if first:
        jax.block_until_ready(metrics)
        stop.trained = True  # from here Ctrl-C saves first
        progress.paused += time.time() - start
        if jax.process_index() == 0:
          what = f'of phase {run.phase.index + 1} ' if len(run.phases) > 1 else ''
          print(f'First step {what}({first}) took {time.time() - start:.1f}s.', flush=True)
      step += 1
      progress.add(step, metrics)
      # A phase's last step is logged and saved: each row has one sequence length, and a
      # resume that lands on the boundary starts the next phase afresh.
      phase_end = step == run.phase.end
      if (step % tc.log_every and step % tc.checkpoint_every and step % tc.eval_every
          and step != end and not phase_end):
        continue
      progress.check()  # a non-finite loss since the last check stops the run here, unsaved
      if step % tc.log_every == 0 or step == end or phase_end:
        summary, steps_per_sec = progress.summary(step)
        writer.write(step, summary, steps_per_sec=steps_per_sec, fields=run.row_fields())
      pause = time.time()
      if step % tc.checkpoint_every == 0 or step == end or phase_end:
        progress.save(step, state)
      if step == tc.num_steps:
        # The results line says the run is done (runner.finished; a later stage starts from
        # its last checkpoint): written only once that checkpoint is.
        with stop.deferred():
          checkpoints.wait(run.mngr)
      if step % tc.eval_every == 0 or step == tc.num_steps or phase_end:
        evaluation.evaluate_and_write(run, state.params, step, writer)
      progress.paused += time.time() - pause
    if step < end:  # stopped by a signal
      progress.check()
      if step > progress.last_step:  # the steps since the last row: logged, not lost
        summary, steps_per_sec = progress.summary(step)
        writer.write(step, summary, steps_per_sec=steps_per_sec, fields=run.row_fields())
      progress.save(step, state)
      with stop.deferred():
        checkpoints.wait(run.mngr)
      if jax.process_index() == 0:
        print(f'{stop.describe()}: saved the checkpoint of step {step} in {run.workdir}; the same '
              'command (or call) resumes from it.', file=sys.stderr, flush=True)
  finally:
    try:
      with stop.deferred():  # also after a second Ctrl-C: the workers stop, the write ends
        run.train_iter.close()  # stops the input workers
        run.eval_data.close()
        checkpoints.wait(run.mngr)
    finally:
      if writer is not None:
        writer.close()
  return state


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """The workdir held for this run by its first process, released when the process ends,
  however it ends: a second run there, which would write the same checkpoints and metrics, is
  refused in one line. Taken on entry if the workdir exists; a new one (made by setup, after
  the checks, before anything is written or built in it) is taken by calling what this yields.
  """
  handles = []

  def take():
    if handles or jax.process_index() != 0 or not os.path.isdir(workdir):
      return  # (a workdir that is a file: setup's check says so)
    handles.append(cli.hold_directory(workdir))

  take()
  try:
    yield take
  finally:
    for handle in handles:
      os.close(handle)


def train_and_evaluate(config, workdir: str, *, stop_after_steps: int | None = None,
                       devices=None) -> TrainState:
  """Trains (or resumes) in `workdir`; `stop_after_steps` ends this run early, as a preemption
  would; `devices` (default: all) make the mesh. SIGTERM, a hangup (not under nohup) and
  Ctrl-C (a notebook's interrupt) save a checkpoint and return the state (StopRequested)."""
  stop = StopRequested()
  # Python sets signal handlers in its main thread only (a notebook's cells run there).
  handled = (signals_to_handle()
             if threading.current_thread() is threading.main_thread() else ())
  previous_handlers = {signum: signal.signal(signum, stop) for signum in handled}
  try:
    mesh = sharding.make_mesh(config.mesh, devices)
    sharding.check_processes_split_the_batch(sharding.batch_shards_by_process(mesh), config.mesh)
    with workdir_lock(workdir) as take, jax.set_mesh(mesh):
      return train_loop(setup(config, workdir, mesh, take), stop, stop_after_steps)
  finally:
    for signum, handler in previous_handlers.items():
      signal.signal(signum, handler)
