"""BERT's feature-based approach (Devlin et al. 2018, sec. 5.3, table 7): extract_features.py
writes a BERT's hidden states exactly, and the tagger over a frozen BERT reads them."""

import json
import os
import shutil
import sys

import flax.linen as nn
import h5py
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import bert_base
from configs import common
import extract_features
import forked  # tests/
import input_pipeline
from models import bert
from models import bert_feature_tagger
from objectives import tagging
from trainer import checkpoints
from trainer import sharding
import trainer.checks
import trainer.optimizer
import trainer.state
import trainer.steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'the', 'cat', '##s', 'sat', 'on', 'mat',
         '.', ',', 'hello', 'world', 'dog', 'is', 'here', 'a']
CLS, SEP = 2, 3
# Five layers, so that every row of table 7 exists and sum_all is not sum_last_four; scanned,
# so that one block is compiled (the layout of the layers' params is BERT's business).
MODEL = dict(vocab_size=40, hidden_size=32, num_layers=5, num_heads=4, mlp_dim=64,
             max_position_embeddings=64, scan_layers=True)
NUM_STATES = MODEL['num_layers'] + 1  # the embeddings, then each layer

LINES = ['The cats sat on the mat.', 'Hello, world ||| the dog is here .', 'a cat']
TOKENS = [['[CLS]', 'the', 'cat', '##s', 'sat', 'on', 'the', 'mat', '.', '[SEP]'],
          ['[CLS]', 'hello', ',', 'world', '[SEP]', 'the', 'dog', 'is', 'here', '.', '[SEP]'],
          ['[CLS]', 'a', 'cat', '[SEP]']]
SEGMENTS = [[0] * 10, [0] * 5 + [1] * 6, [0] * 4]


def _params(model, batch, seed=1):
  """Random params of the model's shapes: no compile for init."""
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch)['params'])
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), shapes)


@pytest.fixture(scope='module')
def bert_run(tmp_path_factory):
  """A BERT workdir as train.py leaves one: config.json, vocab.txt, a checkpoint of random params."""
  workdir = str(tmp_path_factory.mktemp('bert_run'))
  config = bert_base.get_config('tiny')
  config.model.update(MODEL)
  config.model.dtype = 'float32'
  config.data.max_seq_length, config.data.max_predictions_per_seq = 16, 4
  config.train.num_steps = 0  # finished at its checkpoint of step 0, as a converted release
  with open(os.path.join(workdir, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.write('\n'.join(VOCAB) + '\n')
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort(indent=2))
  model = bert.Model(trainer.checks.model_config(config))
  example = input_pipeline.example_batch(config.data, MODEL['vocab_size'], batch_size=1)
  params = _params(model, example, seed=0)
  mngr = checkpoints.manager(workdir, 1)
  # Trained at every position (as converted releases are): tests of extract_features' limits.
  checkpoints.save(mngr, 0, {'step': 0, 'params': params}, {0: {}}, 1,
                   positions=MODEL['max_position_embeddings'])
  mngr.wait_until_finished()
  return workdir, model, params


@pytest.fixture(scope='module')
def lines_file(tmp_path_factory):
  path = tmp_path_factory.mktemp('lines') / 'lines.txt'
  path.write_text('\n'.join(LINES) + '\n', encoding='utf-8')
  return str(path)


def read(path):
  """Every dataset of an extract_features output, and its JSON datasets decoded."""
  if path.endswith('.npz'):
    with np.load(path) as f:
      data = {k: f[k] for k in f.files}
    texts = {k: str(data.pop(k)) for k in ('sentence_to_index', 'tokens') if k in data}
  else:
    with h5py.File(path, 'r') as f:
      data = {k: np.asarray(f[k]) for k in f}
    texts = {k: data.pop(k)[0] for k in ('sentence_to_index', 'tokens') if k in data}
  return data, {k: json.loads(v) for k, v in texts.items()}


@pytest.fixture(scope='module')
def hidden_states(bert_run):
  """Per line, (L + 1, n, D): the model's hidden states on its tokens, all lines in one batch
  padded to the longest (extract_features pads otherwise: by twos, to 16)."""
  _, model, params = bert_run
  length = max(len(t) for t in TOKENS)
  batch = {k: np.zeros((len(TOKENS), length), np.int32)
           for k in ('input_ids', 'segment_ids', 'input_mask')}
  for i, tokens in enumerate(TOKENS):
    batch['input_ids'][i, :len(tokens)] = [VOCAB.index(t) for t in tokens]
    batch['segment_ids'][i, :len(tokens)] = SEGMENTS[i]
    batch['input_mask'][i, :len(tokens)] = 1
  states = np.stack(jax.jit(model.apply)({'params': params}, batch)['hidden_states'], axis=1)
  return [states[i, :, :len(tokens)] for i, tokens in enumerate(TOKENS)]


# ----------------------------------------------------------------------------
# extract_features.py
# ----------------------------------------------------------------------------

@pytest.mark.parametrize('output_name, layers, indices', [
    ('features.h5', '', [-1, -2, -3, -4]),  # the reference's default
    ('features.npz', '0,2,-1,-6', [0, 2, 5, 0])])
def test_features_are_the_hidden_states_of_the_lines_tokens(
    bert_run, hidden_states, lines_file, tmp_path, output_name, layers, indices):
  workdir = bert_run[0]
  output = str(tmp_path / output_name)
  # Two lines per batch: padded rows of different lengths, read back in the input order.
  assert extract_features.extract(workdir, lines_file, output, layers=layers, batch_size=2) == 3
  data, texts = read(output)
  assert texts['sentence_to_index'] == {line: str(i) for i, line in enumerate(LINES)}
  assert texts['tokens'] == TOKENS  # [CLS] A [SEP] (B [SEP]) in WordPieces
  assert sorted(data) == ['0', '1', '2']
  for i in range(3):
    expected = hidden_states[i][indices]
    assert data[str(i)].shape == (len(indices), len(TOKENS[i]), MODEL['hidden_size'])
    assert data[str(i)].dtype == np.float32
    np.testing.assert_allclose(data[str(i)], expected, atol=1e-5)


def test_lines_keep_their_numbers_and_a_byte_order_mark_is_no_text(bert_run, tmp_path):
  """Datasets are named by line number as in the reference (an empty line is [CLS] [SEP]);
  a line given twice maps to its last dataset, as allennlp's sentence_to_index."""
  lines = [LINES[2], '', LINES[0], LINES[2]]
  plain, marked = tmp_path / 'plain.txt', tmp_path / 'marked.txt'
  plain.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  marked.write_bytes(b'\xef\xbb\xbf' + plain.read_bytes())
  outputs = []
  for source in (plain, marked):
    output = str(tmp_path / f'{source.stem}.npz')
    assert extract_features.extract(bert_run[0], str(source), output, combine='last') == 4
    outputs.append(read(output))
  (data, texts), (marked_data, marked_texts) = outputs
  assert texts == marked_texts
  assert texts['tokens'] == [TOKENS[2], ['[CLS]', '[SEP]'], TOKENS[0], TOKENS[2]]
  assert texts['sentence_to_index'] == {LINES[2]: '3', '': '1', LINES[0]: '2'}
  for name in ('0', '1', '2', '3'):
    np.testing.assert_array_equal(data[name], marked_data[name])
  np.testing.assert_allclose(data['0'], data['3'], atol=1e-6)
  latin = tmp_path / 'latin.txt'
  latin.write_bytes('caf\xe9\n'.encode('latin-1'))
  with pytest.raises(ValueError, match=r'latin.txt.* is not UTF-8 text .*convert it to UTF-8'):
    extract_features.extract(bert_run[0], str(latin), str(tmp_path / 'f.npz'))


def test_batches_hold_a_token_budget_and_pad_rows_to_powers_of_two():
  lengths = [5, 0, 300, 9, 9, 60, 7, 0] + [20] * 40
  seen = []
  for chunk, rows, length in extract_features.batches(lengths, 32, 512):
    seen += chunk
    assert len(chunk) <= rows <= 32 and rows & (rows - 1) == 0 and rows < 2 * len(chunk)
    assert all(lengths[i] <= length for i in chunk)
    assert rows * length <= 512 or len(chunk) == 1, (chunk, rows, length)
  assert sorted(seen) == [i for i, n in enumerate(lengths) if n]  # each once; empty ones left out
  # The longest alone, in its own bucket; BERT's lengths stop at max_seq_length.
  assert list(extract_features.batches([300, 5], 32, 512))[-1] == ([0], 1, 512)
  assert list(extract_features.batches([100, 5], 32, 4096, longest=100)) == [([1, 0], 2, 100)]
  # A long line cuts down only the batch it would be in: the short ones still share a pass.
  assert list(extract_features.batches([3, 0, 20, 5, 100], 4, 64)) == [
      ([0, 3], 2, 8), ([2], 1, 32), ([4], 1, 128)]


def test_a_failed_extraction_leaves_no_file(tmp_path):
  def features():
    yield 0, np.ones((2, 3), np.float32)
    raise RuntimeError('out of memory')
  for name in ('f.npz', 'f.h5'):
    with pytest.raises(RuntimeError):
      extract_features.write(str(tmp_path / name), ['a b'], features())
    assert not list(tmp_path.iterdir())
  extract_features.write(str(tmp_path / 'f.npz'), ['a b', 'c'],
                         iter([(1, np.zeros((0, 3))), (0, np.ones((2, 3)))]))
  data, texts = read(str(tmp_path / 'f.npz'))
  assert texts == {'sentence_to_index': {'a b': '0', 'c': '1'}}
  assert data['0'].shape == (2, 3) and data['1'].shape == (0, 3)


def test_each_combination_follows_its_formula(bert_run, lines_file, tmp_path):
  """Table 7's rows from the raw states 0..L (here L = 5)."""
  workdir = bert_run[0]
  raw_path = str(tmp_path / 'raw.npz')
  extract_features.extract(workdir, lines_file, raw_path, layers='0,1,2,3,4,5')
  raw = read(raw_path)[0]
  formulas = {
      'embeddings': lambda h: h[0],
      'second_to_last': lambda h: h[4],
      'last': lambda h: h[5],
      'sum_last_four': lambda h: h[2] + h[3] + h[4] + h[5],
      'concat_last_four': lambda h: np.concatenate([h[5], h[4], h[3], h[2]], axis=-1),
      'sum_all': lambda h: h[1] + h[2] + h[3] + h[4] + h[5],  # layers 1..L, no embeddings
  }
  assert set(formulas) == set(extract_features.COMBINE)
  for combine, formula in formulas.items():
    path = str(tmp_path / f'{combine}.npz')
    extract_features.extract(workdir, lines_file, path, combine=combine)
    data, texts = read(path)
    assert texts['tokens'] == TOKENS
    for i in range(3):
      np.testing.assert_allclose(data[str(i)], formula(raw[str(i)]), atol=1e-5, err_msg=combine)
  # The layers differ enough that a wrong index would show.
  for i, j in [(0, 1), (1, 2), (4, 5)]:
    assert not np.allclose(raw['0'][i], raw['0'][j], atol=1e-2)


def test_long_lines_are_truncated_as_the_reference(bert_run, tmp_path, caplog):
  path = tmp_path / 'long.txt'
  path.write_text('the cat sat on the mat . the dog\n'  # 9 pieces: keeps the first 6
                  'the dog is here . ||| a cat\n'  # 5 + 2: the longer side loses 2
                  'a cat ||| the dog is\n', encoding='utf-8')  # 2 + 3: fits exactly
  output = str(tmp_path / 'long.npz')
  with caplog.at_level('WARNING'):
    extract_features.extract(bert_run[0], str(path), output, max_seq_length=8, combine='last')
  data, texts = read(output)
  assert texts['tokens'] == [
      ['[CLS]', 'the', 'cat', 'sat', 'on', 'the', 'mat', '[SEP]'],
      ['[CLS]', 'the', 'dog', 'is', '[SEP]', 'a', 'cat', '[SEP]'],
      ['[CLS]', 'a', 'cat', '[SEP]', 'the', 'dog', 'is', '[SEP]']]
  assert [data[str(i)].shape for i in range(3)] == [(8, MODEL['hidden_size'])] * 3
  warnings = [r.getMessage() for r in caplog.records if 'truncated' in r.getMessage()]
  assert len(warnings) == 1 and warnings[0].startswith('2 of 3 lines'), warnings


def test_lines_longer_than_the_trained_positions_need_a_flag(bert_run, lines_file, tmp_path):
  # A run that trained 16 of its 64 positions (no later phase): the default stays within them.
  workdir = str(tmp_path / 'run')
  shutil.copytree(bert_run[0], workdir)
  mngr = checkpoints.manager(workdir, 2)
  checkpoints.save(mngr, 1, {'step': 1, 'params': bert_run[2]}, {0: {}}, 1, positions=16)
  mngr.wait_until_finished()
  output = str(tmp_path / 'f.npz')
  with pytest.raises(ValueError, match=r'--max_seq_length=32 but the run trained positions 0-15 '
                     r'only.*--allow_untrained_positions') as e:
    extract_features.extract(workdir, lines_file, output, max_seq_length=32, combine='last')
  assert '\n' not in str(e.value) and not os.path.exists(output)
  extract_features.extract(workdir, lines_file, output, max_seq_length=32, combine='last',
                           allow_untrained_positions=True)
  long_line = tmp_path / 'long.txt'
  long_line.write_text('the cat sat on the mat . ' * 5 + '\n', encoding='utf-8')  # 35 pieces
  extract_features.extract(workdir, str(long_line), output, combine='last')  # 16 by default
  assert [len(t) for t in read(output)[1]['tokens']] == [16]


def test_bad_layers_and_options_are_refused_in_one_line(bert_run, lines_file, tmp_path):
  workdir, output = bert_run[0], str(tmp_path / 'f.npz')
  refusals = [
      (dict(layers='6'), 'from -6 to 5'), (dict(layers='-1,-7'), 'from -6 to 5'),
      (dict(layers='top'), 'a BERT run takes layer indices'),
      (dict(layers='-1', combine='last'), '--combine and --layers'),
      (dict(combine='mean'), 'use one of embeddings'),
      (dict(glove='glove.txt'), 'for CoVe runs; this is a BERT run'),
      (dict(max_seq_length=65), 'max_position_embeddings=64'),
      (dict(max_seq_length=2), 'max_seq_length=2'),
  ]
  for options, message in refusals:
    with pytest.raises(ValueError, match=message) as e:
      extract_features.extract(workdir, lines_file, output, **options)
    assert '\n' not in str(e.value)
  assert not os.path.exists(output)
  # Not a layer list nor an ELMo value: refused before the workdir is read.
  with pytest.raises(ValueError, match='--layers'):
    extract_features.extract(str(tmp_path), lines_file, output, layers='middle')


def test_elmo_and_cove_options_are_still_checked():
  check = extract_features.check_flags
  for ok in [dict(), dict(layers='all'), dict(layers='top'), dict(layers='average')]:
    check('elmo', **ok)
  for ok in [dict(), dict(glove='g.txt'), dict(cove_only=True)]:
    check('cove', **ok)
  for name, options, message in [
      ('elmo', dict(layers='-1,-2'), 'an ELMo run takes all, top, average'),
      ('elmo', dict(combine='last'), 'for BERT runs; this is an ELMo run'),
      ('elmo', dict(max_seq_length=64), 'for BERT runs'),
      ('elmo', dict(cove_only=True), 'for CoVe runs; this is an ELMo run'),
      ('cove', dict(layers='top'), '--layers is for ELMo and BERT runs'),
      ('cove', dict(combine='sum_all'), 'for BERT runs; this is a CoVe run')]:
    with pytest.raises(ValueError, match=message):
      check(name, **options)


def test_command_line(bert_run, lines_file, tmp_path):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1',
             JAX_PLATFORMS='cpu')
  output = str(tmp_path / 'cli.h5')
  base = [sys.executable, 'extract_features.py', f'--workdir={bert_run[0]}',
          f'--input={lines_file}', f'--output={output}']
  # Both runs forked from one import of extract_features.py's modules (tests/forked.py).
  result = forked.run(base + ['--combine=concat_last_four', '--max_seq_length=32'], ROOT, env)
  assert result.returncode == 0, result.stderr[-3000:]
  data, texts = read(output)
  assert texts['tokens'] == TOKENS
  assert data['1'].shape == (len(TOKENS[1]), 4 * MODEL['hidden_size'])
  result = forked.run(base + ['--layers=7'], ROOT, env)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith(
      'extract_features.py: error: --layers=7: this BERT has 5 layers')


# ----------------------------------------------------------------------------
# models/bert_feature_tagger.py
# ----------------------------------------------------------------------------

TAGGER = dict(MODEL, num_labels=3, task_lstm_dim=8, task_num_layers=2)
LENGTHS = [8, 5]


def _tagger(**overrides):
  return bert_feature_tagger.Config(**{**TAGGER, **overrides})


def _batch(length=8, pad_seed=None):
  """The tagging spec of input_pipeline/bert_finetune.py by hand: labels on first pieces.

  The real tokens are the same for every `length`; with `pad_seed`, padding holds random ids.
  """
  rng = np.random.default_rng(0)
  pad = np.random.default_rng(pad_seed)
  B = len(LENGTHS)
  batch = {k: np.zeros((B, length), np.int32) for k in ('input_ids', 'segment_ids', 'input_mask',
                                                         'labels')}
  batch['label_weights'] = np.zeros((B, length), np.float32)
  for b, n in enumerate(LENGTHS):
    batch['input_ids'][b, :n] = [CLS] + rng.integers(5, len(VOCAB), n - 2).tolist() + [SEP]
    batch['input_mask'][b, :n] = 1
    first_piece = np.arange(1, n - 1) % 3 != 2  # every third piece continues a word
    batch['labels'][b, 1:n - 1] = np.where(first_piece, rng.integers(0, 3, n - 2), 0)
    batch['label_weights'][b, 1:n - 1] = first_piece
    if pad_seed is not None:
      batch['input_ids'][b, n:] = pad.integers(0, len(VOCAB), length - n)
      batch['segment_ids'][b, n:] = pad.integers(0, 2, length - n)
  batch['example_weights'] = np.ones((B,), np.float32)
  batch['example_index'] = np.arange(B, dtype=np.int32)
  return batch


def test_config_carries_bert_fields_and_checks_its_own():
  for field in bert.Config.__dataclass_fields__:
    if field not in ('num_labels', 'head'):  # the tagger's own head
      assert getattr(bert_feature_tagger.Config(), field) == getattr(bert.Config(), field), field
  cfg = bert_feature_tagger.Config()  # the paper's task model: 2 x 768 per direction
  assert (cfg.task_lstm_dim, cfg.task_num_layers, cfg.head) == (768, 2, 'tag')
  assert bert_feature_tagger.bert_config(_tagger()) == bert.Config(**MODEL)
  for overrides, message in [(dict(feature_layers='mean'), 'model.feature_layers'),
                             (dict(feature_layers='concat_last_four', num_layers=3), 'has 3'),
                             (dict(head='classify'), 'model.head'),
                             (dict(task_lstm_dim=0), 'model.task_lstm_dim'),
                             (dict(task_dropout_rate=1.0), 'model.task_dropout_rate')]:
    with pytest.raises(ValueError, match=message):
      _tagger(**overrides)
  _tagger(feature_layers='sum_all', num_layers=1)
  config = ml_collections.ConfigDict({'init_from': '', 'optimizer': {'frozen': ('bert',)}})
  with pytest.raises(ValueError, match='init_from'):
    bert_feature_tagger.check_config(config)
  config.init_from, config.optimizer.frozen = 'runs/bert', ()
  with pytest.raises(ValueError, match='optimizer.frozen'):
    bert_feature_tagger.check_config(config)


def test_bert_is_frozen_and_features_combine_its_states():
  model = bert_feature_tagger.Model(_tagger(feature_layers='concat_last_four'))
  batch = _batch()
  params = _params(model, batch)

  def loss(params):
    outputs = model.apply({'params': params}, batch, deterministic=False,
                          rngs={'dropout': jax.random.key(2)})
    return tagging.loss_fn(outputs, batch)[0], outputs

  (_, outputs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  grads = jax.tree.map(np.asarray, grads)
  assert all(not g.any() for g in jax.tree.leaves(grads['bert']))
  for name in ('task_forward_0', 'task_backward_0', 'task_forward_1', 'task_backward_1',
               'classifier'):
    assert all(g.any() for g in jax.tree.leaves(grads[name])), name
  assert outputs['logits'].shape == (2, 8, 3) and outputs['logits'].dtype == jnp.float32

  # The frozen BERT alone, without dropout: the features are its states' combination.
  h = bert.Model(bert.Config(**MODEL)).apply({'params': params['bert']}, batch)['hidden_states']
  h = [np.asarray(x) for x in h]
  expected = np.concatenate([h[5], h[4], h[3], h[2]], -1)
  np.testing.assert_allclose(outputs['features'], expected, atol=1e-5)
  assert params['task_forward_0']['input_kernel'].shape[0] == expected.shape[-1]


def test_real_tokens_do_not_see_the_padding():
  model = bert_feature_tagger.Model(_tagger(feature_layers='sum_last_four'))
  params = _params(model, _batch())
  apply = jax.jit(model.apply)
  short = apply({'params': params}, _batch())['logits']
  long = apply({'params': params}, _batch(length=12, pad_seed=3))['logits']
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(long[b, :n], short[b, :n], atol=1e-5)
  # The padding does reach the model's input: a mask that let it through would change the tags.
  leaky = _batch(length=12, pad_seed=3)
  leaky['input_mask'][1] = 1
  assert not np.allclose(apply({'params': params}, leaky)['logits'][1, :5], short[1, :5],
                         atol=1e-3)


def test_init_from_fills_the_bert_subtree(bert_run, tmp_path):
  workdir, _, saved = bert_run
  model = bert_feature_tagger.Model(_tagger())
  params = _params(model, _batch())
  config = ml_collections.ConfigDict(dict(init_from=workdir, model_name='bert_feature_tagger',
                                          data=dict(task='offline_capitalized')))
  loaded = trainer.state.init_params(params, config)
  # Every BERT array the tagger has (not the MLM head) comes from the run; the rest is as it was.
  assert set(loaded['bert']) == set(saved) - {'mlm_transform', 'mlm_ln', 'mlm_output_bias'}
  jax.tree.map(np.testing.assert_array_equal, loaded['bert'],
               {k: saved[k] for k in loaded['bert']})
  assert not np.allclose(params['bert']['token_embed']['embedding'],
                         saved['token_embed']['embedding'])
  for name in set(params) - {'bert'}:
    jax.tree.map(np.testing.assert_array_equal, loaded[name], params[name])

  # trainer.checks.check_init_from accepts the BERT run for this model, and refuses other sizes.
  config = ml_collections.ConfigDict({
      'model_name': 'bert_feature_tagger', 'init_from': workdir, 'model': TAGGER,
      'data': {'tokenizer': 'wordpiece', 'lower_case': True}})
  trainer.checks.check_init_from(config)
  config.model.hidden_size = 64
  with pytest.raises(ValueError, match='hidden_size'):
    trainer.checks.check_init_from(config)


@pytest.mark.slow  # trainer.state.create_state compiles the initializers: 10 s of CPU
def test_a_train_step_on_a_mesh_moves_only_the_task_model():
  """train.py's state and step, data x tensor sharded, with BERT frozen under weight decay."""
  config = ml_collections.ConfigDict({'seed': 0, 'train': {'grad_accum_steps': 1}})
  common.set_mesh_and_rules(config)
  config.mesh = (('data', 2), ('fsdp', 1), ('tensor', 2))
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:4])
  # One layer of each: the shardings are those of the full model, the compile shorter.
  model = bert_feature_tagger.Model(_tagger(num_layers=1, feature_layers='last',
                                            task_num_layers=1))
  opt = ml_collections.ConfigDict(dict(name='adamw', learning_rate=0.01, b1=0.9, b2=0.999,
                                       eps=1e-8, weight_decay=0.1, clip_norm=1.0,
                                       frozen=('bert',)))
  tx = trainer.optimizer.make_optimizer(opt, optax.constant_schedule(0.01))
  local = _batch()
  state, shardings = trainer.state.create_state(model, tx, local, 0, mesh,
                                                config.logical_axis_rules, opt.frozen)
  before = jax.device_get(state.params)
  step = trainer.steps.make_train_step(model, tagging.loss_fn, tx, config, mesh, shardings)
  with jax.set_mesh(mesh):
    state, metrics = step(state, sharding.global_batch(local, mesh))
  after = jax.device_get(state.params)
  assert np.isfinite(float(metrics['loss'][0]))
  jax.tree.map(np.testing.assert_array_equal, after['bert'], before['bert'])
  assert not np.allclose(after['classifier']['kernel'], before['classifier']['kernel'])


def test_train_flops_count_bert_forward_once():
  cfg = _tagger()
  data = ml_collections.ConfigDict({'max_seq_length': 16})
  L, D, F, S, N = 16, 32, 64, 8, 3
  bert_forward = 5 * (2 * L * (4 * D * D + 2 * D * F) + 4 * L * L * D)  # no pooler, NSP
  lstm = 2 * 2 * (4 * D * 4 * S + S * 4 * S) + 2 * 2 * (2 * S * 4 * S + S * 4 * S)
  expected = bert_forward + 3 * L * (lstm + 2 * 2 * S * N)
  assert bert_feature_tagger.train_flops_per_example(cfg, data) == expected
