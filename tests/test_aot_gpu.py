"""The GPU path compiled on this CPU (aot.py; the train steps of both platforms in test_aot.py):
jax's CUDA plugin describes the GPUs, nothing runs on one; the collective-time model; the cuDNN
call's arguments checked against XLA's attention (whole models: test_fused_attention.py)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aot
from configs import bert_base
from configs import gpt as gpt_config
from models import flash_dropout
from models import layers
from trainer import hlo
from trainer import peaks
import trainer.checks


# Slow: the fast tier has auto's choice (the next test) and cuDNN's call compiled (the dropout
# test below); this is the 8-GPU compile with the call split over the heads.
@pytest.mark.slow
def test_attention_auto_takes_cudnn_in_the_compiled_bert_step():
  config = bert_base.get_config('tiny')
  config.mesh = (('data', 4), ('fsdp', 1), ('tensor', 2))  # cuDNN's call split over the heads too
  config.model.attention_dropout_rate = 0.0  # cuDNN's attention has no dropout in jax's API
  report = aot.compile_step(config, 'h100:8')
  assert report['attention'] == 'cudnn'
  assert report['cudnn_attention_calls'] >= 2 * config.model.num_layers  # forward and backward


def test_auto_attention_takes_xlas_on_a_gpu_before_ampere(monkeypatch):
  """Colab's free T4 (compute capability 7.5) compiles neither Triton kernels nor cuDNN's fused
  attention: BERT's and GPT's first compile stopped there (seen compiling for a T4 target)."""
  class Gpu:
    def __init__(self, capability):
      self.compute_capability = capability
  config = bert_base.get_config('tiny')
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  for capability, with_dropout, without in (('7.5', 'xla', 'xla'), ('8.0', 'triton', 'cudnn'),
                                            ('9.0', 'triton', 'cudnn')):
    monkeypatch.setattr(jax, 'devices', lambda capability=capability: [Gpu(capability)])
    config.model.attention_dropout_rate = 0.1
    assert trainer.checks.model_config(config, 'gpu').attention == with_dropout
    config.model.attention_dropout_rate = 0.0
    assert trainer.checks.model_config(config, 'gpu').attention == without


def test_auto_attention_per_platform_dtype_and_head_width():
  config = bert_base.get_config('tiny')
  config.model.attention_dropout_rate = 0.0
  assert trainer.checks.model_config(config, 'gpu').attention == 'cudnn'
  assert trainer.checks.model_config(config, 'tpu').attention == 'flash'
  assert trainer.checks.model_config(config, 'cpu').attention == 'xla'
  config.model.dtype = 'float32'  # cuDNN's fused attention takes 16-bit inputs only
  assert trainer.checks.model_config(config, 'gpu').attention == 'xla'
  config.model.dtype = 'auto'
  config.model.num_heads = 16  # head width 8 is fine; 128 / 32 = 4 is not a multiple of 8
  assert trainer.checks.model_config(config, 'gpu').attention == 'cudnn'
  config.model.num_heads = 32
  assert trainer.checks.model_config(config, 'gpu').attention == 'xla'
  config.model.num_heads = 2
  config.model.attention = 'cudnn'
  with pytest.raises(ValueError, match='is a GPU kernel and this runs on tpu'):
    trainer.checks.model_config(config, 'tpu')
  config.model.dtype = 'float32'
  with pytest.raises(ValueError, match='cudnn computes in bfloat16 or float16'):
    trainer.checks.model_config(config, 'gpu')
  config.model.dtype = 'auto'
  config.model.attention_dropout_rate = 0.1  # cuDNN's dropout: opt-in
  assert trainer.checks.model_config(config, 'gpu').attention == 'cudnn'
  config.model.scan_layers = True  # the backward's masks were not the forward's (an H200)
  with pytest.raises(ValueError, match='set model.scan_layers=False or use model.attention=xla'):
    trainer.checks.model_config(config, 'gpu')
  config.model.scan_layers = False
  config.model.attention = 'auto'  # with attention dropout: ours on a GPU, XLA's elsewhere
  assert trainer.checks.model_config(config, 'gpu').attention == 'triton'
  assert trainer.checks.model_config(config, 'tpu').attention == 'xla'
  assert trainer.checks.model_config(config, 'cpu').attention == 'xla'
  config.model.dtype = 'float32'  # ours takes any float dtype
  assert trainer.checks.model_config(config, 'gpu').attention == 'triton'
  config.model.dtype = 'auto'
  config.model.attention = 'flash'
  with pytest.raises(ValueError, match='attention_dropout_rate=0.1: set it to 0'):
    trainer.checks.model_config(config, 'tpu')
  config.model.attention = 'triton'  # ours: dropout from the step's RNG, under scan too
  config.model.scan_layers = True
  assert trainer.checks.model_config(config, 'gpu').attention == 'triton'
  with pytest.raises(ValueError, match='triton is a GPU kernel and this runs on cpu'):
    trainer.checks.model_config(config, 'cpu')


def test_cudnn_attention_with_dropout_compiles_and_the_estimate_costs_it(monkeypatch):
  """GPT with the paper's attention dropout in cuDNN's kernel (model.attention=cudnn): a forward
  and a backward call per layer, each costed by its FLOPs and bytes like any kernel, so that
  the estimate cannot skip the attention."""
  # Every group of kernels, not the 30 largest: a tiny step's attention is among the smallest.
  monkeypatch.setattr(aot, 'kernels_by_op', functools.partial(aot.kernels_by_op, top=10_000))
  config = gpt_config.get_config('tiny')
  config.model.num_layers = 1  # each count below is per layer
  config.model.attention = 'cudnn'
  config.train.batch_size = 8
  asked = []  # what the steps asked for: the train step with cuDNN's dropout, the eval step not
  compiler_options = aot.steps.compiler_options
  monkeypatch.setattr(aot.steps, 'compiler_options', lambda mesh, cudnn_dropout=False: (
      asked.append(cudnn_dropout), compiler_options(mesh, cudnn_dropout))[1])
  report = aot.compile_step(config, 'h100:1')
  assert asked[:2] == [True, False]
  layers_count = config.model.num_layers
  assert report['attention'] == 'cudnn' and report['cudnn_attention_calls'] == 2 * layers_count
  # Compiled with cuDNN kept out of CUDA graphs, where its dropout aborted (an H200): no
  # XLA_FLAGS to export.
  assert report['compiler_options'] == {**aot.steps.GPU_COMPILER_OPTIONS,
                                        **aot.steps.CUDNN_DROPOUT_OPTIONS}
  attention = [k for k in report['kernels_by_op'] if k['kind'] == 'attention']
  assert sum(k['count'] for k in attention) == 2 * layers_count
  L, D = config.data.max_seq_length, config.model.hidden_size
  # Forward: two products of B x L x L over every head's width; backward: five.
  forward_flops = 4 * config.train.batch_size * L * L * D
  assert sorted(k['flops'] for k in attention) == [layers_count * forward_flops,
                                                  layers_count * forward_flops * 10 / 4]
  assert all(k['bytes'] > 0 for k in attention)
  assert report['compute_seconds_by_kind']['attention'] > 0
  # The projections before cuDNN's call take their biases in their matmuls (bias_in_matmul):
  # no kernel adds them and none sums their gradients.
  ops = [k['op'] for k in report['kernels_by_op']]
  assert any('attention/query/dot_general' in op for op in ops)
  assert not [op for op in ops if re.search(r'attention/(query|key|value)/(add|reduce_sum)$', op)]


@pytest.mark.parametrize('whole_queries', [0, pytest.param(128, marks=pytest.mark.slow)])
def test_our_attention_kernels_compile_for_a_gpu_and_the_estimate_costs_them(whole_queries,
                                                                             monkeypatch):
  """GPT with the paper's attention dropout in models/flash_dropout.py's kernels
  (model.attention=triton), compiled through Triton for an H100: a forward and a backward
  Pallas call per layer, each costed by the FLOPs it declares and its bytes; with
  WHOLE_QUERIES (opt-in), the backward of the row's 128 queries in one kernel."""
  monkeypatch.setattr(aot, 'kernels_by_op', functools.partial(aot.kernels_by_op, top=10_000))
  monkeypatch.setattr(flash_dropout, 'WHOLE_QUERIES', whole_queries)
  config = gpt_config.get_config('tiny')
  config.model.num_layers = 1  # each count below is per layer
  config.model.attention = 'triton'
  config.train.batch_size = 8
  report = aot.compile_step(config, 'h100:1')
  layers_count = config.model.num_layers
  assert report['attention'] == 'triton' and report['pallas_kernels'] == 2 * layers_count
  attention = {k['op'].split('/')[-2]: k for k in report['kernels_by_op']
               if k['kind'] == 'attention'}
  backward = 'flash_dropout_backward_' + ('all' if whole_queries else 'qkv')
  assert sorted(attention) == [backward, 'flash_dropout_forward']
  L, D = config.data.max_seq_length, config.model.hidden_size  # one 128-query tile per row
  product = 2 * config.train.batch_size * L * L * D  # one (L x K) by (K x L) per head
  # Causal: the forward's 128 x 64 tiles visit every key of the row's one query tile; the
  # backward's 64 x 64 tiles (dQ: 3 products, dK and dV: 4) skip the one above the diagonal;
  # the whole queries' backward visits both key tiles with all 128 queries (5 products).
  assert attention['flash_dropout_forward']['flops'] == layers_count * 2 * product
  assert attention[backward]['flops'] == layers_count * product * (5 if whole_queries else
                                                                   7 * 3 / 4)
  assert all(k['bytes'] > 0 for k in attention.values())
  assert report['compute_seconds_by_kind']['attention'] > 0
  # Self-attention: q, k and v from one matmul, read in place; no projection of its own, and
  # no sum of three input gradients.
  ops = [k['op'] for k in report['kernels_by_op']]
  assert [op for op in ops if op.endswith('_fused_self_attention/dot_general')]
  assert not [op for op in ops if re.search(r'attention/(query|key|value)/', op)]


@pytest.mark.slow  # a 4-process, 32-GPU compile
def test_two_nodes_send_the_data_axis_over_the_network_and_fsdp_over_nvlink():
  config = bert_base.get_config('tiny')
  config.mesh = (('data', 2), ('fsdp', 8), ('tensor', 1))  # fsdp inside a node, data across
  report = aot.compile_step(config, 'h100:2x8')
  assert report['devices'] == 16 and report['hosts'] == 2
  found = report['collectives']
  assert found['all-reduce']['network_bytes'] > 0  # the gradients' sum across the nodes
  assert found['reduce-scatter']['count'] > 0 and found['reduce-scatter']['network_bytes'] == 0


@pytest.mark.parametrize('name,nodes,per_node', [('h100:8', 1, 8), ('a100:4x8', 4, 8),
                                                 ('h200:2', 1, 2)])
def test_gpu_topology_names(name, nodes, per_node):
  chip, plugin_name, dims = aot.parse_topology(name)
  assert chip.gpu and dims == (nodes, per_node) and plugin_name == f'1x{nodes}x{per_node}'


def test_an_unknown_gpu_topology_is_one_line():
  for name in ('h100:16', 'h100:4x9', 'v100:8'):
    with pytest.raises(ValueError, match='GPU:NODESxGPUS'):
      aot.parse_topology(name)


def test_collective_seconds_of_a_hand_written_step():
  # Two hosts of two devices; 100 GB/s inside a host, 10 GB/s between hosts.
  chip = aot.Chip(hbm_bytes=1, peak=peaks.Peak(1.0, 1.0, ''), hbm_bytes_per_sec=1.0,
                  link_bytes_per_sec=100e9,
                  network_bytes_per_sec=10e9, gpu=aot.GPUS['h100'].gpu)
  hosts = [0, 0, 1, 1]
  hlo_text = '\n'.join([
      'HloModule step',
      '%body (p: (s32[], f32[100])) -> (s32[], f32[100]) {',
      '  %p = (s32[], f32[100]{0}) parameter(0)',
      '  %x = f32[100]{0} get-tuple-element(%p), index=1',
      '  %ar.2 = f32[100]{0} all-reduce-start(%x), replica_groups={}, to_apply=%add',
      '}',
      'ENTRY %main (a: f32[1000]) -> f32[1000] {',
      # in-host pairs: each sends 2 (n-1)/n = 1 times 4000 bytes over the links
      '  %ar.1 = f32[1000]{0} all-reduce-start(f32[1000]{0} %a), '
      'replica_groups={{0,1},{2,3}}, to_apply=%add',
      # groups [[0,2],[1,3]] span the hosts: 1/2 of 40 result bytes over the network
      '  %ag = (bf16[10]{0}, bf16[20]{0}) all-gather-start(bf16[10]{0} %b), '
      'replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}',
      # over mesh axis_0 of [[0,1],[2,3]]: groups [[0,2],[1,3]], n - 1 = 1 times 1000 bytes
      "  %rs = f32[250]{0} reduce-scatter(f32[500]{0} %c), replica_groups=mesh['axis_0'=2,"
      "'axis_1'=2] {'axis_0'}, dimensions={0}, to_apply=%add",
      '  %cp = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(f32[10]{0} %d), '
      'source_target_pairs={{0,1},{1,0}}',
      # 3 trips of an all-reduce over all 4 devices: 2 (3/4) 400 bytes each, over the network
      '  %w = (s32[], f32[100]{0}) while(%t), condition=%cond, body=%body, '
      'backend_config={"known_trip_count":{"n":"3"}}',
      '}',
  ])
  found = hlo.collectives(hlo_text, chip, hosts)
  assert found['all-reduce']['count'] == 1 + 3
  assert found['all-reduce']['bytes'] == 4000 + 3 * 400
  assert found['all-reduce']['seconds'] == pytest.approx(4000 / 100e9 + 3 * 600 / 10e9)
  assert found['all-reduce']['network_bytes'] == 3 * 400
  assert found['all-gather']['seconds'] == pytest.approx(20 / 10e9)
  assert found['reduce-scatter']['seconds'] == pytest.approx(1000 / 10e9)
  assert found['collective-permute']['seconds'] == pytest.approx(40 / 100e9)
  assert hlo.collective_seconds(found) == pytest.approx(
      4000 / 100e9 + 1800 / 10e9 + 20 / 10e9 + 1000 / 10e9 + 40 / 100e9)
  # A TPU slice is one ICI domain: every byte on the links, whatever the hosts.
  tpu = dataclasses.replace(chip, network_bytes_per_sec=0.0, gpu=None)
  assert hlo.collective_seconds(hlo.collectives(hlo_text, tpu, hosts)) == pytest.approx(
      (4000 + 1800 + 20 + 1000 + 40) / 100e9)


_FMHA_CONFIG = ('"cudnn_fmha_backend_config": {"fmha_scale": 0.125, "intermediate_tensor_shape": '
                '{"element_type": "BF16", "dimensions": ["2", "4", "128", "128"]}}')
KERNELS_HLO = '\n'.join([
    'HloModule step',
    '%gemm (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {',
    '  %p0 = bf16[64,32]{1,0} parameter(0)',
    '  %p1 = bf16[32,16]{1,0} parameter(1)',
    '  %n = bf16[32,16]{1,0} negate(%p1)',
    '  ROOT %d = bf16[64,16]{1,0} dot(%p0, %n), lhs_contracting_dims={1}, rhs_contracting_dims={0}',
    '}',
    '%outer (o0: bf16[64,32], o1: bf16[32,16]) -> bf16[64,16] {',  # Triton's nested gemm fusion
    '  %o0 = bf16[64,32]{1,0} parameter(0)',
    '  %o1 = bf16[32,16]{1,0} parameter(1)',
    '  ROOT %inner = bf16[64,16]{1,0} fusion(%o0, %o1), kind=kCustom, calls=%gemm',
    '}',
    '%scale (q0: f32[1000]) -> f32[1000] {',
    '  %q0 = f32[1000]{0} parameter(0)',
    '  %e = f32[1000]{0} exponential(%q0)',
    '  %b = f32[1000]{0} broadcast(f32[] %c), dimensions={}',
    '  ROOT %m = f32[1000]{0} multiply(%e, %b)',
    '}',
    '%body (t: (s32[], f32[1000])) -> (s32[], f32[1000]) {',
    '  %t = (s32[], f32[1000]{0}) parameter(0)',
    '  %x = f32[1000]{0} get-tuple-element(%t), index=1',
    '  %f = f32[1000]{0} fusion(%x), kind=kLoop, calls=%scale',
    '}',
    'ENTRY %main (a: bf16[64,32], w: bf16[32,16], v: f32[1000]) -> bf16[64,16] {',
    '  %a = bf16[64,32]{1,0} parameter(0)',
    '  %w = bf16[32,16]{1,0} parameter(1)',
    '  %v = f32[1000]{0} parameter(2)',
    '  %q = bf16[2,128,4,64]{3,2,1,0} parameter(3)',
    '  %g = bf16[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%outer',
    '  %loop = (s32[], f32[1000]{0}) while(%v), condition=%cond, body=%body, '
    'backend_config={"known_trip_count":{"n":"3"}}',
    '  %ar = f32[1000]{0} all-reduce-start(%v), replica_groups={}, to_apply=%add',
    '  %att = (bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), '
    'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={'
    'bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}}, '
    'backend_config={' + _FMHA_CONFIG + '}',
    '}',
])


def test_per_kernel_estimate_of_a_hand_written_step(monkeypatch):
  kernels = {k.name: k for k in hlo.hlo_kernels(KERNELS_HLO)}
  assert set(kernels) == {'g', 'f', 'ar', 'att'}
  # The nested gemm fusion: 2 x 64 x 16 x 32 FLOPs; reads a and w, writes g (bf16).
  assert (kernels['g'].kind, kernels['g'].flops, kernels['g'].bytes) == (
      'matmul', 2 * 64 * 16 * 32, 2 * (64 * 32 + 32 * 16 + 64 * 16))
  # exp and multiply per element (the broadcast computes nothing), 3 trips, 4000 bytes each way.
  assert (kernels['f'].kind, kernels['f'].flops, kernels['f'].bytes, kernels['f'].times) == (
      'vector', 2000, 8000, 3)
  # cuDNN's forward attention: 4 x B H L S K; reads q, k, v, writes its output and statistics.
  q_bytes = 2 * 128 * 4 * 64 * 2
  assert (kernels['att'].kind, kernels['att'].flops, kernels['att'].bytes) == (
      'attention', 4 * 2 * 4 * 128 * 128 * 64, 3 * q_bytes + q_bytes + 2 * 4 * 128 * 4)
  assert kernels['ar'].kind == 'collective'
  assert hlo.hlo_bytes(KERNELS_HLO) == sum(k.bytes * k.times for k in kernels.values())

  monkeypatch.setattr(aot, 'MATMUL_EFFICIENCY', 0.5)
  monkeypatch.setattr(aot, 'HBM_EFFICIENCY', 0.5)
  monkeypatch.setattr(aot, 'KERNEL_SECONDS', 1e-6)
  chip = dataclasses.replace(aot.GPUS['h100'], peak=peaks.Peak(2e12, 1e12, ''),
                             hbm_bytes_per_sec=2e11)
  seconds, source, counts, by_kind = aot.gpu_compute_estimate(KERNELS_HLO, chip, 'bfloat16')
  vector_rate = 132 * 128 * 1.98e9 * 2  # the H100's CUDA cores
  expected = {
      'matmul': max(65536 / 1e12, 7168 / 1e11),  # FLOPs at half of 2e12, bytes at half of 2e11
      'attention': max(33554432 / 1e12, 528384 / 1e11),
      'vector': 3 * max(2000 / vector_rate, 8000 / 1e11),
      'fixed': 5 * 1e-6,  # g, att and f's 3 trips; the collective is collective_seconds'
  }
  assert by_kind == pytest.approx(expected)
  assert seconds == pytest.approx(sum(expected.values()))
  assert counts['kernels'] == 5 and source == 'per kernel, 5 kernels'
  # float32 matmuls run at the TF32 peak (half of bfloat16's here).
  assert aot.gpu_compute_estimate(KERNELS_HLO, chip, 'float32')[3]['attention'] == pytest.approx(
      33554432 / 0.5e12)


def test_hlo_bytes_count_loop_bodies_by_their_trips():
  hlo_text = '\n'.join([
      '%cond (p: (s32[], f32[8])) -> pred[] {',
      '  %n = s32[] constant(5)',
      '  %lt = pred[] compare(%i, %n), direction=LT',
      '}',
      '%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %x = f32[8]{0} get-tuple-element(%p), index=1',
      '  %y = f32[8]{0} fusion(%x), kind=kLoop, calls=%f',  # reads 32, writes 32 bytes
      '}',
      'ENTRY %main (a: f32[8]) -> f32[8] {',
      '  %a = f32[8]{0} parameter(0)',
      '  %b = f32[16]{0} fusion(%a), kind=kLoop, calls=%g',  # reads 32, writes 64 bytes
      '  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body',  # 5 trips, from %cond
      '}',
  ])
  assert hlo.hlo_bytes(hlo_text) == 96 + 5 * 64


def test_hlo_bytes_count_what_is_sliced_or_updated_in_place():
  # An LSTM's loop reads one time step of its inputs and writes one step of its outputs.
  hlo_text = '\n'.join([
      '%fused_step (param_0: f32[20,8], param_1: s32[], param_2: f32[20,8]) -> f32[20,8] {',
      '  %param_0 = f32[20,8]{1,0} parameter(0)',
      '  %param_1 = s32[] parameter(1)',
      '  %param_2 = f32[20,8]{1,0} parameter(2)',
      '  %ds = f32[1,8]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,8}',
      '  %h = f32[1,8]{1,0} tanh(%ds)',
      '  ROOT %dus = f32[20,8]{1,0} dynamic-update-slice(%param_2, %h, %param_1, %zero)',
      '}',
      'ENTRY %main (x: f32[20,8], i: s32[], y: f32[20,8]) -> f32[20,8] {',
      '  %x = f32[20,8]{1,0} parameter(0)',
      '  %i = s32[] parameter(1)',
      '  %y = f32[20,8]{1,0} parameter(2)',
      '  %step = f32[20,8]{1,0} fusion(%x, %i, %y), kind=kLoop, calls=%fused_step',
      '  %row = f32[1,8]{1,0} dynamic-slice(%x, %i, %i), dynamic_slice_sizes={1,8}',
      '}',
  ])
  # The fusion reads 32 bytes of x, the index and none of y, and writes 32 bytes into y; the
  # dynamic-slice reads and writes one row.
  assert hlo.hlo_bytes(hlo_text) == (32 + 4 + 0 + 32) + (32 + 4 + 4 + 32)


def _inputs(B=2, L=8, S=8, H=2, K=8):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (B, L, H, K)), jax.random.normal(keys[1], (B, S, H, K)),
          jax.random.normal(keys[2], (B, S, H, K)))


MASKS = {
    'bert_padding': layers.SegmentMask(jnp.array([[1] * 5 + [0] * 3, [1] * 8]),
                                       jnp.array([[1] * 5 + [0] * 3, [1] * 8]),
                                       kernel='cudnn', right_padded=True),
    'gpt_packed_causal': layers.SegmentMask(jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]] * 2),
                                            jnp.array([[1, 1, 1, 2, 2, 3, 0, 0]] * 2),
                                            causal=True, kernel='cudnn'),
    'gpt_unpacked_causal': layers.SegmentMask(jnp.ones((2, 8), jnp.int32),
                                              jnp.ones((2, 8), jnp.int32), causal=True,
                                              kernel='cudnn', right_padded=True),
    'transformer_cross': layers.SegmentMask(jnp.array([[1, 1, 2, 2, 2, 0, 0, 0]] * 2),
                                            jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]] * 2),
                                            kernel='cudnn'),
}


@pytest.mark.parametrize('name', MASKS)
def test_cudnn_arguments_give_the_xla_paths_attention(name):
  mask = MASKS[name]
  q, k, v = _inputs()
  real = np.asarray(mask.q_BL > 0)  # padding queries' outputs are never read
  expected = jax.nn.dot_product_attention(q, k, v, mask=mask.dense())
  # The arguments the cuDNN call gets, run on XLA's implementation of the same API.
  got = jax.nn.dot_product_attention(q, k, v, **layers.cudnn_arguments(mask),
                                     implementation='xla')
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-5)
  # A mask that let one real query see one more key would differ.
  wrong = jax.nn.dot_product_attention(q, k, v, mask=mask.dense().at[:, :, 1, -1].set(True))
  assert not np.allclose(np.asarray(wrong)[real], np.asarray(expected)[real], atol=1e-3)


CONV = 'window={size=3}, dim_labels=b0f_o0i->b0f, custom_call_target="__cudnn$conv'
CONV_HLO = f'''HloModule conv, entry_computation_layout={{()->()}}

ENTRY %main (x: bf16[64,50,16], k: bf16[32,3,16], dy: bf16[64,48,32]) -> bf16[64,48,32] {{
  %x = bf16[64,50,16]{{2,1,0}} parameter(0)
  %k = bf16[32,3,16]{{2,1,0}} parameter(1)
  %dy = bf16[64,48,32]{{2,1,0}} parameter(2)
  %fwd = (bf16[64,48,32]{{2,1,0}}, u8[0]{{0}}) custom-call(%x, %k), {CONV}Forward"
  %dk = (bf16[32,3,16]{{2,1,0}}, u8[0]{{0}}) custom-call(%x, %dy), {CONV}BackwardFilter"
  %dx = (bf16[64,50,16]{{2,1,0}}, u8[0]{{0}}) custom-call(%dy, %k), {CONV}BackwardInput"
  ROOT %out = bf16[64,48,32]{{2,1,0}} get-tuple-element(%fwd), index=0
}}
'''


def test_cudnn_convolutions_are_costed_by_their_flops():
  """ELMo's and CVT's char CNNs compile to cuDNN convolutions on a GPU (lines as XLA writes
  them for a width-3 filter over 50 characters); each was a kernel of 0 FLOPs."""
  kernels = {k.name: k for k in hlo.hlo_kernels(CONV_HLO)}
  # 2 x batch 64 x 48 positions x 32 filters x width 3 x 16 input features, each pass.
  flops = 2 * 64 * 48 * 32 * 3 * 16
  for name in ('fwd', 'dk', 'dx'):
    assert (kernels[name].kind, kernels[name].flops) == ('matmul', flops)
