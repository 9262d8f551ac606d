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


PTX = '''
.visible .entry flash_dropout_forward(
\t.param .u64 flash_dropout_forward_param_0
)
{
\tmov.u32 \t%r1, 0;
$L__BB0_1:
\tmul.lo.s32 \t%r2, %r1, -2048144789;
\txor.b32 \t%r3, %r2, %r1;
\tsetp.gt.u32 \t%p2, %r3, 6554;
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r4}, %rd1, %rd2;
\t@%p1 bra \t$L__BB0_1;
\tbra.uni \t$L__BB0_3;
$L__BB0_3:
\tex2.approx.f32 \t%r5, %r4;
\tst.global.v4.b32 \t[%rd3], {%r5, %r5, %r5, %r5};
\tret;
}
'''


def test_the_ptx_count_takes_the_loops_instructions_by_kind():
  import flash_dropout_ptx  # pylint: disable=g-import-not-at-top (imports jax and aot.py)
  counts = flash_dropout_ptx.count(PTX)
  # The loop: from its label to the branch back (a forward branch opens no loop).
  assert counts['in_loops'] == {'integer multiply': 1, 'integer logic and shift': 1,
                                'compare and select': 1, 'tensor core': 1,
                                'other (moves, address arithmetic, branches)': 1}
  assert counts['in_loops_total'] == 5 and counts['total'] == 10
  assert counts['whole']['exp and log'] == 1 and counts['whole']['memory'] == 1
