"""What every peer script shares: its flags, its timing loop and its one JSON line.

A peer script trains the same model at the same shapes as `bench.py` with
another library and prints one JSON line with at least `peer`,
`step_seconds` and `tokens_per_sec` (steady state, compile or first steps
excluded), so `peers/compare.py` can set it beside bench.py's line.
"""

import argparse
import json
import time
from typing import Any, Callable


def parse_flags(description: str, shapes: dict, variants: tuple = ('stock',),
                profile: bool = False) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument('--shape', choices=sorted(shapes), required=True,
                      help='the sizes of a bench.py config variant')
  parser.add_argument('--variant', choices=variants, default=variants[0])
  parser.add_argument('--batch_size', type=int, default=0, help='0: the shape\'s default')
  parser.add_argument('--seq_len', type=int, default=0, help='0: the shape\'s default')
  parser.add_argument('--steps', type=int, default=10, help='timed steps')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps first')
  parser.add_argument('--seed', type=int, default=0)
  if profile:
    parser.add_argument('--profile', default='', help='also trace 3 steps into this directory '
                        'and print bench.py\'s summary of the ops')
  args = parser.parse_args()
  if args.steps < 1 or args.warmup < 0:
    parser.error(f'--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0.')
  return args


def seconds_per_step(step: Callable[[], Any], steps: int, warmup: int,
                     wait: Callable[[Any], Any] = lambda out: out) -> tuple[float, Any]:
  """Mean wall seconds of `step()` over `steps` calls after `warmup` calls; and the last output.

  `wait(output)` blocks until an output is computed (JAX dispatches asynchronously).
  """
  out = None
  for _ in range(warmup):
    out = step()
  wait(out)
  start = time.perf_counter()
  for _ in range(steps):
    out = step()
  wait(out)
  return (time.perf_counter() - start) / steps, out


def report(peer: str, batch_size: int, seq_len: int, step_seconds: float, **fields) -> None:
  print(json.dumps({'peer': peer, 'batch_size': batch_size, 'seq_len': seq_len,
                    'step_seconds': round(step_seconds, 5),
                    'tokens_per_sec': round(batch_size * seq_len / step_seconds, 1), **fields}))
