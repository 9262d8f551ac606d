"""Tests of convert_checkpoint.py --from=cove: salesforce/cove's MT-LSTM (wmtlstm-*.pth) into a
CoVe workdir.

The reference is torch's own nn.LSTM loaded with the state dict, run as salesforce/cove's MTLSTM
runs it: one single-layer biLSTM per layer (layer 1's tensors renamed to l0), the batch sorted by
length and packed (pack_padded_sequence), unpacked and put back in order. The state dict is made
up at the released layout with small sizes: those of configs/cove.py:tiny (50-d vectors, 64 cells
per direction), so that configs/cove_classifier.py's tiny size reads the workdir.
"""

import os
import sys

import flax.linen as nn
import h5py
import jax
import numpy as np
import pytest

from configs import cove_classifier
import convert_cove
import extract_features
import forked  # tests/
import input_pipeline
from models import bcn
from trainer import checkpoints
import sweep
import trainer.checks
import trainer.state

# The reference implementation (requirements-parity.txt): imported outright, so that CI fails
# rather than skips without it.
import torch  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, S = 50, 64  # configs/cove.py:tiny's word_dim and hidden_size
GLOVE_WORDS = 40  # fewer than tiny's 4,000 source words: the rest of the table stays zero


def _reference_lstm(seed: int = 0) -> torch.nn.LSTM:
  """The released layout: nn.LSTM(W, S, num_layers=2, bidirectional=True), every weight and both
  biases random and large enough that a swapped gate, direction or bias shows."""
  torch.manual_seed(seed)
  lstm = torch.nn.LSTM(W, S, num_layers=2, bidirectional=True, batch_first=True)
  with torch.no_grad():
    for param in lstm.parameters():
      param.uniform_(-0.4, 0.4)
  return lstm.eval()


def _glove_words() -> list[str]:
  # Cased, as glove.840B, which lists 'I' before 'i'; a word with a space inside (840B has some)
  # and a repeat are left out. '1,000' and '...' are words of 840B's, which a split for raw
  # text would cut.
  # 'Paris' has no lower-case entry, as glove.840B's 'Zebra' has none.
  return ['The', 'the', ',', 'cat', 'sat', 'on', 'mat', 'a', '1,000', '...', 'Paris'] + [
      f'w{i}' for i in range(GLOVE_WORDS - 11)]


def _write_glove(path, words, seed: int = 1) -> dict[str, np.ndarray]:
  vectors = np.random.default_rng(seed).normal(0, 1, (len(words), W)).astype(np.float32)
  lines = [f'{w} {" ".join(f"{x:.6f}" for x in v)}' for w, v in zip(words, vectors)]
  lines.insert(3, 'two words ' + ' '.join(['0.5'] * W))
  lines.insert(5, 'cat ' + ' '.join(['9.0'] * W))
  path.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  return {w: np.array([float(f'{x:.6f}') for x in v], np.float32) for w, v in zip(words, vectors)}


@pytest.fixture(scope='module')
def released(tmp_path_factory):
  """(the reference LSTM, its .pth, the GloVe file and its vectors, the converted workdir)."""
  directory = tmp_path_factory.mktemp('cove')
  lstm = _reference_lstm()
  pth = directory / 'wmtlstm-test.pth'
  torch.save(lstm.state_dict(), pth)
  glove = directory / 'glove.test.50d.txt'
  vectors = _write_glove(glove, _glove_words())
  workdir = str(directory / 'run')
  summary = convert_cove.convert(str(pth), workdir, str(glove))
  assert 'The release has no decoder' in summary
  return lstm, pth, glove, vectors, workdir


def _mtlstm_layers(lstm: torch.nn.LSTM, x_BSW: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
  """Each layer's states (B, S, 2S) as salesforce/cove's MTLSTM computes them, zeros at padding."""
  state = lstm.state_dict()
  layers = []
  for i, width in enumerate((W, 2 * S)):
    layer = torch.nn.LSTM(width, S, num_layers=1, bidirectional=True, batch_first=True)
    layer.load_state_dict({k.replace(f'_l{i}', '_l0'): v for k, v in state.items()
                           if f'_l{i}' in k})
    layers.append(layer.eval())
  lengths_t = torch.tensor(lengths)
  order = torch.argsort(lengths_t, descending=True, stable=True)
  packed = torch.nn.utils.rnn.pack_padded_sequence(
      torch.from_numpy(x_BSW)[order], lengths_t[order], batch_first=True)
  outputs = []
  with torch.no_grad():
    for layer in layers:
      packed, _ = layer(packed)
      padded, _ = torch.nn.utils.rnn.pad_packed_sequence(packed, batch_first=True,
                                                          total_length=x_BSW.shape[1])
      outputs.append(padded[torch.argsort(order)].numpy())
    # The split layers are the two-layer LSTM the file holds.
    whole, _ = lstm(torch.nn.utils.rnn.pack_padded_sequence(
        torch.from_numpy(x_BSW)[order], lengths_t[order], batch_first=True))
    whole = torch.nn.utils.rnn.pad_packed_sequence(whole, batch_first=True,
                                                   total_length=x_BSW.shape[1])[0]
  np.testing.assert_allclose(whole[torch.argsort(order)].numpy(), outputs[-1], atol=1e-6, rtol=0)
  return outputs


def test_every_layer_matches_torch_lstm_over_padded_sentences(released):
  lstm, _, _, _, workdir = released
  config, model, params, _ = trainer.state.load_trained(workdir, 'cove', 'test')
  assert (config.model.word_dim, config.model.hidden_size) == (W, S)
  rng = np.random.default_rng(2)
  lengths = [int(n) for n in rng.integers(1, 14, 24)]
  lengths[0] = 13  # one row without padding
  x_BSW = rng.normal(0, 1, (len(lengths), 13, W)).astype(np.float32)
  for row, n in enumerate(lengths):
    x_BSW[row, n:] = rng.normal(0, 1, (13 - n, W))  # padding that must not leak in
  ours = model.apply({'params': params}, jax.numpy.asarray(x_BSW), jax.numpy.asarray(lengths),
                     method='encode_vectors')
  reference = _mtlstm_layers(lstm, x_BSW, lengths)
  assert len(ours) == len(reference) == 2
  for layer, (mine, theirs) in enumerate(zip(ours, reference)):
    np.testing.assert_allclose(np.asarray(mine, np.float32), theirs, atol=1e-5, rtol=0,
                               err_msg=f'layer {layer}')


def test_extract_features_matches_the_reference_over_glove(released, tmp_path):
  """extract_features.py --cove_only --glove on the converted workdir: the reference's CoVe of
  the GloVe vectors of the lower-cased words (salesforce/cove's example: torchtext's lower=True,
  then an exact lookup), a zero vector for a word GloVe lacks (torchtext's default): 'paris'
  too, though the file has 'Paris'."""
  lstm, _, glove, vectors, workdir = released
  rng = np.random.default_rng(3)
  known = list(vectors)
  sentences = [' '.join(rng.choice(known + ['unseen', 'Zebra'], int(n)))
               for n in rng.integers(1, 12, 22)]
  sentences[0] += ' Paris'
  (tmp_path / 'in.txt').write_text('\n'.join(sentences) + '\n', encoding='utf-8')
  outputs = {}
  for name, kwargs in (('cove', dict(glove=str(glove), cove_only=True)),
                       ('both', dict(glove=str(glove))), ('table', {})):
    out = str(tmp_path / f'{name}.h5')
    assert extract_features.extract(workdir, str(tmp_path / 'in.txt'), out, batch_size=32,
                                    **kwargs) == len(sentences)
    with h5py.File(out) as f:
      outputs[name] = [f[str(i)][()] for i in range(len(sentences))]
  words = [s.split() for s in sentences]
  x_BSW = np.zeros((len(words), max(map(len, words)), W), np.float32)
  for row, sentence in enumerate(words):
    for t, word in enumerate(sentence):
      x_BSW[row, t] = vectors.get(word.lower(), 0.0)
  reference = _mtlstm_layers(lstm, x_BSW, [len(s) for s in words])[-1]
  for row, sentence in enumerate(words):
    n = len(sentence)
    np.testing.assert_allclose(outputs['cove'][row], reference[row, :n], atol=1e-5, rtol=0)
    np.testing.assert_allclose(outputs['both'][row], np.concatenate(
        [x_BSW[row, :n], reference[row, :n]], axis=-1), atol=1e-5, rtol=0)
    # Every word of this small GloVe file is in the workdir's table too.
    np.testing.assert_allclose(outputs['table'][row], outputs['both'][row], atol=1e-6, rtol=0)


def test_the_workdir_is_glove_words_the_encoder_and_a_named_untrained_decoder(released, tmp_path):
  _, pth, glove, vectors, workdir = released
  config, _, params, tokenizer = trainer.state.load_trained(workdir, 'cove', 'test')
  # In the file's order; 'two words' and the second 'cat' left out, and 'The': the release
  # reads lower-cased text, and 'the' has its own vector (torchtext's lookup).
  lower = [w for w in _glove_words() if w == w.lower()]
  assert len(lower) == GLOVE_WORDS - 2 and config.data.lower_case is True
  assert tokenizer.source.words == ['<S>', '</S>', '<UNK>'] + lower
  table = np.asarray(params['word_vectors']['table']['embedding'])
  assert table.shape == (config.model.source_vocab_size, W) == (4000, W)
  np.testing.assert_array_equal(table[3:3 + len(lower)], np.stack([vectors[w] for w in lower]))
  assert not table[:3].any() and not table[3 + len(lower):].any()
  # --lower_case=false keeps the file's words as they are.
  words, cased = convert_cove.glove_vocabulary(str(glove), 4, lower_case=False)
  assert words == ['The', 'the', ',', 'cat']
  np.testing.assert_array_equal(cased, np.stack([vectors[w] for w in words]))
  assert not np.asarray(params['word_vectors']['unknown']).any()
  assert list(config.untrained_params) == ['target_embed', 'decoder', 'output']
  assert config.converted_from == str(pth) and config.data.glove_file == str(glove)
  assert config.train.num_steps == checkpoints.newest_step(workdir) == 0
  # translate.py refuses it in one line.
  source = tmp_path / 'src.txt'
  source.write_text('the cat\n', encoding='utf-8')
  result = forked.run([sys.executable, 'translate.py', f'--workdir={workdir}',
                       f'--input={source}', f'--output={source}.out'], cwd=ROOT)
  assert result.returncode != 0 and not os.path.exists(f'{source}.out')
  assert result.stderr.strip().splitlines()[-1] == (
      f'translate.py: error: {workdir} has an untrained target_embed, decoder, output '
      f'(converted from {pth}): translate with a trained translation run.')


def test_the_released_sizes_make_configs_coves_base():
  tensors = {'weight_ih_l0': np.empty((1200, 300)), 'weight_hh_l0': np.empty((1200, 300)),
             'weight_ih_l1': np.empty((1200, 600))}
  config = convert_cove.config_for(tensors, 'wmtlstm.pth', 'glove.840B.300d.txt', False)
  base = cove_classifier.COVE['base']
  assert config.model.source_vocab_size == base['vocab_size'] == 100_000
  assert (config.model.word_dim, config.model.hidden_size,
          config.model.num_encoder_layers) == (300, 300, 2)


def test_the_bcn_and_the_sweep_read_a_converted_workdir(released):
  """configs/cove_classifier.py:TASK,tiny takes the converted workdir as init_from, no flag more:
  the sizes and casing check out and its word vectors and encoder are the converted ones."""
  _, _, _, _, workdir = released
  config = cove_classifier.get_config('offline_shuffled,tiny')
  config.init_from = workdir
  trainer.checks.inherit_unset_fields(config, None)  # as train.py, before the checks
  # The release's split and casing, as its extracted features.
  assert config.data.split_words == 'spaces' and config.data.lower_case is True
  trainer.checks.check_init_from(config)
  model = bcn.Model(trainer.checks.model_config(config))
  batch = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=1)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        jax.eval_shape(lambda: nn.meta.unbox(model.init(
                            jax.random.key(0), batch, deterministic=True)['params'])))
  params, new, unused = checkpoints.restore_params(workdir, target)
  _, _, converted, _ = trainer.state.load_trained(workdir, 'cove', 'test')
  for part in ('word_vectors', 'encoder'):
    assert not any(name.startswith(part) for name in new)
    jax.tree.map(np.testing.assert_array_equal, params[part], converted[part])
  assert {name.split('/')[0] for name in unused} == {'target_embed', 'decoder', 'output'}
  # The sweep: an encoder workdir replaces the translation stage.
  spec = f'{ROOT}/configs/sweeps/cove_glove.py:tiny,offline_next,{workdir}'
  runs = sweep.unique_runs(sweep.expand(sweep.load_sweep(spec), '/tmp/sweep'))
  assert {run.stage for run in runs} == {'classifier'} and len(runs) == 4
  for run in runs:
    assert f'--config.init_from={workdir}' in run.argv()
    assert any(a.startswith('--config=') and a.endswith('cove_classifier.py:offline_next,tiny')
               for a in run.argv())


def test_bad_input_is_one_line_naming_the_tensor(released, tmp_path):
  lstm, pth, glove, _, workdir = released
  state = lstm.state_dict()
  unidirectional = torch.nn.LSTM(W, S, num_layers=2, batch_first=True).state_dict()
  cases = (
      ({k: v for k, v in state.items() if k != 'bias_hh_l1_reverse'},
       'has no tensor bias_hh_l1_reverse'),
      (unidirectional, 'has no tensor weight_ih_l0_reverse'),
      ({**state, 'weight_hh_l1': state['weight_hh_l1'][:, :32]},
       r'weight_hh_l1 has shape \(256, 32\) but a biLSTM of 64 cells .* needs \(256, 64\)'),
      ({**state, 'weight_ih_l1': state['weight_ih_l1'][:, :64]},
       r'weight_ih_l1 has shape \(256, 64\) .* needs \(256, 128\)'),
      ({**state, 'vectors.weight': torch.zeros(3, W)}, r'1 tensor\(s\) .*: vectors.weight'),
      ({f'rnn1.{k}': v for k, v in state.items()},
       r'has no tensor weight_ih_l0 \(it has rnn1.bias_hh_l0, '),
      ({'bert.embeddings.word_embeddings.weight': torch.zeros(4, 4)}, 'no tensor weight_ih_l0'),
  )
  for i, (tensors, match) in enumerate(cases):
    torch.save(tensors, tmp_path / f'{i}.pth')
    _refused(match, str(tmp_path / f'{i}.pth'), str(tmp_path / f'run{i}'), str(glove))
  narrow = tmp_path / 'glove.10d.txt'
  narrow.write_text('the ' + ' '.join(['0.1'] * 10) + '\n', encoding='utf-8')
  _refused('weight_ih_l0 reads 50-d word vectors but --glove=.* has 10-d ones', str(pth),
           str(tmp_path / 'narrow'), str(narrow))
  _refused('--from=cove needs --glove=', str(pth), str(tmp_path / 'noglove'), '')
  (tmp_path / 'text.pth').write_text('not a torch file', encoding='utf-8')
  _refused('does not load as a PyTorch state dict', str(tmp_path / 'text.pth'),
           str(tmp_path / 'text'), str(glove))
  torch.save([torch.zeros(2)], tmp_path / 'list.pth')
  _refused('holds a list, not a state dict', str(tmp_path / 'list.pth'), str(tmp_path / 'l'),
           str(glove))
  _refused('does not exist', str(tmp_path / 'missing.pth'), str(tmp_path / 'm'), str(glove))
  with pytest.raises(ValueError, match='already holds a checkpoint'):
    convert_cove.convert(str(pth), workdir, str(glove))
  # The command line: one line on stderr, a non-zero exit.
  result = forked.run(
      [sys.executable, 'convert_checkpoint.py', '--from=cove', f'--input={pth}',
       f'--workdir={tmp_path}/cli'], cwd=ROOT)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      'convert_checkpoint.py: error: --from=cove needs --glove=glove.840B.300d.txt: the MT-LSTM '
      'reads GloVe vectors, which the release does not include.']
  assert not os.path.exists(f'{tmp_path}/cli')


def _refused(match: str, source: str, workdir: str, glove: str) -> None:
  """One line, and nothing written."""
  with pytest.raises(ValueError, match=match) as error:
    convert_cove.convert(source, workdir, glove)
  assert '\n' not in str(error.value)
  assert not os.path.exists(workdir)
