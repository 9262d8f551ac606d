"""ELMo end to end: the tiny biLM learns, its features are extracted exactly, and they help a tagger."""

import json
import os
import subprocess
import sys

import h5py
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import end_to_end

from configs import elmo as elmo_configs
import extract_features
from input_pipeline.common import sources
from input_pipeline.common import words as words_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One device: 8 simulated devices on 2 cores would slow these runs several times.
_ENV = end_to_end.env()


@pytest.fixture(scope='module')
def data_dir(shared_data_dir):
  return shared_data_dir


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [m for m in map(json.loads, f) if 'results' not in m]  # the per-step lines


def run_train(config_arg: str, workdir: str, data_dir: str, *overrides: str) -> str:
  """train.py's stderr."""
  result = subprocess.run(
      [sys.executable, 'train.py', f'--config={config_arg}', f'--workdir={workdir}',
       f'--config.data.data_dir={data_dir}', *overrides],
      cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr


@pytest.fixture(scope='module')
def pretrained(data_dir, tmp_path_factory):
  """The first 300 steps of configs/elmo.py:tiny (the issue's learning check), shared below."""
  workdir = str(tmp_path_factory.mktemp('elmo_tiny'))
  stderr = run_train('configs/elmo.py:tiny', workdir, data_dir, '--config.train.num_steps=300',
                     '--config.train.eval_every=300', '--config.train.checkpoint_every=300')
  assert end_to_end.EVAL_WRAPPED not in stderr  # configs/common.TINY_EVAL_HOLDOUT
  return workdir


def unigram_perplexity(workdir: str, data_dir: str) -> float:
  """Perplexity on the eval split of the add-one unigram model of the train split (same vocabulary)."""
  config = elmo_configs.get_config('tiny')
  config.data.data_dir = data_dir
  vocab = words_lib.WordVocab(os.path.join(workdir, words_lib.WordVocab.FILE_NAME))
  def ids(split):  # the tokens a target can be: words and </S> (never <S>)
    return np.concatenate([np.append(vocab.ids(words_lib.word_tokens(s)), vocab.eos_id)
                           for doc in sources.documents(config.data, split) for s in doc])
  return end_to_end.unigram_baseline(ids('train'), ids('eval'), vocab.vocab_size)[0]


@pytest.mark.slow
def test_tiny_bilm_perplexity_falls(pretrained, data_dir):
  """Both directions' eval perplexities fall well below the unigram model's in 300 steps."""
  metrics = read_metrics(pretrained)
  logged = [m for m in metrics if 'loss' in m]
  first, last = logged[0], logged[-1]
  evals = [m for m in metrics if 'eval_loss' in m]
  unigram = unigram_perplexity(pretrained, data_dir)
  print(f"perplexity {first['perplexity']:.0f} (steps 1-20) -> {last['perplexity']:.0f} "
        f"(step {last['step']}); eval forward {evals[-1]['eval_forward_perplexity']:.0f}, "
        f"backward {evals[-1]['eval_backward_perplexity']:.0f}; unigram {unigram:.0f}")
  assert last['step'] == 300
  assert last['perplexity'] < first['perplexity'] / 4
  # Measured at e33568e (1 in 10 held out): forward 230, backward 219 against 386 (0.60, 0.57;
  # 228 and 231 with 1 in 100, and 232 and 221 at an earlier commit). Before the targets across
  # a sentence boundary were dropped (certain ones, which the unigram model never had): 164, 159.
  for direction in ('forward', 'backward'):
    assert evals[-1][f'eval_{direction}_perplexity'] < 0.7 * unigram


@pytest.mark.slow
@pytest.mark.parametrize('output_name', ['features.h5', 'features.npz'])
def test_extracted_features_equal_the_model_outputs(pretrained, tmp_path, output_name):
  # An empty line keeps its place: dataset '2' has 0 words, 'x' is dataset '3'.
  sentences = ['The file is opened for reading .', 'Return the value', '', 'x']
  source = tmp_path / 'sentences.txt'
  source.write_text('\n'.join(sentences) + '\n', encoding='utf-8')
  output = str(tmp_path / output_name)
  if output_name.endswith('.h5'):  # the command line
    result = subprocess.run(
        [sys.executable, 'extract_features.py', f'--workdir={pretrained}', f'--input={source}',
         f'--output={output}', '--batch_size=2'],
        cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
  else:  # the function, in this process, with the other --layers too
    assert extract_features.extract(pretrained, str(source), output, batch_size=2) == 4
    for layers in ('top', 'average'):
      extract_features.extract(pretrained, str(source), str(tmp_path / f'{layers}.npz'),
                               layers=layers)
    with np.load(output) as all_layers, np.load(tmp_path / 'top.npz') as top, \
        np.load(tmp_path / 'average.npz') as average:
      for i in range(4):
        np.testing.assert_allclose(top[str(i)], all_layers[str(i)][-1], atol=1e-6)
        np.testing.assert_allclose(average[str(i)], all_layers[str(i)].mean(0), atol=1e-6)

  config, model, params, vocab = extract_features.load_bilm(pretrained)
  width = config.data.max_characters_per_token
  two_d = 2 * config.model.projection_dim
  if output_name.endswith('.h5'):
    with h5py.File(output, 'r') as f:
      read = {k: np.asarray(f[k]) for k in f}
    index = json.loads(read['sentence_to_index'][0])
  else:
    with np.load(output) as f:
      read = {k: f[k] for k in f.files}
    index = json.loads(str(read['sentence_to_index']))
  assert index == {s: str(i) for i, s in enumerate(sentences)}
  for i, sentence in enumerate(sentences):
    if not sentence:
      assert read[str(i)].shape == (config.model.num_layers + 1, 0, two_d)
      continue
    token_ids, char_ids = vocab.sentence(words_lib.word_tokens(sentence), width)
    n = len(token_ids)
    # The model alone, on one unpadded sentence.
    out = model.apply({'params': params}, {
        'char_ids': char_ids[None], 'token_ids': token_ids[None],
        'lengths': np.array([n], np.int32)}, deterministic=True)
    expected = np.asarray(out['layers'][0, :, 1:n - 1])
    assert read[str(i)].shape == (config.model.num_layers + 1, n - 2, two_d)  # 2L+1 = J layers of [fw; bw]
    np.testing.assert_allclose(read[str(i)], expected, atol=2e-5, rtol=1e-4)


def test_extraction_rejects_bad_input(tmp_path):
  with pytest.raises(ValueError, match='does not exist'):
    extract_features.extract(str(tmp_path), str(tmp_path / 'x.txt'), str(tmp_path / 'f.h5'))
  (tmp_path / 'x.txt').write_text('A sentence .\n', encoding='utf-8')
  with pytest.raises(ValueError, match='holds no config.json'):
    extract_features.extract(str(tmp_path), str(tmp_path / 'x.txt'), str(tmp_path / 'f.h5'))
  with pytest.raises(ValueError, match='--output'):
    extract_features.extract(str(tmp_path), str(tmp_path / 'x.txt'), str(tmp_path / 'f.txt'))
  with pytest.raises(ValueError, match='--layers'):
    extract_features.extract(str(tmp_path), str(tmp_path / 'x.txt'), str(tmp_path / 'f.h5'),
                             layers='middle')


def saved_params(workdir) -> dict:
  """The params of the latest checkpoint of a workdir, as numpy arrays."""
  directory = os.path.join(workdir, 'checkpoints')
  step = max(int(n) for n in os.listdir(directory) if n.isdigit())
  state = ocp.PyTreeCheckpointer().restore(os.path.join(directory, str(step), 'state'))
  return jax.tree.map(np.asarray, state['params'])


def final_eval(workdir):
  return [m for m in read_metrics(workdir) if 'eval_loss' in m][-1]


@pytest.mark.slow
def test_tagger_with_elmo_beats_the_same_tagger_without(pretrained, data_dir, tmp_path):
  """Feature-based transfer (sec. 3.3, Table 1) on the offline replaced-word task.

  The baseline learns the same word vocabulary from the same cache (data_dir),
  so the two task models differ only in ELMo.
  """
  runs = {}
  for use_elmo in (True, False):
    workdir = str(tmp_path / f'elmo_{use_elmo}')
    init = [f'--config.init_from={pretrained}'] if use_elmo else []
    run_train('configs/elmo_tagger.py:offline_replaced,tiny', workdir, data_dir, *init,
              f'--config.model.use_elmo={use_elmo}')
    runs[use_elmo] = final_eval(workdir)
  # The biLM came through the tagger's training unchanged (frozen).
  pretrained_bilm, tagger_bilm = (saved_params(w)['bilm'] for w in (pretrained, tmp_path / 'elmo_True'))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(pretrained_bilm),
                          jax.tree_util.tree_leaves(tagger_bilm)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  with_elmo, without = runs[True], runs[False]
  print(f"offline_replaced eval: with ELMo accuracy {with_elmo['eval_accuracy']:.3f}, "
        f"F1 {with_elmo['eval_span_f1']:.3f}; without {without['eval_accuracy']:.3f}, "
        f"F1 {without['eval_span_f1']:.3f}")
  assert with_elmo['eval_span_f1'] > without['eval_span_f1'] + 0.1
  assert with_elmo['eval_accuracy'] > without['eval_accuracy']


def test_tagger_with_elmo_needs_a_pretrained_bilm(tmp_path):
  result = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/elmo_tagger.py:offline_replaced,tiny',
       f'--workdir={tmp_path}'], cwd=ROOT, env=_ENV, capture_output=True, text=True,
      timeout=300, check=False)
  assert result.returncode != 0
  assert 'config.init_from' in result.stderr.strip().splitlines()[-1]
