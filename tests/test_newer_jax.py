"""On a jax newer than the pin (a GPU or TPU image's own), what it no longer has costs one line,
never the run: XLA options its compiler refuses are dropped, a moved experimental module
turns its kernel off."""

import os
import subprocess
import sys

import jax
import jaxlib
import numpy as np
import pytest

import input_pipeline
from configs import bert_base
from models import layers
from test_train import micro_config
from trainer import sharding
from trainer import steps
import trainer.checks
import trainer.state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An option no jaxlib knows (as 'xla_gpu_enable_pipelined_all_reduce' is unknown to jaxlib 0.11.2's
# GPU compiler) and one the CPU compiler knows.
REFUSED = 'xla_cpu_option_that_no_jaxlib_has'
OPTIONS = {REFUSED: True, 'xla_cpu_enable_fast_math': False}


@pytest.fixture
def cpu_options(monkeypatch):
  """Options for steps on the CPU, as GPU_COMPILER_OPTIONS are for steps on GPUs."""
  monkeypatch.setitem(steps.PLATFORM_OPTIONS, 'cpu', OPTIONS)
  monkeypatch.setattr(steps, '_accepted', {})


def test_a_refused_option_is_dropped_in_one_line_once_and_the_step_trains(
    cpu_options, shared_data_dir, capfd):
  config = micro_config(shared_data_dir)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:2])
  _, _, state, train_step, eval_step = trainer.state.build(config, mesh)
  local = input_pipeline.example_batch(config.data, config.model.vocab_size,
                                       batch_size=config.train.batch_size)
  with jax.set_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    for _ in range(3):  # the first step's learning rate is 0 (warmup)
      state, metrics = train_step(state, batch)
    eval_step(state.params, batch)  # compiled with the same options
  assert int(state.step) == 3 and np.isfinite(float(metrics['loss'][0]))
  assert steps.compiler_options(mesh) == {'xla_cpu_enable_fast_math': False}
  err = capfd.readouterr().err
  line = (f'XLA option {REFUSED} is not known to this jaxlib ({jaxlib.__version__}, cpu): the '
          'steps compile without it.')
  assert err.count('XLA option') == 1 and line in err, err


def test_options_the_compiler_knows_are_all_kept(monkeypatch):
  monkeypatch.setattr(steps, '_accepted', {})
  mesh = sharding.make_mesh((('data', 2), ('fsdp', 1), ('tensor', 1)), jax.devices()[:2])
  with jax.set_mesh(mesh):  # as when trainer.state.build compiles the steps
    kept = steps.accepted_options(mesh, {'xla_cpu_enable_fast_math': False})
  assert kept == {'xla_cpu_enable_fast_math': False}
  # On the CPU no options are set; on GPUs all of GPU_COMPILER_OPTIONS (test_aot.py).
  assert steps.compiler_options(mesh) is None


def test_an_unknown_name_in_a_list_option_is_dropped_in_one_line(monkeypatch, capfd):
  # CUDNN_DROPOUT_OPTIONS names kinds of XLA's command buffers; a jaxlib without one of them
  # compiles with the others, not with none.
  monkeypatch.setattr(steps, '_said', set())
  mesh = sharding.make_mesh((('data', 1), ('fsdp', 1), ('tensor', 1)), jax.devices()[:1])
  wanted = {'xla_gpu_enable_command_buffer': 'FUSION,NO_SUCH_KIND,CUBLAS'}
  with jax.set_mesh(mesh):
    kept = steps.accepted_options(mesh, wanted)
    steps.accepted_options(mesh, wanted)
  assert kept == {'xla_gpu_enable_command_buffer': 'FUSION,CUBLAS'}
  err = capfd.readouterr().err
  assert err.count('XLA option') == 1 and 'knows no NO_SUCH_KIND' in err, err


@pytest.mark.slow  # a train.py run
def test_train_py_on_a_jaxlib_that_refuses_an_option_says_so_once_and_trains(
    tmp_path, shared_data_dir):
  # train.py itself, its steps given an option the compiler refuses.
  program = ('import runpy, sys; from trainer import steps; '
             f'steps.PLATFORM_OPTIONS["cpu"] = {OPTIONS!r}; '
             'sys.argv = ["train.py"] + sys.argv[1:]; '
             'runpy.run_path("train.py", run_name="__main__")')
  result = subprocess.run(
      [sys.executable, '-c', program, '--config=configs/bert_base.py:tiny',
       f'--workdir={tmp_path}', f'--config.data.data_dir={shared_data_dir}',
       '--config.train.num_steps=6', '--config.train.log_every=3', '--config.train.eval_every=6',
       '--config.train.eval_steps=1', '--config.optimizer.warmup_steps=2',
       '--config.data.later_phases=()'],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2'),
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  refusals = [line for line in result.stderr.splitlines() if line.startswith('XLA option')]
  assert refusals == [f'XLA option {REFUSED} is not known to this jaxlib ({jaxlib.__version__}, '
                      'cpu): the steps compile without it.'], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert os.path.isdir(tmp_path / 'checkpoints' / '6')


def test_without_the_tpu_flash_module_attention_auto_takes_xla_and_flash_is_refused(
    monkeypatch):
  config = bert_base.get_config('tiny')
  config.model.attention_dropout_rate = 0.0
  assert trainer.checks.model_config(config, 'tpu').attention == 'flash'
  monkeypatch.setattr(layers, 'tpu_flash', None)  # as if a newer jax had moved it
  assert trainer.checks.model_config(config, 'tpu').attention == 'xla'
  config.model.attention = 'flash'
  with pytest.raises(ValueError, match='has no jax.experimental.pallas.ops.tpu.flash_attention: '
                                       'use model.attention=auto or xla'):
    trainer.checks.model_config(config, 'tpu')
