"""Compiles a config's train step for a TPU slice or NVIDIA GPU nodes on this machine (neither
needed) and reports whether it fits in HBM, the predicted step time (compute and collectives)
and MFU bound, and the collectives XLA inserted.

    python aot.py --config=configs/bert_base.py:large --topology=v5e:4x4 \
        --config.mesh='(("data",4),("fsdp",4),("tensor",1))'
    python aot.py --config=configs/bert_base.py:large --topology=h100:8
    python aot.py --config=configs/bert_base.py --topology=v4:2x2x1 --find_max_batch
    python aot.py --config=configs/gpt.py --topology=h100:1 --kernels=20  # where GPU time goes

The train step is train.py's own (trainer.state.build, with the config's logical axis
rules and XLA options); the state comes from jax.eval_shape and the batch is abstract, so
nothing is executed. libtpu describes TPU slices; jax's CUDA plugin describes GPU nodes from
XLA target descriptions written here (GPUS). Every figure is XLA's estimate from compiling,
not a measurement. Prints a short table, then one JSON line, for each phase of the run
(data.later_phases: BERT's last 10% of steps at 512 tokens; --phase=N for one); a config
that cannot compile or does not fit gets one line that names the fix.
"""

import dataclasses
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
from ml_collections import config_flags

from trainer import cli
from trainer import hlo
from trainer import peaks
from trainer import sharding
from trainer import steps
import trainer.checks
import trainer.optimizer
import trainer.phases
import trainer.state

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """What XLA compiles for on an NVIDIA GPU: the facts of its GpuTargetConfig (NVIDIA's
  published specifications and the CUDA guide's table of compute capabilities)."""
  name: str  # the device kind, as the CUDA driver reports it
  compute_capability: tuple[int, int]
  sm_count: int
  fp32_units_per_sm: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  l2_cache_bytes: int
  clock_ghz: float
  cudnn_version: tuple[int, int, int] = (9, 8, 0)

  def target_config(self, memory_bytes: int, memory_bytes_per_sec: float) -> str:
    """The target as the text proto jax's get_topology_desc(platform='cuda') takes."""
    major, minor = self.compute_capability
    cudnn = dict(zip(('major', 'minor', 'patch'), self.cudnn_version))
    device = {
        'threads_per_block_limit': 1024, 'threads_per_warp': 32,
        'shared_memory_per_block': 48 * 1024, 'shared_memory_per_core': self.shared_memory_per_sm,
        'threads_per_core_limit': 2048, 'core_count': self.sm_count,
        'fpus_per_core': self.fp32_units_per_sm, 'block_dim_limit_x': 2**31 - 1,
        'block_dim_limit_y': 65535, 'block_dim_limit_z': 65535,
        'memory_bandwidth': int(memory_bytes_per_sec), 'l2_cache_size': self.l2_cache_bytes,
        'clock_rate_ghz': self.clock_ghz, 'device_memory_size': memory_bytes,
        'shared_memory_per_block_optin': self.shared_memory_per_block_optin,
        'registers_per_core_limit': 65536, 'registers_per_block_limit': 65536}
    fields = ' '.join(f'{k}: {v}' for k, v in device.items())
    return (f'gpu_device_info {{ {fields} cuda_compute_capability {{ major: {major} minor: '
            f'{minor} }} }} platform_name: "CUDA" dnn_version_info {{ '
            + ' '.join(f'{k}: {v}' for k, v in cudnn.items())
            + f' }} device_description_str: "{self.name}"')


@dataclasses.dataclass(frozen=True)
class Chip:
  """An accelerator's published per-device figures.

  `link_bytes_per_sec` is what one device sends in one direction over the links inside its
  slice or node (TPU ICI, all links; NVLink through the node's NVSwitch); GPUs in other
  nodes are reached over the network at `network_bytes_per_sec` each (one NIC per GPU).
  """
  hbm_bytes: int
  peak: peaks.Peak  # dense matmul FLOP/s by compute dtype (trainer/peaks.py)
  hbm_bytes_per_sec: float
  link_bytes_per_sec: float
  network_bytes_per_sec: float = 0.0  # GPUs only: a TPU slice is one ICI domain
  libtpu_name: str = ''  # TPUs: the generation as libtpu's topology names spell it
  megacore: bool = False  # TPUs: two TensorCores driven as one device
  gpu: GpuTarget | None = None

  @property
  def platform(self) -> str:
    return 'gpu' if self.gpu else 'tpu'

  @property
  def usable_fraction(self) -> float:
    """Of hbm_bytes, what a step may take: on GPUs what train.py lets JAX's allocator take."""
    return steps.GPU_MEMORY_FRACTION if self.gpu else 1.0


CHIPS = {
    # Cloud TPU docs: HBM and its bandwidth, ICI per chip (half the bidirectional).
    'v4': Chip(32 * GiB, peaks.PEAKS['tpu v4'], 1228e9, 300e9, libtpu_name='v4', megacore=True),
    'v5e': Chip(16 * GiB, peaks.PEAKS['tpu v5 lite'], 819e9, 200e9, libtpu_name='v5e'),
    'v5p': Chip(95 * GiB, peaks.PEAKS['tpu v5'], 2765e9, 600e9, libtpu_name='v5', megacore=True),
    'v6e': Chip(32 * GiB, peaks.PEAKS['tpu v6'], 1640e9, 400e9, libtpu_name='v6e'),
}
_HOPPER = dict(compute_capability=(9, 0), sm_count=132, fp32_units_per_sm=128,
               shared_memory_per_sm=228 * 1024, shared_memory_per_block_optin=227 * 1024,
               l2_cache_bytes=50 * 2**20, clock_ghz=1.98)
# NVIDIA's data sheets (SXM parts): memory and its bandwidth, NVLink (half of the bidirectional
# figure), and DGX nodes' one InfiniBand NIC per GPU (A100 200, H100/H200 400 Gb/s).
GPUS = {
    'a100': Chip(85_100_068_864, peaks.PEAKS['a100'], 2039e9, 300e9, 25e9, gpu=GpuTarget(
        'NVIDIA A100-SXM4-80GB', (8, 0), 108, 64, 164 * 1024, 163 * 1024, 40 * 2**20, 1.41)),
    'h100': Chip(84_942_979_072, peaks.PEAKS['h100'], 3350e9, 450e9, 50e9,
                 gpu=GpuTarget('NVIDIA H100 80GB HBM3', **_HOPPER)),
    'h200': Chip(151_397_597_184, peaks.PEAKS['h200'], 4800e9, 450e9, 50e9,
                 gpu=GpuTarget('NVIDIA H200', **_HOPPER)),
}
GPUS_PER_NODE = 8  # an NVLink domain: an HGX/DGX board

# libtpu looks for this machine's TPU and its worker hosts, and logs that it found none; it
# needs neither to describe a topology. Several processes may load it (its lockfile allows one).
QUIET_LIBTPU = {'TPU_ACCELERATOR_TYPE': 'v4-8', 'TPU_WORKER_HOSTNAMES': 'localhost',
                'TPU_SKIP_MDS_QUERY': '1', 'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}


class DoesNotFit(ValueError):
  """A config that cannot compile or fit on the topology; the message names the fix."""


def parse_topology(name: str) -> tuple[Chip, str, tuple[int, ...]]:
  """'v5e:4x4' -> (the chip, libtpu's topology name, chip grid); 'h100:4x8' -> (the GPU,
  the CUDA plugin's topology name, (nodes, GPUs per node)); 'h100:8' is one node."""
  kind, _, grid = name.partition(':')
  if kind in GPUS and re.fullmatch(r'(\d+x)?\d+', grid):
    nodes, per_node = (int(d) for d in (grid if 'x' in grid else f'1x{grid}').split('x'))
    if 1 <= per_node <= GPUS_PER_NODE and nodes >= 1:
      return GPUS[kind], f'1x{nodes}x{per_node}', (nodes, per_node)
  if kind in CHIPS and re.fullmatch(r'\d+(x\d+){1,2}', grid):
    chip = CHIPS[kind]
    return chip, f'{chip.libtpu_name}:{grid}', tuple(int(d) for d in grid.split('x'))
  raise ValueError(f'--topology={name!r}: use GENERATION:GRID with a TPU generation of '
                   f'{", ".join(CHIPS)} (e.g. v4:2x2x1, v5e:4x4), or GPU:NODESxGPUS with a GPU '
                   f'of {", ".join(GPUS)} and up to {GPUS_PER_NODE} GPUs a node (e.g. h100:8, '
                   'h100:4x8).')


def topology_devices(name: str) -> tuple[Chip, list[Any]]:
  """The compile-only devices of a TPU slice (one per chip, described by libtpu) or of GPU
  nodes (one process per node, described by jax's CUDA plugin)."""
  chip, topology_name, dims = parse_topology(name)
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top (experimental)
    if chip.gpu:
      topology = topologies.get_topology_desc(
          platform='cuda', topology=topology_name,
          target_config=chip.gpu.target_config(chip.hbm_bytes, chip.hbm_bytes_per_sec))
    else:
      per_host = tuple(min(d, h) for d, h in zip(dims + (1,) * (3 - len(dims)), (2, 2, 1)))
      topology = topologies.get_topology_desc(
          platform='tpu', topology_name=topology_name,
          chip_config_name='megacore' if chip.megacore else 'default',
          chips_per_host_bounds=per_host, num_slices=1, wrap=(False, False, False))
  except Exception as e:  # libtpu or the CUDA plugin missing, or a grid it does not know
    needs = ('jax\'s CUDA plugin, run with JAX_PLATFORMS=cpu' if chip.gpu else 'libtpu')
    raise ValueError(f'cannot describe topology {name!r} ({str(e).splitlines()[0]}): install '
                     f'requirements-dev.txt ({needs}) and use a real slice shape.') from e
  return chip, list(topology.devices)




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


def _cost(compiled) -> dict[str, float]:
  """XLA's cost analysis of a compiled step (one dict; some versions wrap it in a list; none
  for GPUs: {})."""
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost) or {}


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
      batch = trainer.state.abstract_batch(shallow, mesh)
      costs.append(_cost(train_step.lower(state, batch).compile()))
  depth = depths.pop()
  return {k: costs[0][k] + (depth - 1) * (costs[1][k] - costs[0][k])
          for k in ('flops', 'bytes accessed')}


def step_estimate(cost: dict[str, float], unrolled: dict[str, float] | None, model_flops: float,
                  chip: Chip, num_devices: int, dtype: str = 'bfloat16'
                  ) -> tuple[float, str, float]:
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
  roofline = max(xla_flops * undercount / chip.peak.flops(dtype),
                 float(counts.get('bytes accessed', 0.0)) * undercount / chip.hbm_bytes_per_sec)
  if unrolled:
    return roofline, 'roofline, layers unrolled', undercount
  return roofline, 'roofline, loop scaled' if looped else 'roofline', undercount


# The per-kernel GPU estimate's assumptions (docs/accelerators.md compares it with steps measured
# on an H100): the share of the dense peak XLA's matmul kernels reach (XLA's own table of
# measured H100 bf16 matmuls has 0.64 at 2048^3 and 0.79 at 4096^3), the share of the HBM
# bandwidth a streaming kernel reaches (assumed), and each kernel's fixed cost: its launch
# (XLA's GPU cost model takes 1 us for that alone) and the ramp-up and tail of its blocks.
MATMUL_EFFICIENCY = 0.7
HBM_EFFICIENCY = 0.9
KERNEL_SECONDS = 2e-6


def gpu_compute_estimate(hlo_text: str, chip: Chip, dtype: str
                         ) -> tuple[float, str, dict[str, float], dict[str, float]]:
  """Seconds of a GPU step's compute, where they come from, the counts, and the seconds by kind.

  XLA gives no cost analysis for GPUs. Each kernel of the compiled step (hlo.hlo_kernels; the
  collectives are hlo.collective_seconds') takes the larger of its FLOPs at its rate and its bytes
  at HBM_EFFICIENCY of the bandwidth, plus KERNEL_SECONDS; the kernels run one after another.
  Matmuls and fused attention (cuDNN's; ours, by the FLOPs its kernels declare) run at
  MATMUL_EFFICIENCY of the dense peak in the compute dtype, the rest on the CUDA cores (SMs x
  FP32 units x clock x 2).
  """
  kernels = [k for k in hlo.hlo_kernels(hlo_text) if k.kind != 'collective']
  by_kind = {kind: 0.0 for kind in ('matmul', 'attention', 'vector')}
  for k, seconds in zip(kernels, _kernel_seconds(kernels, chip, dtype)):
    by_kind[k.kind] += k.times * seconds
  launches = sum(k.times for k in kernels)
  by_kind['fixed'] = launches * KERNEL_SECONDS
  counts = {'flops': sum(k.flops * k.times for k in kernels),
            'bytes accessed': sum(k.bytes * k.times for k in kernels), 'kernels': launches}
  return sum(by_kind.values()), f'per kernel, {launches} kernels', counts, by_kind


def _kernel_seconds(kernels: list[hlo.Kernel], chip: Chip, dtype: str) -> list[float]:
  """Each kernel's seconds per run, without the fixed cost (gpu_compute_estimate's rule)."""
  gpu = chip.gpu
  tensor_cores = chip.peak.flops(dtype) * MATMUL_EFFICIENCY
  rates = {'matmul': tensor_cores, 'attention': tensor_cores,
           'vector': gpu.sm_count * gpu.fp32_units_per_sm * gpu.clock_ghz * 1e9 * 2}
  bandwidth = chip.hbm_bytes_per_sec * HBM_EFFICIENCY
  return [max(k.flops / rates[k.kind], k.bytes / bandwidth) for k in kernels]


def kernels_by_op(hlo_text: str, chip: Chip, dtype: str, top: int | None = 30
                  ) -> list[dict[str, Any]]:
  """The GPU step's kernels grouped by the jax operation that made them (op_name), largest
  estimated time first: where the step's time goes, by gpu_compute_estimate's rule (each
  group's seconds include its kernels' fixed cost)."""
  kernels = [k for k in hlo.hlo_kernels(hlo_text) if k.kind != 'collective']
  groups: dict[tuple[str, str], dict[str, Any]] = {}
  for k, seconds in zip(kernels, _kernel_seconds(kernels, chip, dtype)):
    # One group for the same op in every layer.
    op = re.sub(r'layer_\d+', 'layer_*', re.sub(r'^jit\([\w.]+\)/', '', k.op_name)) or k.name
    group = groups.setdefault((op, k.kind), {'op': op, 'kind': k.kind, 'count': 0,
                                             'seconds': 0.0, 'flops': 0.0, 'bytes': 0.0})
    group['count'] += k.times
    group['seconds'] += k.times * (seconds + KERNEL_SECONDS)
    group['flops'] += k.times * k.flops
    group['bytes'] += k.times * k.bytes
  return sorted(groups.values(), key=lambda g: -g['seconds'])[:top]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """A config's train step compiled for a topology's devices (compile_train_step)."""
  config: Any
  topology: str
  chip: Chip
  devices: list[Any]
  mesh: Any
  state: Any  # abstract: shapes, dtypes and shardings
  executable: Any  # jax's Compiled: .as_text(), .memory_analysis(), .cost_analysis()
  seconds: float


def compile_step(config, topology: str, unroll_estimate: bool = True) -> dict[str, Any]:
  """Compiles the train step for the topology's devices and returns the report's figures;
  `unroll_estimate` costs a TPU step's scanned layers one by one (unrolled_cost: two more
  compiles)."""
  return step_report(compile_train_step(config, topology), unroll_estimate)


def compile_train_step(config, topology: str) -> CompiledStep:
  """The config's train step compiled for the topology's devices; DoesNotFit where XLA's memory
  assignment finds no room in HBM."""
  chip, devices = topology_devices(topology)
  mesh = sharding.make_mesh(config.mesh, devices)
  hosts = len({d.process_index for d in devices})
  trainer.checks.inherit_unset_fields(config, None)
  trainer.checks.validate(config, mesh, num_hosts=hosts)
  start = time.perf_counter()
  _, _, state, train_step, _ = trainer.state.build(config, mesh, materialize=False)
  with jax.set_mesh(mesh):
    try:
      compiled = train_step.lower(state, trainer.state.abstract_batch(config, mesh)).compile()
    except Exception as e:  # pylint: disable=broad-except
      if 'RESOURCE_EXHAUSTED' in str(e):  # XLA's memory assignment found no room in HBM
        raise DoesNotFit(f'DOES NOT FIT: {_first_line(e)}; {fixes(config, mesh)}') from e
      raise
  return CompiledStep(config, topology, chip, devices, mesh, state, compiled,
                      time.perf_counter() - start)


def step_report(step: CompiledStep, unroll_estimate: bool = True) -> dict[str, Any]:
  """The report's figures of a compiled step (compile_step's); DoesNotFit where it is larger
  than the HBM JAX may use."""
  config, topology, chip, devices, mesh, state, compiled = (
      step.config, step.topology, step.chip, step.devices, step.mesh, step.state, step.executable)
  hosts = len({d.process_index for d in devices})
  compile_seconds = step.seconds
  memory = compiled.memory_analysis()
  temp = memory.temp_size_in_bytes
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
           - memory.alias_size_in_bytes + temp + memory.generated_code_size_in_bytes)
  usable = chip.hbm_bytes * chip.usable_fraction
  if total > usable:
    share = f' (JAX takes {chip.usable_fraction:.0%})' if chip.usable_fraction < 1 else ''
    raise DoesNotFit(f'DOES NOT FIT: {_gib(total)} per {_device(chip)} of {_gib(usable)} HBM'
                     f'{share}; {fixes(config, mesh)}')
  model_cfg = trainer.checks.model_config(config, chip.platform)
  batch_size = config.train.batch_size
  model_flops = trainer.checks.train_flops_per_example(config, model_cfg) * batch_size
  hlo_text = compiled.as_text()
  cost = _cost(compiled)
  by_kind, by_op = {}, []
  if chip.gpu:
    compute_seconds, source, counts, by_kind = gpu_compute_estimate(hlo_text, chip, model_cfg.dtype)
    by_op = kernels_by_op(hlo_text, chip, model_cfg.dtype)
    undercount = 1.0
  else:
    # Only a step that fits is worth the two more compiles of the unrolled estimate.
    unrolled = unrolled_cost(config, mesh) if unroll_estimate else None
    compute_seconds, source, undercount = step_estimate(cost, unrolled, model_flops, chip,
                                                        mesh.size, model_cfg.dtype)
    counts = unrolled or cost
  found = hlo.collectives(hlo_text, chip, [d.process_index for d in mesh.devices.flat])
  comm_seconds = hlo.collective_seconds(found)
  step_seconds = compute_seconds + comm_seconds
  dp = sharding.data_parallel_size(mesh)
  peak = mesh.size * chip.peak.flops(model_cfg.dtype)
  return {
      'model': config.model_name, 'topology': topology, 'platform': chip.platform,
      'device_kind': devices[0].device_kind,
      'devices': mesh.size, 'hosts': hosts, 'mesh': dict(mesh.shape),
      'dtype': model_cfg.dtype, 'attention': getattr(model_cfg, 'attention', 'xla'),
      'pallas_kernels': sum(hlo_text.count(f'custom_call_target="{target}"') for target in
                            ('tpu_custom_call', '__gpu$xla.gpu.triton')),
      'cudnn_attention_calls': hlo_text.count('custom_call_target="__cudnn$fmha'),
      # The train step's (with cuDNN's attention dropout, CUDNN_DROPOUT_OPTIONS too).
      'compiler_options': steps.compiler_options(
          mesh, steps.runs_cudnn_dropout(model_cfg)) or {},
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
      'usable_hbm_bytes': usable,
      'replicated_params': replicated_params(state.params) if mesh.size > 1 else [],
      'step_seconds': step_seconds,
      'compute_seconds': compute_seconds,
      'collective_seconds': comm_seconds,
      'step_seconds_source': source,
      'compute_seconds_by_kind': by_kind,  # GPUs: matmul, attention, vector and fixed costs
      'kernels_by_op': by_op,  # GPUs: the 30 largest groups of kernels
      'xla_optimal_seconds': float(cost.get('optimal_seconds', -1.0)),
      'xla_flops_per_device': float(counts.get('flops', 0.0)),
      'xla_bytes_per_device': float(counts.get('bytes accessed', 0.0)),
      'loop_undercount': round(undercount, 2),
      'model_flops_per_step': model_flops,
      'mfu_bound': model_flops / (step_seconds * peak),
      # TPUs: a roofline at the full peaks, an upper bound; GPUs: the kernels' sum at the
      # efficiencies above, an estimate (measured steps came 10-27% slower).
      'mfu_bound_is': 'an estimate' if chip.gpu else 'an upper bound',
      'mfu_bound_overlapped': model_flops / (max(compute_seconds, comm_seconds) * peak),
      'collectives': found,
      'collectives_by_op': hlo.collectives_by_op(hlo_text, top=20),
      'compile_seconds': round(compile_seconds, 1),
      'examples_per_sec_per_host': batch_size / step_seconds / hosts,
      # Figures of the roofline estimate, not measured: bench.py measures on the chip.
      'estimates': ['step_seconds', 'compute_seconds', 'collective_seconds',
                    'compute_seconds_by_kind', 'kernels_by_op', 'mfu_bound',
                    'mfu_bound_overlapped', 'examples_per_sec_per_host', 'collectives'],
  }


def _device(chip: Chip) -> str:
  return 'GPU' if chip.gpu else 'chip'


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
  _, devices = topology_devices(topology)
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
    guess = max(high, low + int((a['usable_hbm_bytes'] - a['total_bytes']) / per_example))
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


def print_table(report: dict[str, Any], by_op: int = 0, top_kernels: int = 0) -> None:
  """The report as aligned rows; `by_op` > 0 adds that many groups of collectives by op,
  `top_kernels` > 0 that many groups of a GPU step's kernels by op."""
  unit = 'GPU' if report['platform'] == 'gpu' else 'chip'
  kernels = {**dict.fromkeys(('flash', 'triton'), f"{report['pallas_kernels']} Pallas calls"),
             'cudnn': f"{report['cudnn_attention_calls']} cuDNN calls"}
  attention = report['attention'] + (f" ({kernels[report['attention']]})"
                                     if report['attention'] in kernels else '')
  usable = ('' if report['usable_hbm_bytes'] == report['hbm_bytes'] else
            f" (JAX takes {report['usable_hbm_bytes'] / report['hbm_bytes']:.0%})")
  rows = [
      ('topology', f"{report['topology']}: {report['devices']} x {report['device_kind']}, "
                   f"{report['hosts']} hosts, mesh {report['mesh']}"),
      ('batch', f"{report['batch_size']} ({report['per_device_batch']} per data shard) x "
                f"{report['seq_len']} tokens, {report['dtype']}, attention {attention}"),
      (f'params per {unit}', f"{_gib(report['param_bytes'])} of "
                             f"{_gib(report['param_bytes_unsharded'])}"),
      (f'memory per {unit}', f"state {_gib(report['state_bytes'])} + temporaries "
                             f"{_gib(report['temp_bytes'])} -> {_gib(report['total_bytes'])} of "
                             f"{_gib(report['usable_hbm_bytes'])}{usable}: FITS"),
      ('step (estimate)', f"{report['step_seconds'] * 1e3:.1f} ms = compute "
                          f"{report['compute_seconds'] * 1e3:.1f} ({report['step_seconds_source']})"
                          f" + collectives {report['collective_seconds'] * 1e3:.1f}; MFU "
                          + ('estimate ' if report['mfu_bound_is'] == 'an estimate' else 'bound ')
                          + f"{report['mfu_bound']:.2f} ({report['mfu_bound_overlapped']:.2f} if "
                          'they overlapped)'),
      *([('compute (estimate)', ' + '.join(
          f'{kind} {seconds * 1e3:.1f}'
          for kind, seconds in report['compute_seconds_by_kind'].items() if seconds) + ' ms')]
        if report['compute_seconds_by_kind'] else []),
      ('feed per host', f"{report['examples_per_sec_per_host']:.0f} examples/s (estimate)"
                        + (f"; measured here: {report['input_examples_per_sec']:.0f} with "
                           f"{report['input_workers']} workers, "
                           f"{report['input_examples_per_sec_per_worker']:.0f} per worker -> "
                           f"{report['input_workers_needed']} workers per host for a 2x margin"
                           if 'input_examples_per_sec' in report else '')),
      ('compile', f"{report['compile_seconds']} s"),
  ]
  rows += [(kind, f"{c['count']} ops, {_gib(c['bytes'])}, {c['seconds'] * 1e3:.1f} ms (est.)"
                  + (f" ({_gib(c['network_bytes'])} across nodes)" if c['network_bytes'] else ''))
           for kind, c in report['collectives'].items() if c['count']]
  rows += [('  ' + c['kind'], f"{c['count']} ops, {c['bytes'] / 2 ** 20:.1f} MiB: {c['op']}")
           for c in report['collectives_by_op'][:by_op]]
  rows += [(f"  {k['kind']} {k['seconds'] * 1e3:.2f} ms (est.)",
            f"{k['count']} kernels, {k['bytes'] / 2 ** 30:.2f} GiB: {k['op']}")
           for k in report.get('kernels_by_op', [])[:top_kernels]]
  if report['replicated_params']:
    rows.append(('unsharded params', ', '.join(report['replicated_params'])))
  if report['compiler_options']:
    rows.append(('XLA options', ', '.join(f'{k}={v}' for k, v in
                                         report['compiler_options'].items())))
  width = max(len(name) for name, _ in rows)
  for name, value in rows:
    print(f'{name:<{width}}  {value}')


FLAGS = flags.FLAGS


def main(argv):
  del argv
  # JAX itself runs on this CPU; the topologies' devices are compile-only (the CUDA plugin
  # would otherwise look for a GPU to run on).
  jax.config.update('jax_platforms', 'cpu')
  # Its programs are for compile-only devices: with JAX_COMPILATION_CACHE_DIR set, jax writes
  # them to the cache but cannot read them back without a client of those devices, so every
  # later run warned and compiled again. Before the first compile, which fixes the choice.
  if 'jax_enable_compilation_cache' in jax.config.values:
    jax.config.update('jax_enable_compilation_cache', False)
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  config = cli.loaded_config('aot.py')
  try:
    chosen, count = trainer.phases.chosen(config, FLAGS.phase), len(trainer.phases.of(config))
  except ValueError as e:
    raise SystemExit(f'aot.py: {e}')
  for phase in chosen:
    if count > 1:
      print(f'== {phase.describe(count)}')
    report = phase_report(phase.config)
    report['phase'] = phase.index + 1
    print_table(report, FLAGS.collectives_by_op, FLAGS.kernels)
    print(json.dumps(report), flush=True)


def phase_report(config) -> dict[str, Any]:
  """The report of one phase's step (its config), with --find_max_batch and --input_rate."""
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
    # Per worker, with the config's workers (at least one) on this host's cores.
    report.update(bench.input_rate(config, workers=max(1, config.data.get('workers', 0))))
    report['input_workers_needed'] = math.ceil(
        2 * report['examples_per_sec_per_host'] / report['input_examples_per_sec_per_worker'])
  return report


if __name__ == '__main__':
  os.environ.update(QUIET_LIBTPU)
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.', lock_config=True)
  flags.DEFINE_string('topology', 'v4:2x2x1', 'TPU slice, GENERATION:GRID (v4, v5e, v5p, v6e), '
                      'or NVIDIA GPU nodes, GPU:NODESxGPUS or GPU:GPUS (a100, h100, h200).')
  flags.DEFINE_integer('phase', 0, 'The phase of the run (data.later_phases) to compile, from '
                       '1; 0 compiles each.')
  flags.DEFINE_integer('collectives_by_op', 0, "List the step's N largest groups of collectives "
                       '(up to 20) by the operation that made them (the HLO op_name) and pass.')
  flags.DEFINE_integer('kernels', 0, "GPUs: list the step's N largest groups of kernels (up to "
                       '30) by estimated time, with the operation that made them (the HLO op_name).')
  flags.DEFINE_bool('find_max_batch', False, 'Search the largest per-device batch that fits.')
  flags.DEFINE_bool('input_rate', False, "Measure the input pipeline's examples/s on this host "
                    '(data.workers processes, at least 1) and the workers a host needs.')
  flags.DEFINE_bool('unroll_estimate', True, 'On TPU with scanned layers, two more compiles (depth '
                    '1 and 2, unscanned) so that the step-time estimate counts every layer.')
  flags.mark_flag_as_required('config')
  app.run(main, flags_parser=cli.parse_flags)
