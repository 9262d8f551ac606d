"""Tests of convert_checkpoint.py --from=bilm (convert_elmo.py): bilm-tf ELMo weights into workdirs.

The reference is bilm-tf's own BidirectionalLanguageModel (TF1, not installable here): its
outputs at every layer for two made-up biLMs of the released layout are stored beside the
script that made them, tests/fixtures/elmo_bilm/ (make_fixture.py, VERSIONS.json).
"""

import json
import os
import shutil
import sys

import h5py
import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

import convert_elmo
import extract_features
import forked  # tests/
import sweep
from configs import elmo_tagger as elmo_tagger_configs
from input_pipeline.common import words as words_lib
from models import elmo
from models import elmo_tagger
from trainer import checkpoints
import trainer.checks
import trainer.state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'elmo_bilm')
VARIANTS = ('residual', 'plain')


def _sentences() -> list[list[str]]:
  with open(os.path.join(FIXTURES, 'sentences.txt'), encoding='utf-8') as f:
    return [line.split() for line in f if line.strip()]


def _reference(variant: str) -> dict[str, np.ndarray]:
  with np.load(os.path.join(FIXTURES, variant, 'reference.npz')) as f:
    return {k: f[k] for k in f.files}


@pytest.fixture(scope='module')
def converted(tmp_path_factory):
  """Each fixture biLM converted once: {variant: workdir}."""
  root = tmp_path_factory.mktemp('elmo')
  return {v: (convert_elmo.convert(os.path.join(FIXTURES, v), str(root / v)), str(root / v))[1]
          for v in VARIANTS}


@pytest.mark.parametrize('variant', VARIANTS)
def test_every_layer_matches_bilm_tf(converted, variant):
  ref = _reference(variant)
  sentences = _sentences()
  assert len(sentences) >= 20 and len(set(ref['lengths'])) > 5  # padded rows of many lengths
  config, model, params, _ = trainer.state.load_trained(converted[variant], 'elmo', 'test')
  options = json.load(open(os.path.join(FIXTURES, variant, 'options.json'), encoding='utf-8'))
  assert (config.model.lstm_dim, config.model.skip_connections, config.model.char_activation,
          config.data.max_characters_per_token) == (
              options['lstm']['dim'], options['lstm']['use_skip_connections'],
              options['char_cnn']['activation'], options['char_cnn']['max_characters_per_token'])
  # Our character ids are bilm-tf's Batcher's (its ids plus one, 0 for padding).
  width = config.data.max_characters_per_token
  for row, words in enumerate(sentences):
    n = len(words) + 2
    np.testing.assert_array_equal(words_lib.char_ids([words_lib.BOS, *words, words_lib.EOS],
                                                     width), ref['char_ids'][row, :n])
  out = jax.jit(elmo.BiLM(model.config).apply)({'params': params['bilm']},
                                               jnp.asarray(ref['char_ids']),
                                               jnp.asarray(ref['lengths']))
  real = np.arange(ref['char_ids'].shape[1])[None, :] < ref['lengths'][:, None]
  ours = {'token': out['token_BLD'], **{f'{d}_{i}': x for d in ('forward', 'backward')
                                        for i, x in enumerate(out[d])}}
  theirs = {'token': ref['token'], **{f'{d}_{i}': x for d in ('forward', 'backward')
                                      for i, x in enumerate(ref[d])}}
  assert ours.keys() == theirs.keys()
  for name, x in ours.items():
    x = np.asarray(x, np.float32)
    np.testing.assert_allclose(x[real], theirs[name][real], rtol=0, atol=1e-5, err_msg=name)
    assert not x[~real].any(), name  # zeros at padding (bilm-tf's token layer is not)
  if variant == 'residual':  # the fixture's clips bind, so a clip in the wrong place shows
    assert (np.abs(ref['forward'][0][real]) == options['lstm']['proj_clip']).mean() > 0.05


def test_extract_features_reads_the_converted_workdir(converted, tmp_path):
  """extract_features.py on the converted release gives bilm-tf's layers of each sentence."""
  ref = _reference('plain')
  # Its words are split at spaces, as bilm-tf was given them: sentence 10's 'al.' too, which
  # the split for raw text cuts in two (a vector too many, and the rest shifted).
  rows = [0, 1, 2, 10]
  words = _sentences()[10]
  assert words_lib.word_tokens(' '.join(words), 'punctuation') != words
  source = tmp_path / 'sentences.txt'
  source.write_text('\n'.join(' '.join(_sentences()[i]) for i in rows) + '\n', encoding='utf-8')
  output = str(tmp_path / 'features.npz')
  assert extract_features.extract(converted['plain'], str(source), output, batch_size=3) == 4
  with np.load(output) as f:
    for k, i in enumerate(rows):
      words = slice(1, ref['lengths'][i] - 1)
      expected = np.stack([np.concatenate([ref['token'][i], ref['token'][i]], -1)[words]] + [
          np.concatenate([ref['forward'][j][i], ref['backward'][j][i]], -1)[words]
          for j in range(3)])
      np.testing.assert_allclose(f[str(k)], expected, rtol=0, atol=1e-5)


def test_the_tagger_and_the_sweep_start_from_the_converted_workdir(converted, tmp_path):
  workdir = converted['plain']
  config = elmo_tagger_configs.get_config('offline_replaced')  # no size: init_from's
  config.init_from = workdir
  trainer.checks.inherit_unset_fields(config, str(tmp_path / 'run'))
  trainer.checks.check_init_from(config)
  assert (config.model.num_layers, config.model.skip_connections, config.model.char_activation,
          tuple(map(tuple, config.model.filters)), config.data.max_characters_per_token) == (
              3, False, 'tanh', ((1, 3), (2, 5)), 16)
  # A tagger whose biLM computes otherwise is refused, the fields added for the conversion too;
  # a run saved before they were added computed a residual over relu.
  for field, other in (('skip_connections', True), ('char_activation', 'relu')):
    wrong = config.copy_and_resolve_references()
    wrong.model[field] = other
    with pytest.raises(ValueError, match=rf'config.model.{field}={other} but the run in '
                       rf'config.init_from has model.{field}=(False|tanh)'):
      trainer.checks.check_init_from(wrong)
  older = tmp_path / 'older'
  shutil.copytree(converted['residual'], older)
  with open(older / 'config.json') as f:
    saved = json.load(f)
  assert (saved['model'].pop('skip_connections'), saved['model'].pop('char_activation')) == (
      True, 'relu')
  with open(older / 'config.json', 'w') as f:
    json.dump(saved, f)
  residual = elmo_tagger_configs.get_config('offline_replaced')
  residual.init_from = str(older)
  trainer.checks.inherit_unset_fields(residual, str(tmp_path / 'run_older'))
  trainer.checks.check_init_from(residual)
  assert (residual.model.skip_connections, residual.model.char_activation) == (True, 'relu')
  model = elmo_tagger.Model(trainer.checks.model_config(config))
  W = config.data.max_characters_per_token
  batch = {'token_ids': np.zeros((1, 4), np.int32), 'char_ids': np.ones((1, 4, W), np.int32),
           'lengths': np.array([4], np.int32), 'labels': np.zeros((1, 4), np.int32)}
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        jax.eval_shape(lambda: nn.meta.unbox(
                            model.init(jax.random.key(0), batch)['params'])))
  params, new, _ = checkpoints.restore_params(workdir, target)
  assert not [name for name in new if name.startswith('bilm')]
  with h5py.File(os.path.join(FIXTURES, 'plain', 'weights.hdf5'), 'r') as f:
    np.testing.assert_array_equal(params['bilm']['char_cnn']['conv_1_kernel'],
                                  f['CNN/W_cnn_1'][0])
  # The sweep: taggers only, each started from the converted biLM.
  loaded = sweep.load_sweep(f'configs/sweeps/elmo_layers.py:{workdir}')
  assert [s[0] for s in loaded['stages']] == ['tagger']
  runs = [run for _, _, runs in sweep.expand(loaded, str(tmp_path / 'sweep')) for run in runs]
  assert len(runs) == 5 * 2 * 2 and all(
      dict(run.overrides)['init_from'] == workdir for run in runs)


# Bad input: one line naming the tensor or field, nothing written.

def _copy_fixture(tmp_path, name: str, variant: str = 'residual'):
  source = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, variant), source,
                  ignore=shutil.ignore_patterns('reference.npz'))
  return source


def _edit_weights(source, edit) -> None:
  with h5py.File(source / 'weights.hdf5', 'a') as f:
    edit(f)


def _edit_options(source, edit) -> None:
  options = json.loads((source / 'options.json').read_text())
  edit(options)
  (source / 'options.json').write_text(json.dumps(options))


def test_bad_input_is_one_line_naming_the_tensor_before_anything_is_written(tmp_path):
  def refused(match, source):
    workdir = tmp_path / 'run'
    with pytest.raises(ValueError, match=match) as error:
      convert_elmo.convert(str(source), str(workdir))
    assert '\n' not in str(error.value)
    assert not workdir.exists()

  refused('is not a directory', tmp_path / 'missing')
  source = _copy_fixture(tmp_path, 'missing_tensor')
  _edit_weights(source, lambda f: f.__delitem__('RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0'))
  refused('has no tensor RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_P_0', source)
  source = _copy_fixture(tmp_path, 'contradicted')  # options say 9 filters of width 3, file 8
  _edit_options(source, lambda o: o['char_cnn'].__setitem__('filters', [[1, 4], [2, 4], [3, 9]]))
  refused(r'CNN/W_cnn_2 has shape \(1, 3, 4, 8\) but options.json gives \(1, 3, 4, 9\)', source)
  source = _copy_fixture(tmp_path, 'fewer_layers')  # a third layer in options only
  _edit_options(source, lambda o: o['lstm'].__setitem__('n_layers', 3))
  refused('has no tensor RNN_0/RNN/MultiRNNCell/Cell2/LSTMCell/W_0', source)
  source = _copy_fixture(tmp_path, 'left_over')  # the softmax, which dump_weights leaves out
  _edit_weights(source, lambda f: f.create_dataset('softmax/W', data=np.zeros((5, 8))))
  refused('no place for: softmax/W', source)
  source = _copy_fixture(tmp_path, 'other_layout')  # an HF checkpoint renamed
  (source / 'weights.hdf5').write_bytes(b'not hdf5 at all')
  refused('weights.hdf5 is not an HDF5 file', source)
  for i, (edit, match) in enumerate((
      (lambda o: o.__setitem__('bidirectional', False), 'bidirectional=false'),
      (lambda o: o.pop('char_cnn'), 'has no char_cnn'),
      (lambda o: o['lstm'].pop('use_skip_connections'), 'has no lstm.use_skip_connections'),
      (lambda o: o['char_cnn'].__setitem__('n_characters', 300), 'n_characters=300'),
      (lambda o: o['lstm'].__setitem__('projection_dim', 16), 'projection_dim=16 above'))):
    source = _copy_fixture(tmp_path, f'options{i}')
    _edit_options(source, edit)
    refused(match, source)
  source = _copy_fixture(tmp_path, 'two')
  shutil.copy(source / 'options.json', source / 'small_options.json')
  refused(r'holds 2 files \*options.json', source)
  # The command line: one line on stderr, a non-zero exit, no workdir.
  source = _copy_fixture(tmp_path, 'cli')
  _edit_weights(source, lambda f: f.__delitem__('CNN_high_1/W_carry'))
  command = [sys.executable, 'convert_checkpoint.py', '--from=bilm', f'--input={source}',
             f'--workdir={tmp_path}/cli_run']
  result = forked.run(command, cwd=ROOT)
  expected = (f'convert_checkpoint.py: error: {source}/weights.hdf5 has no tensor '
              'CNN_high_1/W_carry: it is not a complete bilm-tf biLM of the sizes its '
              'options.json gives; pass the pair written together.')
  assert (result.returncode, result.stderr.strip().splitlines()) == (1, [expected])
  assert not (tmp_path / 'cli_run').exists()


def test_a_vocabulary_beside_the_weights_becomes_words_txt(tmp_path):
  source = _copy_fixture(tmp_path, 'with_vocab', 'plain')
  (source / 'vocab-2016-09-10.txt').write_text('</S>\n<S>\n<UNK>\nthe\n,\ncafé\n',
                                               encoding='utf-8')
  summary = convert_elmo.convert(str(source), str(tmp_path / 'run'))
  assert 'softmax/bias, softmax/kernel (6 words, from' in summary
  config, _, params, vocab = trainer.state.load_trained(str(tmp_path / 'run'), 'elmo', 'test')
  assert vocab.words == ['<S>', '</S>', '<UNK>', 'the', ',', 'café']
  assert config.model.vocab_size == 6 and params['softmax']['kernel'].shape == (6, 8)
