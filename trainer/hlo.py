"""What a compiled step does, read from its HLO text: the instructions that run (loop bodies
counted by their trips), the kernels with their FLOPs and the HBM bytes they move, and the
collectives with their bytes and, on given links, their seconds.

aot.py reads the HLO of steps compiled for TPU slices and GPU nodes with these; bench.py and
the tests read a CPU step's. It is text, not XLA's own analysis: XLA gives no cost analysis for
GPUs, and its TPU one does not split the time by kernel.
"""

import dataclasses
import math
import re
from typing import Any

import numpy as np

COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
_SHAPE_RE = re.compile(r'\b([a-z]+[0-9]*)\[([0-9,]*)\]')
_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4,
          's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
# Bytes each device sends per byte of the collective's result, over a group of n (a ring, as
# NCCL's bus bandwidth counts it): a reduce-scatter's result is one device's share.
_SENT_PER_RESULT_BYTE = {
    'all-reduce': lambda n: 2 * (n - 1) / n, 'all-gather': lambda n: (n - 1) / n,
    'reduce-scatter': lambda n: n - 1, 'all-to-all': lambda n: (n - 1) / n,
    'collective-permute': lambda n: 1.0}



_INSTRUCTION_RE = re.compile(r'^\s*(?:ROOT )?%?([\w.-]+) = (.+?) ([a-z][\w-]*)\((.*)$')
_HEADER_RE = re.compile(r'^(ENTRY )?%?([\w.-]+) \(.*\{\s*$')
_TRIPS_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Bookkeeping: no data moves (or it is counted where the data is made or used).
_NO_TRAFFIC = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while', 'call',
               'conditional', 'after-all', 'partition-id', 'replica-id', 'opt-barrier'}


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """The lines of each computation of HLO text, and the entry's name (text without
  computations is one)."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER_RE.match(line)
    if header and current is None:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith('}'):
      current = None
    elif current is not None:
      computations[current].append(line)
  if entry is None:
    return {'entry': hlo_text.splitlines()}, 'entry'
  return computations, entry


def hlo_instructions(hlo_text: str) -> list[tuple[str, str, str, str, int]]:
  """(name, result shape, opcode, operands and attributes, times run) of the instructions that
  run, from compiled HLO text: the entry computation's, and a loop body's as many times as its
  trip count (XLA's known_trip_count, nested loops multiplied; once where unknown); fused
  computations are not entered."""
  return _instructions(*_computations(hlo_text))


def _instructions(computations: dict[str, list[str]], entry: str
                  ) -> list[tuple[str, str, str, str, int]]:
  found = []

  def visit(name: str, times: int) -> None:
    for line in computations.get(name, []):
      match = _INSTRUCTION_RE.match(line)
      if not match:
        continue
      found.append(match.groups() + (times,))
      called = re.search(r'body=%?([\w.-]+)', line) if match.group(3) == 'while' else (
          re.search(r'(?:calls|to_apply)=%?([\w.-]+)', line)
          if match.group(3) in ('call', 'async-start')
          else None)
      if called:
        visit(called.group(1), times * (_trip_count(line, computations)
                                        if match.group(3) == 'while' else 1))

  visit(entry, 1)
  return found


def _trip_count(while_line: str, computations: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's known_trip_count (GPU), else the one integer constant
  its condition compares the counter with (scan and fori_loop count from 0), else 1."""
  known = _TRIPS_RE.search(while_line)
  if known:
    return int(known.group(1))
  condition = re.search(r'condition=%?([\w.-]+)', while_line)
  bounds = [int(n) for line in computations.get(condition.group(1) if condition else '', [])
            for n in re.findall(r'= s32\[\][^ ]* constant\((\d+)\)', line)]
  return bounds[0] if len(bounds) == 1 else 1


def _shape_bytes(shapes: str) -> list[int]:
  return [_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(',') if d)
          for dtype, dims in _SHAPE_RE.findall(shapes)]


def _operands(arguments: str) -> list[str]:
  """The %names inside an instruction's parentheses (its attributes follow them)."""
  depth = 1
  for i, c in enumerate(arguments):
    depth += (c == '(') - (c == ')')
    if not depth:
      return re.findall(r'%([\w.-]+)', arguments[:i])
  return re.findall(r'%([\w.-]+)', arguments)


_SLICING = ('dynamic-slice', 'slice', 'gather')


def _fusion_traffic(lines: list[str]) -> tuple[dict[int, int], int | None]:
  """What a fused computation reads of each parameter it only slices (or updates in place), by
  parameter number, and what it writes if its root updates slices in place (else None)."""
  ops, numbers, root = [], {}, None
  for line in lines:
    match = _INSTRUCTION_RE.match(line)
    if match:
      name, shape, opcode, arguments = match.groups()
      ops.append((name, sum(_shape_bytes(shape)), opcode, _operands(arguments)))
      if opcode == 'parameter':
        numbers[name] = int(re.match(r'\d+', arguments).group())
      if line.lstrip().startswith('ROOT'):
        root = ops[-1]
  sizes = {name: size for name, size, *_ in ops}
  reads = {}
  for parameter, number in numbers.items():
    uses = [(name, opcode, operands) for name, _, opcode, operands in ops if parameter in operands]
    if uses and all(operands[0] == parameter and opcode in _SLICING + ('dynamic-update-slice',)
                    for _, opcode, operands in uses):
      reads[number] = sum(sizes[name] for name, opcode, _ in uses if opcode in _SLICING)
  members = ([op for op in ops if op[0] in root[3]] if root and root[2] == 'tuple' else
             [root] if root else [])
  if not any(opcode == 'dynamic-update-slice' for _, _, opcode, _ in members):
    return reads, None
  return reads, sum(sizes.get(operands[1], 0) if opcode == 'dynamic-update-slice' else size
                    for _, size, opcode, operands in members)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One op of a compiled GPU step that runs as a kernel (a fusion, a library call, a lone op)."""
  name: str
  kind: str  # 'matmul' (a dot: tensor cores), 'attention' (cuDNN's, ours), 'collective' or 'vector'
  flops: float  # matmul and attention: the dots' FLOPs; vector: one per element of each op
  bytes: float  # read and written, as hlo_bytes counts them
  times: int  # runs per step: a loop body's as many as its trips
  op_name: str = ''  # the jax operation that made it (the HLO metadata's op_name)


# Ops in a fused computation that compute nothing per element (they move or name data).
_NO_FLOPS = _NO_TRAFFIC | {'bitcast-convert', 'broadcast', 'concatenate', 'copy', 'dynamic-slice',
                           'dynamic-update-slice', 'gather', 'iota', 'pad', 'reshape', 'reverse',
                           'slice', 'transpose'}


def _dims(shape: str) -> list[int]:
  found = _SHAPE_RE.search(shape)
  return [int(d) for d in found.group(2).split(',') if d] if found else []


def _dot_flops(shape: str, arguments: str, lhs_shape: str) -> float:
  """2 x the result's elements x the contracted size, from a dot's (or a cuBLAS call's) HLO."""
  contracting = (re.search(r'lhs_contracting_dims=\{([\d,]*)\}', arguments) or
                 re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', arguments))
  lhs = _dims(lhs_shape)
  size = math.prod(lhs[int(d)] for d in re.findall(r'\d+', contracting.group(1))
                   ) if contracting else 1
  return 2.0 * math.prod(_dims(shape)) * size


def _conv_flops(target: str, result: str, arguments: str, operands: list[str]) -> float:
  """A cuDNN convolution's: 2 x the forward output's elements x the kernel's elements per
  output feature (each output element sums kernel width x input features / groups products),
  the same for its input's and its filter's gradient. dim_labels name the forward's layouts
  (b0f_o0i->b0f: the kernel's 'o' is its output features); the forward's output is the call's
  result, the input gradient's first operand (dy), the filter gradient's second."""
  labels = re.search(r'dim_labels=\w+_(\w+)->', arguments)
  if not labels or len(operands) < 2:
    return 0.0
  if 'BackwardFilter' in target:
    output, kernel = operands[1], result
  elif 'BackwardInput' in target:
    output, kernel = operands[0], operands[1]
  else:
    output, kernel = result, operands[1]
  kernel_dims = _dims(kernel)
  if 'o' not in labels.group(1) or len(kernel_dims) != len(labels.group(1)):
    return 0.0
  per_output = math.prod(kernel_dims) / kernel_dims[labels.group(1).index('o')]
  return 2.0 * math.prod(_dims(output)) * per_output


def _attention_flops(target: str, arguments: str) -> float:
  """cuDNN's fused attention: two matmuls of B x H x L x S x K forward; the backward pass
  recomputes the scores and makes four products (dQ, dK, dV and the probabilities')."""
  scores = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*'
                     r'"dimensions":\s*\[([\d", ]+)\]', arguments)
  query = re.search(r'operand_layout_constraints=\{\w+\[([\d,]+)\]', arguments)
  if not scores or not query:
    return 0.0
  size = math.prod(int(d) for d in re.findall(r'\d+', scores.group(1)))
  return (10 if 'Backward' in target else 4) * size * int(query.group(1).split(',')[-1])


def _fused_flops(computations: dict[str, list[str]], name: str,
                 memo: dict[str, tuple[float, float]]) -> tuple[float, float]:
  """(dot FLOPs, other FLOPs) of a fused computation, nested fusions included."""
  if name not in memo:
    dots = others = 0.0
    shapes: dict[str, str] = {}
    for line in computations.get(name, []):
      match = _INSTRUCTION_RE.match(line)
      if not match:
        continue
      instruction, shape, opcode, arguments = match.groups()
      shapes[instruction] = shape
      if opcode == 'dot':
        dots += _dot_flops(shape, arguments, shapes.get(_operands(arguments)[0], ''))
      elif opcode in ('fusion', 'call'):
        called = re.search(r'(?:calls|to_apply)=%?([\w.-]+)', arguments)
        nested = _fused_flops(computations, called.group(1), memo) if called else (0.0, 0.0)
        dots, others = dots + nested[0], others + nested[1]
      elif opcode == 'reduce':
        others += math.prod(_dims(shapes.get(_operands(arguments)[0], shape)))
      elif opcode not in _NO_FLOPS:
        others += math.prod(_dims(shape))
    memo[name] = (dots, others)
  return memo[name]


def hlo_kernels(hlo_text: str) -> list[Kernel]:
  """The ops a step runs, from compiled HLO text, each with its FLOPs and the HBM bytes it moves:
  it reads its operands and writes its result once, no cache reuse, except what is sliced (only
  the slice is read) or updated in place (only the update is written); loop bodies count their
  trips."""
  computations, entry = _computations(hlo_text)
  instructions = _instructions(computations, entry)
  shapes = {name: shape for name, shape, *_ in instructions}
  sizes = {name: sum(_shape_bytes(shape)) for name, shape in shapes.items()}
  fusions: dict[str, tuple[dict[int, int], int | None]] = {}
  flops_memo: dict[str, tuple[float, float]] = {}
  kernels = []
  for name, shape, opcode, arguments, times in instructions:
    if opcode in _NO_TRAFFIC or opcode.endswith('-done'):
      continue
    operand_names = _operands(arguments)
    operands = [sizes.get(op, 0) for op in operand_names]
    written = sizes[name]
    kind, flops = 'vector', float(math.prod(_dims(shape)))
    if opcode in _SLICING:
      operands[0] = written
    elif opcode == 'dynamic-update-slice':
      operands[0], written = 0, operands[1]
    elif opcode == 'fusion':
      called = re.search(r'calls=%?([\w.-]+)', arguments)
      if called and called.group(1) not in fusions:
        fusions[called.group(1)] = _fusion_traffic(computations.get(called.group(1), []))
      reads, in_place = fusions[called.group(1)] if called else ({}, None)
      operands = [reads.get(i, size) for i, size in enumerate(operands)]
      written = written if in_place is None else in_place
      dots, others = _fused_flops(computations, called.group(1), flops_memo) if called else (0, 0)
      kind, flops = ('matmul', dots) if dots else ('vector', others)
    elif opcode == 'custom-call':
      target = re.search(r'custom_call_target="([^"]+)"', arguments)
      target = target.group(1) if target else ''
      if target.startswith('__cudnn$fmha'):
        kind, flops = 'attention', _attention_flops(target, arguments)
      # A Pallas kernel that declares its FLOPs in its metadata, {"flops": "N"} (HLO text quotes
      # it as \22 or \"): ours, models/flash_dropout.py.
      elif 'triton' in target and (declared := re.search(
          r'flops(?:\\22|\\?")\s*:\s*(?:\\22|\\?")(\d+)', arguments)):
        kind, flops = 'attention', float(declared.group(1))
      elif target.startswith('__cublas'):
        lhs = shapes.get(operand_names[0], '') if operand_names else ''
        kind, flops = 'matmul', _dot_flops(_top_level(shape)[0], arguments, lhs)
      elif target.startswith('__cudnn$conv'):
        kind, flops = 'matmul', _conv_flops(target, _top_level(shape)[0], arguments,
                                            [shapes.get(op, '') for op in operand_names])
      else:
        flops = 0.0
    elif opcode == 'dot':
      kind, flops = 'matmul', _dot_flops(shape, arguments, shapes.get(operand_names[0], ''))
    elif opcode.removesuffix('-start') in COLLECTIVES:
      kind = 'collective'
    op_name = re.search(r'op_name="([^"]*)"', arguments)
    kernels.append(Kernel(name, kind, flops, written + sum(operands), times,
                          op_name.group(1) if op_name else ''))
  return kernels


def hlo_bytes(hlo_text: str) -> float:
  """HBM bytes a step moves, from compiled HLO (hlo_kernels' counts). It stands in for XLA's
  count where XLA gives none (GPUs)."""
  return sum(kernel.bytes * kernel.times for kernel in hlo_kernels(hlo_text))


def _replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective from the rest of its HLO line: explicit
  ({{0,1},{2,3}}), iota ([2,2]<=[4] or [2,2]<=[2,2]T(1,0)), over axes of a mesh of device ids
  (mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}), a permute's pairs, or
  all devices."""
  def iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(int(d) for d in dims.split(','))).reshape(
        [int(d) for d in dims.split(',')])
    return ids.transpose([int(p) for p in perm.split(',')]) if perm else ids

  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                   r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", attributes)
  if mesh:
    axes = re.findall(r"'([\w]+)'=(\d+)", mesh.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = (iota(mesh.group(2), mesh.group(3)) if mesh.group(2)
           else np.arange(math.prod(sizes))).reshape(sizes)
    grouped = [names.index(a) for a in re.findall(r"'([\w]+)'", mesh.group(4))]
    ids = ids.transpose([i for i in range(len(names)) if i not in grouped] + grouped)
    return ids.reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
  listed_iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?',
                          attributes)
  if listed_iota:
    groups, size, dims, perm = listed_iota.groups()
    return iota(dims, perm).reshape(int(groups), int(size)).tolist()
  listed = re.search(r'(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}',
                     attributes)
  groups = [[int(i) for i in g.split(',') if i]
            for g in re.findall(r'\{([\d,]*)\}', listed.group(1))] if listed else []
  return [g for g in groups if g] or [list(range(num_devices))]


def _top_level(shapes: str) -> list[str]:
  """The members of a tuple shape '(a, (b, c), d)' (a plain shape is its own one member)."""
  if not shapes.startswith('('):
    return [shapes]
  members, depth, start = [], 0, 1
  for i, c in enumerate(shapes):
    depth += (c in '([{') - (c in ')]}')
    if (c == ',' and depth == 1) or (c == ')' and depth == 0):
      members.append(shapes[start:i])
      start = i + 1
  return members


def _collective_ops(hlo_text: str) -> list[tuple[str, int, str, int]]:
  """(kind, result bytes, attributes, times run) of each collective a step runs."""
  found = []
  for _, shapes, opcode, attributes, times in hlo_instructions(hlo_text):
    kind = opcode.removesuffix('-start')
    if kind not in COLLECTIVES:
      continue
    # An async start's shape is (operands, results[, context]): the results are the data; an
    # all-reduce-start's is its results alone.
    if opcode.endswith('-start') and kind != 'all-reduce':
      shapes = _top_level(shapes)[1]
    found.append((kind, sum(_shape_bytes(shapes)), attributes, times))
  return found


def collectives(hlo_text: str, chip: Any = None, hosts: list[int] | None = None
                ) -> dict[str, dict[str, Any]]:
  """Count and result bytes of each collective that a step runs, from compiled HLO text (a loop
  body's as often as its trip count), and, given the chip and each device's host (in the
  mesh's device order, which the groups index), the seconds its bytes take on the links.

  A device of a group of n sends 2(n-1)/n of an all-reduce's bytes, (n-1)/n of an all-gather's
  or all-to-all's, n-1 times a reduce-scatter's share, a permute's whole: over the network
  where the group spans hosts of GPUs, over NVLink or ICI otherwise; peak bandwidths, no
  latency, collectives one after another (none overlapped with another or with compute).
  """
  found = {kind: {'count': 0, 'bytes': 0, 'seconds': 0.0, 'network_bytes': 0}
           for kind in COLLECTIVES}
  for kind, size, attributes, times in _collective_ops(hlo_text):
    found[kind]['count'] += times
    found[kind]['bytes'] += times * size
    if chip is None or hosts is None:
      continue
    groups = _replica_groups(attributes, len(hosts))
    n = len(groups[0])
    over_network = chip.network_bytes_per_sec > 0 and any(
        len({hosts[i] for i in group}) > 1 for group in groups)
    sent = size * _SENT_PER_RESULT_BYTE[kind](n) if n > 1 or kind == 'collective-permute' else 0
    found[kind]['seconds'] += times * sent / (chip.network_bytes_per_sec if over_network
                                              else chip.link_bytes_per_sec)
    found[kind]['network_bytes'] += times * size if over_network else 0
  return found


def collectives_by_op(hlo_text: str, top: int = 8) -> list[dict[str, Any]]:
  """The `top` groups of a step's collectives by result bytes: kind, the jax operation that made
  them (HLO op_name metadata, layer numbers folded into layer_N; 'backward' for the gradient's),
  count and result bytes. Which part of the model a collective serves, and in which pass."""
  groups: dict[tuple[str, str], list[int]] = {}
  for kind, size, attributes, times in _collective_ops(hlo_text):
    name = re.search(r'op_name="([^"]*)"', attributes)
    op = re.sub(r'layer_\d+', 'layer_N', name.group(1) if name else '?')
    op = ('backward ' if 'transpose(' in op else '') + re.sub(r'[\w.]*\(|\)', '', op.split(
        'jit(train_step)/', 1)[-1])
    group = groups.setdefault((kind, op), [0, 0])
    group[0] += times
    group[1] += times * size
  ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:top]
  return [{'kind': kind, 'op': op, 'count': count, 'bytes': size}
          for (kind, op), (count, size) in ranked]


def collective_seconds(found: dict[str, dict[str, Any]]) -> float:
  return sum(c['seconds'] for c in found.values())
