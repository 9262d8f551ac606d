"""Translation data (pairs, the offline cipher task, packing, resume) and the Transformer end to end:
BLEU rises on the offline task; translate.py decodes a file and scores it."""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import end_to_end

from configs import transformer_wmt
from input_pipeline import translation
import input_pipeline
from input_pipeline.common import tokenizer as tokenizer_lib
import trainer.checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cipher_replaces_letters_only_and_can_be_undone():
  sentence = 'Return the value of x, or None (2 cases).'
  ciphered = translation.cipher(sentence)
  assert ciphered != sentence and len(ciphered) == len(sentence)
  for a, b in zip(sentence, ciphered):
    assert a.isalpha() == b.isalpha() and a.isupper() == b.isupper()
    if not a.isalpha():
      assert a == b
  inverse = {c: p for p, c in zip(sentence, ciphered)}
  assert len(set(inverse.values())) == len(inverse)  # one letter each way
  assert ''.join(inverse[c] for c in ciphered) == sentence
  assert translation.cipher('aa bb') == translation.cipher('aa') + ' ' + translation.cipher('bb')


def test_packing_by_hand():
  source = [[11, 12, 1], [13, 1], [14, 15, 16, 1]]
  target = [[21, 1], [22, 23, 24, 1], [25, 1]]
  rows = translation.pack(source, target, length=6, bos_id=2)
  # Rows hold examples in order while both sides fit: [0, 1] (5 and 6 tokens), then [2].
  np.testing.assert_array_equal(rows['source_ids'], [[11, 12, 1, 13, 1, 0], [14, 15, 16, 1, 0, 0]])
  np.testing.assert_array_equal(rows['source_segment_ids'], [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(rows['source_positions'], [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
  np.testing.assert_array_equal(rows['target_ids'], [[21, 1, 22, 23, 24, 1], [25, 1, 0, 0, 0, 0]])
  # The decoder's input: BOS, then the target shifted right, per example.
  np.testing.assert_array_equal(rows['target_input_ids'],
                                [[2, 21, 2, 22, 23, 24], [2, 25, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['target_segment_ids'], [[1, 1, 2, 2, 2, 2], [1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(rows['target_positions'], [[0, 1, 0, 1, 2, 3], [0, 1, 0, 0, 0, 0]])


def _data_cfg(tmp_path, **overrides) -> ml_collections.ConfigDict:
  config = transformer_wmt.get_config('tiny')
  config.data.data_dir = str(tmp_path / 'data')
  config.data.update(overrides)
  return config.data


def _write_pairs(tmp_path, n=60):
  source = [f'the cat number {i} sat on the mat' for i in range(n)]
  target = [f'die Katze Nummer {i} sass auf der Matte' for i in range(n)]
  (tmp_path / 'src.txt').write_text('\n'.join(source) + '\n', encoding='utf-8')
  (tmp_path / 'tgt.txt').write_text('\n'.join(target) + '\n', encoding='utf-8')
  return source, target


def test_file_pairs_hold_out_every_nth_and_reject_misaligned_files(tmp_path):
  source, target = _write_pairs(tmp_path)
  cfg = _data_cfg(tmp_path, pairs='files', source_files=str(tmp_path / 'src.txt'),
                  target_files=str(tmp_path / 'tgt.txt'), eval_holdout=20)
  train = list(translation.pairs(cfg, 'train'))
  evals = list(translation.pairs(cfg, 'eval'))
  assert evals == [[source[i], target[i]] for i in (0, 20, 40)]
  assert len(train) == 57 and [source[1], target[1]] in train
  host1 = list(translation.pairs(cfg, 'train', process_index=1, process_count=2))
  assert host1 == train[1::2]
  # Its vocabulary is cached under the holdout too: another holdout is other training pairs.
  cfg.eval_holdout = 10
  assert translation._pairs_key(cfg).endswith('-holdout10')  # pylint: disable=protected-access
  cfg.eval_source_files, cfg.eval_target_files = cfg.source_files, cfg.target_files
  assert '-holdout' not in translation._pairs_key(cfg)  # pylint: disable=protected-access
  cfg.eval_source_files = cfg.eval_target_files = ''
  cfg.pairs, keys = 'offline', set()  # its pairs: the corpus's sentences of few enough words
  for cfg.offline_max_words in (8, 12):
    keys.add(translation._pairs_key(cfg))  # pylint: disable=protected-access
  assert len(keys) == 2 and all('-holdout10-' in key for key in keys)
  cfg.pairs = 'files'
  (tmp_path / 'tgt.txt').write_text('only one line\n', encoding='utf-8')
  with pytest.raises(ValueError, match='different numbers of lines'):
    list(translation.pairs(cfg, 'train'))


def test_offline_task_pairs_are_short_sentences_and_their_cipher(tmp_path):
  cfg = _data_cfg(tmp_path)
  first = list(translation.pairs(cfg, 'eval'))[:50]
  assert all(t == translation.cipher(s) and len(s.split()) <= 12 for s, t in first)


def test_tfds_pairs_through_mock_data(tmp_path):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  cfg = _data_cfg(tmp_path, pairs='tfds', tfds_name='wmt14_translate/de-en',
                  tfds_eval_split='validation')
  with tfds.testing.mock_data(num_examples=5, policy=tfds.testing.MockPolicy.USE_CODE):
    expected = list(tfds.as_numpy(tfds.load('wmt14_translate/de-en', split='validation',
                                            shuffle_files=False)))
    got = list(translation.pairs(cfg, 'eval'))
    with pytest.raises(ValueError, match='no language'):
      list(translation.pairs(_data_cfg(tmp_path, pairs='tfds', tfds_name='wmt14_translate/de-en',
                                       source_language='fr'), 'eval'))
  # English to German: the source is the 'en' feature.
  want = [[e['en'].decode(), e['de'].decode()] for e in expected]
  assert got == [[s.strip(), t.strip()] for s, t in want if s.strip() and t.strip()]


def test_iterator_is_static_and_exactly_resumable(tmp_path):
  _write_pairs(tmp_path)
  cfg = _data_cfg(tmp_path, pairs='files', source_files=str(tmp_path / 'src.txt'),
                  target_files=str(tmp_path / 'tgt.txt'), max_seq_length=32, docs_per_chunk=7)
  tokenizer = translation.get_tokenizer(cfg, 300)
  assert isinstance(tokenizer, tokenizer_lib.ByteLevelBPETokenizer)
  # Learned from both sides: German words are in the vocabulary too.
  assert len(tokenizer.encode(' Katze')) == 1 and len(tokenizer.encode(' cat')) == 1
  make = lambda: translation.get_iterator(cfg, 'train', tokenizer=tokenizer, batch_size=3,  # noqa: E731
                                          seed=1)
  straight = make()
  batches = [next(straight) for _ in range(8)]
  assert all(b[k].shape == (3, 32) for b in batches for k in b)
  resumed = make()
  for _ in range(3):
    next(resumed)
  state = resumed.get_state()
  again = make()
  again.set_state(state)
  for expected in batches[3:]:
    got = next(again)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
  # Every example ends with EOS on both sides, and decodes to a pair of the files.
  b = batches[0]
  segment = (b['source_segment_ids'][0] == 1)
  assert b['source_ids'][0][segment][-1] == tokenizer.eot_id
  text = tokenizer.decode(b['source_ids'][0][segment])
  assert text.startswith('the cat number ')


def test_config_errors_are_one_line(tmp_path):
  config = transformer_wmt.get_config('tiny')
  config.data.pairs = 'files'
  with pytest.raises(ValueError, match='data.source_files and data.target_files'):
    input_pipeline.check_config(config)
  config.data.pairs = 'web'
  with pytest.raises(ValueError, match='Unknown data.pairs'):
    input_pipeline.check_config(config)
  config = transformer_wmt.get_config('tiny')
  config.model.positions = 'rotary'
  with pytest.raises(ValueError, match='model.positions'):
    trainer.checks.model_config(config)


# End to end, in one subprocess on one device: 300 steps of :tiny, BLEU at steps 150 and 300.
_RUN = """
import sys
from configs import transformer_wmt
import trainer.loop
config = transformer_wmt.get_config('tiny')
config.data.data_dir = sys.argv[2]
config.train.update(num_steps=300, eval_every=150, checkpoint_every=300, eval_steps=4)
config.decode.bleu_examples = 64
trainer.loop.train_and_evaluate(config, sys.argv[1])
"""


@pytest.fixture(scope='module')
def trained(tmp_path_factory, shared_data_dir):
  workdir = str(tmp_path_factory.mktemp('mt_tiny'))
  data_dir = shared_data_dir
  env = end_to_end.env()
  result = subprocess.run([sys.executable, '-c', _RUN, workdir, data_dir], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, data_dir


@pytest.mark.slow
def test_tiny_bleu_rises_well_above_the_start(trained):
  workdir, _ = trained
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    evals = [m for m in map(json.loads, f) if 'eval_bleu' in m]
  bleu = [round(m['eval_bleu'], 2) for m in evals]
  print(f'offline cipher task, BLEU of 64 eval sentences (beam 4) at steps 150 and 300: {bleu}; '
        f'eval perplexity {evals[-1]["eval_perplexity"]:.2f}')
  assert [m["step"] for m in evals] == [150, 300]
  assert bleu[-1] > 10.0 and bleu[-1] > bleu[0] + 8.0
  assert evals[-1]['eval_perplexity'] < evals[0]['eval_perplexity'] / 4


@pytest.mark.slow
def test_translate_command_writes_a_line_per_sentence_and_bleu(trained, tmp_path):
  workdir, data_dir = trained
  cfg = _data_cfg(tmp_path)
  cfg.data_dir = data_dir
  pairs = translation.eval_pairs(cfg, 12)
  (tmp_path / 'src.txt').write_text('\n'.join(p[0] for p in pairs) + '\n', encoding='utf-8')
  (tmp_path / 'ref.txt').write_text('\n'.join(p[1] for p in pairs) + '\n', encoding='utf-8')
  result = subprocess.run(
      [sys.executable, 'translate.py', f'--workdir={workdir}', f'--input={tmp_path / "src.txt"}',
       f'--output={tmp_path / "hyp.txt"}', f'--reference={tmp_path / "ref.txt"}',
       '--beam_size=2'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  hypotheses = (tmp_path / 'hyp.txt').read_text(encoding='utf-8').splitlines()
  assert len(hypotheses) == 12 and sum(bool(h) for h in hypotheses) >= 10
  assert result.stdout.startswith('BLEU ') and '12 sentences, beam 2' in result.stdout
  bad = subprocess.run(
      [sys.executable, 'translate.py', f'--workdir={tmp_path}', f'--input={tmp_path / "src.txt"}',
       f'--output={tmp_path / "x.txt"}'], cwd=ROOT, capture_output=True, text=True, timeout=300,
      check=False)
  assert bad.returncode != 0 and 'holds no config.json' in bad.stderr.strip().splitlines()[-1]
