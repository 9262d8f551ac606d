"""bench.py measures a real train step and reports every figure it promises."""

import gzip
import json
import os
import sys

import jax
import pytest

import bench
import forked  # tests/
from test_train import micro_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a timed benchmark of a real step
def test_benchmark_reports_consistent_figures(shared_data_dir):
  config = micro_config(shared_data_dir)
  result = bench.benchmark(config, steps=2, warmup=1)
  expected = {'step_seconds', 'tokens_per_sec', 'model_flops_per_step', 'achieved_flops_per_sec',
              'matmul_peak_flops_per_sec', 'mfu', 'compile_seconds', 'peak_memory_bytes',
              'input_examples_per_sec'}
  assert expected <= set(result)
  assert all(result[k] > 0 for k in expected)
  tokens = config.train.batch_size * config.data.max_seq_length
  assert abs(result['tokens_per_sec'] * result['step_seconds'] - tokens) < 0.01 * tokens
  # On the CPU, MFU's reference is the float32 matmul peak measured here.
  assert result['peak_flops_per_sec'] == result['matmul_peak_flops_per_sec']
  assert 'measured here' in result['peak_source'] and 'float32' in result['peak_source']
  assert abs(result['mfu'] - result['achieved_flops_per_sec'] /
             result['matmul_peak_flops_per_sec']) < 1e-3
  assert 0 < result['mfu'] <= 1 and result['mfu'] == result['mfu_of_matmul_peak']
  assert result['devices'] == len(jax.devices())


@pytest.mark.slow  # two compiles of a fine-tuning step
def test_gpt_finetunings_flops_follow_what_the_lm_coefficient_leaves_in_the_step():
  """At loss.lm_coef=0 the LM head runs forward only: the count follows XLA's (layers
  unrolled, which XLA counts each; it also counts the elementwise work, a few percent)."""
  from configs import gpt_finetune  # pylint: disable=g-import-not-at-top
  import input_pipeline  # pylint: disable=g-import-not-at-top
  from trainer import sharding  # pylint: disable=g-import-not-at-top
  import trainer.checks  # pylint: disable=g-import-not-at-top
  import trainer.state  # pylint: disable=g-import-not-at-top
  ratios = {}
  for lm_coef in (0.5, 0.0):
    config = gpt_finetune.get_config('offline_shuffled,tiny')
    config.model.scan_layers, config.loss.lm_coef = False, lm_coef
    config.mesh = (('data', 1), ('fsdp', 1), ('tensor', 1))
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    _, _, state, step_fn, _ = trainer.state.build(config, mesh)
    local = input_pipeline.example_batch(config.data, config.model.vocab_size,
                                         batch_size=config.train.batch_size)
    with jax.set_mesh(mesh):
      compiled = step_fn.lower(state, sharding.global_batch(local, mesh)).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)['flops']
    model_cfg = trainer.checks.model_config(config)
    counted = trainer.checks.train_flops_per_example(config, model_cfg) * config.train.batch_size
    ratios[lm_coef] = xla / counted
  assert all(1.0 <= r < 1.1 for r in ratios.values()), ratios


def test_mfu_divides_by_the_chips_published_peak_in_the_compute_dtype():
  # The H100 runs bfloat16 at 989 TFLOP/s and float32 as TF32 at half that; a measured float32
  # matmul (169 TFLOP/s there) is not the reference of a bfloat16 model (it gave MFU 1.63).
  peak, source = bench.mfu_reference('NVIDIA H100 80GB HBM3', 'bfloat16', measured=169e12)
  assert peak == 989e12 and 'H100' in source and 'published' in source
  assert bench.mfu_reference('NVIDIA H100 80GB HBM3', 'float32', 169e12)[0] == 494.5e12
  assert bench.mfu_reference('NVIDIA H100 PCIe', 'bfloat16', 1.0)[0] == 756e12
  assert bench.mfu_reference('NVIDIA H200', 'float16', 1.0)[0] == 989e12
  assert bench.mfu_reference('NVIDIA H200 NVL', 'bfloat16', 1.0)[0] == 835e12
  assert bench.mfu_reference('NVIDIA A100-SXM4-80GB', 'bfloat16', 1.0)[0] == 312e12
  tpus = {'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5': 459e12, 'TPU v6 lite': 918e12}
  for kind, flops in tpus.items():  # the device kinds libtpu reports (aot.py's topologies)
    assert bench.mfu_reference(kind, 'bfloat16', 1.0)[0] == flops
    assert bench.mfu_reference(kind, 'float32', 1.0)[0] == flops  # bfloat16 passes on the MXU
  assert bench.mfu_reference('cpu', 'float32', 2e11) == (2e11, 'float32 matmul peak measured '
                                                                'here on cpu')
  assert bench.mfu_reference('NVIDIA GeForce RTX 4090', 'bfloat16', 3e14)[0] == 3e14


@pytest.mark.slow  # a bench.py run with a profile: end to end
def test_profile_names_the_hlo_ops_that_take_the_time(shared_data_dir, tmp_path):
  config = micro_config(shared_data_dir)
  result = bench.benchmark(config, steps=1, warmup=0, profile_dir=str(tmp_path))
  ops = result['top_ops']
  assert ops and all(0 < op['share'] <= 1 and op['ms_per_step'] > 0 for op in ops)
  assert sum(op['share'] for op in ops) <= 1.0001
  assert [op['share'] for op in ops] == sorted((op['share'] for op in ops), reverse=True)
  # The whole op table, read back from the trace and HLO the profile wrote, holds the step's
  # matmuls and adds up to the matmul share. The top 12 alone may hold no matmul: in a micro
  # model on 8 simulated devices, all-reduces and dropout's bits can outweigh them (CI saw it).
  hlo = (tmp_path / 'train_step.hlo.txt').read_text(encoding='utf-8')
  trace = max(tmp_path.glob('plugins/profile/*/perfetto_trace.json.gz'),
              key=lambda p: p.stat().st_mtime)
  every_op = bench.top_ops(str(trace), hlo, steps=3, top=None)
  assert every_op[:len(ops)] == ops
  assert abs(sum(op['share'] for op in every_op) - 1) < 1e-4 * len(every_op)
  matmuls = sum(op['share'] for op in every_op if op['jax_op'].endswith('dot_general'))
  assert 0 < matmuls < 1
  assert abs(matmuls - result['matmul_share']) < 1e-4 * len(every_op)


def test_top_ops_reads_a_trace_against_the_hlo(tmp_path):
  hlo = '\n'.join([
      '%fused_computation (param_0: f32[4]) -> f32[4] {',
      '  ROOT %exp.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(f)/exp"}',
      '}',
      'ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {',
      '  %fusion.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation',
      '  %dot.3 = f32[4]{0} dot(%p, %p), metadata={op_name="jit(f)/layer/dot_general"}',
      '  ROOT %tuple.4 = (f32[4], f32[4]) tuple(%fusion.2, %dot.3)',
      '}'])
  trace = tmp_path / 'trace.json.gz'
  events = [{'ph': 'X', 'name': 'dot.3', 'dur': 300}, {'ph': 'X', 'name': 'fusion.2', 'dur': 100},
            {'ph': 'X', 'name': 'dot.3', 'dur': 300}, {'ph': 'X', 'name': 'PjitFunction(f)',
                                                        'dur': 5000}]
  with gzip.open(trace, 'wt', encoding='utf-8') as f:
    json.dump({'traceEvents': events}, f)
  assert bench.top_ops(str(trace), hlo, steps=2) == [
      {'op': 'dot.3', 'opcode': 'dot', 'jax_op': 'jit(f)/layer/dot_general', 'ms_per_step': 0.3,
       'share': 0.8571},
      {'op': 'fusion.2', 'opcode': 'fusion', 'jax_op': 'jit(f)/exp', 'ms_per_step': 0.05,
       'share': 0.1429}]
  assert bench.matmul_share(str(trace), hlo) == 0.8571


def test_a_gpu_trace_is_read_by_its_kernels_hlo_ops_beside_the_estimate(tmp_path):
  """A GPU's kernels are named otherwise than their HLO ops (args.hlo_op has those); the host's
  events (unless the device's name no op) and another program's kernels are not the step's
  time."""
  hlo = '\n'.join([
      'HloModule jit_f, entry_computation_layout={(f32[4]{0})->(f32[4]{0}, f32[4]{0})}',
      '%fused_computation (param_0: f32[4]) -> f32[4] {',
      '  ROOT %exp.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(f)/exp"}',
      '}',
      'ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {',
      '  %fusion.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation',
      '  %dot.3 = f32[4]{0} dot(%p, %p), metadata={op_name="jit(f)/layer_2/dot_general"}',
      '  ROOT %tuple.4 = (f32[4], f32[4]) tuple(%fusion.2, %dot.3)',
      '}'])
  kernel = lambda name, op, dur, module='jit_f', pid=2: {  # noqa: E731
      'ph': 'X', 'pid': pid, 'name': name, 'dur': dur,
      'args': {'hlo_op': op, 'hlo_module': module}}
  events = [{'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
            {'ph': 'M', 'pid': 2, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
            kernel('sm90_xmma_gemm_bf16bf16', 'dot.3', 300),
            kernel('loop_exponential_fusion', 'fusion.2', 100),
            kernel('sm90_xmma_gemm_bf16bf16', 'dot.3', 300),
            kernel('dot.3', 'dot.3', 5000, pid=1),  # the host's launch of it
            kernel('other_gemm', 'dot.3', 7000, module='jit_g')]  # another program's op
  trace = tmp_path / 'trace.json.gz'
  with gzip.open(trace, 'wt', encoding='utf-8') as f:
    json.dump({'traceEvents': events}, f)
  assert [(op['op'], op['ms_per_step']) for op in bench.top_ops(str(trace), hlo, steps=2)] == [
      ('dot.3', 0.3), ('fusion.2', 0.05)]
  # A device whose kernels name no op of the step (all inside a CUDA graph): the host's events.
  with gzip.open(trace, 'wt', encoding='utf-8') as f:
    json.dump({'traceEvents': events[:2] + [
        {'ph': 'X', 'pid': 2, 'name': 'cudaGraphLaunch', 'dur': 900}, events[5]]}, f)
  assert [(op['op'], op['ms_per_step']) for op in bench.top_ops(str(trace), hlo, steps=2)] == [
      ('dot.3', 2.5)]
  with gzip.open(trace, 'wt', encoding='utf-8') as f:
    json.dump({'traceEvents': events}, f)
  estimate = bench.estimated_ms(hlo, 'NVIDIA H100 80GB HBM3', 'bfloat16')
  assert set(estimate) == {'layer_*/dot_general', 'exp'}  # the fusion by its fused root's op
  assert all(0 < ms < 0.1 for ms in estimate.values())  # tiny kernels: their fixed cost
  assert bench.estimated_ms(hlo, 'cpu', 'bfloat16') is None
  rows = bench.ops_by_jax_op(str(trace), hlo, steps=2, estimate={'exp': 0.01})
  assert rows == [
      {'jax_op': 'layer_*/dot_general', 'ms_per_step': 0.3, 'share': 0.8571, 'estimate_ms': None},
      {'jax_op': 'exp', 'ms_per_step': 0.05, 'share': 0.1429, 'estimate_ms': 0.01}]


def test_a_trace_that_holds_part_of_the_step_and_an_op_without_estimate_say_so(capsys):
  grouped = [{'jax_op': 'all-reduce', 'ms_per_step': 1.0, 'share': 0.5, 'estimate_ms': None},
             {'jax_op': 'exp', 'ms_per_step': 1.0, 'share': 0.5, 'estimate_ms': 0.9}]
  bench.print_ops([], 0.010, 0.0, grouped, op_ms=2.0)  # 2 of the step's 10 ms
  out = capsys.readouterr().out
  assert out.startswith('NOTE: the trace holds 2.0 ms of op events per step of the 10.0 ms step')
  assert '(n/a)  all-reduce' in out and '(0.900)  exp' in out
  bench.print_ops([], 0.010, 0.0, grouped, op_ms=9.0)
  assert 'NOTE' not in capsys.readouterr().out


def test_peak_memory_says_what_it_is():
  class Device:
    def __init__(self, platform, stats):
      self.platform, self.stats = platform, stats

    def memory_stats(self):
      return self.stats

  one = [Device('gpu', {'peak_bytes_in_use': 7})]
  assert bench.peak_memory(one) == (7, 'gpu peak_bytes_in_use, the most of 1 local devices')
  # Sharded state: device 0 need not hold the most.
  two = one + [Device('gpu', {'peak_bytes_in_use': 9})]
  assert bench.peak_memory(two) == (9, 'gpu peak_bytes_in_use, the most of 2 local devices')
  assert bench.peak_memory([Device('gpu', None)])[0] is None  # never the host's memory
  bytes_, source = bench.peak_memory([Device('cpu', {})])
  assert bytes_ > 2 ** 20 and source == 'host process max RSS'


def test_a_bad_flag_is_one_line_before_anything_compiles():
  """--steps=0 ended in an UnboundLocalError traceback after a compile."""
  done = forked.run([sys.executable, 'bench.py', '--config=configs/bert_base.py:tiny',
                     '--steps=0'], cwd=ROOT, env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
                    timeout=120)
  assert done.returncode != 0
  assert done.stderr.strip().splitlines() == [
      'bench.py: error: --steps=0 --warmup=4: time 1 step or more, after 0 or more.']
