"""The peer benchmarks (peers/) and the command that sets them beside bench.py."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'peers'))
import compare  # noqa: E402


def line(tokens_per_sec, peer=None):
  out = {'tokens_per_sec': tokens_per_sec, 'batch_size': 2, 'seq_len': 8}
  return dict(out, peer=peer) if peer else dict(out, matmul_peak_flops_per_sec=1e11)


def test_the_table_gives_the_median_of_each_rounds_ratio():
  # Round 2 ran on a machine twice as slow: its ratios still count, its speeds do not mix.
  rounds = [[line(100), line(90), line(50, 'torch')],
            [line(50), line(44), line(20, 'torch')],
            [line(99), line(91), line(45, 'torch')]]
  text = compare.table({'bert_mini': rounds}, ['now', 'before'])
  row = text.splitlines()[-1]
  # Ratios 2.0, 2.5, 2.2 -> 2.2; before 1.8, 2.2, 2.02 -> 2.02.
  assert row == '| bert_mini 2x8 | torch | 45 | 99, **2.20x** | 90, **2.02x** |'


def test_commands_skip_what_cannot_run(tmp_path):
  old = tmp_path / 'old'
  old.mkdir()
  (old / 'bench.py').write_text('# an older bench.py without the flag\n')
  runs = compare.commands('bert_mini', 3, 1, '', [compare.ROOT, str(old)])
  assert [cwd for cwd, _ in runs[:2]] == [compare.ROOT, str(old)]
  assert '--input_seconds=0' in runs[0][1] and '--input_seconds=0' not in runs[1][1]
  scripts = [argv[1] for _, argv in runs[2:]]
  assert all(s.endswith('bert_torch.py') for s in scripts) and len(scripts) == 2  # no HF Flax
  assert all('--steps=3' in argv and '--warmup=1' in argv for _, argv in runs)


def test_an_unknown_case_is_one_line():
  done = subprocess.run([sys.executable, 'peers/compare.py', '--cases=bert_huge'], cwd=ROOT,
                        capture_output=True, text=True)
  assert done.returncode == 2
  assert 'unknown --cases' in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize('script,args', [
    ('bert_torch.py', ['--shape=mini', '--variant=gathered']),
    ('bert_torch.py', ['--shape=mini', '--variant=stock']),
    ('gpt_torch.py', ['--shape=mini']),
    ('elmo_torch.py', ['--shape=tiny']),
])
def test_a_peer_prints_one_json_line(script, args):
  done = subprocess.run(
      [sys.executable, os.path.join('peers', script), *args, '--batch_size=2', '--seq_len=16',
       '--steps=1', '--warmup=0'], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result['batch_size'] == 2 and result['seq_len'] == 16 and result['step_seconds'] > 0
  assert 0 < result['final_loss'] < 20
