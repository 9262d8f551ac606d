"""Compiles a config's train step for a TPU topology on this machine (no TPU needed) and reports
whether it fits in HBM, the predicted step time and MFU bound, and the collectives XLA inserted.

    python aot.py --config=configs/bert_base.py:large --topology=v5e:4x4 \
        --config.mesh='(("data",4),("fsdp",4),("tensor",1))'
    python aot.py --config=configs/bert_base.py --topology=v4:2x2x1 --find_max_batch

The train step is train.py's own (trainer.state.build, with the config's logical axis
rules); the state comes from jax.eval_shape and the batch is abstract, so nothing is executed.
Every figure is XLA's estimate from compiling, not a measurement on a TPU. Prints a short
table, then one JSON line; a config that cannot compile or does not fit gets one line that
names the fix.
"""

import dataclasses
import importlib
import json
import math
import os
import re
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
from jax.experimental import topologies
from ml_collections import config_flags

import input_pipeline
from trainer import cli
from trainer import sharding
import trainer.checks
import trainer.optimizer
import trainer.state

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation's published per-chip figures."""
  hbm_bytes: int
  bf16_flops: float  # peak dense bf16 FLOP/s
  hbm_bytes_per_sec: float
  libtpu_name: str  # the generation as libtpu's topology names spell it
  megacore: bool  # two TensorCores driven as one device


CHIPS = {
    'v4': Chip(32 * GiB, 275e12, 1228e9, 'v4', True),
    'v5e': Chip(16 * GiB, 197e12, 819e9, 'v5e', False),
    'v5p': Chip(95 * GiB, 459e12, 2765e9, 'v5', True),
    'v6e': Chip(32 * GiB, 918e12, 1640e9, 'v6e', False),
}

COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
# '%name = f32[8,128]{1,0:T(8,128)} all-gather(' or, tuple-shaped, '%name = (bf16[..], /*index=5*/
# bf16[..]) all-reduce-start(', one instruction per line.
_COLLECTIVE_RE = re.compile(
    r'^\s*(?:ROOT )?%?[\w.-]+ = (.+?) (' + '|'.join(COLLECTIVES) + r')(-start)?\(', re.MULTILINE)
_SHAPE_RE = re.compile(r'\b([a-z]+[0-9]*)\[([0-9,]*)\]')
_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4,
          's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}


# libtpu looks for this machine's TPU and its worker hosts, and logs that it found none; it
# needs neither to describe a topology. Several processes may load it (its lockfile allows one).
QUIET_LIBTPU = {'TPU_ACCELERATOR_TYPE': 'v4-8', 'TPU_WORKER_HOSTNAMES': 'localhost',
                'TPU_SKIP_MDS_QUERY': '1', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}


class DoesNotFit(ValueError):
  """A config that cannot compile or fit on the topology; the message names the fix."""


def parse_topology(name: str) -> tuple[Chip, str, tuple[int, ...]]:
  """'v5e:4x4' -> (the chip, libtpu's topology name, chip grid)."""
  generation, _, grid = name.partition(':')
  if generation not in CHIPS or not re.fullmatch(r'\d+(x\d+){1,2}', grid):
    raise ValueError(f'--topology={name!r}: use GENERATION:GRID with a generation of '
                     f'{", ".join(CHIPS)}, e.g. v4:2x2x1 or v5e:4x4.')
  chip = CHIPS[generation]
  dims = tuple(int(d) for d in grid.split('x'))
  return chip, f'{chip.libtpu_name}:{grid}', dims


def topology_devices(name: str) -> tuple[Chip, list[Any]]:
  """The compile-only devices of a TPU topology (one per chip), described by libtpu."""
  chip, libtpu_name, dims = parse_topology(name)
  per_host = tuple(min(d, h) for d, h in zip(dims + (1,) * (3 - len(dims)), (2, 2, 1)))
  try:
    topology = topologies.get_topology_desc(
        platform='tpu', topology_name=libtpu_name,
        chip_config_name='megacore' if chip.megacore else 'default',
        chips_per_host_bounds=per_host, num_slices=1, wrap=(False, False, False))
  except Exception as e:  # libtpu missing, or a grid it does not know
    raise ValueError(f'libtpu cannot describe topology {name!r} ({str(e).splitlines()[0]}): '
                     'install requirements-dev.txt (libtpu) and use a real slice shape.') from e
  return chip, list(topology.devices)


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Count and result bytes of each collective in compiled HLO text (the body of a loop, such as
  scanned layers, counted once)."""
  found = {kind: {'count': 0, 'bytes': 0} for kind in COLLECTIVES}
  for shapes, kind, started in _COLLECTIVE_RE.findall(hlo_text):
    sizes = [_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(',') if d)
             for dtype, dims in _SHAPE_RE.findall(shapes)]
    # An async start returns (operands..., results..., context): its largest member is the data.
    found[kind]['count'] += 1
    found[kind]['bytes'] += max(sizes) if started else sum(sizes)
  return found


def bytes_per_device(abstract_tree) -> int:
  """Bytes of a tree of sharded abstract arrays on one device."""
  return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(abstract_tree))


def replicated_params(abstract_params, top: int = 3) -> list[str]:
  """The largest parameters that no mesh axis splits (what FSDP leaves whole on every chip)."""
  whole = [(leaf.size, trainer.optimizer.param_name(path))
           for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]
           if leaf.sharding.shard_shape(leaf.shape) == leaf.shape and leaf.size > 1]
  return [name for _, name in sorted(whole, reverse=True)[:top]]


def abstract_batch(config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes (every feature is batch-first), without making its examples."""
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=2)
  batch_sharding = sharding.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((config.train.batch_size,) + v.shape[1:], v.dtype,
                                  sharding=batch_sharding)
          for k, v in example.items()}


def _cost(compiled) -> dict[str, float]:
  """XLA's cost analysis of a compiled step (one dict; some versions wrap it in a list)."""
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, list) else cost


LAYER_FIELDS = ('num_layers', 'num_encoder_layers', 'num_decoder_layers')


def unrolled_cost(config, mesh) -> dict[str, float] | None:
  """XLA's per-device FLOPs and bytes of a step with scanned layers, every layer counted.

  XLA counts a loop body once, so a scanned step's counts hold one layer. The same step unscanned
  at depth 1 and 2 (quick compiles) gives the cost of a layer and of the rest, extrapolated to the
  config's depth. None when the layers are not scanned or the depth cannot be varied.
  """
  depths = {config.model[f] for f in LAYER_FIELDS if f in config.model}
  if not config.model.get('scan_layers') or len(depths) != 1:
    return None
  costs = []
  for depth in (1, 2):
    shallow = config.copy_and_resolve_references()
    shallow.model.scan_layers = False
    for field in LAYER_FIELDS:
      if field in shallow.model:
        shallow.model[field] = depth
    try:
      _, _, state, train_step, _ = trainer.state.build(shallow, mesh, materialize=False)
    except ValueError:  # e.g. the BERT feature tagger's last four layers need four
      return None
    with jax.set_mesh(mesh):
      costs.append(_cost(train_step.lower(state, abstract_batch(shallow, mesh)).compile()))
  depth = depths.pop()
  return {k: costs[0][k] + (depth - 1) * (costs[1][k] - costs[0][k])
          for k in ('flops', 'bytes accessed')}


def step_estimate(cost: dict[str, float], unrolled: dict[str, float] | None, model_flops: float,
                  chip: Chip, num_devices: int) -> tuple[float, str, float]:
  """Seconds per step, where they come from, and how much XLA's FLOPs fall short of the model's.

  The roofline of XLA's per-device FLOP and byte counts, max(FLOPs / peak, bytes / bandwidth),
  with every layer counted where the layers are scanned (unrolled_cost); XLA's own estimate
  ('optimal_seconds') where it gives one (it is negative, unknown, for most train steps) and
  counts no loop short. In another loop (an LSTM's time steps) XLA counts one trip: where its
  FLOPs fall short of the model's, its bytes are scaled up by the same factor (which overstates
  the bytes outside the loop, such as the optimizer's).
  """
  xla_optimal = float(cost.get('optimal_seconds', -1.0))
  counts = unrolled or cost
  xla_flops = float(counts.get('flops', 0.0))
  undercount = max(1.0, model_flops / num_devices / max(xla_flops, 1.0))
  looped = undercount >= 1.5  # the analytic FLOPs leave out softmaxes and norms, not half
  if xla_optimal > 0 and not (unrolled or looped):
    return xla_optimal, 'xla_optimal_seconds', undercount
  roofline = max(xla_flops * undercount / chip.bf16_flops,
                 float(counts.get('bytes accessed', 0.0)) * undercount / chip.hbm_bytes_per_sec)
  if unrolled:
    return roofline, 'roofline, layers unrolled', undercount
  return roofline, 'roofline, loop scaled' if looped else 'roofline', undercount


def compile_step(config, topology: str, unroll_estimate: bool = True) -> dict[str, Any]:
  """Compiles the train step for the topology's chips and returns the report's figures;
  `unroll_estimate` costs scanned layers one by one (unrolled_cost: two more compiles)."""
  chip, devices = topology_devices(topology)
  mesh = sharding.make_mesh(config.mesh, devices)
  hosts = len({d.process_index for d in devices})
  trainer.checks.inherit_unset_fields(config, None)
  trainer.checks.validate(config, mesh, num_hosts=hosts)
  start = time.perf_counter()
  _, _, state, train_step, _ = trainer.state.build(config, mesh, materialize=False)
  with jax.set_mesh(mesh):
    try:
      compiled = train_step.lower(state, abstract_batch(config, mesh)).compile()
    except Exception as e:  # pylint: disable=broad-except
      if 'RESOURCE_EXHAUSTED' in str(e):  # XLA's memory assignment found no room in HBM
        raise DoesNotFit(f'DOES NOT FIT: {_first_line(e)}; {fixes(config, mesh)}') from e
      raise
  compile_seconds = time.perf_counter() - start

  memory = compiled.memory_analysis()
  temp = memory.temp_size_in_bytes
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
           - memory.alias_size_in_bytes + temp + memory.generated_code_size_in_bytes)
  if total > chip.hbm_bytes:
    raise DoesNotFit(f'DOES NOT FIT: {_gib(total)} per chip of {_gib(chip.hbm_bytes)} HBM; '
                     f'{fixes(config, mesh)}')
  # Only a step that fits is worth the two more compiles of the unrolled estimate.
  unrolled = unrolled_cost(config, mesh) if unroll_estimate else None
  cost = _cost(compiled)
  model_cfg = trainer.checks.model_config(config, 'tpu')
  model_module = importlib.import_module(f'models.{config.model_name}')
  batch_size = config.train.batch_size
  model_flops = model_module.train_flops_per_example(model_cfg, config.data) * batch_size
  step_seconds, source, undercount = step_estimate(cost, unrolled, model_flops, chip, mesh.size)
  dp = sharding.data_parallel_size(mesh)
  hlo = compiled.as_text()
  return {
      'model': config.model_name, 'topology': topology,
      'devices': mesh.size, 'hosts': hosts, 'mesh': dict(mesh.shape),
      'dtype': model_cfg.dtype, 'attention': getattr(model_cfg, 'attention', 'xla'),
      'pallas_kernels': hlo.count('custom_call_target="tpu_custom_call"'),
      'scan_layers': bool(config.model.get('scan_layers', False)),
      'remat': bool(config.model.get('remat', False)),
      'batch_size': batch_size, 'per_device_batch': batch_size // dp,
      'seq_len': config.data.max_seq_length,
      'state_bytes': bytes_per_device(state),
      'param_bytes': bytes_per_device(state.params),
      'param_bytes_unsharded': sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
      'temp_bytes': temp,
      'total_bytes': total,
      'hbm_bytes': chip.hbm_bytes,
      'replicated_params': replicated_params(state.params) if mesh.size > 1 else [],
      'step_seconds': step_seconds,
      'step_seconds_source': source,
      'xla_optimal_seconds': float(cost.get('optimal_seconds', -1.0)),
      'xla_flops_per_device': float((unrolled or cost).get('flops', 0.0)),
      'xla_bytes_per_device': float((unrolled or cost).get('bytes accessed', 0.0)),
      'loop_undercount': round(undercount, 2),
      'model_flops_per_step': model_flops,
      'mfu_bound': model_flops / (step_seconds * mesh.size * chip.bf16_flops),
      'collectives': collectives(hlo),
      'compile_seconds': round(compile_seconds, 1),
      'examples_per_sec_per_host': batch_size / step_seconds / hosts,
  }


def _first_line(error: Exception) -> str:
  lines = [line for line in str(error).splitlines() if line.strip()]
  return lines[0][:300] if lines else type(error).__name__


def fixes(config, mesh) -> str:
  """What to change when a step does not fit."""
  advice = []
  if mesh.shape['fsdp'] < mesh.size:
    advice.append(f'more FSDP (--config.mesh with fsdp up to {mesh.size})')
  if not config.model.get('remat', True):
    advice.append('remat (--config.model.remat=True)')
  dp = sharding.data_parallel_size(mesh)
  if config.train.batch_size > dp:
    advice.append(f'a smaller per-chip batch (--config.train.batch_size below '
                  f'{config.train.batch_size}, or train.grad_accum_steps)')
  if not config.model.get('scan_layers', True):
    advice.append('--config.model.scan_layers=True')
  return 'fix: ' + '; or '.join(advice) if advice else 'fix: use a larger slice'


def find_max_batch(config, topology: str) -> tuple[int, dict[str, Any]]:
  """The largest per-device batch whose step fits, and its report.

  Memory grows about linearly in the batch: two compiles give the line, a third checks its
  prediction, and a bisection between the nearest fitting and failing sizes settles it.
  """
  chip, devices = topology_devices(topology)
  mesh = sharding.make_mesh(config.mesh, devices)
  dp = sharding.data_parallel_size(mesh)
  reports: dict[int, dict[str, Any] | None] = {}

  def fits(per_device: int) -> bool:
    if per_device not in reports:
      config.train.batch_size = per_device * dp
      try:
        reports[per_device] = compile_step(config, topology, unroll_estimate=False)
      except DoesNotFit:
        reports[per_device] = None
      logging.warning('per-device batch %d: %s', per_device,
                      'fits' if reports[per_device] else 'does not fit')
    return reports[per_device] is not None

  low = max(config.train.batch_size // dp, 1)
  while not fits(low):
    if low == 1:
      raise DoesNotFit(f'DOES NOT FIT even at one example per device; {fixes(config, mesh)}')
    low //= 2
  high = 2 * low
  if fits(high):
    a, b = reports[low], reports[high]
    per_example = max((b['total_bytes'] - a['total_bytes']) / (high - low), 1.0)
    guess = max(high, low + int((chip.hbm_bytes - a['total_bytes']) / per_example))
    low, high = (guess, guess + 1) if fits(guess) else (high, guess)
    while fits(high):  # the line was pessimistic: double past it
      low, high = high, 2 * high
  while high - low > 1:
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  config.train.batch_size = low * dp
  return low, compile_step(config, topology)  # with the full step-time estimate


def _gib(n: float) -> str:
  return f'{n / GiB:.2f} GiB'


def print_table(report: dict[str, Any]) -> None:
  rows = [
      ('topology', f"{report['topology']}: {report['devices']} chips, {report['hosts']} hosts, "
                   f"mesh {report['mesh']}"),
      ('batch', f"{report['batch_size']} ({report['per_device_batch']} per data shard) x "
                f"{report['seq_len']} tokens, {report['dtype']}, attention {report['attention']}"),
      ('params per chip', f"{_gib(report['param_bytes'])} of {_gib(report['param_bytes_unsharded'])}"),
      ('memory per chip', f"state {_gib(report['state_bytes'])} + temporaries "
                          f"{_gib(report['temp_bytes'])} -> {_gib(report['total_bytes'])} of "
                          f"{_gib(report['hbm_bytes'])}: FITS"),
      ('step (estimate)', f"{report['step_seconds'] * 1e3:.1f} ms ({report['step_seconds_source']}); "
                          f"MFU bound {report['mfu_bound']:.2f}"),
      ('feed per host', f"{report['examples_per_sec_per_host']:.0f} examples/s"
                        + (f" (this host's pipeline: {report['input_examples_per_sec']:.0f})"
                           if 'input_examples_per_sec' in report else '')),
      ('compile', f"{report['compile_seconds']} s"),
  ]
  rows += [(kind, f"{c['count']} ops, {_gib(c['bytes'])}")
           for kind, c in report['collectives'].items() if c['count']]
  if report['replicated_params']:
    rows.append(('unsharded params', ', '.join(report['replicated_params'])))
  width = max(len(name) for name, _ in rows)
  for name, value in rows:
    print(f'{name:<{width}}  {value}')


FLAGS = flags.FLAGS


def main(argv):
  del argv
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  config = cli.loaded_config('aot.py')
  try:
    if FLAGS.find_max_batch:
      per_device, report = find_max_batch(config, FLAGS.topology)
      report['max_per_device_batch'] = per_device
    else:
      report = compile_step(config, FLAGS.topology, FLAGS.unroll_estimate)
  except ValueError as e:  # DoesNotFit included
    raise SystemExit(f'aot.py: {e}')
  if FLAGS.input_rate:
    import bench  # pylint: disable=g-import-not-at-top (measures on this host's CPU)
    report['input_examples_per_sec'] = bench.input_examples_per_sec(config)
  print_table(report)
  print(json.dumps(report))


if __name__ == '__main__':
  os.environ.update(QUIET_LIBTPU)
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('topology', 'v4:2x2x1', 'TPU slice, GENERATION:GRID (v4, v5e, v5p, v6e).')
  flags.DEFINE_bool('find_max_batch', False, 'Search the largest per-device batch that fits.')
  flags.DEFINE_bool('input_rate', False, "Measure the input pipeline's examples/s on this host.")
  flags.DEFINE_bool('unroll_estimate', True, 'With scanned layers, two more compiles (depth 1 and '
                    '2, unscanned) so that the step-time estimate counts every layer.')
  flags.mark_flag_as_required('config')
  app.run(main, flags_parser=cli.parse_flags)
