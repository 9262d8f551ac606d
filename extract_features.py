"""Writes the ELMo, CoVe or BERT representations of every token of a text file.

    python extract_features.py --workdir=runs/elmo_tiny --input=sentences.txt --output=features.h5
    python extract_features.py --workdir=runs/elmo_tiny --input=sentences.txt \
        --output=features.npz --layers=average
    python extract_features.py --workdir=runs/cove --input=sentences.txt --output=cove.h5 \
        [--glove=glove.840B.300d.txt] [--cove_only]
    python extract_features.py --workdir=runs/bert --input=sentences.txt --output=features.npz \
        [--layers=-1,-2,-3,-4 | --combine=concat_last_four] [--max_seq_length=128]

ELMo (Peters et al. 2018, sec. 3.2), from a configs/elmo.py run:

One sentence per line, split into words as the pretraining text was. Each
line becomes one dataset named by its index in the file ("0", "1", ...), as
bilm-tf's dump_bilm_embeddings numbers them (an empty line gets an array of
0 words): --layers=all (the default) gives (L+1, n, 2D)
float32 (the token layer duplicated, then each LSTM layer's [forward;
backward]); top gives the top layer (n, 2D); average the equal-weight mix
(n, 2D). The <S> and </S> the biLM reads around the sentence are left out.

CoVe (McCann et al. 2017, sec. 4), from a configs/cove.py run: per sentence
[GloVe(w); CoVe(w)] of each word, (n, W + 2H) float32, or CoVe(w) alone (n,
2H) with --cove_only; CoVe(w) is the MT-LSTM encoder's top layer. Words are
split as in training. GloVe(w) is the run's frozen vector of the word, or
with --glove the vector from that file (so words outside the run's
vocabulary get theirs too); a word without one gets the run's learned
unknown-word vector.

BERT (Devlin et al. 2018, sec. 5.3), from any BERT workdir (pretraining,
converted or fine-tuning runs; a fine-tuning head is not run): per line one
sentence, or "A ||| B" for a pair (split at the last " ||| ", as the
reference extract_features.py), read as [CLS] A [SEP] (B [SEP]) in the run's
WordPiece vocabulary, segment 0 up to the first [SEP] and 1 after it. A line
over --max_seq_length tokens (default 128, or the positions the run trained
if fewer: a BERT pretrained without its 512-token phase trained 128; longer
needs --allow_untrained_positions) is truncated as the reference
does: a sentence loses its last tokens, a pair one token at a time from the
end of its longer side; one warning counts such lines. Layer indices run
over the hidden states: 0 is the embedding output, i the output of layer i,
and negative ones count from the top (-1 the last layer); the reference
numbers the layers alone, so its 0 is our 1 (negative ones agree). An empty
line is read as [CLS] [SEP], as the reference reads it. --layers is a
comma list of them (default -1,-2,-3,-4, as the reference) and gives (J, n,
D) float32 per line, n counting [CLS] and [SEP]. --combine gives one (n, D)
or (n, 4D) array instead, as the feature-based NER rows of table 7:
embeddings, second_to_last, last, sum_last_four, concat_last_four (layers
-1, -2, -3, -4 side by side, in that order) or sum_all (layers 1..L with
equal weights, the embeddings left out; models/bert_feature_tagger.py has
the formulas). A dataset "tokens" holds the JSON list, per line, of its
WordPiece tokens (the rows of its array).

All write a dataset "sentence_to_index" holding a JSON object from each
line's text to its dataset's name (a line given twice: its last), as
allennlp's elmo command writes. Lines of similar length share a forward pass
of at most --batch_size lines and --max_batch_tokens padded tokens (a longer
line goes alone); each batch's features are written as it finishes, into
OUTPUT.tmp, renamed to --output once complete.
"""

import dataclasses
import json
import math
import os
import sys
from typing import Iterator
import zipfile

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from input_pipeline import gpt_finetune
from input_pipeline.common import glove as glove_lib
from models import bert
from models import bert_feature_tagger
from models import cove
from models import elmo
from trainer import cli
from trainer import phases
import trainer.state

LAYERS = ('all', 'top', 'average')  # ELMo's --layers
BERT_LAYERS = '-1,-2,-3,-4'  # the reference's default
COMBINE = bert_feature_tagger.FEATURE_LAYERS
PAIR_SEPARATOR = ' ||| '
RUN_NAMES = {'elmo': 'an ELMo', 'cove': 'a CoVe', 'bert': 'a BERT'}


def load_bilm(workdir: str) -> tuple[ml_collections.ConfigDict, elmo.Model, dict, object]:
  """The config, pretraining model, parameters (latest checkpoint) and vocabulary of an ELMo run."""
  return trainer.state.load_trained(workdir, 'elmo', 'extract_features.py (configs/elmo.py)')


def read_sentences(path: str) -> list[str]:
  """Every line of the file, stripped (a byte-order mark too)."""
  sentences = cli.read_lines(path, '--input')
  if not any(sentences):
    raise ValueError(f'--input={path!r} has no sentences: one sentence per line.')
  return sentences


def _bucket(length: int) -> int:
  """Padded lengths are powers of two (at least 8), so few shapes are compiled."""
  return max(8, 1 << (length - 1).bit_length())


def batches(lengths: list[int], batch_size: int, max_tokens: int, longest: int | None = None
            ) -> Iterator[tuple[list[int], int, int]]:
  """(indices, padded rows, padded length) of each forward pass over the items of nonzero
  length, sorted by length so that a batch pads little: at most batch_size rows and, but for
  one long item alone, max_tokens padded tokens. Padded lengths are _bucket's (at most
  `longest`), padded rows powers of two up to batch_size, so few shapes are compiled."""
  order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: lengths[i])

  def padded(first: int, rows: int) -> tuple[int, int]:
    length = _bucket(lengths[order[first + rows - 1]])
    return min(batch_size, 1 << (rows - 1).bit_length()), min(length, longest or length)

  start = 0
  while start < len(order):
    rows = min(batch_size, len(order) - start)
    while rows > 1 and math.prod(padded(start, rows)) > max_tokens:
      rows -= 1
    yield (order[start:start + rows], *padded(start, rows))
    start += rows


def _with_empty_lines(computed: Iterator[tuple[int, np.ndarray]], empty: list[int], word_axis: int
                      ) -> Iterator[tuple[int, np.ndarray]]:
  """The computed features, then each empty line's: the first one's shape with 0 words."""
  shape = None
  for i, x in computed:
    shape = shape or x.shape
    yield i, x
  for i in empty:
    yield i, np.zeros(shape[:word_axis] + (0,) + shape[word_axis + 1:], np.float32)


def representations(model: elmo.Model, params, vocab, config, sentences: list[str], *,
                    layers: str, batch_size: int, max_tokens: int = 4096
                    ) -> Iterator[tuple[int, np.ndarray]]:
  """Per line (index, its words' ELMo layers (J, n, 2D), or the top or averaged layer (n, 2D)),
  batch by batch."""
  width = config.data.max_characters_per_token

  @jax.jit
  def run(bilm_params, char_ids_BLW, lengths_B):
    encoder = elmo.BiLM(model.config)
    out = encoder.apply({'params': bilm_params}, char_ids_BLW, lengths_B, deterministic=True)
    layers_BJLX = elmo.elmo_layers(out['token_BLD'], out['forward'], out['backward'])
    return {'all': layers_BJLX, 'top': layers_BJLX[:, -1],
            'average': layers_BJLX.mean(axis=1)}[layers]

  words = [vocab.words_of(s) for s in sentences]
  # With <S> and </S>; an empty line is not run.
  lengths = [len(w) + 2 if w else 0 for w in words]

  def computed():
    for chunk, rows, length in batches(lengths, batch_size, max_tokens):
      char_ids = np.zeros((rows, length, width), np.int32)
      for row, i in enumerate(chunk):
        char_ids[row, :lengths[i]] = vocab.sentence(words[i], width)[1]
      lengths_B = np.zeros(rows, np.int32)
      lengths_B[:len(chunk)] = [lengths[i] for i in chunk]
      out = np.asarray(run(params['bilm'], jnp.asarray(char_ids), jnp.asarray(lengths_B)),
                       np.float32)
      for row, i in enumerate(chunk):
        kept = slice(1, lengths[i] - 1)  # the words, without <S> and </S>
        yield i, (out[row][:, kept] if layers == 'all' else out[row][kept])

  return _with_empty_lines(computed(), [i for i, n in enumerate(lengths) if not n],
                           1 if layers == 'all' else 0)


def cove_features(model: cove.Model, params, tokenizer, config, sentences: list[str], *,
                  glove_file: str = '', cove_only: bool = False, batch_size: int = 32,
                  max_tokens: int = 4096) -> Iterator[tuple[int, np.ndarray]]:
  """Per line (index, [GloVe(w); CoVe(w)] (n, W + X) of its words, or CoVe(w) (n, X) alone),
  batch by batch."""
  lower = config.data.lower_case
  # Split as the run's sources were (data.split_words).
  sentence_words = [tokenizer.source.words_of(s.lower() if lower else s) for s in sentences]
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
    # A converted release reads as its torchtext example: a word's own entry or none ('zebra'
    # none, though glove.840B has 'Zebra'), as the workdir's table. A run of ours took the
    # first entry that lower-cases to a word where there was no own one (glove.vectors_for).
    folded = lower and not config.get('converted_from')
    vectors, found = glove_lib.vectors_for(distinct, glove_file, lower_case=folded)
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

  lengths = [len(words) for words in sentence_words]

  def computed():
    for chunk, rows, length in batches(lengths, batch_size, max_tokens):
      vectors_BSW = np.zeros((rows, length, table.shape[1]), np.float32)
      lengths_B = np.zeros(rows, np.int32)
      for r, i in enumerate(chunk):
        vectors_BSW[r, :lengths[i]] = word_vectors(sentence_words[i])
        lengths_B[r] = lengths[i]
      states_BSX = np.asarray(encode(jnp.asarray(vectors_BSW), jnp.asarray(lengths_B)),
                              np.float32)
      for r, i in enumerate(chunk):
        n = lengths[i]
        parts = [states_BSX[r, :n]] if cove_only else [vectors_BSW[r, :n], states_BSX[r, :n]]
        yield i, np.concatenate(parts, axis=-1)

  return _with_empty_lines(computed(), [i for i, n in enumerate(lengths) if not n], 0)


def layer_indices(layers: str) -> list[int] | None:
  """The integers of a comma list such as '-1,-2', or None if `layers` is not one."""
  try:
    return [int(part) for part in layers.split(',')]
  except ValueError:
    return None


def check_flags(model_name: str, *, layers: str = '', combine: str = '',
                max_seq_length: int | None = None, glove: str = '',
                cove_only: bool = False) -> None:
  """One-line ValueErrors for options a run of `model_name` (elmo, cove, bert) cannot take."""
  run = RUN_NAMES[model_name]
  if model_name != 'cove' and (glove or cove_only):
    raise ValueError(f'--glove and --cove_only are for CoVe runs; this is {run} run.')
  if model_name != 'bert' and (combine or max_seq_length is not None):
    raise ValueError(f'--combine and --max_seq_length are for BERT runs; this is {run} run.')
  if model_name == 'cove' and layers:
    raise ValueError('--layers is for ELMo and BERT runs: a CoVe run writes [GloVe(w); CoVe(w)] '
                     '(or CoVe(w) alone with --cove_only); drop --layers.')
  if model_name == 'elmo' and layers not in ('',) + LAYERS:
    raise ValueError(f'--layers={layers}: an ELMo run takes {", ".join(LAYERS)}.')
  if model_name == 'bert':
    if layers and layer_indices(layers) is None:
      raise ValueError(f'--layers={layers}: a BERT run takes layer indices such as '
                       f'{BERT_LAYERS} (0 = the embeddings), or --combine.')
    if combine and layers:
      raise ValueError('--combine and --layers both choose the layers: pass only one.')
    if combine and combine not in COMBINE:
      raise ValueError(f'--combine={combine}: use one of {", ".join(COMBINE)}.')


def bert_inputs(tokenizer, lines: list[str], max_seq_length: int
                ) -> tuple[list[list[int]], list[int], int]:
  """[CLS] A [SEP] (B [SEP]) ids of each line, the length of [CLS] A [SEP], and how many lines
  were truncated to max_seq_length (reference: _truncate_seq_pair)."""
  parts = []
  for line in lines:
    a, separator, b = line.rpartition(PAIR_SEPARATOR)
    parts.append([a, b] if separator else [line])
  flat = tokenizer.encode_batch([text for texts in parts for text in texts])
  ids, first_segment, truncated, offset = [], [], 0, 0
  for texts in parts:
    pieces = flat[offset:offset + len(texts)]
    offset += len(texts)
    # [CLS] and one [SEP] per text take the rest.
    lengths = [len(p) for p in pieces]
    kept = gpt_finetune.kept_lengths(lengths, max_seq_length - 1 - len(texts))
    truncated += int(kept != lengths)
    sequence = [tokenizer.cls_id] + pieces[0][:kept[0]] + [tokenizer.sep_id]
    first_segment.append(len(sequence))
    for p, k in zip(pieces[1:], kept[1:]):
      sequence += p[:k] + [tokenizer.sep_id]
    ids.append(sequence)
  return ids, first_segment, truncated


def bert_features(model: bert.Model, params, tokenizer, config, lines: list[str], *,
                  layers: str = '', combine: str = '', max_seq_length: int | None = None,
                  batch_size: int = 32, max_tokens: int = 4096, trained: int | None = None,
                  allow_untrained: bool = False
                  ) -> tuple[Iterator[tuple[int, np.ndarray]], list[list[str]]]:
  """Per line (index, its hidden states (J, n, D) at the --layers indices, or their --combine
  (n, X)), batch by batch; and each line's n WordPiece tokens. `trained`: the positions the run
  trained (default: all)."""
  if config.data.get('tokenizer', 'wordpiece') != 'wordpiece':
    raise ValueError(f'This BERT run uses data.tokenizer={config.data.tokenizer!r}: '
                     'extract_features.py reads WordPiece runs ([CLS] A [SEP] B [SEP]).')
  # The encoder alone: a fine-tuning head may need more of the batch, and is not wanted.
  cfg = dataclasses.replace(model.config, num_labels=0)
  num_layers, positions = cfg.num_layers, cfg.max_position_embeddings
  trained = min(trained or positions, positions)
  if max_seq_length is None:
    max_seq_length = min(128, trained)
  if not 3 <= max_seq_length <= positions:
    raise ValueError(f'--max_seq_length={max_seq_length}: use 3 ([CLS] A [SEP]) up to this '
                     f"BERT's max_position_embeddings={positions}.")
  if max_seq_length > trained and not allow_untrained:
    raise ValueError(f'--max_seq_length={max_seq_length} but the run trained positions '
                     f'0-{trained - 1} only (data.later_phases), so positions {trained}-'
                     f'{max_seq_length - 1} are untrained: use --max_seq_length={trained} or '
                     'less, or --allow_untrained_positions to go on.')
  if combine:
    bert_feature_tagger.check_feature_layers(combine, num_layers, '--combine')
    indices = None
  else:
    indices = layer_indices(layers or BERT_LAYERS)
    if not all(-num_layers - 1 <= i <= num_layers for i in indices):
      given = layers or f'{BERT_LAYERS} (the default)'
      raise ValueError(f'--layers={given}: this BERT has {num_layers} layers; use indices from '
                       f'{-num_layers - 1} to {num_layers} (0 = the embeddings, -1 = the last '
                       'layer).')
  encoder = bert.Model(cfg)

  @jax.jit
  def run(params, ids_BL, segment_ids_BL, mask_BL):
    hidden = encoder.apply({'params': params}, {
        'input_ids': ids_BL, 'segment_ids': segment_ids_BL, 'input_mask': mask_BL},
                           deterministic=True)['hidden_states']
    hidden = [h.astype(jnp.float32) for h in hidden]
    if combine:
      return bert_feature_tagger.combine_layers(hidden, combine)
    return jnp.stack([hidden[i] for i in indices], axis=1)  # (B, J, L, D)

  ids, first_segment, truncated = bert_inputs(tokenizer, lines, max_seq_length)
  if truncated:
    logging.warning('%d of %d lines were longer than --max_seq_length=%d tokens and were '
                    'truncated.', truncated, len(lines), max_seq_length)

  def computed():
    for chunk, rows, length in batches([len(i) for i in ids], batch_size, max_tokens,
                                       longest=max_seq_length):
      ids_BL = np.zeros((rows, length), np.int32)
      segment_ids_BL = np.zeros((rows, length), np.int32)
      mask_BL = np.zeros((rows, length), np.int32)
      for row, i in enumerate(chunk):
        n = len(ids[i])
        ids_BL[row, :n], mask_BL[row, :n] = ids[i], 1
        segment_ids_BL[row, first_segment[i]:n] = 1
      out = np.asarray(run(params, jnp.asarray(ids_BL), jnp.asarray(segment_ids_BL),
                           jnp.asarray(mask_BL)), np.float32)
      for row, i in enumerate(chunk):
        n = len(ids[i])
        yield i, (out[row][:n] if combine else out[row][:, :n])

  return computed(), [tokenizer.convert_ids_to_tokens(i) for i in ids]


class FeatureFile:
  """The output, .h5/.hdf5 (hdf5) or .npz, written dataset by dataset into path + '.tmp' and
  renamed to `path` once closed without an error: a crash leaves no half-written file under
  the output name (and removes the temporary one).

      with FeatureFile('features.h5') as out:
        out.add('0', features)
        out.add_text('sentence_to_index', json.dumps(index))
  """

  def __init__(self, path: str):
    self.path, self.tmp = path, path + '.tmp'
    self._npz = path.endswith('.npz')

  def __enter__(self):
    if self._npz:  # what np.savez writes, one member at a time: <name>.npy in a zip
      self._file = zipfile.ZipFile(self.tmp, 'w', zipfile.ZIP_STORED, allowZip64=True)
    else:
      import h5py  # pylint: disable=g-import-not-at-top
      self._file = h5py.File(self.tmp, 'w')
    return self

  def add(self, name: str, x: np.ndarray) -> None:
    if self._npz:
      with self._file.open(f'{name}.npy', 'w', force_zip64=True) as member:
        np.lib.format.write_array(member, np.asanyarray(x), allow_pickle=False)
    else:
      self._file.create_dataset(name, data=x)

  def add_text(self, name: str, text: str) -> None:
    """A string dataset: a 0-d str array in .npz, one variable-length string in hdf5."""
    if self._npz:
      self.add(name, np.array(text))
    else:
      import h5py  # pylint: disable=g-import-not-at-top
      self._file.create_dataset(name, data=np.array([text], dtype=h5py.string_dtype()))

  def __exit__(self, kind, value, traceback):
    self._file.close()
    if kind is None:
      os.replace(self.tmp, self.path)
    elif os.path.exists(self.tmp):
      os.remove(self.tmp)


def write(path: str, sentences: list[str], features: Iterator[tuple[int, np.ndarray]],
          tokens: list[list[str]] | None = None) -> None:
  """Dataset str(i) for each (i, features) as it comes, then sentence_to_index (each line's
  text to its dataset's name, the last line's where a text repeats) and, with `tokens`, a
  dataset 'tokens' holding them as JSON."""
  with FeatureFile(path) as out:
    for i, x in features:
      out.add(str(i), x)
    out.add_text('sentence_to_index', json.dumps({s: str(i) for i, s in enumerate(sentences)}))
    if tokens is not None:
      out.add_text('tokens', json.dumps(tokens))


def extract(workdir: str, input_path: str, output: str, *, layers: str = '',
            batch_size: int = 32, max_batch_tokens: int = 4096, glove: str = '',
            cove_only: bool = False, combine: str = '', max_seq_length: int | None = None,
            allow_untrained_positions: bool = False) -> int:
  """Writes the features of every line of `input_path` to `output`; returns the line count.

  Empty `layers` (and None `max_seq_length`) mean the run's default.
  """
  if layers and layers not in LAYERS and layer_indices(layers) is None:
    raise ValueError(f'--layers={layers!r}: use {", ".join(LAYERS)} (ELMo) or layer indices '
                     f'such as {BERT_LAYERS} (BERT).')
  if not output.endswith(('.h5', '.hdf5', '.npz')):
    raise ValueError(f'--output={output!r}: name a .h5, .hdf5 or .npz file.')
  if batch_size < 1 or max_batch_tokens < 1:
    raise ValueError('--batch_size and --max_batch_tokens must be 1 or more.')
  if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
    raise ValueError(f'--output={output!r}: its directory does not exist; create it first.')
  sentences = read_sentences(input_path)
  config, model, params, vocab = trainer.state.load_trained(
      workdir, ('elmo', 'cove', 'bert'),
      'extract_features.py (configs/elmo.py, configs/cove.py or BERT)')
  check_flags(config.model_name, layers=layers, combine=combine, max_seq_length=max_seq_length,
              glove=glove, cove_only=cove_only)
  tokens = None
  sizes = dict(batch_size=batch_size, max_tokens=max_batch_tokens)
  if config.model_name == 'cove':
    features = cove_features(model, params, vocab, config, sentences, glove_file=glove,
                             cove_only=cove_only, **sizes)
  elif config.model_name == 'bert':
    features, tokens = bert_features(model, params, vocab, config, sentences, layers=layers,
                                     combine=combine, max_seq_length=max_seq_length,
                                     trained=phases.trained_positions(workdir),
                                     allow_untrained=allow_untrained_positions, **sizes)
  else:
    features = representations(model, params, vocab, config, sentences, layers=layers or 'all',
                               **sizes)
  write(output, sentences, features, tokens)
  return len(sentences)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  cli.skip_absent_accelerators()
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if not (f.workdir and f.input and f.output):
    sys.exit('extract_features.py: error: pass --workdir=DIR --input=FILE --output=FILE.h5.')
  try:
    count = extract(f.workdir, f.input, f.output, layers=f.layers, batch_size=f.batch_size,
                    max_batch_tokens=f.max_batch_tokens, glove=f.glove, cove_only=f.cove_only,
                    combine=f.combine, max_seq_length=f.max_seq_length,
                    allow_untrained_positions=f.allow_untrained_positions)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'extract_features.py: error: {e}')
  print(f'Wrote the features of {count} lines to {f.output}.', flush=True)


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Workdir of an ELMo, CoVe or BERT training run.')
  flags.DEFINE_string('input', None, 'Text file, one sentence per line (BERT: or "A ||| B").')
  flags.DEFINE_string('output', None, 'Output file: .h5/.hdf5 (hdf5) or .npz.')
  flags.DEFINE_string('layers', '', 'ELMo: all (L+1, n, 2D; the default), top or average '
                      f'(n, 2D). BERT: layer indices, 0 = the embeddings (default {BERT_LAYERS}).')
  flags.DEFINE_string('combine', '', f'BERT: one (n, X) array per line: {", ".join(COMBINE)}.')
  flags.DEFINE_integer('max_seq_length', None, 'BERT: tokens per line, [CLS] and [SEP] included '
                       '(default 128, at most max_position_embeddings); longer lines are truncated.')
  flags.DEFINE_bool('allow_untrained_positions', False, 'BERT: allow a --max_seq_length beyond '
                    'the positions the run trained (a run without its 512-token phase).')
  flags.DEFINE_string('glove', '', 'CoVe: GloVe text file for GloVe(w) (default: the run\'s).')
  flags.DEFINE_bool('cove_only', False, 'CoVe: write CoVe(w) without GloVe(w).')
  flags.DEFINE_integer('batch_size', 32, 'Lines per forward pass, at most.')
  flags.DEFINE_integer('max_batch_tokens', 4096, 'Padded tokens per forward pass, at most (a '
                       'longer line goes alone).')
  app.run(main)
