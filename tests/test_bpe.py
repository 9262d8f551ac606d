"""Tests of the byte-level BPE tokenizer, the tokenizer roles, and sources.get_tokenizer.

Radford et al. 2018 sec. 4.1 (a BPE vocabulary learned on the pretraining
text); byte-level as in GPT-2, so that nothing is unknown and decoding is exact.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from configs import gpt
from input_pipeline.common import sources
from input_pipeline.common import tokenizer as tokenizer_lib

TEXT = ['The quick brown fox jumps over the lazy dog.',
        'A lazy dog sleeps all day, the quick fox runs.',
        'Foxes and dogs are animals; animals sleep. Héllo wörld, 你好世界!'] * 20
# Bytes of every width, combining marks, controls, CRLF, NUL, runs of spaces,
# private use, text spelling the specials: all must come back exactly.
UNICODE = ['Héllo, Wörld! Ünïcödé', 'e\u0301 vs é', '你好，世界。日本語のテキスト',
           'emoji 😀👍🏽 🇫🇷 and ZWJ 👩‍👩‍👧', 'tabs\tand\r\nCRLF\x00NUL\x07bell',
           '   leading and trailing   ', 'Ελληνικά ΟΔΟΣ русский עברית العربية',
           '\ue000\U0010fffd private use', '<|endoftext|> <|pad|><|start|>', '', ' ', '\n\n']


@pytest.fixture(scope='module')
def cased_file(tmp_path_factory):
  return tokenizer_lib.learn_bpe(TEXT, 400, False,
                                 str(tmp_path_factory.mktemp('bpe') / 'tokenizer.json'))


@pytest.fixture(scope='module')
def cased(cased_file):
  return tokenizer_lib.ByteLevelBPETokenizer(cased_file, lower_case=False)


def test_round_trip_any_text(cased):
  for text in UNICODE + TEXT[:3]:
    ids = cased.encode(text)
    assert cased.decode(ids) == text, text
  assert cased.encode_batch(UNICODE) == [cased.encode(t) for t in UNICODE]
  # Learned merges are used: frequent words are single tokens (with their leading space).
  assert cased.convert_ids_to_tokens(cased.encode('the quick fox')) == ['the', 'Ġquick', 'Ġfox']
  # Text the vocabulary never saw still encodes, byte by byte.
  assert len(cased.encode('ж')) == 2 and cased.decode(cased.encode('ж')) == 'ж'


def test_vocabulary_layout_and_exact_size(cased, tmp_path):
  assert cased.vocab_size == 400
  assert tokenizer_lib.ByteLevelBPETokenizer.FILE_NAME == 'tokenizer.json'
  assert (cased.pad_id, cased.eot_id, cased.start_id, cased.delim_id, cased.extract_id) == (
      0, 1, 2, 3, 4)
  assert cased.convert_ids_to_tokens(range(5)) == list(tokenizer_lib.BPE_SPECIAL_TOKENS)
  # Too little text for 5000 ids: padded with unused tokens at the end, exactly 5000.
  small = tokenizer_lib.ByteLevelBPETokenizer(
      tokenizer_lib.learn_bpe(TEXT, 5000, False, str(tmp_path / 'big.json')), False)
  tokens = small.convert_ids_to_tokens(range(5000))
  first_unused = tokens.index('<|unused0|>')
  assert small.vocab_size == 5000 and 261 < first_unused < 1000
  assert tokens[first_unused:] == [f'<|unused{i}|>' for i in range(5000 - first_unused)]
  assert max(i for ids in small.encode_batch(TEXT + UNICODE) for i in ids) < first_unused
  # Exactly the minimum: specials and the 256 bytes in byte order (byte b is id 5 + b), no merges.
  bare = tokenizer_lib.ByteLevelBPETokenizer(
      tokenizer_lib.learn_bpe(TEXT, 261, False, str(tmp_path / 'bare.json')), False)
  assert bare.vocab_size == 261
  assert bare.encode('ab é\x00') == [5 + 97, 5 + 98, 5 + 32, 5 + 0xC3, 5 + 0xA9, 5 + 0]
  assert len(set(bare.convert_ids_to_tokens(range(261)))) == 261
  assert bare.encode(bytes(range(128)).decode()) == list(range(5, 133))
  with pytest.raises(ValueError, match='at least 261') as error:
    tokenizer_lib.learn_bpe(TEXT, 260, False, str(tmp_path / 'tiny.json'))
  assert '\n' not in str(error.value)


def test_specials_are_never_made_from_text(cased, tmp_path):
  text = ' '.join(tokenizer_lib.BPE_SPECIAL_TOKENS) + ''.join(tokenizer_lib.BPE_SPECIAL_TOKENS)
  for t in (text, '<|endoftext|>', 'x<|endoftext|>y', '<|unused0|>'):
    ids = cased.encode(t)
    assert min(ids) >= 5 and cased.decode(ids) == t
  # A file that registers them as the library's special tokens (one from elsewhere)
  # would have them matched in text; loaded here, they are text still.
  import tokenizers  # pylint: disable=g-import-not-at-top
  registered = tokenizers.Tokenizer.from_file(cased.vocab_file)
  registered.add_special_tokens(list(tokenizer_lib.BPE_SPECIAL_TOKENS))
  assert registered.encode('a<|endoftext|>b').ids[1] == 1  # the danger is real
  path = str(tmp_path / 'registered.json')
  registered.save(path)
  safe = tokenizer_lib.ByteLevelBPETokenizer(path, False)
  assert 1 not in safe.encode('a<|endoftext|>b')
  assert safe.encode_batch(['a<|endoftext|>b']) == [safe.encode('a<|endoftext|>b')]


def test_decode_drops_specials(cased):
  ids = [cased.eot_id] + cased.encode('the fox') + [cased.eot_id, cased.pad_id, cased.pad_id]
  assert cased.decode(ids) == 'the fox'


def test_learn_bpe_is_deterministic(tmp_path):
  first = tokenizer_lib.learn_bpe(TEXT, 350, True, str(tmp_path / 'a.json'))
  second = tokenizer_lib.learn_bpe(iter(TEXT), 350, True, str(tmp_path / 'b.json'))
  # The library's hash maps are seeded per process: another process must agree too.
  script = ('import sys; from input_pipeline.common import tokenizer as t; '
            f'from tests.test_bpe import TEXT; t.learn_bpe(TEXT, 350, True, sys.argv[1])')
  third = str(tmp_path / 'c.json')
  subprocess.run([sys.executable, '-c', script, third], check=True,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(first, 'rb') as a, open(second, 'rb') as b, open(third, 'rb') as c:
    assert a.read() == b.read() == c.read()
  assert sorted(os.listdir(tmp_path)) == ['a.json', 'b.json', 'c.json']  # no temporary files


def test_lower_case(tmp_path):
  path = tokenizer_lib.learn_bpe(TEXT, 350, True, str(tmp_path / 'uncased.json'))
  uncased = tokenizer_lib.ByteLevelBPETokenizer(path, lower_case=True)
  assert uncased.encode('THE Quick Fox') == uncased.encode('the quick fox')
  assert uncased.decode(uncased.encode('Héllo WÖRLD')) == 'héllo wörld'
  with pytest.raises(ValueError, match='lower_case=True') as error:
    tokenizer_lib.ByteLevelBPETokenizer(path, lower_case=False)
  assert '\n' not in str(error.value)


def test_bad_tokenizer_files_say_what_to_fix(tmp_path):
  (tmp_path / 'vocab.txt').write_text('[PAD]\nhello\n', encoding='utf-8')
  (tmp_path / 'wp.json').write_text('{"not": "a tokenizer"}', encoding='utf-8')
  for path, match in ((tmp_path / 'missing.json', 'not found'),
                      (tmp_path / 'vocab.txt', 'is not a tokenizer.json'),
                      (tmp_path / 'wp.json', 'is not a tokenizer.json')):
    with pytest.raises(ValueError, match=match) as error:
      tokenizer_lib.ByteLevelBPETokenizer(str(path), False)
    assert '\n' not in str(error.value)


def test_wordpiece_roles_decode_and_load(tmp_path):
  vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'un', '##aff', '##able', 'fox', '.']
  path = tmp_path / 'vocab.txt'
  path.write_text(''.join(t + '\n' for t in vocab), encoding='utf-8')
  wordpiece = tokenizer_lib.load(str(path), lower_case=True)
  assert isinstance(wordpiece, tokenizer_lib.WordPieceTokenizer)
  assert tokenizer_lib.WordPieceTokenizer.FILE_NAME == 'vocab.txt'
  assert (wordpiece.pad_id, wordpiece.eot_id, wordpiece.start_id, wordpiece.delim_id,
          wordpiece.extract_id) == (0, 3, 2, 3, 4)
  ids = wordpiece.encode('Unaffable fox. xyz')
  assert ids == [5, 6, 7, 8, 9, 1]
  assert wordpiece.decode([2] + ids + [3, 0]) == 'unaffable fox . [UNK]'


def test_load_picks_the_class_by_file(cased_file):
  assert isinstance(tokenizer_lib.load(cased_file, False), tokenizer_lib.ByteLevelBPETokenizer)


# sources.get_tokenizer.

DOCS_TXT = ('The fox runs.\nThe dog sleeps.\n\nA fox and a dog.\n\nDogs sleep all day.\n'
            'Foxes run all night.\n\nThe end.\n')


def _data_cfg(tmp_path, **overrides):
  (tmp_path / 'docs.txt').write_text(DOCS_TXT * 3, encoding='utf-8')
  data_cfg = gpt.get_config('tiny').data
  data_cfg.update(dict(source='files', files=str(tmp_path / 'docs.txt'), eval_holdout=4,
                       data_dir=str(tmp_path / 'cache')) | overrides)
  return data_cfg


def test_get_tokenizer_learns_caches_and_prefers_saved_dir(tmp_path, monkeypatch):
  data_cfg = _data_cfg(tmp_path, tokenizer='bpe', lower_case=False)
  tok = sources.get_tokenizer(data_cfg, 300)
  assert isinstance(tok, tokenizer_lib.ByteLevelBPETokenizer) and tok.vocab_size == 300
  [name] = os.listdir(tmp_path / 'cache' / 'vocab')
  assert name.startswith('files-docs-') and name.endswith('-bpe-300-cased.json')
  assert tok.decode(tok.encode('Foxes run all night.')) == 'Foxes run all night.'
  # The kind is part of the cache name: WordPiece learns its own file beside it.
  wordpiece = sources.get_tokenizer(_data_cfg(tmp_path, tokenizer='wordpiece'), 300)
  assert isinstance(wordpiece, tokenizer_lib.WordPieceTokenizer)
  assert sorted(os.listdir(tmp_path / 'cache' / 'vocab'))[1].endswith('-wordpiece-300-cased.txt')

  monkeypatch.setattr(tokenizer_lib, 'learn_bpe', None)  # from now on nothing is learned
  assert sources.get_tokenizer(data_cfg, 300).vocab_file == tok.vocab_file
  # A run's directory wins over data.vocab_file and the cache, with the file of the configured kind.
  saved = tmp_path / 'workdir'
  saved.mkdir()
  (saved / 'tokenizer.json').write_bytes(pathlib.Path(tok.vocab_file).read_bytes())
  (saved / 'vocab.txt').write_bytes(pathlib.Path(wordpiece.vocab_file).read_bytes())
  data_cfg.vocab_file = str(tmp_path / 'missing.json')
  from_saved = sources.get_tokenizer(data_cfg, 300, saved_dir=str(saved))
  assert from_saved.vocab_file == str(saved / 'tokenizer.json')
  data_cfg.tokenizer, data_cfg.vocab_file = 'wordpiece', ''
  assert sources.get_tokenizer(data_cfg, 300, saved_dir=str(saved)).vocab_file == str(
      saved / 'vocab.txt')
  # Without the kind's file there, an error: a new vocabulary's ids would mean something else.
  data_cfg.tokenizer, data_cfg.vocab_file = 'bpe', tok.vocab_file
  (saved / 'tokenizer.json').unlink()
  with pytest.raises(ValueError, match="has no tokenizer.json: it was not trained with "
                     "data.tokenizer='bpe'"):
    sources.get_tokenizer(data_cfg, 300, saved_dir=str(saved))


def test_get_tokenizer_errors_are_one_line(tmp_path):
  for overrides, match in (
      (dict(tokenizer='sentencepiece'), "Unknown data.tokenizer 'sentencepiece'"),
      (dict(tokenizer='bpe', vocab_file=str(tmp_path / 'docs.txt')), 'is not a bpe tokenizer.json'),
      (dict(tokenizer='wordpiece', vocab_file=str(tmp_path / 'docs.txt.json')), 'does not exist'),
  ):
    with pytest.raises(ValueError, match=match) as error:
      sources.get_tokenizer(_data_cfg(tmp_path, **overrides), 300)
    assert '\n' not in str(error.value)
  (tmp_path / 'wp.json').write_text('{}', encoding='utf-8')
  with pytest.raises(ValueError, match='is not a wordpiece vocab.txt'):
    sources.get_tokenizer(_data_cfg(tmp_path, tokenizer='wordpiece',
                                    vocab_file=str(tmp_path / 'wp.json')), 300)
