"""Every mistake a user can make stops train.py with one line naming the fix, before compiling."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *overrides, devices=4, config='configs/bert_base.py:tiny'):
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
             JAX_PLATFORMS='cpu')
  args = [sys.executable, 'train.py', f'--config={config}',
          f'--workdir={tmp_path / "run"}', f'--config.data.data_dir={tmp_path / "data"}',
          *overrides]
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


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


def test_missing_config_file(tmp_path):
  line = error_line(run_train(tmp_path, config='configs/missing.py'))
  assert "No such file or directory: 'configs/missing.py'" in line and 'configs/<file>.py' in line


def test_workdir_that_is_a_file(tmp_path):
  (tmp_path / 'run').write_text('not a run\n', encoding='utf-8')
  line = error_line(run_train(tmp_path))
  assert 'is a file: pass a directory' in line
  assert (tmp_path / 'run').read_text(encoding='utf-8') == 'not a run\n'


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
     'holds no checkpoint'),
    ('configs/gpt.py:tiny', ('--config.data.tokenizer=sentencepiece',),
     "Unknown data.tokenizer 'sentencepiece'"),
    ('configs/gpt.py:tiny', ('--config.optimizer.schedule=step',), 'use one of linear, cosine, constant'),
    ('configs/gpt.py:tiny', ('--config.model.head=pool',), "model.head='pool'"),
    ('configs/gpt.py:tiny', ('--config.data.pipeline=elmo',), "Unknown data.pipeline 'elmo'"),
])
def test_gpt_config_errors(tmp_path, config, overrides, expected):
  line = error_line(run_train(tmp_path, *overrides, config=config))
  assert expected in line, line
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')
