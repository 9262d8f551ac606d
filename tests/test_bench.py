"""bench.py measures a real train step and reports every figure it promises."""

import jax

import bench
from test_train import micro_config


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
  assert abs(result['mfu'] - result['achieved_flops_per_sec'] /
             result['matmul_peak_flops_per_sec']) < 1e-3
  assert result['devices'] == len(jax.devices())
