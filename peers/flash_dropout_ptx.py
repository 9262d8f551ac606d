"""On this CPU: the PTX that XLA makes of our attention kernels (models/flash_dropout.py) for one
H100, counted by kind of instruction inside the kernels' loops (one key or query tile each), and
what ptxas makes of it: registers a thread, spills, so how many of the kernel's blocks an SM
holds at once, and the machine code (SASS) itself, counted by opcode in the loops.

    python peers/flash_dropout_ptx.py              # BERT-base's and GPT-1's attention, dropout 0.1
    python peers/flash_dropout_ptx.py --rate=0     # the same without dropout
    python peers/flash_dropout_ptx.py --variants   # at each of flash_dropout_gpu.py's VARIANTS

Without --variants, at flash_dropout's own settings and at flash_dropout_gpu.py's CANDIDATE (the
opt-in inline PTX exponentials, which a GPU's check has yet to make the default).

aot.py's estimate costs a Pallas kernel by its FLOPs and bytes, as cuDNN's attention, so it does
not see the per-element work that runs beside the tensor cores: the scores' masking, the online
softmax, and the dropout mask's hash. At head size 64 that work, not the matrix products, bounds
the kernels (docs/benchmarks.md), and a GPU's profile is not always at hand; the count of a loop's
instructions is a measure of it that this machine can take. It is a count of PTX, before ptxas
(which fuses some shifts and logic ops into one instruction), and of one pass of each loop body,
not a time.

ptxas (the CUDA plugin's, requirements-gpu.txt) assembles each kernel's PTX for the GPU's
architecture and says how many registers a thread takes and how many bytes it spills to local
memory; XLA's thunk sequence gives the launch (grid, threads, dynamic shared memory). With the
GPU's limits (XLA's target config: registers and shared memory of an SM, its threads), that gives
the blocks an SM holds at once, what limits them, and the waves of blocks a launch takes. These
are the assembler's and the launch's figures, before any run. nvdisasm (requirements-dev.txt)
lists the machine code ptxas made, what the SM issues: `sass_count` counts its loops.

Prints one JSON line per kernel: the case, the kernel, counts by kind in its loops and whole,
and `assembled`.
"""

import collections
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aot  # noqa: E402  pylint: disable=wrong-import-position
from models import flash_dropout  # noqa: E402  pylint: disable=wrong-import-position
import flash_dropout_gpu  # noqa: E402  pylint: disable=wrong-import-position (VARIANTS)

# name: (batch, length, heads, head size, causal, fused): BERT-base's and GPT-1's attention as
# the models call it (a self-attention's q, k and v one array: flash_dropout.self_attention),
# and BERT-base's as three arrays (flash_dropout.attention, as a cross attention's).
CASES = {'bert_base_256x128': (256, 128, 12, 64, False, True),
         'gpt1_64x512': (64, 512, 12, 64, True, True),
         'bert_base_256x128_three_arrays': (256, 128, 12, 64, False, False)}

# Kinds by the PTX opcode's first word (its type suffixes dropped).
KINDS = {
    'tensor core': ('wgmma', 'mma'),
    'integer multiply': ('mul.lo', 'mul.hi', 'mad.lo', 'mul.wide', 'mad.wide'),
    'integer logic and shift': ('xor', 'shr', 'shl', 'and', 'or', 'not', 'lop3', 'shf'),
    'float arithmetic': ('add.rn', 'sub.rn', 'mul.rn', 'fma.rn', 'max', 'min', 'div', 'neg',
                         'add.f', 'sub.f', 'mul.f', 'fma.f', 'abs'),
    'exp and log': ('ex2', 'lg2'),
    'compare and select': ('setp', 'selp', 'set.'),
    'conversion': ('cvt',),
    'memory': ('ld', 'st', 'cp.async', 'ldmatrix', 'stmatrix', 'shfl', 'bar', 'fence'),
}


def kind(opcode: str) -> str:
  for name, prefixes in KINDS.items():
    if any(opcode.startswith(p) for p in prefixes):
      return name
  return 'other (moves, address arithmetic, branches)'


def instructions(ptx: str) -> list[tuple[int, str]]:
  """(line number, opcode) of each instruction, its predicate dropped; inline assembly's
  `{ .reg ...; a ...; b ...; }` lines give each of theirs."""
  found = []
  for number, line in enumerate(ptx.splitlines()):
    if line.lstrip().startswith('//'):
      continue
    for statement in line.strip().strip('{}').split(';'):
      m = re.match(r'\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)', statement)
      if m and not statement.lstrip().startswith('.'):
        found.append((number, m.group(1)))
  return found


def loop_lines(ptx: str) -> set[int]:
  """The lines inside loops: from a label to a branch back to it."""
  lines = ptx.splitlines()
  labels = {m.group(1): n for n, line in enumerate(lines) if (m := re.match(r'(\$\w+):', line))}
  inside = set()
  for n, line in enumerate(lines):
    m = re.search(r'\bbra(?:\.uni)?\s+(\$\w+);', line)
    if m and labels.get(m.group(1), n + 1) < n:
      inside.update(range(labels[m.group(1)], n + 1))
  return inside


def count(ptx: str) -> dict:
  loops, all_kinds, in_loops = loop_lines(ptx), collections.Counter(), collections.Counter()
  for number, opcode in instructions(ptx):
    all_kinds[kind(opcode)] += 1
    if number in loops:
      in_loops[kind(opcode)] += 1
  return {'in_loops': dict(in_loops.most_common()), 'in_loops_total': sum(in_loops.values()),
          'total': sum(all_kinds.values()), 'whole': dict(all_kinds.most_common())}


def dump_to_new_folder() -> str:
  """Before jax's backends start (the first compile): XLA is to write what it compiles, PTX
  included, into a new folder, on this CPU."""
  folder = tempfile.mkdtemp(prefix='flash_dropout_ptx_')
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --xla_dump_to={folder}'.strip()
  return folder


def ptxas() -> str | None:
  """The CUDA plugin's ptxas (the nvidia-cuda-nvcc wheel), else one on the PATH."""
  try:
    from nvidia import cuda_nvcc  # pylint: disable=g-import-not-at-top
    for folder in cuda_nvcc.__path__:
      if os.path.exists(os.path.join(folder, 'bin', 'ptxas')):
        return os.path.join(folder, 'bin', 'ptxas')
  except ImportError:
    pass
  return shutil.which('ptxas')


def nvdisasm() -> str | None:
  """NVIDIA's disassembler (the nvidia-cuda-nvdisasm wheel of requirements-dev.txt), else one on
  the PATH."""
  spec = importlib.util.find_spec('nvidia')
  folders = (spec.submodule_search_locations or []) if spec else []
  for folder in folders:  # nvidia/cu13/bin/nvdisasm
    for found in sorted(glob.glob(os.path.join(folder, '*', 'bin', 'nvdisasm'))):
      return found
  return shutil.which('nvdisasm')


def sass_count(sass: str) -> dict:
  """nvdisasm's listing of one kernel: its machine instructions inside loops (from a label to a
  branch back to it), by opcode, and the spills among them (local memory: STL, LDL). What the
  SM issues, one a warp each: ptxas fuses and drops PTX's, and adds its own. `in_loops_fewest`:
  the fewest a pass of the loops can issue, without the code that a forward branch inside them
  skips (a tile whose every query sees every key skips its masking: flash_dropout._Visible)."""
  addresses, labels, pending = [], {}, []
  for line in sass.splitlines():
    label = re.match(r'\s*\.(L_x_\d+):', line)
    if label:
      pending.append(label.group(1))
      continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)[^;]*;', line)
    if m:
      address = int(m.group(1), 16)
      labels.update((name, address) for name in pending)
      pending = []
      branch = re.search(r'BRA\b.*`\(\.(L_x_\d+)\)', line)
      addresses.append((address, m.group(2), branch.group(1) if branch else None))
  loops = [(labels[target], address) for address, _, target in addresses
           if target in labels and labels[target] < address]
  in_loop = lambda address: any(start <= address <= end for start, end in loops)  # noqa: E731
  skips = [(address, labels[target]) for address, _, target in addresses
           if target in labels and labels[target] > address and in_loop(address)
           and in_loop(labels[target])]
  inside = collections.Counter(opcode for address, opcode, _ in addresses if in_loop(address))
  skipped = sum(1 for address, _, _ in addresses
                if in_loop(address) and any(start < address < end for start, end in skips))
  return {'in_loops_total': sum(inside.values()), 'total': len(addresses),
          'in_loops_fewest': sum(inside.values()) - skipped,
          'spills_in_loops': inside['STL'] + inside['LDL'],
          'in_loops': dict(inside.most_common())}


def device_limits(config: str) -> dict[str, int]:
  """The numbers of XLA's GPU target config (gpu_device_info), by name."""
  return {k: int(v) for k, v in re.findall(r'^\s*(\w+): (\d+)$', config, re.M)}


def launch(thunks: str, kernel: str) -> dict[str, int]:
  """The kernel's grid, threads and dynamic shared memory, from XLA's thunk sequence."""
  m = re.search(rf'\b{kernel} grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]'
                r'\s+shared_memory: (\d+) bytes', thunks)
  if not m:
    raise ValueError(f'no launch of {kernel} in the thunk sequence')
  n = [int(x) for x in m.groups()]
  return {'blocks': n[0] * n[1] * n[2], 'threads': n[3] * n[4] * n[5], 'shared_bytes': n[6]}


def ptxas_report(text: str) -> dict[str, int]:
  """Registers a thread and the spills of `ptxas -v`'s report of one kernel."""
  figures = {'registers': r'Used (\d+) registers',
             'spill_store_bytes': r'(\d+) bytes spill stores',
             'spill_load_bytes': r'(\d+) bytes spill loads',
             'stack_bytes': r'(\d+) bytes stack frame'}
  found = {name: re.search(pattern, text) for name, pattern in figures.items()}
  if not found['registers']:
    raise ValueError(f'no register count in ptxas\'s report: {text[-300:]}')
  return {name: int(m.group(1)) if m else 0 for name, m in found.items()}


def residency(registers: int, threads: int, shared_bytes: int, limits: dict[str, int]) -> dict:
  """How many blocks of a kernel an SM holds at once, and what limits them. Registers go to
  warps in units of 256; each block's shared memory takes 1 KiB more that CUDA reserves (sm_80
  on); an SM holds at most 32 blocks."""
  warps = math.ceil(threads / limits['threads_per_warp'])
  warp_registers = math.ceil(registers * limits['threads_per_warp'] / 256) * 256
  by = {'registers': limits['registers_per_core_limit'] // warp_registers // warps,
        'shared memory': limits['shared_memory_per_core'] // (shared_bytes + 1024),
        'threads': limits['threads_per_core_limit'] // threads, 'blocks': 32}
  blocks = min(by.values())
  return {'blocks_per_sm': blocks, 'limited_by': [k for k, v in by.items() if v == blocks],
          'warps_per_sm': blocks * warps}


def assemble(ptx_path: str, kernel: str, thunks: str, limits: dict[str, int]) -> dict:
  """ptxas's figures for one kernel's PTX, with its launch and what an SM holds of it."""
  tool = ptxas()
  if tool is None:
    return {'ptxas': 'not found: pip install -r requirements-gpu.txt'}
  ptx = open(ptx_path, encoding='utf-8').read()
  target = re.search(r'^\.target\s+(\w+)', ptx, re.M).group(1)
  cubin = ptx_path[:-len('.ptx')] + '.cubin'
  done = subprocess.run([tool, '-v', '--gpu-name', target, ptx_path, '-o', cubin],
                        capture_output=True, text=True, check=True)
  figures = ptxas_report(done.stdout + done.stderr)
  shape = launch(thunks, kernel)
  held = residency(figures['registers'], shape['threads'], shape['shared_bytes'], limits)
  waves = shape['blocks'] / (limits['core_count'] * held['blocks_per_sm'])
  disassembler = nvdisasm()
  if disassembler is None:
    sass = {'nvdisasm': 'not found: pip install -r requirements-dev.txt'}
  else:
    sass = sass_count(subprocess.run([disassembler, '-c', cubin], capture_output=True,
                                     text=True, check=True).stdout)
  return {**figures, **shape, **held, 'waves': round(waves, 2), 'target': target, 'sass': sass}


def compile_case(name: str, devices, rate: float, dump: str) -> dict[str, dict]:
  """Compiles the gradient of one attention call; returns {kernel name: counts}."""
  B, L, H, K, causal, fused = CASES[name]
  before = set(os.listdir(dump))

  def loss(qkv, ids, keys):
    if fused:
      out = flash_dropout.self_attention(qkv, ids, ids, keys, rate, causal)
    else:
      out = flash_dropout.attention(*qkv, ids, ids, keys, rate, causal)
    return jnp.sum(out.astype(jnp.float32))

  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  qkv = (jax.ShapeDtypeStruct((B, L, 3, H, K), jnp.bfloat16, sharding=sharding) if fused else
         [jax.ShapeDtypeStruct((B, L, H, K), jnp.bfloat16, sharding=sharding)] * 3)
  # Under a mesh of the GPU: jax 0.11's Pallas takes the GPU it lowers for from the mesh's
  # devices (on this CPU, no other device is one).
  with jax.set_mesh(jax.sharding.Mesh(np.array(devices[:1]), ('x',))):
    jax.jit(jax.grad(loss)).lower(qkv, jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sharding),
                                  jax.ShapeDtypeStruct((B, H), jnp.uint32, sharding=sharding)
                                  ).compile()
  kernels = {}
  for file in sorted(set(os.listdir(dump)) - before):
    if file.endswith('.ptx'):
      path = os.path.join(dump, file)
      ptx = open(path, encoding='utf-8').read()
      entry = re.search(r'\.entry\s+(flash_dropout_\w+)', ptx)
      if entry:
        module = os.path.join(dump, file.rsplit('.', 2)[0])  # module_0001.jit_loss
        thunks = open(module + '.thunk_sequence.txt', encoding='utf-8').read()
        limits = device_limits(open(module + '.gpu_target_config.pbtxt', encoding='utf-8').read())
        kernels[entry.group(1)] = {**count(ptx),
                                   'assembled': assemble(path, entry.group(1), thunks, limits)}
  if not kernels:
    raise SystemExit(f'{name}: no flash_dropout kernel in the PTX XLA wrote to {dump}')
  return kernels


def main(argv):
  del argv
  dump = dump_to_new_folder()
  _, devices = aot.topology_devices(flags.FLAGS.topology)
  chosen = (flash_dropout_gpu.VARIANTS if flags.FLAGS.variants else
            dict.fromkeys([flash_dropout_gpu.OWN, flash_dropout_gpu.CANDIDATE]))
  for variant in chosen:
    with flash_dropout_gpu.configured(*variant) as variant_name:
      for name in CASES:
        for kernel, counts in compile_case(name, devices, flags.FLAGS.rate, dump).items():
          print(json.dumps({'case': name, 'kernel': kernel, 'rate': flags.FLAGS.rate,
                            'variant': variant_name, 'topology': flags.FLAGS.topology,
                            **counts}), flush=True)


if __name__ == '__main__':
  flags.DEFINE_float('rate', 0.1, 'The attention dropout rate.')
  flags.DEFINE_string('topology', 'h100:1', "aot.py's name of the GPU to compile for.")
  flags.DEFINE_bool('variants', False,
                    "Each of flash_dropout_gpu.py's VARIANTS, not only the first two.")
  app.run(main)
