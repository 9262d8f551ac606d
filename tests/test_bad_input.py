"""Every mistake a user can make stops train.py with one line naming the fix, before compiling."""

import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forked  # tests/
from configs import bert_finetune as bert_finetune_config
from configs import elmo as elmo_config
from configs import elmo_tagger as elmo_tagger_config
from configs import gpt as gpt_config
from configs import transformer_wmt as transformer_config
from configs.bert_base import get_config as bert_config
import input_pipeline
from models import gpt
from trainer import checkpoints
from trainer import checks
from trainer import cli
from trainer import host_memory
import trainer.loop
import trainer.state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *overrides, devices=4, config='configs/bert_base.py:tiny'):
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
             JAX_PLATFORMS='cpu')
  args = [sys.executable, 'train.py', f'--config={config}',
          f'--workdir={tmp_path / "run"}', f'--config.data.data_dir={tmp_path / "data"}',
          *overrides]
  return forked.run(args, cwd=ROOT, env=env)  # train.py as a new process, its imports done


def error_line(result):
  lines = [l for l in result.stderr.splitlines() if l.startswith('train.py: error:')]
  assert result.returncode != 0, result.stdout + result.stderr
  assert len(lines) == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  return lines[0]


@pytest.fixture
def text_files(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text('The first sentence here.\nAnd a second one.\n\nAnother document.\n'
                  'It has two lines.\n', encoding='utf-8')
  return str(path)


@pytest.mark.parametrize('overrides,expected', [
    (('--config.model.hidden_sizee=64',), "no field 'hidden_sizee'"),
    (('--config.model.num_heads=3',), 'not divisible by model.num_heads=3'),
    (('--config.train.batch_size=30',), 'not divisible by the data-parallel size 4'),
    (('--config.data.max_seq_length=1024',), 'above model.max_position_embeddings=512'),
    (('--config.mesh=(("data",-1),("fsdp",1),("tensor",3))',), 'does not divide the 4'),
    (('--config.mesh=(("data",1),("fsdp",1),("tensor",4))', '--config.model.num_heads=2'),
     "along 'heads', which the mesh axes ('tensor',) split 4 ways"),
    (('--config.data.source=files', '--config.data.files=/nonexistent/*.txt'),
     'matches no files'),
    (('--config.data.source=nowhere',), 'nowhere'),
])
def test_config_errors(tmp_path, overrides, expected):
  line = error_line(run_train(tmp_path, *overrides))
  assert expected in line, line
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')
  assert not os.path.exists(tmp_path / 'data'), 'the data was built before the error'


def test_missing_config_file(tmp_path):
  line = error_line(run_train(tmp_path, config='configs/missing.py'))
  assert "No such file or directory: 'configs/missing.py'" in line and 'configs/<file>.py' in line


def test_workdir_that_is_a_file(tmp_path):
  (tmp_path / 'run').write_text('not a run\n', encoding='utf-8')
  line = error_line(run_train(tmp_path))
  assert 'is a file: pass a directory' in line
  assert (tmp_path / 'run').read_text(encoding='utf-8') == 'not a run\n'


def test_a_workdir_in_use_by_another_run_is_refused_before_anything_is_built(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  holder = os.open(workdir, os.O_RDONLY)  # as a running train.py holds it
  fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    with pytest.raises(ValueError, match=r'run is in use by another training process .*wait '
                       'for it or stop it, or pass another --workdir'):
      trainer.loop.train_and_evaluate(gpt_config.get_config('tiny'), str(workdir))
  finally:
    os.close(holder)
  assert os.listdir(workdir) == []
  # Released when its run ends; a workdir made after the checks is taken then.
  with trainer.loop.workdir_lock(str(workdir)):
    with pytest.raises(ValueError, match='in use by another'):
      with trainer.loop.workdir_lock(str(workdir)):
        pass
  new = tmp_path / 'new'
  with trainer.loop.workdir_lock(str(new)) as take:
    new.mkdir()
    with trainer.loop.workdir_lock(str(new)):  # not taken yet
      pass
    take()
    with pytest.raises(ValueError, match='in use by another'):
      with trainer.loop.workdir_lock(str(new)):
        pass
  with trainer.loop.workdir_lock(str(new)):
    pass
  # A sweep holds its workdir as a run does (sweep.py's main).
  sweep_dir = tmp_path / 'sweep'
  sweep_dir.mkdir()
  held = cli.hold_directory(str(sweep_dir))
  try:
    result = forked.run([sys.executable, os.path.join(ROOT, 'sweep.py'),
                         '--sweep=configs/sweeps/gpt_aux_lm.py', f'--workdir={sweep_dir}'],
                        cwd=ROOT)
  finally:
    os.close(held)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith(
      f'sweep.py: error: {sweep_dir} is in use by another training process'), result.stderr
  assert os.listdir(sweep_dir) == []


def test_text_file_that_is_not_utf8(tmp_path):
  path = tmp_path / 'latin1.txt'
  path.write_bytes('Un café à Paris.\nLa tête.\n\nÉté chaud.\n'.encode('latin-1'))
  line = error_line(run_train(tmp_path, '--config.data.source=files',
                              f'--config.data.files={path}'))
  assert f'{path} is not UTF-8 text' in line and 'iconv' in line


def test_vocabulary_larger_than_the_model(tmp_path, text_files):
  vocab = tmp_path / 'vocab.txt'
  vocab.write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] +
                             [f'w{i}' for i in range(5000)]) + '\n', encoding='utf-8')
  line = error_line(run_train(tmp_path, '--config.data.source=files',
                              f'--config.data.files={text_files}',
                              f'--config.data.vocab_file={vocab}'))
  assert '--config.model.vocab_size=5005' in line


def test_empty_source(tmp_path):
  empty = tmp_path / 'empty.txt'
  empty.write_text('\n\n', encoding='utf-8')
  line = error_line(run_train(tmp_path, '--config.data.source=files',
                              f'--config.data.files={empty}'))
  assert "gives no 'train' documents" in line, line


@pytest.mark.parametrize('config,overrides,expected', [
    ('configs/gpt_finetune.py:nosuch,tiny', (), "Unknown task 'nosuch'"),
    ('configs/gpt_finetune.py:sst2,huge', (), "Unknown size 'huge'"),
    ('configs/gpt_finetune.py:offline_shuffled,tiny', ('--config.init_from=/nonexistent',),
     "config.init_from='/nonexistent' is not a directory (nothing is there)"),
    ('configs/gpt.py:tiny', ('--config.data.tokenizer=sentencepiece',),
     "data.tokenizer='sentencepiece' is not a tokenizer this code knows"),
    ('configs/gpt.py:tiny', ('--config.optimizer.schedule=step',), 'use one of linear, cosine, constant'),
    ('configs/gpt.py:tiny', ('--config.model.head=pool',), "model.head='pool'"),
    ('configs/gpt.py:tiny', ('--config.data.pipeline=elmo',), "data.pipeline='elmo' is not a pipeline"),
])
def test_gpt_config_errors(tmp_path, config, overrides, expected):
  line = error_line(run_train(tmp_path, *overrides, config=config))
  assert expected in line, line
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_without_an_accelerator_the_plugins_say_nothing(tmp_path):
  """requirements-dev.txt installs libtpu and the CUDA plugin. On a machine with neither chip
  (and JAX_PLATFORMS unset) train.py leaves JAX on the CPU, so a bad value gives its one line
  and nothing else: no libtpu E0000 lines, no cuInit traceback."""
  assert importlib.util.find_spec('libtpu'), 'requirements-dev.txt installs libtpu'
  if not host_memory.cpu_backend_expected():
    pytest.skip('this machine has an accelerator')
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/gpt.py:tiny', f'--workdir={tmp_path}',
       '--config.optimizer.learning_rate=-2.5e-4'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.splitlines() == [
      'train.py: error: optimizer.learning_rate=-0.00025 is outside (0, inf) (a positive '
      'number): set a value in (0, inf).'], result.stderr[-3000:]


def bert_run(workdir, checkpoint=True, config=None):
  """A workdir as a run (BERT tiny's) leaves it: config.json, and a checkpoint directory (or
  only a save's temporary one)."""
  config = config or bert_config('tiny')
  os.makedirs(workdir / 'checkpoints' / ('4' if checkpoint else '4.orbax-checkpoint-tmp'))
  (workdir / 'config.json').write_text(config.to_json_best_effort(), encoding='utf-8')


def test_a_workdir_of_another_run_is_named_as_such(tmp_path):
  bert_run(tmp_path / 'bert')
  with pytest.raises(ValueError, match=re.escape(
      f'--workdir={tmp_path / "bert"} holds a bert run (objective mlm_nsp) and this config trains '
      'gpt (lm): pass a new --workdir for this run, or give the config that run was started '
      'with to resume it.')):
    checks.check_run_directories(gpt_config.get_config('tiny'), str(tmp_path / 'bert'))
  config = bert_config('tiny')
  config.data.tokenizer = 'bpe'
  with pytest.raises(ValueError, match=re.escape(
      'holds a checkpoint of a run with data.tokenizer=wordpiece and this config has bpe, so it '
      'cannot resume it: pass a new --workdir for this run, or set --config.data.tokenizer='
      'wordpiece to resume that run.')):
    checks.check_run_directories(config, str(tmp_path / 'bert'))
  bert_run(tmp_path / 'elmo', config=elmo_config.get_config('tiny'))
  config = elmo_config.get_config('tiny')
  config.optimizer.name = 'sgd'
  with pytest.raises(ValueError, match='optimizer.name=adagrad and this config has sgd'):
    checks.check_run_directories(config, str(tmp_path / 'elmo'))
  config = elmo_config.get_config('tiny')
  config.data.split_words = 'spaces'  # its words.txt holds the words of the other split
  with pytest.raises(ValueError, match='data.split_words=punctuation and this config has spaces'):
    checks.check_run_directories(config, str(tmp_path / 'elmo'))
  config = bert_config('tiny')
  config.optimizer.clip_norm = 0.0  # no clipping: optax.chain's state no longer
  with pytest.raises(ValueError, match=re.escape(
      'optimizer.clip_norm=1.0 and this config has 0.0: clipping on or off is another optimizer '
      'state, so it cannot resume it: pass a new --workdir for this run, or set '
      '--config.optimizer.clip_norm to a positive one to resume that run.')):
    checks.check_run_directories(config, str(tmp_path / 'bert'))
  config = bert_config('tiny')
  config.seed = 1
  with pytest.raises(ValueError, match=re.escape(
      'holds a checkpoint of a run with seed=0 and this config has 1, which draws other data and '
      'dropout from here on: pass a new --workdir for this run, or set --config.seed=0 to resume '
      'that run.')):
    checks.check_run_directories(config, str(tmp_path / 'bert'))
  # Its data position counts chunks of docs_per_chunk documents and the examples of each.
  for field, value in (('docs_per_chunk', 7), ('max_seq_length', 64)):
    config = bert_config('tiny')
    config.data[field] = value
    with pytest.raises(ValueError, match=re.escape(f'and this config has {value}, so it cannot '
                                                   f'resume it')):
      checks.check_run_directories(config, str(tmp_path / 'bert'))
  config = bert_config('tiny')
  config.data.eval_holdout = 3
  with pytest.raises(ValueError, match=re.escape(
      'a run that held out 1 in data.eval_holdout=10 training examples and this config holds out '
      '1 in 3, which is another training stream, so it cannot resume it: pass a new --workdir '
      'for this run, or set --config.data.eval_holdout=10 to resume it.')):
    checks.check_run_directories(config, str(tmp_path / 'bert'))
  # The same files moved elsewhere resume; a run with eval files of its own holds nothing out.
  config = bert_config('tiny')
  config.data.update(source='files', files='/nfs/books/*.txt', eval_files='/nfs/dev.txt')
  bert_run(tmp_path / 'files', config=config)
  config.data.update(files='/local/books/*.txt', eval_holdout=3)
  checks.check_run_directories(config, str(tmp_path / 'files'))
  config.data.eval_files = ''
  with pytest.raises(ValueError, match=re.escape(
      'a run that took its eval examples from a source of their own and this config holds out 1 '
      'in 3, which is another training stream, so it cannot resume it: pass a new --workdir for '
      'this run, or give the data fields of that run (its config.json) again to resume it.')):
    checks.check_run_directories(config, str(tmp_path / 'files'))
  # Pipelines whose eval split is their own (WMT's validation pairs, a GLUE dev set, CVT's
  # synthetic tags) take any eval_holdout; their offline forms hold out and do not.
  for make, own, offline in (
      (lambda: transformer_config.get_config('base'), {}, {'pairs': 'offline'}),
      (lambda: bert_finetune_config.get_config('sst2'), {}, {'task': 'offline_next'}),
      (lambda: elmo_tagger_config.get_config('offline_names'), {}, {'task': 'offline_replaced'})):
    for fields, refused in ((own, False), (offline, True)):
      config = make()
      config.data.update(fields)
      workdir = tmp_path / f'{config.model_name}_{refused}'
      bert_run(workdir, config=config)
      config.data.eval_holdout += 1
      if refused:
        with pytest.raises(ValueError, match='holds out 1 in'):
          checks.check_workdir(config, str(workdir))
      else:
        checks.check_workdir(config, str(workdir))
  # Fewer steps would report a run stopped at step 4 of 600 as finished at 4 (exit 0).
  config = bert_config('tiny')
  config.train.num_steps = 4
  with pytest.raises(ValueError, match=re.escape(
      'holds a run of train.num_steps=600 (its newest checkpoint is step 4) and this config has '
      '4: a run is not cut short, its schedule runs to 600: set --config.train.num_steps=600 (or '
      'more) to resume it, or pass a new --workdir for this run.')):
    checks.check_run_directories(config, str(tmp_path / 'bert'))
  # What may change on resuming (rates, dtype, more steps, the clipping threshold) is
  # no other run.
  config = bert_config('tiny')
  config.model.dropout_rate, config.train.num_steps, config.model.dtype = 0.0, 900, 'float32'
  config.optimizer.clip_norm = 0.5
  checks.check_run_directories(config, str(tmp_path / 'bert'))
  # A run that stopped before its first checkpoint (only a save's temporary directory) is
  # started afresh with any optimizer.
  bert_run(tmp_path / 'unsaved', checkpoint=False, config=elmo_config.get_config('tiny'))
  config = elmo_config.get_config('tiny')
  config.optimizer.name = 'sgd'
  checks.check_run_directories(config, str(tmp_path / 'unsaved'))


def test_a_checkpoint_of_other_parameters_is_named_before_it_is_read(tmp_path):
  (tmp_path / 'config.json').write_text(bert_config('tiny').to_json_best_effort())
  params = {'embed': {'table': np.zeros((8, 4), np.float32)},
            'layer_0': {'kernel': np.zeros((4, 4), np.float32)}}
  mngr = checkpoints.manager(str(tmp_path), 1)
  checkpoints.save(mngr, 4, {'step': 4, 'params': params}, {0: {}}, 1)
  mngr.wait_until_finished()
  checks.check_resumable_params(bert_config('tiny'), str(tmp_path), params)
  wider = bert_config('tiny')
  wider.model.hidden_size = 8
  with pytest.raises(ValueError, match=re.escape(
      f'--workdir={tmp_path} holds a checkpoint that cannot be resumed with this config: it has '
      'embed/table of shape (8, 4) where this config makes (8, 8) (its run had '
      'model.hidden_size=128): pass a new --workdir for this run, or the config it was started '
      'with to resume it.')):
    checks.check_resumable_params(wider, str(tmp_path), {
        'embed': {'table': np.zeros((8, 8))}, 'layer_0': {'kernel': np.zeros((4, 4))}})
  deeper = dict(params, layer_1={'kernel': np.zeros((4, 4))})
  with pytest.raises(ValueError, match='it lacks the parameter layer_1/kernel this config has:'):
    checks.check_resumable_params(bert_config('tiny'), str(tmp_path), deeper)


def test_an_init_from_that_is_not_a_finished_run_is_named_as_such(tmp_path):
  config = bert_finetune_config.get_config('offline_shuffled')
  workdir = str(tmp_path / 'finetune')

  def error(init_from):
    config.init_from = str(init_from)
    with pytest.raises(ValueError) as raised:
      checks.check_run_directories(config, workdir)
    return str(raised.value)

  assert error(tmp_path / 'nothing') == (
      f"config.init_from='{tmp_path / 'nothing'}' is not a directory (nothing is there): point "
      'config.init_from at the workdir of a pretraining run.')
  (tmp_path / 'file').write_text('{}', encoding='utf-8')
  assert 'is not a directory: point' in error(tmp_path / 'file')
  (tmp_path / 'empty').mkdir()
  assert error(tmp_path / 'empty') == (
      f"config.init_from='{tmp_path / 'empty'}' has no config.json and no complete checkpoint "
      'in checkpoints/, so it is not a finished run: point config.init_from at the workdir of a '
      'pretraining run (or run that pretraining to its last step).')
  bert_run(tmp_path / 'unsaved', checkpoint=False)
  assert 'has no complete checkpoint in checkpoints/, so' in error(tmp_path / 'unsaved')
  gpt_run = tmp_path / 'gpt'
  gpt_run.mkdir()
  (gpt_run / 'config.json').write_text(gpt_config.get_config('tiny').to_json_best_effort())
  os.makedirs(gpt_run / 'checkpoints' / '8')
  assert error(gpt_run) == (f"config.init_from='{gpt_run}' is a 'gpt' run and this config "
                            "trains 'bert': start from a 'bert' run.")
  finished = bert_config('tiny')
  finished.train.num_steps = 4
  bert_run(tmp_path / 'bert', config=finished)
  config.init_from = str(tmp_path / 'bert')
  checks.check_run_directories(config, workdir)


def test_an_init_from_stopped_before_its_last_step_is_refused_before_anything_is_built(
    tmp_path, monkeypatch):
  """A pretraining preempted at step 4 of its 600 (its config.json and newest checkpoint): one
  line naming both, before the model is built; allow_unfinished_init_from=True starts from it."""
  bert_run(tmp_path / 'stopped')

  def build(*args, **kwargs):
    raise AssertionError('the model was built before the check')
  monkeypatch.setattr(trainer.loop, 'build', build)
  config = bert_finetune_config.get_config('offline_shuffled')
  config.init_from = str(tmp_path / 'stopped')
  with pytest.raises(ValueError) as refused:
    trainer.loop.train_and_evaluate(config, str(tmp_path / 'finetune'))
  assert str(refused.value) == (
      f"config.init_from='{tmp_path / 'stopped'}' stopped at step 4 of its train.num_steps=600: "
      'resume it to its last step first (its train.py command again), or set '
      '--config.allow_unfinished_init_from=True to start from step 4 on purpose.')
  assert not os.path.exists(tmp_path / 'finetune')
  config.allow_unfinished_init_from = True
  checks.check_run_directories(config, str(tmp_path / 'finetune'))


def test_a_checkpoint_with_parameters_the_model_no_longer_has_is_refused(tmp_path):
  # A layer since removed: in a module read in part (a bias of a projection whose kernel is
  # read), any reader refuses it; a whole module, translate.py, extract_features.py and
  # generate.py (load_trained) do, where a fine-tuning leaves out pretraining heads.
  config = gpt_config.get_config('tiny')
  config.model.update(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32,
                      max_position_embeddings=128)
  example = input_pipeline.example_batch(config.data, 64, batch_size=1)
  params = nn.meta.unbox(gpt.Model(trainer.checks.model_config(config)).init(
      jax.random.key(0), example, deterministic=True)['params'])

  def saved(name, extra):
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / 'config.json').write_text(config.to_json_best_effort(), encoding='utf-8')
    mngr = checkpoints.manager(str(workdir), 1)
    checkpoints.save(mngr, 1, {'step': 1, 'params': {**params, **extra}}, {0: {}}, 1)
    checkpoints.wait(mngr)
    return str(workdir)

  query = {**params['layer_0']['attention']['query'], 'old_scale': np.ones(2, np.float32)}
  attention = {**params['layer_0']['attention'], 'query': query}
  partial = saved('partial', {'layer_0': {**params['layer_0'], 'attention': attention}})
  target = jax.tree.map(jnp.asarray, params)
  for read in (lambda: trainer.state.load_trained(partial, 'gpt', 'test'),
               lambda: checkpoints.restore_params(partial, target)):
    with pytest.raises(ValueError, match=r'holds layer_0/attention/query/old_scale, which this '
                       r"model's layer_0/attention/query has no place for: the run was trained"):
      read()
  whole = saved('whole', {'old_head': {'kernel': np.ones((16, 2), np.float32)}})
  with pytest.raises(ValueError, match=r'holds old_head/kernel, which models/gpt.py no longer '
                     r'has: it was trained by an earlier version'):
    trainer.state.load_trained(whole, 'gpt', 'test')
  _, _, unused = checkpoints.restore_params(whole, target)  # a fine-tuning: a head left out
  assert unused == ['old_head/kernel']


def test_a_config_json_of_no_run_of_ours_is_one_line(tmp_path):
  """An HF export's config.json (or any other) in a workdir: no traceback, no 'a None run'."""
  (tmp_path / 'config.json').write_text('{"model_type": "bert"}')
  (tmp_path / 'checkpoints' / '1').mkdir(parents=True)
  with pytest.raises(ValueError, match='no train.py') as error:
    checks.check_workdir(bert_config('tiny'), str(tmp_path))
  assert '\n' not in str(error.value) and 'None' not in str(error.value)
  assert checkpoints.exist(str(tmp_path))
  with pytest.raises(ValueError, match='no train.py'):  # extract_features.py, generate.py ...
    trainer.state.load_trained(str(tmp_path), 'bert', 'test')


def test_translate_checks_its_files_and_flags_before_it_loads_the_model(tmp_path):
  """A decode of a whole test set was lost to an output path that could not be written."""
  import types  # pylint: disable=import-outside-toplevel
  import translate  # pylint: disable=import-outside-toplevel
  (tmp_path / 'src.txt').write_text('a b\nc d\n', encoding='utf-8')
  (tmp_path / 'ref.txt').write_text('x\n', encoding='utf-8')
  (tmp_path / 'latin1.txt').write_bytes('caf\xe9\n'.encode('latin1'))
  (tmp_path / 'empty.txt').write_text('', encoding='utf-8')
  good = dict(input=str(tmp_path / 'src.txt'), output=str(tmp_path / 'hyp.txt'), reference=None,
              beam_size=None, alpha=None, batch_size=32)
  assert translate.check_files(types.SimpleNamespace(**good)) == (['a b', 'c d'], None)
  for change, message in (
      ({'output': str(tmp_path / 'missing' / 'hyp.txt')}, 'cannot be written'),
      ({'output': str(tmp_path)}, 'cannot be written'),
      ({'input': str(tmp_path / 'latin1.txt')}, 'not UTF-8 text'),
      ({'input': str(tmp_path / 'nope.txt')}, 'does not exist'),
      ({'input': str(tmp_path / 'empty.txt')}, 'is empty'),
      ({'reference': str(tmp_path / 'ref.txt')}, 'line-aligned'),
      ({'beam_size': 0}, '--beam_size=0'), ({'alpha': -1.0}, '--alpha=-1.0'),
      ({'batch_size': 0}, '--batch_size=0')):
    with pytest.raises(ValueError, match=message) as error:
      translate.check_files(types.SimpleNamespace(**{**good, **change}))
    assert '\n' not in str(error.value)


def test_a_cvt_run_of_before_normalized_words_is_refused_naming_the_field(tmp_path):
  """Its words.txt holds words as written: read as normalized, they would be other ids."""
  from configs import cvt as cvt_config  # pylint: disable=import-outside-toplevel
  config = cvt_config.get_config('tiny')
  saved = json.loads(config.to_json())
  del saved['data']['normalize_words']  # config.json of a run from before the field
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  (tmp_path / 'checkpoints' / '4').mkdir(parents=True)
  with pytest.raises(ValueError, match='data.normalize_words=False') as error:
    checks.check_workdir(config, str(tmp_path))
  assert '\n' not in str(error.value)
