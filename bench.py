"""Measures the train step of any config and prints one JSON line.

    python bench.py --config=configs/bert_base.py:base --config.train.batch_size=8
    python bench.py --config=configs/bert_base.py:mini --profile=/tmp/bert_profile
    python bench.py --config=configs/bert_base.py:base --input_only --config.data.workers=2

The step is timed on one synthetic batch of the pipeline's spec that stays on the devices
(input_pipeline.example_batch: BERT's rows as full as pretraining's), so the step time
leaves the host's input out; --input_seconds measures that apart.

Figures: steady-state seconds per step (compile excluded), tokens/s (batch x
data.max_seq_length positions, x num_choices, padding included: a translation
pair's one side), analytic model FLOPs per step, achieved FLOP/s, MFU against
the chip's published dense peak in the model's compute dtype (trainer/peaks.py:
H100, H200, A100, TPU v4, v5e, v5p, v6e) or, on a CPU or another chip, against
the matmul peak measured here in that dtype; that measured peak and the MFU
against it always; compile seconds, peak memory, page faults per step, and the
training input's examples/s on the configured source, made by data.workers
processes as train.py makes it (--config.data.workers=N), in total and per
worker; --input_only measures only that. On a CPU backend, glibc's malloc is
first set to keep freed memory, as train.py does (trainer/host_memory.py;
--nokeep_freed_memory measures without).

--profile=DIR also traces a few steps into DIR (jax.profiler: TensorBoard's
profile plugin or ui.perfetto.dev open it), writes the compiled step's HLO
text there (train_step.hlo.txt) and prints the HLO ops that took the most
time per step, before the JSON line; on a GPU that aot.py knows (H100, H200,
A100), each JAX op's time beside aot.py's estimate of it, from the same
compiled step.
"""

import collections
import glob
import gzip
import json
import os
import re
import resource
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

import aot
import input_pipeline
from trainer import cli
from trainer import host_memory
from trainer import peaks
from trainer import phases
from trainer import sharding
import trainer.checks
import trainer.loop
import trainer.state


def matmul_peak_flops(dtype: str = 'float32', sizes: tuple[int, ...] | None = None,
                      repeats: int = 5) -> float:
  """Best matmul FLOP/s of this machine's first device over a few square sizes, in `dtype`
  (an accelerator's default sizes are larger: its small matmuls do not fill it)."""
  if sizes is None:
    sizes = (1024, 2048, 3072) if jax.default_backend() == 'cpu' else (4096, 8192)
  best = 0.0
  for n in sizes:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
      matmul(a, a).block_until_ready()
    best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
  return best


def mfu_reference(device_kind: str, dtype: str, measured: float) -> tuple[float, str]:
  """The peak FLOP/s of one device that MFU divides by, and what it is: the chip's published
  dense peak in the compute dtype (trainer/peaks.py), else (a CPU, a GPU not in the table) the
  matmul peak measured here in that dtype."""
  published = peaks.published(device_kind)
  if published:
    return published.flops(dtype), f'published {dtype} peak of {device_kind}: {published.source}'
  return measured, f'{dtype} matmul peak measured here on {device_kind}'


def peak_memory(devices=None) -> tuple[int | None, str]:
  """The most memory held so far (since the process started: the state's initialization
  too) and what it is: on an accelerator the largest of the local devices' allocator
  high-water marks (with FSDP or tensor sharding device 0 need not hold the most; None where
  the backend reports none), on a CPU the process's peak resident memory (Python, libraries
  and host arrays included)."""
  devices = list(devices or jax.local_devices())
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in devices]
  device = devices[0]
  if all(p is not None for p in peaks):
    return int(max(peaks)), (f'{device.platform} peak_bytes_in_use, the most of '
                             f'{len(peaks)} local devices')
  if device.platform != 'cpu':
    return None, f'not reported by this {device.platform} backend (memory_stats)'
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'host process max RSS'


def input_rate(config, max_seconds: float = 30.0, workers: int | None = None) -> dict:
  """The training input's examples/s as train.py reads it (this host's data shard, made by
  `workers` processes; default data.workers for this host), from the first batch on (the
  workers' start-up left out) for `max_seconds` or to the end of the first epoch: the total,
  and per worker."""
  # A fine-tuning run reads the vocabulary of the run it starts from (the BCN has no other).
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size,
                                           saved_dir=config.get('init_from') or None)
  if workers is None:
    workers = input_pipeline.num_workers(config.data, jax.default_backend(),
                                         jax.local_device_count())
  data = input_pipeline.get_train_stream(config.data, tokenizer=tokenizer,
                                         global_batch=config.train.batch_size, seed=0,
                                         num_shards=1, workers=workers)
  try:
    next(data)
    examples, start = 0, time.perf_counter()
    while time.perf_counter() - start < max_seconds:
      next(data)
      examples += config.train.batch_size
      state = data.get_state()[0]  # CVT's keeps the text stream's position as unlabeled_*
      if state.get('epoch', state.get('unlabeled_epoch', 0)):
        break
    total = examples / (time.perf_counter() - start)
  finally:
    data.close()
  return {'input_workers': workers, 'input_examples_per_sec': round(total, 1),
          'input_examples_per_sec_per_worker': round(total / max(workers, 1), 1)}


# An HLO instruction: its name, then after the shape its opcode, e.g.
# "fusion.3 = f32[8,128]{1,0} fusion(...)" or "ROOT tuple.9 = (f32[2], s32[]) tuple(...)".
_HLO_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(', re.M)
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$')


def _jax_ops(hlo_text: str) -> dict[str, str]:
  """Each instruction's JAX op (metadata op_name, e.g. ".../attention/dot_general"); a fusion
  without one takes its fused computation's root's."""
  roots, calls, names, computation = {}, {}, {}, None
  for line in hlo_text.splitlines():
    if match := _COMPUTATION.match(line):
      computation = match.group(1)
      continue
    instruction = _HLO_INSTRUCTION.match(line)
    if not instruction:
      continue
    op_name = re.search(r'op_name="([^"]*)"', line)
    names[instruction.group(1)] = op_name.group(1) if op_name else ''
    if line.lstrip().startswith('ROOT') and computation:
      roots[computation] = names[instruction.group(1)]
    if called := re.search(r'calls=%?([\w.\-]+)', line):
      calls[instruction.group(1)] = called.group(1)
  return {name: op or roots.get(calls.get(name), '') for name, op in names.items()}


def op_micros(trace_path: str, hlo_text: str) -> collections.Counter:
  """Microseconds per HLO op of `hlo_text` in a Perfetto trace (summed over threads). An event's
  op is its args' hlo_op where it has one (a GPU's kernels are named otherwise: cuBLAS's,
  Triton's, XLA's own with '_' for '.'), else its name (a CPU's); only this program's ops count
  (hlo_module, in a trace of several), and those of the device processes (a GPU's or TPU's)
  where they have any: the host's events for the same ops would count them twice."""
  opcodes = dict(_HLO_INSTRUCTION.findall(hlo_text))
  module = re.match(r'\s*HloModule\s+([\w.\-]+)', hlo_text)
  with gzip.open(trace_path, 'rt', encoding='utf-8') as f:
    events = json.load(f)
  events = events['traceEvents'] if isinstance(events, dict) else events
  devices = {event.get('pid') for event in events
             if event.get('ph') == 'M' and event.get('name') == 'process_name'
             and str((event.get('args') or {}).get('name', '')).startswith('/device:')}
  on_devices, everywhere = collections.Counter(), collections.Counter()
  for event in events:
    args = event.get('args') or {}
    op = args.get('hlo_op') or event.get('name')
    if event.get('ph') != 'X' or op not in opcodes or (
        module and not str(args.get('hlo_module', module.group(1))).startswith(module.group(1))):
      continue
    everywhere[op] += event.get('dur', 0)
    if event.get('pid') in devices:
      on_devices[op] += event.get('dur', 0)
  return on_devices or everywhere


def top_ops(trace_path: str, hlo_text: str, steps: int, top: int = 12) -> list[dict]:
  """The HLO ops of `hlo_text` that took the most time in a Perfetto trace of `steps` steps:
  name, opcode, JAX op, milliseconds per step and share of all HLO op time (summed over
  threads)."""
  opcodes, jax_ops = dict(_HLO_INSTRUCTION.findall(hlo_text)), _jax_ops(hlo_text)
  micros = op_micros(trace_path, hlo_text)
  total = sum(micros.values()) or 1
  return [{'op': name, 'opcode': opcodes[name], 'jax_op': jax_ops.get(name, ''),
           'ms_per_step': round(us / steps / 1e3, 3), 'share': round(us / total, 4)}
          for name, us in micros.most_common(top)]


def ops_by_jax_op(trace_path: str, hlo_text: str, steps: int, top: int = 12,
                  estimate: dict[str, float] | None = None) -> list[dict]:
  """Op time per JAX op with the layers together (layer_3 -> layer_*): milliseconds per step
  and share, the largest first; with `estimate` (estimated_ms's), each op's estimate too (None
  for an op it leaves out: collectives, ops of no kernel it knows)."""
  jax_ops, micros = _jax_ops(hlo_text), op_micros(trace_path, hlo_text)
  groups = collections.Counter()
  for name, us in micros.items():
    groups[_group(jax_ops.get(name, '') or name)] += us
  total = sum(groups.values()) or 1
  return [{'jax_op': op, 'ms_per_step': round(us / steps / 1e3, 3), 'share': round(us / total, 4),
           **({'estimate_ms': None if op not in estimate else round(estimate[op], 3)}
              if estimate is not None else {})}
          for op, us in groups.most_common(top)]


def _group(jax_op: str) -> str:
  """A JAX op's group: every layer's together (layer_3 -> layer_*), without the jit prefix."""
  return re.sub(r'layer([_/])\d+', r'layer\1*', re.sub(r'^jit\([^)]*\)/', '', jax_op))


def estimated_ms(hlo_text: str, device_kind: str, dtype: str) -> dict[str, float] | None:
  """aot.py's estimate of a compiled GPU step, milliseconds per JAX op (layers together, as
  ops_by_jax_op groups them), on the GPU of `device_kind`; None off the GPUs aot.py knows."""
  chip = next((c for c in aot.GPUS.values() if c.gpu.name == device_kind), None)
  if chip is None:
    return None
  jax_ops, by_op = _jax_ops(hlo_text), collections.Counter()
  for group in aot.kernels_by_op(hlo_text, chip, dtype, top=None):
    # A kernel without an op_name of its own goes by its instruction's name: its fused root's op.
    by_op[_group(jax_ops.get(group['op']) or group['op'])] += group['seconds'] * 1e3
  return dict(by_op)


def matmul_share(trace_path: str, hlo_text: str) -> float:
  """The share of all HLO op time in ops made from a matmul (JAX's dot_general)."""
  jax_ops, micros = _jax_ops(hlo_text), op_micros(trace_path, hlo_text)
  matmul = sum(us for name, us in micros.items() if jax_ops.get(name, '').endswith('dot_general'))
  return round(matmul / (sum(micros.values()) or 1), 4)


def profile(compiled, state, batch, directory: str, dtype: str, steps: int = 3
            ) -> tuple[list[dict], float, list[dict], float]:
  """Traces `steps` steps of `compiled` into `directory`; the top HLO ops by time, the share
  of op time in matmuls, the top JAX ops (layers together, on a GPU aot.py knows with its
  estimate of each) and the milliseconds per step that the trace's op events hold."""
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(steps):
      state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
  traces = glob.glob(os.path.join(directory, 'plugins', 'profile', '*', 'perfetto_trace.json.gz'))
  hlo_text = compiled.as_text()
  with open(os.path.join(directory, 'train_step.hlo.txt'), 'w') as f:  # the trace's op names
    f.write(hlo_text)
  trace = max(traces, key=os.path.getmtime)
  estimate = estimated_ms(hlo_text, jax.devices()[0].device_kind, dtype)
  return (top_ops(trace, hlo_text, steps), matmul_share(trace, hlo_text),
          ops_by_jax_op(trace, hlo_text, steps, top=20 if estimate else 12, estimate=estimate),
          round(sum(op_micros(trace, hlo_text).values()) / steps / 1e3, 3))


def benchmark(config, steps: int, warmup: int, profile_dir: str = '',
              input_seconds: float = 30.0, keeps_freed_memory: bool = False) -> dict:
  mesh = sharding.make_mesh(config.mesh)
  # A fine-tuning config's sizes come from its init_from.
  trainer.checks.inherit_unset_fields(config, None)
  trainer.checks.validate(config, mesh)
  model_cfg = trainer.checks.model_config(config)
  _, _, state, step_fn, _ = trainer.state.build(config, mesh)
  batch_size = config.train.batch_size
  local = input_pipeline.example_batch(config.data, model_cfg.vocab_size,
                                       batch_size=batch_size // jax.process_count())
  with jax.set_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_seconds = time.perf_counter() - start
    for _ in range(warmup):
      state, _ = compiled(state, batch)
      jax.block_until_ready(state)
      host_memory.give_back_if_over()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    in_flight = collections.deque()
    for _ in range(steps):  # as many steps in flight as train.py's loop lets run ahead
      state, metrics = compiled(state, batch)
      in_flight.append(metrics)
      trainer.loop.wait_for_room(in_flight)
    jax.block_until_ready((state, metrics))
    step_seconds = (time.perf_counter() - start) / steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / steps
    # Before the matmul benchmark below, whose arrays would be the high-water mark of a small
    # step (jax cannot reset it).
    memory, memory_source = peak_memory()
    ops, matmuls, grouped, op_ms = (profile(compiled, state, batch, profile_dir, model_cfg.dtype)
                                    if profile_dir else (None, 0, None, None))
  measured_peak = matmul_peak_flops(model_cfg.dtype)
  peak, peak_source = mfu_reference(jax.devices()[0].device_kind, model_cfg.dtype, measured_peak)
  flops = trainer.checks.train_flops_per_example(config, model_cfg) * batch_size
  if jax.default_backend() != 'cpu':  # the peaks are one of several accelerators'
    peak *= jax.device_count()
    measured_peak *= jax.device_count()
  tokens = batch_size * config.data.max_seq_length * config.data.get('num_choices', 1)
  return {
      'model': config.model_name, 'batch_size': batch_size,
      'seq_len': config.data.max_seq_length, 'devices': len(jax.devices()),
      'mesh': dict(mesh.shape), 'dtype': model_cfg.dtype,
      'step_seconds': round(step_seconds, 5),
      'tokens_per_sec': round(tokens / step_seconds, 1),
      'model_flops_per_step': flops,
      'achieved_flops_per_sec': round(flops / step_seconds, 1),
      'peak_flops_per_sec': round(peak, 1),
      'peak_source': peak_source,
      'mfu': round(flops / step_seconds / peak, 4),
      'matmul_peak_flops_per_sec': round(measured_peak, 1),  # measured here, in `dtype`
      'mfu_of_matmul_peak': round(flops / step_seconds / measured_peak, 4),
      'compile_seconds': round(compile_seconds, 2),
      'peak_memory_bytes': memory,
      'peak_memory_source': memory_source,
      'page_faults_per_step': round(faults),  # minor: pages the kernel mapped (and zeroed)
      'malloc_keeps_freed_memory': keeps_freed_memory and host_memory.kept(),  # to the end
      'final_loss': float(np.divide(*jax.device_get(metrics['loss']))),  # a (sum, count) pair
      **(input_rate(config, input_seconds) if input_seconds > 0 else
         {'input_examples_per_sec': None}),
      **({'profile_dir': profile_dir, 'top_ops': ops, 'matmul_share': matmuls,
          'top_jax_ops': grouped, 'profile_op_ms_per_step': op_ms} if ops is not None else {}),
  }


def print_ops(ops: list[dict], step_seconds: float, matmuls: float, grouped: list[dict],
              op_ms: float | None = None) -> None:
  if op_ms is not None and op_ms < 0.5 * step_seconds * 1e3:
    print(f'NOTE: the trace holds {op_ms:.1f} ms of op events per step of the '
          f'{step_seconds * 1e3:.1f} ms step (kernels inside a CUDA graph have none): the shares '
          'and the matmul share below are of those ops alone, not of the step.')
  print(f'HLO ops by time per step (the step took {step_seconds * 1e3:.1f} ms; shares are of all '
        f'HLO op time, summed over threads; {matmuls:.0%} of it in matmuls):')
  for op in ops:
    jax_op = re.sub(r'^jit\([^)]*\)/', '', op['jax_op'])
    print(f'  {op["share"]:6.1%} {op["ms_per_step"]:9.3f} ms  {op["opcode"]:<8} {op["op"]:<24} '
          f'{jax_op[-60:]}')
  print('The same time by JAX op, all layers together'
        + (" (and aot.py's estimate of it):" if grouped and 'estimate_ms' in grouped[0] else ':'))
  for op in grouped:
    estimate = ('' if 'estimate_ms' not in op else ' (n/a)' if op['estimate_ms'] is None
                else f' ({op["estimate_ms"]:.3f})')
    print(f'  {op["share"]:6.1%} {op["ms_per_step"]:9.3f} ms{estimate}  {op["jax_op"][-90:]}')


def main(argv):
  del argv
  cli.skip_absent_accelerators()
  # Before JAX's backend starts.
  # The input alone is measured as an accelerator host makes it, with glibc's defaults.
  keeps_freed_memory = (flags.FLAGS.keep_freed_memory and not flags.FLAGS.input_only
                        and host_memory.keep_freed_memory())
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  config, f = cli.loaded_config('bench.py'), flags.FLAGS
  try:
    if config is None:
      raise ValueError('pass --config=configs/<file>.py[:variant].')
    if f.phase < 1:
      raise ValueError(f'--phase={f.phase}: phases are numbered from 1.')
    if f.steps < 1 or f.warmup < 0:
      raise ValueError(f'--steps={f.steps} --warmup={f.warmup}: time 1 step or more, after 0 '
                       'or more.')
    if f.input_only and f.input_seconds <= 0:
      raise ValueError(f'--input_only measures the input for --input_seconds={f.input_seconds}:'
                       ' give it a positive time.')
    if f.input_seconds < 0:
      raise ValueError(f'--input_seconds={f.input_seconds}: 0 skips the input, more measures it.')
    if f.profile and os.path.exists(f.profile) and not os.path.isdir(f.profile):
      raise ValueError(f'--profile={f.profile} is a file: pass a directory for the trace.')
    config = phases.chosen(config, f.phase)[0].config
    if f.input_only:  # the data alone: its settings' errors are one line too
      print(json.dumps(input_rate(config, f.input_seconds)))
      return
    # The checks benchmark() starts with, here where they are one line (its own errors,
    # after them, keep their tracebacks).
    trainer.checks.inherit_unset_fields(config, None)
    trainer.checks.validate(config, sharding.make_mesh(config.mesh))
  except ValueError as e:  # a config value out of range, a bad flag: one line
    raise SystemExit(f'bench.py: error: {e}') from None
  # compile_seconds is a compile, not a read of an earlier one from a persistent cache.
  if 'jax_enable_compilation_cache' in jax.config.values:
    jax.config.update('jax_enable_compilation_cache', False)
  result = benchmark(config, f.steps, f.warmup, f.profile, f.input_seconds, keeps_freed_memory)
  if 'top_ops' in result:
    print_ops(result['top_ops'], result['step_seconds'], result['matmul_share'],
              result['top_jax_ops'], result['profile_op_ms_per_step'])
  print(json.dumps(result))


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.')
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 4, 'Untimed steps after compilation (on a CPU the heap grows '
                       'over the first few).')
  flags.DEFINE_string('profile', '', 'Also trace 3 steps into this directory and print the top '
                      'HLO ops by time.')
  flags.DEFINE_float('input_seconds', 30.0, 'At most this long measuring the input pipeline; 0 '
                     'skips it (input_examples_per_sec is then null).')
  flags.DEFINE_bool('input_only', False, 'Measure only the input pipeline (no step).')
  flags.DEFINE_integer('phase', 1, 'The phase of the run (data.later_phases) whose sequence '
                       'length, masking and remat are measured, from 1.')
  flags.DEFINE_bool('keep_freed_memory', True, 'On a CPU backend, set glibc\'s malloc to keep '
                    'freed memory as train.py does; --nokeep_freed_memory measures without.')
  app.run(main, flags_parser=cli.parse_flags)
