"""The ELMo half of convert_checkpoint.py: a released biLM (bilm-tf, AllenNLP) as a workdir of ours.

    python convert_checkpoint.py --from=bilm --input=DIR --workdir=runs/elmo_released

DIR holds one `*options.json` and one `*weights.hdf5`, as bilm-tf's
dump_weights writes them and AllenNLP's ElmoBiLm reads them (the original
5.5B, original, medium and small releases), and optionally one `*vocab*.txt`
(bilm-tf's vocabulary, one word a line). The workdir is what configs/elmo.py
leaves after its last step: config.json with options.json's sizes, words.txt,
an orbax checkpoint; extract_features.py, configs/elmo_tagger.py's
config.init_from and configs/sweeps/elmo_layers.py read it with no further
flag. Every tensor of the file goes to one parameter of the tree our model's
init makes, each shape checked against options.json first; a missing or
left-over tensor, or one of another shape, is an error naming it, before
anything is written.

Where the references compute otherwise (bilm-tf's bilm/model.py inference
graph; AllenNLP's ElmoBiLm computes the same):
- Character ids: bilm-tf's UnicodeCharsVocabulary gives utf-8 bytes 0-255,
  <S> 256, </S> 257, begin-of-word 258, end-of-word 259, in-word padding
  260; its Batcher adds 1 so that 0 is a padding token, and its graph puts
  a zero row before the file's 261-row char_embed. Ours (and AllenNLP's
  ELMoCharacterMapper) are those ids plus one already: our 262-row table is
  [zeros; char_embed], and words are cut to max_characters_per_token - 2
  bytes as there. The training graph's options say n_characters=261; both
  values are read.
- The LSTM: TF's LSTMCell stores one (input + recurrent, 4 S) kernel `W_0`
  with gates in the order i, j (the candidate), f, o and a bias `B`; ours
  keeps input and recurrent kernels (D, 4, S) and (P, 4, S) in the order i,
  f, g, o. Both add the forget bias 1.0 when they run, so `B` is taken as
  stored (AllenNLP adds the 1.0 to the bias when it loads). The cell is
  clipped after its update and before the tanh, the projection `W_P_0`'s
  output (which is also the recurrent state) after the projection, in both.
  With cells as wide as the projection dim bilm-tf has no `W_P_0`, and ours
  no projection either.
- The highway: bilm-tf's `W_carry` makes the gate that multiplies the ReLU
  transform, `W_transform` the transform; our (N, 2, N) kernel holds them
  in that order (gate, transform).
- The char CNN's projection: bilm-tf has none (no `CNN_proj`) when the
  filters sum to the projection dim, and ours none either.
- Padding: bilm-tf's token layer at padding positions is the char CNN of
  all-zero ids; ours is zeros there, as AllenNLP's ElmoBiLm output.
- State: bilm-tf's and AllenNLP's LSTMs carry their states from one batch
  to the next; ours start every sentence from zeros, as their first batch.
- The softmax is not in weights.hdf5 (dump_weights leaves it out): ours is
  initialized afresh, one row per word of words.txt. Without a vocabulary
  file words.txt holds <S> </S> <UNK> only, so a tagger's word embedding
  sees every word as <UNK>; put the biLM's vocabulary beside the weights.
"""

import glob
import json
import os
import sys

from flax import traverse_util
import jax
import numpy as np

from configs import elmo as elmo_configs
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import words as words_lib
from trainer import checkpoints

RNN = 'RNN_{d}/RNN/MultiRNNCell/Cell{i}/LSTMCell/'  # d: 0 forward, 1 backward
TF_GATES = (0, 2, 1, 3)  # ours (i, f, g, o) from TF's (i, j, f, o)


def _one_file(input_dir: str, pattern: str, required: bool = True) -> str | None:
  found = sorted(glob.glob(os.path.join(input_dir, pattern)))
  if len(found) > 1 or (required and not found):
    raise ValueError(f'--input={input_dir} holds {len(found)} files {pattern}: pass a directory '
                     'with one options.json and one weights.hdf5 of a bilm-tf biLM.')
  return found[0] if found else None


def _option(options: dict, path: str, source: str, default=None):
  """options['a']['b'] for path 'a.b'; an error naming it where it is absent and required."""
  value = options
  for key in path.split('.'):
    value = value.get(key) if isinstance(value, dict) else None
  if value is None and default is None:
    raise ValueError(f'{source} has no {path}: pass the options.json written with the weights.')
  return default if value is None else value


def model_fields(options: dict, source: str) -> dict:
  """Our configs/elmo.py model fields from bilm-tf's options.json; what ours cannot compute is
  refused."""
  if options.get('bidirectional') is False:
    raise ValueError(f'{source} has bidirectional=false: ELMo needs both directions; convert a '
                     'bidirectional biLM.')
  if 'char_cnn' not in options:
    raise ValueError(f'{source} has no char_cnn: a biLM over word embeddings has no characters '
                     'for our char CNN to read; convert a character biLM.')
  n_characters = _option(options, 'char_cnn.n_characters', source)
  if n_characters not in (261, 262):
    raise ValueError(f'{source} has char_cnn.n_characters={n_characters}: bilm-tf biLMs have '
                     '261 (training) or 262 (inference); pass the options of this file.')
  activation = _option(options, 'char_cnn.activation', source, 'tanh')  # bilm-tf's default
  if activation not in ('relu', 'tanh'):
    raise ValueError(f'{source} has char_cnn.activation={activation!r}: bilm-tf has relu and '
                     'tanh only.')
  filters = tuple((int(w), int(n)) for w, n in _option(options, 'char_cnn.filters', source))
  projection_dim = int(_option(options, 'lstm.projection_dim', source))
  lstm_dim = int(_option(options, 'lstm.dim', source))
  if projection_dim > lstm_dim:
    raise ValueError(f'{source} has lstm.projection_dim={projection_dim} above lstm.dim='
                     f'{lstm_dim}: bilm-tf then has LSTM outputs of {lstm_dim}, which no '
                     'layer of ours makes; convert a biLM with projection_dim <= dim.')
  return dict(
      char_dim=int(_option(options, 'char_cnn.embedding.dim', source)),
      max_characters_per_token=int(_option(options, 'char_cnn.max_characters_per_token',
                                           source)),
      filters=filters, num_highway=int(_option(options, 'char_cnn.n_highway', source, 0)),
      char_activation=activation, projection_dim=projection_dim, lstm_dim=lstm_dim,
      num_layers=int(_option(options, 'lstm.n_layers', source, 1)),
      cell_clip=float(_option(options, 'lstm.cell_clip', source, 0.0)),
      proj_clip=float(_option(options, 'lstm.proj_clip', source, 0.0)),
      skip_connections=bool(_option(options, 'lstm.use_skip_connections', source)),
      dropout_rate=float(_option(options, 'dropout', source, 0.1)))


def layout(m: dict) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Our parameter path -> the shapes of the file's tensors it is made of (see to_params)."""
  E, D, S = m['char_dim'], m['projection_dim'], m['lstm_dim']
  N = sum(n for _, n in m['filters'])
  P = D if D < S else S
  table = {'char_cnn/char_embed': {'char_embed': (261, E)}}
  for i, (width, count) in enumerate(m['filters']):
    table[f'char_cnn/conv_{i}_kernel'] = {f'CNN/W_cnn_{i}': (1, width, E, count)}
    table[f'char_cnn/conv_{i}_bias'] = {f'CNN/b_cnn_{i}': (count,)}
  for k in range(m['num_highway']):
    table[f'char_cnn/highway_{k}_kernel'] = {f'CNN_high_{k}/W_carry': (N, N),
                                             f'CNN_high_{k}/W_transform': (N, N)}
    table[f'char_cnn/highway_{k}_bias'] = {f'CNN_high_{k}/b_carry': (N,),
                                           f'CNN_high_{k}/b_transform': (N,)}
  if N != D:
    table['char_cnn/projection_kernel'] = {'CNN_proj/W_proj': (N, D)}
    table['char_cnn/projection_bias'] = {'CNN_proj/b_proj': (D,)}
  for d, direction in enumerate(('forward', 'backward')):
    for i in range(m['num_layers']):
      rnn = RNN.format(d=d, i=i)
      # Kernels split along W_0's rows: the layer's input (D, also from the second layer on:
      # bilm-tf's LSTM outputs are D wide when they are projected), then the recurrent P.
      table[f'{direction}_{i}/kernels'] = {rnn + 'W_0': (D + P, 4 * S)}
      table[f'{direction}_{i}/bias'] = {rnn + 'B': (4 * S,)}
      if P < S:
        table[f'{direction}_{i}/projection_kernel'] = {rnn + 'W_P_0': (S, P)}
  return table


def read_weights(path: str) -> dict[str, np.ndarray]:
  """Every dataset of an hdf5 file by its full name ('CNN/W_cnn_0')."""
  import h5py  # pylint: disable=g-import-not-at-top
  tensors = {}
  try:
    with h5py.File(path, 'r') as f:
      f.visititems(lambda name, item: tensors.__setitem__(name, np.asarray(item[...]))
                   if isinstance(item, h5py.Dataset) else None)
  except OSError as e:
    raise ValueError(f'{path} is not an HDF5 file ({e}): pass the weights.hdf5 of a bilm-tf '
                     'biLM.') from None
  return tensors


def to_params(tensors: dict[str, np.ndarray], m: dict, source: str) -> dict[str, np.ndarray]:
  """Our 'bilm/...' params (flat) from the file's tensors, every shape checked first."""
  table = layout(m)
  expected = {name: shape for parts in table.values() for name, shape in parts.items()}
  for name, shape in expected.items():
    if name not in tensors:
      raise ValueError(f'{source} has no tensor {name}: it is not a complete bilm-tf biLM of '
                       'the sizes its options.json gives; pass the pair written together.')
    if tuple(tensors[name].shape) != shape:
      raise ValueError(f'{source}: {name} has shape {tuple(tensors[name].shape)} but options.json '
                       f'gives {shape}: pass the options.json written with these weights.')
  left_over = sorted(set(tensors) - set(expected))
  if left_over:
    raise ValueError(f'{source} has tensor(s) that bilm-tf\'s layout for its options.json has no '
                     f'place for: {", ".join(left_over[:5])}: convert a weights.hdf5 of '
                     "bilm-tf's dump_weights with the options.json written beside it.")
  D, S = m['projection_dim'], m['lstm_dim']
  f32 = lambda name: tensors[name].astype(np.float32)  # noqa: E731
  params = {}
  for path, parts in table.items():
    names = list(parts)
    if path == 'char_cnn/char_embed':  # id 0, a padding token, embeds to zeros
      x = np.concatenate([np.zeros((1, m['char_dim']), np.float32), f32(names[0])])
    elif '/conv_' in path and path.endswith('kernel'):
      x = f32(names[0])[0]  # (1, width, E, count) -> (width, E, count)
    elif '/highway_' in path:  # (gate, transform) on the middle axis of ours
      x = np.stack([f32(n) for n in names], axis=1 if path.endswith('kernel') else 0)
    elif path.endswith('/kernels'):
      gates = f32(names[0]).reshape(-1, 4, S)[:, TF_GATES]
      layer = path[:-len('/kernels')]
      params[f'{layer}/input_kernel'] = gates[:D]
      params[f'{layer}/recurrent_kernel'] = gates[D:]
      continue
    elif path.endswith('/bias') and path.startswith(('forward', 'backward')):
      x = f32(names[0]).reshape(4, S)[list(TF_GATES)]
    else:
      x = f32(names[0])
    params[path] = x
  return {f'bilm/{k}': np.ascontiguousarray(v) for k, v in params.items()}


def read_vocabulary(path: str | None) -> list[str]:
  """words.txt's lines: our specials, then the file's other words in its order."""
  if path is None:
    return list(words_lib.SPECIAL_WORDS)
  with open(path, encoding='utf-8') as f:
    words = [line.strip() for line in f if line.strip()]
  seen, repeated = set(), None
  for word in words:
    repeated = repeated or (word if word in seen else None)
    seen.add(word)
  if repeated is not None:
    raise ValueError(f'{path} lists {repeated!r} twice: pass a vocabulary of distinct words.')
  specials = set(words_lib.SPECIAL_WORDS)
  return [*words_lib.SPECIAL_WORDS, *(w for w in words if w not in specials)]


def our_config(m: dict, vocab_size: int):
  """configs/elmo.py (base) with options.json's sizes; a finished run of 0 steps."""
  config = elmo_configs.get_config('base')
  for field, value in m.items():
    config.model[field] = value
  config.model.vocab_size = vocab_size
  config.model.num_sampled = min(config.model.num_sampled, vocab_size)
  config.data.max_characters_per_token = m['max_characters_per_token']
  config.data.vocab_file = ''
  # Trained on lm1b's tokens; bilm-tf and allennlp read a sentence's words split at spaces.
  config.data.split_words = 'spaces'
  config.train.num_steps = 0  # the release is the whole of this workdir's training
  return config


def convert(input_dir: str, workdir: str) -> str:
  """Writes the biLM in `input_dir` as a workdir; returns a summary."""
  import convert_checkpoint  # pylint: disable=g-import-not-at-top (it imports this module)
  if not os.path.isdir(input_dir):
    raise ValueError(f'--input={input_dir} is not a directory: pass the directory holding '
                     'options.json and weights.hdf5.')
  if checkpoints.exist(workdir):
    raise ValueError(f'--workdir={workdir} already holds a checkpoint: pass a new directory.')
  options_path = _one_file(input_dir, '*options.json')
  weights_path = _one_file(input_dir, '*weights.hdf5')
  vocab_path = _one_file(input_dir, '*vocab*.txt', required=False)
  with open(options_path, encoding='utf-8') as f:
    try:
      options = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f'{options_path} is not JSON ({e}): pass bilm-tf\'s options.json.') from None
  m = model_fields(options, options_path)
  params = to_params(read_weights(weights_path), m, weights_path)
  words = read_vocabulary(vocab_path)
  # The softmax's rows: one per word, and one word besides the specials at least (our synthetic
  # batches draw word ids above them).
  config = our_config(m, max(len(words), len(words_lib.SPECIAL_WORDS) + 1))
  init = convert_checkpoint.model_init(config)
  abstract = jax.eval_shape(init)
  fresh = sorted(set(abstract) - set(params))
  wrong = [p for p in params if p not in abstract or abstract[p].shape != params[p].shape]
  if wrong or any(not p.startswith('softmax/') for p in fresh):
    raise ValueError(f'convert_elmo.py maps {(wrong or fresh)[0]} wrongly for our models/elmo.py: '
                     'fix its layout table.')
  params |= convert_checkpoint.fresh_params(init, fresh)
  os.makedirs(workdir, exist_ok=True)
  vocab_file = tokenizer_lib.write_lines_atomically(
      words, os.path.join(workdir, words_lib.WordVocab.FILE_NAME))
  convert_checkpoint.write_workdir(workdir, config, traverse_util.unflatten_dict(params, sep='/'),
                                   vocab_file)
  return (f'Converted {weights_path} (ELMo, {m["num_layers"]} layers of {m["lstm_dim"]} cells '
          f'projected to {m["projection_dim"]}, {sum(n for _, n in m["filters"])} filters, '
          f'{m["num_highway"]} highway) into {workdir}. Not in the file, initialized: '
          f'{", ".join(fresh)} ({len(words)} words, '
          + (f'from {vocab_path}).' if vocab_path else
             'no *vocab*.txt beside the weights: <S> </S> <UNK> only).'))


if __name__ == '__main__':
  sys.exit('convert_elmo.py is a module of convert_checkpoint.py: run python '
           'convert_checkpoint.py --from=bilm --input=DIR_OF_THE_RELEASE --workdir=DIR')
