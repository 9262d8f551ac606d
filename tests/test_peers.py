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


# Slow: each imports torch and transformers in a process of its own (4-7 s each, 24 s of the
# fast tier's time); benchmarks' peers, not what a change to the models breaks.
@pytest.mark.slow
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


@pytest.mark.slow  # 20 steps of each BERT and the evals: about 1.5 minutes
def test_bert_tiny_and_hfs_learn_alike_on_the_same_batches(shared_data_dir, tmp_path):
  """peers/bert_learning_hf.py: after 20 steps from the same batches, ours and HF's
  BertForPreTraining score the eval's masked positions alike (measured: perplexity 1690 and
  1696, from 4096 at a uniform start)."""
  done = subprocess.run(
      [sys.executable, 'peers/bert_learning_hf.py', '--steps=20',
       f'--workdir={tmp_path / "run"}', f'--data_dir={shared_data_dir}'],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = {line.split(' | ')[0].strip('| '): line.split(' | ')[1:]
          for line in done.stdout.splitlines() if line.startswith('| ')}
  # The last column: all positions, 'accuracy / perplexity (count)'.
  perplexity = {name: float(cells[-1].split(' / ')[1].split(' (')[0])
                for name, cells in rows.items() if name != 'model'}
  assert set(perplexity) == {'ours (JAX)', 'HF BertForPreTraining', 'unigram'}
  ours, hf = perplexity['ours (JAX)'], perplexity['HF BertForPreTraining']
  assert ours < 0.6 * 4096 and abs(ours - hf) < 0.05 * hf, perplexity


@pytest.mark.slow
def test_the_gpu_gpt_peer_attends_in_one_fused_call_with_the_librarys_function():
  """HF's OpenAI GPT writes every score to memory: the GPU peer swaps in SDPA (causal, its
  dropout inside), the same function; checked here on the CPU."""
  import torch  # pylint: disable=import-outside-toplevel
  import gpt_torch_gpu  # pylint: disable=import-outside-toplevel
  config = gpt_torch_gpu.OpenAIGPTConfig(vocab_size=50, n_positions=16, n_embd=16, n_layer=2,
                                         n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
  torch.manual_seed(0)
  stock = gpt_torch_gpu.OpenAIGPTLMHeadModel(config).eval()
  fused = gpt_torch_gpu.OpenAIGPTLMHeadModel(config).eval()
  fused.load_state_dict(stock.state_dict())
  gpt_torch_gpu.use_sdpa(fused)
  scores = []
  for layer in fused.modules():
    if isinstance(layer, gpt_torch_gpu.Attention):
      layer.attn_dropout.register_forward_hook(lambda m, i, o: scores.append(o.shape))
  tokens = torch.randint(50, (2, 12), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    torch.testing.assert_close(fused(input_ids=tokens).logits, stock(input_ids=tokens).logits,
                               rtol=1e-5, atol=1e-5)
  assert not scores  # no (batch, heads, length, length) tensor went through a dropout module
  # Training: the dropout is SDPA's own, at the layer's rate.
  config.attn_pdrop = 1.0 - 1e-6
  dropped = gpt_torch_gpu.use_sdpa(gpt_torch_gpu.OpenAIGPTLMHeadModel(config).train())
  layer = next(m for m in dropped.modules() if isinstance(m, gpt_torch_gpu.Attention))
  q = k = v = torch.ones(1, 2, 4, 8)
  attend = layer._attn  # pylint: disable=protected-access
  assert torch.count_nonzero(attend(q, k.transpose(-1, -2), v)[0]) == 0


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


PTXAS = '''ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_dropout_backward_all' for 'sm_90a'
ptxas info    : Function properties for flash_dropout_backward_all
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size
'''
THUNKS = ('002: kCustomKernel [source | next=005 (3)] loop_broadcast_fusion grid: [49152, 1, 1] '
          'threads: [128, 1, 1]  shared_memory: 0 bytes\n'
          '003: kCustomKernel [prev=001 (2) | next=004 (1)] flash_dropout_forward '
          'grid: [256, 12, 1] threads: [128, 1, 1]  shared_memory: 49536 bytes\n')
H100 = '''gpu_device_info {
  threads_per_warp: 32
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  registers_per_core_limit: 65536
  name: "NVIDIA H100 80GB HBM3"
}'''


SASS = '''
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   IMAD R3, R0, -0x7a143595, RZ ;
        /*0020*/                   LOP3.LUT R4, R3, R0, RZ, 0x3c, !PT ;
        /*0030*/                   STL [R1+0x4], R4 (*"SpillRefill"*);
        /*0040*/               @P2 BRA `(.L_x_3) ;
        /*0050*/                   ISETP.NE.AND P3, PT, R4, R0, PT ;
        /*0060*/                   FSEL R5, R5, -1.0, P3 ;
.L_x_3:
        /*0070*/              @!P0 FFMA R5, R4, 0.5, R5 ;
        /*0080*/                   MUFU.EX2 R5, R5 ;
        /*0090*/               @P1 BRA `(.L_x_1) ;
        /*00a0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00b0*/                   LDL.LU R6, [R1+0x4] (*"SpillRefill"*);
        /*00c0*/                   EXIT ;
'''


def test_the_sass_count_takes_the_loops_machine_instructions_and_spills():
  import flash_dropout_ptx  # pylint: disable=g-import-not-at-top (imports jax and aot.py)
  counts = flash_dropout_ptx.sass_count(SASS)
  # The loop: from its label to the branch back (the forward branch out of it opens none); the
  # spill store inside it counts, the load after it does not; the fewest a pass issues skips
  # the two instructions that the branch inside it jumps over.
  assert counts == {'in_loops_total': 9, 'total': 13, 'in_loops_fewest': 7,
                    'spills_in_loops': 1,
                    'in_loops': {'BRA': 2, 'IMAD': 1, 'LOP3': 1, 'STL': 1, 'ISETP': 1, 'FSEL': 1,
                                 'FFMA': 1, 'MUFU': 1}}


def test_the_ptx_report_reads_ptxas_and_the_launch_and_counts_the_blocks_an_sm_holds():
  import flash_dropout_ptx  # pylint: disable=g-import-not-at-top (imports jax and aot.py)
  assert flash_dropout_ptx.ptxas_report(PTXAS) == {
      'registers': 255, 'spill_store_bytes': 12, 'spill_load_bytes': 8, 'stack_bytes': 16}
  assert flash_dropout_ptx.launch(THUNKS, 'flash_dropout_forward') == {
      'blocks': 3072, 'threads': 128, 'shared_bytes': 49536}
  limits = flash_dropout_ptx.device_limits(H100)
  assert limits['core_count'] == 132 and limits['registers_per_core_limit'] == 65536
  # 239 registers take 7,680 a warp (units of 256): 8 warps, two blocks of 4 (shared memory
  # would allow 4: 233,472 // 50,560).
  assert flash_dropout_ptx.residency(239, 128, 49536, limits) == {
      'blocks_per_sm': 2, 'limited_by': ['registers'], 'warps_per_sm': 8}
  # 32 registers and no shared memory: 64 warps, 2,048 threads, 16 blocks of 128.
  assert flash_dropout_ptx.residency(32, 128, 0, limits) == {
      'blocks_per_sm': 16, 'limited_by': ['registers', 'threads'], 'warps_per_sm': 64}
  # 100 KB of shared memory: two blocks (64 registers would allow 8).
  assert flash_dropout_ptx.residency(64, 128, 100_000, limits)['limited_by'] == ['shared memory']


@pytest.mark.slow  # six compiles for an H100 and ptxas: about 20 s
def test_our_kernels_assemble_for_an_h100_without_spilling():
  """python peers/flash_dropout_ptx.py: every kernel of BERT-base's and GPT-1's attention, as the
  models call it, with flash_dropout's own settings and with the opt-in inline PTX exponentials,
  assembled by ptxas for sm_90a: registers, its launch, two blocks an SM, and no spill (a spill
  to local memory in a kernel's loop would cost every pass)."""
  # Without the tier's XLA_FLAGS: at --xla_backend_optimization_level=0 GPT-1's forward spills.
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  done = subprocess.run([sys.executable, 'peers/flash_dropout_ptx.py'], cwd=ROOT, env=env,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  kernels = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{')]
  assert len(kernels) == 12 and {(k['case'], k['kernel'], k['variant'].endswith(' exp2 ptx'))
                                  for k in kernels} == {
      (case, f'flash_dropout_{kernel}', ptx)
      for case in ('bert_base_256x128', 'gpt1_64x512', 'bert_base_256x128_three_arrays')
      for kernel in ('forward', 'backward_qkv') for ptx in (False, True)}
  for k in kernels:
    assembled = k['assembled']
    assert assembled['target'] == 'sm_90a' and 0 < assembled['registers'] <= 255
    assert assembled['spill_store_bytes'] == 0 == assembled['spill_load_bytes'], k
    # The machine code (nvdisasm, requirements-dev.txt): loops of thousands of instructions.
    assert 'in_loops_total' in assembled['sass'], assembled['sass']  # else: no nvdisasm
    assert assembled['sass']['spills_in_loops'] == 0 and assembled['sass']['in_loops_total'] > 500
    # With the inline PTX, each exponential one FFMA and one MUFU.EX2 (flash_dropout._exp2): no
    # compare for a subnormal result an element, as libdevice's exp2f without flush-to-zero has.
    sass = assembled['sass']['in_loops']
    if k['variant'].endswith(' exp2 ptx'):
      assert sass['MUFU'] >= 64 and sass['FFMA'] >= 64 and sass.get('FSETP', 0) < 8, sass
    else:
      assert sass['MUFU'] >= 64 and sass['FSETP'] >= 64, sass
    assert assembled['threads'] == 128 and assembled['blocks_per_sm'] == 2
    assert k['in_loops']['tensor core'] > 0 and k['in_loops_total'] > 0


@pytest.mark.slow  # the GPU session's kernel scripts at tiny shapes, interpret mode: about 40 s
def test_the_gpu_sessions_kernel_scripts_run_small_on_a_cpu():
  """peers/flash_dropout_gpu.py's check, time and profile (peers/gpu_session.sh runs them on a
  GPU, whose few minutes a broken script would waste) at --small shapes: each checks or times
  the opt-in changes beside the default, and the check finds the kernels right."""
  import flash_dropout_gpu  # pylint: disable=g-import-not-at-top (imports jax)
  checked = flash_dropout_gpu.check(small=True)
  assert checked.pop('mask read off the output') == {'elements': 65536,
                                                     'differing from keep_mask': 0}
  assert {name.endswith(' exp2 ptx') for name in checked} == {True, False}
  for name, figures in checked.items():
    assert max(figures['dq dk dv errors (of the largest entry)']) < (
        1e-4 if 'float32' in name else 2e-2), (name, figures)
  timed = flash_dropout_gpu.timing(small=True)['small 2x128']
  assert timed['triton self_attention exp2 ptx ms'] > 0 < timed['triton self_attention ms']
  # Interpret mode runs jnp.exp2 either way: the same numbers.
  assert timed['triton self_attention exp2 ptx dq dk dv against triton (of the largest entry)'] == [
      0.0, 0.0, 0.0]
  profiled = flash_dropout_gpu.profile(small=True, calls=2)
  assert len(profiled) == 4 and all(p['all ops us'] > 0 and p['ops'] for p in profiled.values())
  assert any(name.endswith(' exp2 ptx') for name in profiled)
  # Each kernel's time whether or not its ops make the ten largest (on a CPU they may not).
  for p in profiled.values():
    assert p['kernels us'].pop('flash_dropout_forward') > 0, p
    [(backward, us)] = p['kernels us'].items()
    assert backward.startswith('flash_dropout_backward_') and 0 < us < p['all ops us'], p


def test_the_gpu_session_takes_the_opt_in_changes_a_check_found_right_and_a_time_faster(
    tmp_path):
  import flash_dropout_gpu  # pylint: disable=g-import-not-at-top (imports jax)
  errors = 'dq dk dv errors (of the largest entry)'
  check = {'bert float32 exp2 ptx': {errors: [1e-3, 1e-4, 0.0]},
           'bert bfloat16 exp2 ptx': {errors: [0.01, 0.006, 0.0]},
           'bert bfloat16': {errors: [0.5, 0.5, 0.5]},  # the default's: not what is chosen
           'bert_128 whole queries bfloat16 exp2 ptx': {errors: [0.01, 0.0, 0.0]},
           'bert_128 whole queries bfloat16': {errors: [0.01, 0.0, 0.0]},
           'mask read off the output': {'elements': 8, 'differing from keep_mask': 0}}
  base = 'triton self_attention'
  timed = {'bert': {f'{base} ms': 0.6, f'{base} exp2 ptx ms': 0.5,
                    f'{base} whole queries ms': 0.4},
           'gpt': {f'{base} ms': 1.2, f'{base} exp2 ptx ms': 1.1}}

  def chosen(check, timed):
    (tmp_path / 'check.txt').write_text('progress\n' + json.dumps({'check': check}) + '\n')
    (tmp_path / 'time.txt').write_text(json.dumps({'time': timed, 'jax': '0.11.2'}) + '\n')
    return flash_dropout_gpu.settings(str(tmp_path / 'check.txt'), str(tmp_path / 'time.txt'))

  assert chosen(check, timed) == ['--flash_dropout.EXP2_PTX=True',
                                  '--flash_dropout.WHOLE_QUERIES=128']
  slower = {'bert': timed['bert'], 'gpt': {**timed['gpt'], f'{base} exp2 ptx ms': 1.3}}
  assert chosen(check, slower) == ['--flash_dropout.WHOLE_QUERIES=128']  # slower at one shape
  wrong = {**check, 'bert float32 exp2 ptx': {errors: [1e-3, 3e-3, 0.0]}}
  assert chosen(wrong, timed) == ['--flash_dropout.WHOLE_QUERIES=128']
  # The one-kernel backward is judged with the exponentials the steps take: here jnp.exp2's.
  whole_wrong = {**check, 'bert_128 whole queries bfloat16': {errors: [0.03, 0.0, 0.0]}}
  assert chosen(whole_wrong, slower) == []
  assert chosen(whole_wrong, timed) == ['--flash_dropout.EXP2_PTX=True',
                                        '--flash_dropout.WHOLE_QUERIES=128']
  mask = {**check, 'mask read off the output': {'elements': 8, 'differing from keep_mask': 1}}
  assert chosen(mask, timed) == []
  assert flash_dropout_gpu.settings(str(tmp_path / 'none.txt'), str(tmp_path / 'time.txt')) == []


def test_a_curve_too_short_to_time_is_one_line_before_anything_is_built():
  import attention_dropout_gpu  # pylint: disable=g-import-not-at-top (imports jax)
  with pytest.raises(SystemExit, match=r'^attention_dropout_gpu.py: curve times steps 21 to '
                                       r'STEPS: give STEPS above 20, not 20\.$'):
    attention_dropout_gpu._curve('configs/gpt.py:tiny', 20, [])  # pylint: disable=protected-access
