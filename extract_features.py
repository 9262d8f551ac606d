"""Writes the ELMo or CoVe representations of every word of a text file.

    python extract_features.py --workdir=runs/elmo_tiny --input=sentences.txt --output=features.h5
    python extract_features.py --workdir=runs/elmo_tiny --input=sentences.txt \
        --output=features.npz --layers=average
    python extract_features.py --workdir=runs/cove --input=sentences.txt --output=cove.h5 \
        [--glove=glove.840B.300d.txt] [--cove_only]

ELMo (Peters et al. 2018, sec. 3.2), from a configs/elmo.py run:

One sentence per line (empty lines are skipped), split into words as the
pretraining text was. Each sentence becomes one dataset named by its line's
index among the non-empty lines ("0", "1", ...), as bilm-tf's
dump_bilm_embeddings does: --layers=all gives (2L+1, n, 2D) float32 (the
token layer duplicated, then each LSTM layer's [forward; backward]); top gives
the top layer (n, 2D); average the equal-weight mix (n, 2D). The <S> and </S>
the biLM reads around the sentence are left out.

CoVe (McCann et al. 2017, sec. 4), from a configs/cove.py run: per sentence
[GloVe(w); CoVe(w)] of each word, (n, W + 2H) float32, or CoVe(w) alone (n,
2H) with --cove_only; CoVe(w) is the MT-LSTM encoder's top layer. Words are
split as in training. GloVe(w) is the run's frozen vector of the word, or
with --glove the vector from that file (so words outside the run's
vocabulary get theirs too); a word without one gets the run's learned
unknown-word vector.

Both write a dataset "sentence_to_index" holding a JSON object from each
sentence's text to its index, as allennlp's elmo command writes.
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import train
from input_pipeline import glove as glove_lib
from input_pipeline import words as words_lib
from models import cove
from models import elmo

LAYERS = ('all', 'top', 'average')


def load_bilm(workdir: str) -> tuple[ml_collections.ConfigDict, elmo.Model, dict, object]:
  """The config, pretraining model, parameters (latest checkpoint) and vocabulary of an ELMo run."""
  return train.load_trained(workdir, 'elmo', 'extract_features.py (configs/elmo.py)')


def read_sentences(path: str) -> list[str]:
  if not os.path.isfile(path):
    raise ValueError(f'--input={path!r} does not exist: pass a text file, one sentence per line.')
  with open(path, encoding='utf-8') as f:
    sentences = [line.strip() for line in f if line.strip()]
  if not sentences:
    raise ValueError(f'--input={path!r} has no sentences: one sentence per line.')
  return sentences


def _bucket(length: int) -> int:
  """Padded lengths are powers of two (at least 8), so few shapes are compiled."""
  return max(8, 1 << (length - 1).bit_length())


def representations(model: elmo.Model, params, vocab, config, sentences: list[str], *,
                    layers: str, batch_size: int) -> list[np.ndarray]:
  """Per sentence, its words' ELMo layers (J, n, 2D), or the top or averaged layer (n, 2D)."""
  width = config.data.max_characters_per_token

  @jax.jit
  def run(bilm_params, char_ids_BLW, lengths_B):
    encoder = elmo.BiLM(model.config)
    out = encoder.apply({'params': bilm_params}, char_ids_BLW, lengths_B, deterministic=True)
    layers_BJLX = elmo.elmo_layers(out['token_BLD'], out['forward'], out['backward'])
    return {'all': layers_BJLX, 'top': layers_BJLX[:, -1],
            'average': layers_BJLX.mean(axis=1)}[layers]

  framed = [vocab.sentence(words_lib.word_tokens(s), width) for s in sentences]
  # Sorted by length, so a batch pads little.
  order = sorted(range(len(sentences)), key=lambda i: len(framed[i][0]))
  results = [None] * len(sentences)
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    length = _bucket(max(len(framed[i][0]) for i in chunk))
    char_ids = np.zeros((batch_size, length, width), np.int32)
    lengths = np.zeros(batch_size, np.int32)
    for row, i in enumerate(chunk):
      n = len(framed[i][0])
      char_ids[row, :n], lengths[row] = framed[i][1], n
    out = np.asarray(run(params['bilm'], jnp.asarray(char_ids), jnp.asarray(lengths)), np.float32)
    for row, i in enumerate(chunk):
      # Positions 1 .. n-2: the words, without <S> and </S>.
      words = slice(1, lengths[row] - 1)
      results[i] = out[row][:, words] if layers == 'all' else out[row][words]
  return results


def cove_features(model: cove.Model, params, tokenizer, config, sentences: list[str], *,
                  glove_file: str = '', cove_only: bool = False,
                  batch_size: int = 32) -> list[np.ndarray]:
  """Per sentence, [GloVe(w); CoVe(w)] (n, W + X) of its words, or CoVe(w) (n, X) alone."""
  lower = config.data.lower_case
  sentence_words = [words_lib.word_tokens(s.lower() if lower else s) for s in sentences]
  table = np.asarray(params['word_vectors']['table']['embedding'])
  unknown = np.asarray(params['word_vectors']['unknown'])
  if glove_file:
    if not config.data.get('glove_file'):
      raise ValueError('This CoVe run was trained on random word vectors, not GloVe: drop '
                       '--glove (its own vectors are used).')
    width = glove_lib.width(glove_file)
    if width != table.shape[1]:
      raise ValueError(f'--glove has {width}-d vectors but the run read {table.shape[1]}-d '
                       'ones: pass the GloVe file it was trained with.')
    distinct = sorted({w for words in sentence_words for w in words})
    vectors, found = glove_lib.vectors_for(distinct, glove_file, lower_case=lower)
    row = {w: i for i, w in enumerate(distinct)}

    def word_vectors(words):  # the file's vector, or the learned one where it has none
      rows = np.array([row[w] for w in words])
      return np.where(found[rows][:, None], vectors[rows], unknown)
  else:
    def word_vectors(words):  # the run's table, as in training
      ids = tokenizer.source.ids(words)
      return np.where((ids == cove.UNKNOWN_WORD_ID)[:, None], unknown, table[ids])

  @jax.jit
  def encode(vectors_BSW, lengths_B):
    return model.apply({'params': params}, vectors_BSW, lengths_B, method='encode_vectors')[-1]

  order = sorted(range(len(sentences)), key=lambda i: len(sentence_words[i]))
  results = [None] * len(sentences)
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    length = _bucket(max(len(sentence_words[i]) for i in chunk))
    vectors_BSW = np.zeros((batch_size, length, table.shape[1]), np.float32)
    lengths_B = np.zeros(batch_size, np.int32)
    for r, i in enumerate(chunk):
      words = sentence_words[i]
      vectors_BSW[r, :len(words)] = word_vectors(words)
      lengths_B[r] = len(words)
    states_BSX = np.asarray(encode(jnp.asarray(vectors_BSW), jnp.asarray(lengths_B)), np.float32)
    for r, i in enumerate(chunk):
      n = lengths_B[r]
      parts = [states_BSX[r, :n]] if cove_only else [vectors_BSW[r, :n], states_BSX[r, :n]]
      results[i] = np.concatenate(parts, axis=-1)
  return results


def write(path: str, sentences: list[str], features: list[np.ndarray]) -> None:
  """hdf5 (.h5, .hdf5) or npz (.npz): dataset str(i) per sentence, plus sentence_to_index."""
  index = json.dumps({s: i for i, s in reversed(list(enumerate(sentences)))})
  tmp = path + '.tmp'
  try:
    _write_file(tmp, index, features)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  os.replace(tmp, path)  # a crash leaves no half-written file under the output name


def _write_file(tmp: str, index: str, features: list[np.ndarray]) -> None:
  if tmp.endswith('.npz.tmp'):
    with open(tmp, 'wb') as f:
      np.savez(f, sentence_to_index=np.array(index),
               **{str(i): x for i, x in enumerate(features)})
  else:
    import h5py  # pylint: disable=g-import-not-at-top
    with h5py.File(tmp, 'w') as f:
      for i, x in enumerate(features):
        f.create_dataset(str(i), data=x)
      f.create_dataset('sentence_to_index', data=np.array([index], dtype=h5py.string_dtype()))


def extract(workdir: str, input_path: str, output: str, *, layers: str = 'all',
            batch_size: int = 32, glove: str = '', cove_only: bool = False) -> int:
  """Writes the features of every sentence of `input_path` to `output`; returns the count."""
  if layers not in LAYERS:
    raise ValueError(f'--layers={layers!r}: use one of {", ".join(LAYERS)}.')
  if not output.endswith(('.h5', '.hdf5', '.npz')):
    raise ValueError(f'--output={output!r}: name a .h5, .hdf5 or .npz file.')
  if batch_size < 1:
    raise ValueError('--batch_size must be 1 or more.')
  if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
    raise ValueError(f'--output={output!r}: its directory does not exist; create it first.')
  sentences = read_sentences(input_path)
  config, model, params, vocab = train.load_trained(
      workdir, ('elmo', 'cove'), 'extract_features.py (configs/elmo.py or configs/cove.py)')
  if config.model_name == 'cove':
    features = cove_features(model, params, vocab, config, sentences, glove_file=glove,
                             cove_only=cove_only, batch_size=batch_size)
  elif glove or cove_only:
    raise ValueError('--glove and --cove_only are for CoVe runs; this is an ELMo run.')
  else:
    features = representations(model, params, vocab, config, sentences, layers=layers,
                               batch_size=batch_size)
  write(output, sentences, features)
  return len(sentences)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if not (f.workdir and f.input and f.output):
    sys.exit('extract_features.py: error: pass --workdir=DIR --input=FILE --output=FILE.h5.')
  try:
    count = extract(f.workdir, f.input, f.output, layers=f.layers, batch_size=f.batch_size,
                    glove=f.glove, cove_only=f.cove_only)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'extract_features.py: error: {e}')
  print(f'Wrote the features of {count} sentences to {f.output}.', flush=True)


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Workdir of an ELMo or CoVe training run.')
  flags.DEFINE_string('input', None, 'Text file, one sentence per line.')
  flags.DEFINE_string('output', None, 'Output file: .h5/.hdf5 (hdf5) or .npz.')
  flags.DEFINE_enum('layers', 'all', LAYERS, 'ELMo: all (2L+1, n, 2D), top or average (n, 2D).')
  flags.DEFINE_string('glove', '', 'CoVe: GloVe text file for GloVe(w) (default: the run\'s).')
  flags.DEFINE_bool('cove_only', False, 'CoVe: write CoVe(w) without GloVe(w).')
  flags.DEFINE_integer('batch_size', 32, 'Sentences per forward pass.')
  app.run(main)
