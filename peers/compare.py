"""Runs bench.py and its peers alternately, N rounds, and prints this project's speed over theirs.

    python peers/compare.py --rounds=3
    python peers/compare.py --cases=bert_mini,gpt_base --rounds=5 --steps=5
    python peers/compare.py --also=/tmp/old   # and bench.py of another checkout, alongside

Each round runs every case's bench.py and peer scripts one after another (the
order reversed every other round), each in its own process at the same
shapes. A ratio is this project's tokens/s over a peer's in the same round;
the table gives the median over rounds, so drift between rounds cancels.
The HF Flax peers need transformers 4.57.6 in their own venv:

    python -m venv --system-site-packages peers/.venv-hf-flax
    peers/.venv-hf-flax/bin/pip install -r peers/requirements-hf-flax.txt

Without it those peers are left out, with a line that says so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_FLAX_PYTHON = os.path.join(ROOT, 'peers', '.venv-hf-flax', 'bin', 'python')

# name: (bench.py flags, [(python, peer script and flags)]); the same shapes on both sides.
CASES = {
    'bert_mini': (
        ['--config=configs/bert_base.py:mini', '--config.train.batch_size=32',
         '--config.data.max_seq_length=128'],
        [('python', ['peers/bert_torch.py', '--shape=mini', '--variant=gathered']),
         ('python', ['peers/bert_torch.py', '--shape=mini', '--variant=stock']),
         ('hf_flax', ['peers/bert_hf_flax.py', '--shape=mini', '--variant=gathered']),
         ('hf_flax', ['peers/bert_hf_flax.py', '--shape=mini', '--variant=stock'])]),
    'bert_base': (
        ['--config=configs/bert_base.py:base', '--config.train.batch_size=8',
         '--config.data.max_seq_length=128'],
        [('python', ['peers/bert_torch.py', '--shape=base', '--variant=gathered']),
         ('python', ['peers/bert_torch.py', '--shape=base', '--variant=stock']),
         ('hf_flax', ['peers/bert_hf_flax.py', '--shape=base', '--variant=gathered']),
         ('hf_flax', ['peers/bert_hf_flax.py', '--shape=base', '--variant=stock'])]),
    'gpt_base': (
        ['--config=configs/gpt.py:base', '--config.train.batch_size=4',
         '--config.data.max_seq_length=512'],
        [('python', ['peers/gpt_torch.py', '--shape=base'])]),
    'elmo_small': (
        ['--config=configs/elmo.py:small', '--config.train.batch_size=128',
         '--config.data.max_seq_length=20'],
        [('python', ['peers/elmo_torch.py', '--shape=small'])]),
}


def run(cwd: str, argv: list[str]) -> dict:
  """The JSON line a bench or peer process prints last; one line naming the command if it fails."""
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get('JAX_PLATFORMS', 'cpu'))
  done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
  lines = [line for line in done.stdout.splitlines() if line.startswith('{')]
  if done.returncode or not lines:
    tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
    sys.exit(f'compare.py: `{" ".join(argv)}` in {cwd} failed (exit {done.returncode}): {tail}')
  return json.loads(lines[-1])


def commands(case: str, steps: int, warmup: int, hf_flax_python: str, checkouts: list[str]
             ) -> list[tuple[str, list[str]]]:
  """(working directory, command): bench.py in each checkout first, then each peer that can run."""
  bench_flags, peers = CASES[case]
  timing = [f'--steps={steps}', f'--warmup={warmup}']
  out = []
  for checkout in checkouts:
    with open(os.path.join(checkout, 'bench.py')) as f:  # older ones time the input pipeline too
      skip_input = ['--input_seconds=0'] if 'input_seconds' in f.read() else []
    out.append((checkout, [sys.executable, 'bench.py', *bench_flags, *timing, *skip_input]))
  for python, script in peers:
    if python == 'hf_flax' and not hf_flax_python:
      continue
    out.append((ROOT, [sys.executable if python == 'python' else hf_flax_python,
                       os.path.join(ROOT, script[0]), *script[1:], *timing]))
  return out


def commit(checkout: str) -> str:
  done = subprocess.run(['git', '-C', checkout, 'rev-parse', '--short', 'HEAD'],
                        capture_output=True, text=True)
  dirty = subprocess.run(['git', '-C', checkout, 'status', '--porcelain', '--untracked-files=no'],
                         capture_output=True, text=True).stdout.strip()
  return (done.stdout.strip() or '?') + ('+changes' if dirty else '')


def table(results: dict[str, list[list[dict]]], labels: list[str]) -> str:
  """Markdown: a row per case and peer; per checkout, its median tokens/s and the median of the
  rounds' ratios (its tokens/s over the peer's)."""
  n = len(labels)
  rows = ['| case | peer | peer tokens/s | ' + ' | '.join(
              f'{label}: tokens/s, ratio' for label in labels) + ' |',
          '|---|---|---|' + '---|' * n]
  for case, rounds in results.items():
    for i, first in enumerate(rounds[0][n:], start=n):
      theirs = statistics.median(r[i]['tokens_per_sec'] for r in rounds)
      cells = []
      for j in range(n):
        ours = statistics.median(r[j]['tokens_per_sec'] for r in rounds)
        ratio = statistics.median(r[j]['tokens_per_sec'] / r[i]['tokens_per_sec'] for r in rounds)
        cells.append(f'{ours:,.0f}, **{ratio:.2f}x**')
      rows.append(f'| {case} {first["batch_size"]}x{first["seq_len"]} | {first["peer"]} | '
                  f'{theirs:,.0f} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--cases', default=','.join(CASES), help=f'of {", ".join(CASES)}')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=5, help='timed steps per run')
  parser.add_argument('--warmup', type=int, default=4, help='untimed steps per run')
  parser.add_argument('--hf_flax_python', default=HF_FLAX_PYTHON,
                      help='a python with transformers 4.57.6; empty leaves HF Flax out')
  parser.add_argument('--also', default='', help='other checkouts (comma-separated directories) '
                      'whose bench.py runs in the same rounds, e.g. a worktree of an older commit')
  parser.add_argument('--json_out', default='', help='also write every run\'s JSON line here')
  args = parser.parse_args()
  cases = [c for c in args.cases.split(',') if c]
  unknown = [c for c in cases if c not in CASES]
  if unknown or args.rounds < 1:
    parser.error(f'unknown --cases {unknown}: use some of {", ".join(CASES)}' if unknown
                 else f'--rounds={args.rounds} must be >= 1.')
  hf_flax = args.hf_flax_python if os.path.exists(args.hf_flax_python) else ''
  if not hf_flax and args.hf_flax_python:
    print(f'HF Flax peers left out: no {args.hf_flax_python} (see this script\'s docstring).')
  checkouts = [ROOT] + [os.path.abspath(d) for d in args.also.split(',') if d]
  labels = [f'this checkout ({commit(ROOT)})'] + [f'{d} ({commit(d)})' for d in checkouts[1:]]
  results = {case: [] for case in cases}
  for r in range(args.rounds):
    for case in cases:
      runs = commands(case, args.steps, args.warmup, hf_flax, checkouts)
      out = [None] * len(runs)
      for i in list(range(len(runs)))[::(-1 if r % 2 else 1)]:
        out[i] = run(*runs[i])
        who = out[i].get('peer') or labels[i]
        print(f'round {r + 1} {case}: {who} {out[i]["tokens_per_sec"]:,.1f} tokens/s', flush=True)
      results[case].append(out)
  peaks = [r[0]['matmul_peak_flops_per_sec'] for rounds in results.values() for r in rounds]
  print(f'\nfloat32, {args.rounds} rounds of {args.steps} timed steps after {args.warmup}; this '
        f'machine\'s float32 matmul peak (bench.py, median) {statistics.median(peaks) / 1e9:.0f} '
        'GFLOP/s\n')
  print(table(results, labels))
  if args.json_out:
    with open(args.json_out, 'w') as f:
      json.dump({'labels': labels, 'results': results}, f, indent=1)


if __name__ == '__main__':
  main()
