"""On this CPU: the PTX that XLA makes of our attention kernels (models/flash_dropout.py) for one
H100, counted by kind of instruction inside the kernels' loops (one key or query tile each).

    python peers/flash_dropout_ptx.py            # BERT-base's and GPT-1's attention, dropout 0.1
    python peers/flash_dropout_ptx.py --rate=0   # the same without dropout

aot.py's estimate costs a Pallas kernel by its FLOPs and bytes, as cuDNN's attention, so it does
not see the per-element work that runs beside the tensor cores: the scores' masking, the online
softmax, and the dropout mask's hash. At head size 64 that work, not the matrix products, bounds
the kernels (docs/benchmarks.md), and a GPU's profile is not always at hand; the count of a loop's
instructions is a measure of it that this machine can take. It is a count of PTX, before ptxas
(which fuses some shifts and logic ops into one instruction), and of one pass of each loop body,
not a time.

Prints one JSON line per kernel: the case, the kernel, and counts by kind in its loops and whole.
"""

import collections
import json
import os
import re
import sys
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aot  # noqa: E402  pylint: disable=wrong-import-position
from models import flash_dropout  # noqa: E402  pylint: disable=wrong-import-position

# name: (batch, length, heads, head size, causal): BERT-base's and GPT-1's attention.
CASES = {'bert_base_256x128': (256, 128, 12, 64, False), 'gpt1_64x512': (64, 512, 12, 64, True)}

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
  """(line number, opcode) of each instruction, its predicate dropped."""
  found = []
  for number, line in enumerate(ptx.splitlines()):
    m = re.match(r'\s+(?:@!?%p\d+\s+)?([a-z][\w.]*)', line)
    if m and not line.lstrip().startswith(('.', '//')):
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


def compile_case(name: str, devices, rate: float, dump: str) -> dict[str, dict]:
  """Compiles the gradient of one attention call; returns {kernel name: counts}."""
  B, L, H, K, causal = CASES[name]
  before = set(os.listdir(dump))

  def loss(q, k, v, ids, keys):
    return jnp.sum(flash_dropout.attention(q, k, v, ids, ids, keys, rate, causal).astype(
        jnp.float32))

  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  args = [jax.ShapeDtypeStruct((B, L, H, K), jnp.bfloat16, sharding=sharding)] * 3
  args += [jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=sharding),
           jax.ShapeDtypeStruct((B, H), jnp.uint32, sharding=sharding)]
  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  kernels = {}
  for file in sorted(set(os.listdir(dump)) - before):
    if file.endswith('.ptx'):
      ptx = open(os.path.join(dump, file), encoding='utf-8').read()
      entry = re.search(r'\.entry\s+(flash_dropout_\w+)', ptx)
      if entry:
        kernels[entry.group(1)] = count(ptx)
  if not kernels:
    raise SystemExit(f'{name}: no flash_dropout kernel in the PTX XLA wrote to {dump}')
  return kernels


def main(argv):
  del argv
  dump = dump_to_new_folder()
  _, devices = aot.topology_devices(flags.FLAGS.topology)
  for name in CASES:
    for kernel, counts in compile_case(name, devices, flags.FLAGS.rate, dump).items():
      print(json.dumps({'case': name, 'kernel': kernel, 'rate': flags.FLAGS.rate,
                        'topology': flags.FLAGS.topology, **counts}))


if __name__ == '__main__':
  flags.DEFINE_float('rate', 0.1, 'The attention dropout rate.')
  flags.DEFINE_string('topology', 'h100:1', "aot.py's name of the GPU to compile for.")
  app.run(main)
