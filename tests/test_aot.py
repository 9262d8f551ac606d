"""The accelerator paths compiled on this CPU (aot.py): nothing runs on a TPU or GPU; libtpu
and jax's CUDA plugin describe the devices. More of the GPU path in test_aot_gpu.py."""

import functools
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import aot
from configs import bert_base
from configs import gpt
from configs import transformer_wmt
from models import layers
import trainer.checks
import trainer.phases
from trainer import hlo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {'data_fsdp': (('data', 1), ('fsdp', 4), ('tensor', 1)),
          'tensor': (('data', 2), ('fsdp', 1), ('tensor', 2))}
FSDP_AND_TENSOR = (('data', 1), ('fsdp', 2), ('tensor', 2))  # the fast tier's one TPU step
# Each platform's slice with a mesh of each kind: FSDP over all devices, or tensor parallel.
SLICES = {'v4:2x2x1': MESHES,
          'h100:8': {'data_fsdp': (('data', 1), ('fsdp', 8), ('tensor', 1)),
                     'tensor': (('data', 4), ('fsdp', 1), ('tensor', 2))}}


@pytest.fixture(autouse=True)
def quiet_libtpu(monkeypatch):
  for name, value in aot.QUIET_LIBTPU.items():  # and xdist workers compile side by side
    monkeypatch.setenv(name, value)


def _tiny(module, mesh, topology='v4:2x2x1'):
  config = module.get_config('tiny')
  config.mesh = SLICES[topology][mesh]
  return config


def _check_sharded_step(report, mesh):
  """What every compiled step of a slice shows: its devices, the figures of a step that fits,
  its collectives, and its parameters sharded as the mesh (a SLICES value) says."""
  devices = dict(mesh)
  assert report['devices'] == math.prod(devices.values()) and report['hosts'] == 1
  assert report['dtype'] == 'bfloat16'  # dtype auto on an accelerator
  assert report['cudnn_attention_calls'] == 0
  assert report['compiler_options'] == (aot.steps.GPU_COMPILER_OPTIONS
                                        if report['platform'] == 'gpu' else {})
  assert 0 < report['total_bytes'] < report['usable_hbm_bytes'] <= report['hbm_bytes']
  assert report['step_seconds'] > 0 and 0 < report['mfu_bound'] <= 1
  # A TPU's is a roofline at the full peaks; a GPU's the kernels' sum at their efficiencies.
  assert report['mfu_bound_is'] == ('an estimate' if report['platform'] == 'gpu'
                                    else 'an upper bound')
  # The collectives' time over ICI or NVLink comes on top of the compute roofline.
  assert report['collective_seconds'] > 0 and report['step_seconds'] == pytest.approx(
      report['compute_seconds'] + report['collective_seconds'])
  counts = {kind: c['count'] for kind, c in report['collectives'].items()}
  # The gradients of the batch-sharded step are summed across devices.
  assert counts['all-reduce'] + counts['reduce-scatter'] > 0
  if devices['fsdp'] > 1:  # at most a quarter on each of 4 or 8 devices (norms and biases whole)
    shards = devices['fsdp'] * devices['tensor']
    assert report['param_bytes'] <= report['param_bytes_unsharded'] / (3 if shards == 4 else 4)
    assert counts['all-gather'] > 0  # FSDP weights gathered for the matmuls
  else:
    assert report['param_bytes'] < report['param_bytes_unsharded']


# Each kind of mesh, each model, for the TPU slice and the GPU node. The fast tier compiles one
# step for the TPU slice (the phase test below: a one-layer BERT at 512 tokens with the flash
# kernel, its parameters split over FSDP and tensor axes at once) and a step too large for a
# v5e; tests/test_aot_gpu.py compiles one-layer GPTs for GPUs in the fast tier.
@pytest.mark.slow
@pytest.mark.parametrize('module,mesh,topology', [
    pytest.param(module, mesh, topology, id=f'{name}-{mesh}-{topology}')
    for topology in SLICES for mesh in MESHES
    for name, module in (('bert', bert_base), ('gpt', gpt))])
def test_tiny_train_steps_compile(module, mesh, topology):
  report = aot.compile_step(_tiny(module, mesh, topology), topology)
  _check_sharded_step(report, SLICES[topology][mesh])
  assert report['platform'] == ('gpu' if topology.startswith('h100') else 'tpu')
  # Attention dropout 0.1: on GPUs our kernel with the dropout inside (a forward and a backward
  # call a layer, on each device's shard), on TPUs XLA's, as the flash kernel has none.
  gpu = report['platform'] == 'gpu'
  assert report['attention'] == ('triton' if gpu else 'xla')
  config = module.get_config('tiny')
  assert report['pallas_kernels'] == (2 * config.model.num_layers if gpu else 0)


@functools.cache  # one compile for the tests that read it (a test file runs on one worker)
def _flash_step(module) -> aot.CompiledStep:
  """The model's step with the flash kernel, tensor parallel on the TPU slice."""
  config = module.get_config('tiny')
  for name in ('num_layers', 'num_encoder_layers', 'num_decoder_layers'):
    if name in config.model:  # what a layer compiles to does not change with their number
      config.model[name] = 1
  config.model.attention_dropout_rate = 0.0  # the kernel has none; BERT's 0.1 keeps XLA's
  config.data.max_seq_length = 128  # the kernel's tile; shorter rows take XLA's attention
  if 'max_position_embeddings' in config.model:
    config.model.max_position_embeddings = max(config.model.max_position_embeddings, 128)
  config.mesh = MESHES['tensor']
  return aot.compile_train_step(config, 'v4:2x2x1')


# The fast tier's phase test below takes BERT's flash kernel on the TPU at 512 tokens.
@pytest.mark.slow
@pytest.mark.parametrize('module', [pytest.param(bert_base, id='bert'),
                                    pytest.param(transformer_wmt, id='transformer')])
def test_attention_auto_takes_the_flash_kernel_on_tpu(module):
  report = aot.step_report(_flash_step(module))
  assert report['platform'] == 'tpu'
  assert report['attention'] == 'flash' and report['pallas_kernels'] > 0
  _check_sharded_step(report, MESHES['tensor'])


@pytest.mark.slow  # a compile of its own: with FSDP the walk gives 0.79 (the phase test's step)
def test_hlo_bytes_agree_with_xla_cost_analysis():
  # Where XLA counts (a TPU step), the HLO walk that stands in for it on GPUs agrees: 0.942 on
  # this one-layer tensor-parallel step with the flash kernel (0.966 with two layers). Not as
  # close on every step: two-layer BERT with attention dropout gave 0.85 on a mesh of data 2 and
  # FSDP 2, 0.94 tensor parallel and 0.73 with FSDP 4 at 512 tokens.
  step = _flash_step(bert_base)
  xla_bytes = aot._cost(step.executable)['bytes accessed']
  assert 0.8 < hlo.hlo_bytes(step.executable.as_text()) / xla_bytes < 1.2


@pytest.mark.slow  # three compiles of a 2-layer BERT for a TPU
def test_scanned_layers_are_costed_as_if_unrolled():
  config = _tiny(bert_base, 'data_fsdp')
  config.model.scan_layers = True  # XLA counts a loop body once
  report = aot.compile_step(config, 'v4:2x2x1')
  assert report['step_seconds_source'] == 'roofline, layers unrolled'
  # Every layer counted: XLA's FLOPs within a few tens of percent of the model's analytic ones.
  ratio = report['xla_flops_per_device'] * report['devices'] / report['model_flops_per_step']
  assert 0.8 < ratio < 1.5 and report['loop_undercount'] < 1.25


def test_segment_mask_is_the_dense_masks_of_the_models():
  segments_BL = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]])
  dense = layers.SegmentMask(segments_BL, segments_BL, causal=True).dense()
  real = (segments_BL > 0)[:, None, :, None]  # padding queries' rows are never read
  np.testing.assert_array_equal(dense & real, layers.segment_causal_mask(segments_BL) & real)
  mask_BL = segments_BL.clip(0, 1)
  np.testing.assert_array_equal(layers.SegmentMask(mask_BL, mask_BL).dense() & real,
                                jnp.broadcast_to(layers.padding_mask(mask_BL), dense.shape) & real)


def test_the_512_token_phase_compiles_for_a_tpu_slice_with_fsdp_tensor_and_the_flash_kernel():
  # BERT's last 10% of steps (appendix A.2) as aot.py compiles them: the phase's config, on the
  # slice with its parameters split over FSDP and tensor axes at once. One compile of one layer
  # for the fast tier's TPU checks (19 s here, where the FSDP step at 512 tokens with XLA's
  # attention and the tensor-parallel one with the kernel took 28 and 18 s): attention dropout 0,
  # so that `auto` takes the flash kernel (with BERT's 0.1 XLA's attention, as the kernel has
  # none: test_aot_gpu.py's test of `auto`, and the slow tier's test_tiny_train_steps_compile).
  config = bert_base.get_config('tiny')
  config.model.num_layers = 1  # what a layer compiles to does not change with their number
  config.model.attention_dropout_rate = 0.0
  config.data.later_phases = ((0.9, 512, 80, True),)  # remat, as base and large have it
  config.train.batch_size = 8
  config.mesh = FSDP_AND_TENSOR
  first, second = trainer.phases.of(config)
  report = aot.compile_step(second.config, 'v4:2x2x1', unroll_estimate=False)
  assert (report['seq_len'], report['remat'], report['batch_size']) == (512, True, 8)
  assert first.config.data.max_seq_length == 128 and not first.config.model.remat
  _check_sharded_step(report, FSDP_AND_TENSOR)
  assert report['platform'] == 'tpu'
  assert report['attention'] == 'flash' and report['pallas_kernels'] > 0
  # The roofline's figures say they are estimates (bench.py's step_seconds is measured).
  assert {'step_seconds', 'mfu_bound', 'examples_per_sec_per_host'} <= set(report['estimates'])
  assert set(report['estimates']) <= set(report)


def test_flash_attention_is_refused_off_tpu_and_with_attention_dropout():
  config = bert_base.get_config('tiny')
  config.model.attention = 'flash'
  with pytest.raises(ValueError, match='is a TPU kernel'):
    trainer.checks.model_config(config, 'cpu')
  with pytest.raises(ValueError, match='attention_dropout_rate=0.1: set it to 0'):
    trainer.checks.model_config(config, 'tpu')


# 8 GB of embeddings on a 16 GiB v5e (XLA refuses it); 19 GiB on an H100, of which a step may
# take 90% (its total is over): three and four times over with AdamW's two moments.
@pytest.mark.parametrize('topology,vocab_size,message', [
    ('v5e:2x2', 16_000_000, r'RESOURCE_EXHAUSTED: .*HBM.*; fix: more FSDP'),
    pytest.param('h100:8', 40_000_000,
                 r'per GPU of 71.20 GiB HBM \(JAX takes 90%\); fix: more FSDP',
                 marks=pytest.mark.slow)])
def test_a_step_too_large_for_the_device_is_one_line(topology, vocab_size, message):
  config = bert_base.get_config('tiny')
  config.model.num_layers = 1  # the embeddings are what does not fit
  config.model.vocab_size = vocab_size
  config.train.batch_size = 8
  with pytest.raises(aot.DoesNotFit, match=r'^DOES NOT FIT: .*' + message) as error:
    aot.compile_step(config, topology)
  assert '\n' not in str(error.value)


def test_collectives_are_counted_from_hlo_text():
  hlo_text = '\n'.join([
      '  %ag = bf16[128,512]{1,0:T(8,128)(2,1)} all-gather(bf16[32,512] %p), dimensions={0}',
      '  %ar = (f32[10]{0}, /*index=1*/f32[6]{0}) all-reduce(f32[10] %a, f32[6] %b), to_apply=%add',
      '  %ars = f32[4,4]{1,0} all-reduce-start(f32[4,4] %c), to_apply=%add',
      '  %cp = (bf16[8]{0}, bf16[8]{0}, u32[], u32[]) collective-permute-start(bf16[8] %d)',
      '  %fusion = f32[4]{0} fusion(f32[4] %e), calls=%all-gather-like-name',
  ])
  found = {kind: {k: c[k] for k in ('count', 'bytes')}
           for kind, c in hlo.collectives(hlo_text).items()}
  assert found['all-gather'] == {'count': 1, 'bytes': 128 * 512 * 2}
  assert found['all-reduce'] == {'count': 2, 'bytes': 16 * 4 + 16 * 4}
  assert found['collective-permute'] == {'count': 1, 'bytes': 16}
  assert found['reduce-scatter']['count'] == found['all-to-all']['count'] == 0


def test_collectives_are_grouped_by_the_operation_and_pass_that_made_them():
  meta = lambda op: f', metadata={{op_name="jit(train_step)/{op}" stack_frame_id=3}}'  # noqa: E731
  hlo_text = '\n'.join([
      '  %cp1 = (bf16[64,8]{1,0}, bf16[64,8]{1,0}, u32[], u32[]) collective-permute-start('
      'bf16[64,8] %a)' + meta('transpose(jvp(Model))/layer_0/mlp/wi/dot_general'),
      '  %cp2 = (bf16[64,8]{1,0}, bf16[64,8]{1,0}, u32[], u32[]) collective-permute-start('
      'bf16[64,8] %b)' + meta('transpose(jvp(Model))/layer_7/mlp/wi/dot_general'),
      '  %cp3 = (bf16[64,8]{1,0}, bf16[64,8]{1,0}, u32[], u32[]) collective-permute-start('
      'bf16[64,8] %c)' + meta('jvp(Model)/layer_7/mlp/wi/dot_general'),
      '  %ar = f32[100,10]{1,0} all-reduce(f32[100,10] %d), to_apply=%add'
      + meta('transpose(jvp(Model))/token_embed/jit(_take)/scatter-add'),
  ])
  assert hlo.collectives_by_op(hlo_text) == [
      {'kind': 'all-reduce', 'op': 'backward Model/token_embed/_take/scatter-add', 'count': 1,
       'bytes': 4000},
      {'kind': 'collective-permute', 'op': 'backward Model/layer_N/mlp/wi/dot_general',
       'count': 2, 'bytes': 2048},
      {'kind': 'collective-permute', 'op': 'Model/layer_N/mlp/wi/dot_general', 'count': 1,
       'bytes': 1024}]


def test_an_unknown_topology_is_one_line():
  with pytest.raises(ValueError, match='use GENERATION:GRID with a TPU generation'):
    aot.topology_devices('v9:2x2')


def test_find_max_batch_finds_the_largest_fitting_batch(monkeypatch):
  # Memory 3 GiB + 0.7 GiB per example, 0.5 GiB more off multiples of 8 (tiles): not a line.
  compiled = []

  def compile_step(config, topology, unroll_estimate=True):
    del topology, unroll_estimate
    per_device = config.train.batch_size // 4
    compiled.append(per_device)
    total = (3 + 0.7 * per_device + (0.5 if per_device % 8 else 0)) * aot.GiB
    if total > 16 * aot.GiB:
      raise aot.DoesNotFit('DOES NOT FIT')
    return {'total_bytes': total, 'usable_hbm_bytes': 16 * aot.GiB}

  monkeypatch.setattr(aot, 'compile_step', compile_step)
  config = bert_base.get_config('tiny')
  config.mesh = (('data', 4), ('fsdp', 1), ('tensor', 1))
  config.train.batch_size = 16
  per_device, report = aot.find_max_batch(config, 'v5e:2x2')
  assert per_device == 17 and config.train.batch_size == 68  # 17 fits in 15.4 GiB, 18 needs 16.1
  assert report['total_bytes'] == pytest.approx(15.4 * aot.GiB)
  assert len(compiled) <= 8  # the search, then the report at 17


@pytest.mark.slow  # a process of its own and a compile
def test_the_command_leaves_a_compilation_cache_alone(tmp_path):
  """aot.py's programs are for compile-only devices: jax wrote them to a persistent compilation
  cache (JAX_COMPILATION_CACHE_DIR) that it could not read them back from, and every later run
  warned and compiled again. The command now writes nothing there."""
  cache = tmp_path / 'cache'
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),  # QUIET_LIBTPU: the fixture
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  result = subprocess.run(
      [sys.executable, 'aot.py', '--config=configs/bert_base.py:tiny', '--topology=v4:2x2x1',
       '--phase=1', '--config.model.num_layers=1'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'step (estimate)' in result.stdout
  assert not cache.exists() or not os.listdir(cache)
