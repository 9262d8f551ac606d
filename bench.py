"""Measures the train step of any config and prints one JSON line.

    python bench.py --config=configs/bert_base.py:base --config.train.batch_size=8

Figures: steady-state seconds per step (compile excluded), tokens/s, analytic
model FLOPs per step, achieved FLOP/s, MFU against this machine's float32
matmul peak (measured here, first), compile seconds, peak memory, and the
input pipeline's examples/s on the configured source.
"""

import importlib
import json
import resource
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

import input_pipeline
from trainer import cli
from trainer import sharding
import trainer.checks
import trainer.state


def matmul_peak_flops(sizes=(1024, 2048, 3072), repeats=5) -> float:
  """Best float32 matmul FLOP/s of this machine over a few square sizes."""
  best = 0.0
  for n in sizes:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
      matmul(a, a).block_until_ready()
    best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
  return best


def peak_memory_bytes() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use'])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: process peak RSS


def input_examples_per_sec(config, max_seconds: float = 30.0) -> float:
  """Host-side pipeline speed on the configured source over whole chunks (reading,
  tokenizing, packing or pairing and masking), without prefetching; at most `max_seconds`."""
  # A fine-tuning run reads the vocabulary of the run it starts from (the BCN has no other).
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size,
                                           saved_dir=config.get('init_from') or None)
  data = input_pipeline.get_dataset(config.data, 'train', tokenizer=tokenizer,
                                    batch_size=config.train.batch_size, seed=0, prefetch=0)
  examples, start = 0, time.perf_counter()
  while True:
    state = data.get_state()  # CVT's keeps the text stream's position as unlabeled_*
    if state.get('chunk', state.get('unlabeled_chunk', 0)) >= 2 or state.get('epoch', 0):
      break
    next(data)
    examples += config.train.batch_size
    if time.perf_counter() - start > max_seconds:
      break
  return examples / (time.perf_counter() - start)


def benchmark(config, steps: int, warmup: int) -> dict:
  peak = matmul_peak_flops()
  mesh = sharding.make_mesh(config.mesh)
  # A fine-tuning config's sizes come from its init_from.
  trainer.checks.inherit_unset_fields(config, None)
  trainer.checks.validate(config, mesh)
  model_module = importlib.import_module(f'models.{config.model_name}')
  model_cfg = trainer.checks.model_config(config)
  _, _, state, step_fn, _ = trainer.state.build(config, mesh)
  batch_size = config.train.batch_size
  local = input_pipeline.example_batch(config.data, model_cfg.vocab_size,
                                       batch_size=batch_size // jax.process_count())
  with jax.set_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_seconds = time.perf_counter() - start
    for _ in range(warmup):
      state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    start = time.perf_counter()
    for _ in range(steps):
      state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    step_seconds = (time.perf_counter() - start) / steps
  flops = model_module.train_flops_per_example(model_cfg, config.data) * batch_size
  if jax.default_backend() != 'cpu':  # the peak was measured on one of several accelerators
    peak *= jax.device_count()
  tokens = batch_size * config.data.max_seq_length * config.data.get('num_choices', 1)
  return {
      'model': config.model_name, 'batch_size': batch_size,
      'seq_len': config.data.max_seq_length, 'devices': len(jax.devices()),
      'mesh': dict(mesh.shape), 'dtype': model_cfg.dtype,
      'step_seconds': round(step_seconds, 5),
      'tokens_per_sec': round(tokens / step_seconds, 1),
      'model_flops_per_step': flops,
      'achieved_flops_per_sec': round(flops / step_seconds, 1),
      'matmul_peak_flops_per_sec': round(peak, 1),
      'mfu': round(flops / step_seconds / peak, 4),
      'compile_seconds': round(compile_seconds, 2),
      'peak_memory_bytes': peak_memory_bytes(),
      'final_loss': float(np.divide(*jax.device_get(metrics['loss']))),  # a (sum, count) pair
      'input_examples_per_sec': round(input_examples_per_sec(config), 1),
  }


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  config = cli.loaded_config('bench.py')
  print(json.dumps(benchmark(config, flags.FLAGS.steps, flags.FLAGS.warmup)))


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.')
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 2, 'Untimed steps after compilation.')
  app.run(main, flags_parser=cli.parse_flags)
