"""The CoVe part of convert_checkpoint.py: salesforce/cove's released MT-LSTM as a workdir of ours.

    python convert_checkpoint.py --from=cove --input=wmtlstm-8f474287.pth \
        --glove=glove.840B.300d.txt --workdir=runs/cove_released

CoVe's release is the MT-LSTM's encoder alone: the state dict of a
bidirectional torch.nn.LSTM (weight_ih_l0, weight_hh_l0_reverse, ...), which
reads GloVe vectors. The workdir is a configs/cove.py run of its sizes: the
encoder, a word table of the first data.source_vocab_size - 3 words of --glove
(words.txt), and a decoder, target embedding and softmax freshly initialized
over a stand-in byte-level target vocabulary, which config.json names in
untrained_params (translate.py refuses the workdir).

Where the reference computes otherwise:
- torch's LSTM adds two biases, b_ih and b_hh; our CoVe encoder has one, their
  sum (the gates differ by float32 rounding). Both order the gates i, f, g, o
  and add no forget-gate bias.
- salesforce/cove's MTLSTM has no vocabulary: its user's torchtext vocabulary
  takes GloVe's vectors, a zero vector for a word GloVe lacks. Ours keeps
  GloVe's first words in the table and gives other words the unknown-word
  vector, zero in a converted workdir; extract_features.py --glove reads every
  word of the file, each word its own entry only (lower-cased 'zebra' none,
  though glove.840B has 'Zebra'), as the reference's user would.
"""

import os
import sys

from flax import traverse_util
import jax
import numpy as np

from configs import cove as cove_configs
import convert_checkpoint
from input_pipeline.common import glove
from input_pipeline.common import tokenizer as tokenizer_lib
from input_pipeline.common import words as words_lib
from trainer import checkpoints

RELEASE = ("salesforce/cove's wmtlstm-*.pth, the state dict of "
           'nn.LSTM(300, 300, num_layers=2, bidirectional=True)')
# torch's suffix of each direction's tensors, and our layer's.
DIRECTIONS = (('', 'forward'), ('_reverse', 'backward'))
# What the release leaves out (the MT-LSTM's decoder, target embedding and softmax): the
# converted workdir has them freshly initialized and says so in config.json.
UNTRAINED = ('target_embed', 'decoder', 'output')
# The stand-in target vocabulary of the absent decoder: byte-level BPE without merges.
TARGET_VOCAB = len(tokenizer_lib.BPE_SPECIAL_TOKENS) + 256


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of a torch state dict file, as float32 arrays."""
  if not os.path.isfile(path):
    raise ValueError(f'--input={path} does not exist: pass {RELEASE}.')
  try:
    import torch  # pylint: disable=g-import-not-at-top (only CoVe's .pth needs it)
  except ImportError:
    raise ValueError(f'{path} is a PyTorch file: pip install -r requirements-parity.txt (torch) '
                     'to read it.') from None
  try:
    state = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except (many kinds, for non-torch files)
    raise ValueError(f'{path} does not load as a PyTorch state dict ({type(e).__name__}): pass '
                     f'{RELEASE}.') from None
  if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
    raise ValueError(f'{path} holds a {type(state).__name__}, not a state dict of tensors: pass '
                     f'{RELEASE}.')
  return {k: v.float().numpy() for k, v in state.items()}


def sizes(tensors: dict, source: str) -> tuple[int, int, int]:
  """(word_dim, cells per direction, layers) of an nn.LSTM state dict: W and S from
  weight_ih_l0 (4S, W) and weight_hh_l0 (4S, S), the layers from the weight_ih_l{i} present."""
  for name in ('weight_ih_l0', 'weight_hh_l0'):
    if name not in tensors:
      raise ValueError(f'{source} has no tensor {name} (it has {", ".join(sorted(tensors)[:3])}'
                       f'{" ..." if len(tensors) > 3 else ""}): pass {RELEASE}.')
    if tensors[name].ndim != 2:
      raise ValueError(f'{source}: {name} has shape {tensors[name].shape}, not a matrix: pass '
                       f'{RELEASE}.')
  layers = 1
  while f'weight_ih_l{layers}' in tensors:
    layers += 1
  return tensors['weight_ih_l0'].shape[1], tensors['weight_hh_l0'].shape[1], layers


def encoder_params(tensors: dict, source: str) -> dict[str, np.ndarray]:
  """Our encoder's parameters (flat) from nn.LSTM's: per layer and direction, weight_ih (4S, I)
  and weight_hh (4S, S) as kernels (I, 4, S) and (S, 4, S), gates i, f, g, o in torch's order as
  in ours; torch's two biases b_ih + b_hh as our one (4, S)."""
  word_dim, cells, layers = sizes(tensors, source)
  params, used = {}, set()
  for i in range(layers):
    width = word_dim if i == 0 else 2 * cells
    for suffix, direction in DIRECTIONS:
      expected = {'weight_ih': (4 * cells, width), 'weight_hh': (4 * cells, cells),
                  'bias_ih': (4 * cells,), 'bias_hh': (4 * cells,)}
      theirs = {}
      for kind, shape in expected.items():
        name = f'{kind}_l{i}{suffix}'
        if name not in tensors:
          raise ValueError(f'{source} has no tensor {name}: pass {RELEASE} (bidirectional, '
                           'with both biases).')
        if tensors[name].shape != shape:
          raise ValueError(f'{source}: {name} has shape {tensors[name].shape} but a biLSTM of '
                           f'{cells} cells (weight_hh_l0) over {word_dim}-d vectors (weight_ih_l0) '
                           f'needs {shape}: pass an unmodified {RELEASE}.')
        theirs[kind] = tensors[name]
        used.add(name)
      ours = f'encoder/layer{i}_{direction}/'
      # Torch's (4S, I), gates first, as our (I, 4, S).
      params[ours + 'input_kernel'] = theirs['weight_ih'].reshape(4, cells, -1).transpose(2, 0, 1)
      params[ours + 'recurrent_kernel'] = theirs['weight_hh'].reshape(4, cells, -1).transpose(
          2, 0, 1)
      params[ours + 'bias'] = (theirs['bias_ih'] + theirs['bias_hh']).reshape(4, cells)
  unexpected = sorted(set(tensors) - used)
  if unexpected:
    raise ValueError(f'{source} has {len(unexpected)} tensor(s) a bidirectional nn.LSTM without '
                     f'projections has not: {", ".join(unexpected[:5])}: pass {RELEASE}.')
  return {path: np.ascontiguousarray(x, np.float32) for path, x in params.items()}


def glove_vocabulary(glove_file: str, count: int, lower_case: bool
                     ) -> tuple[list[str], np.ndarray]:
  """The first `count` words of a GloVe file (GloVe lists its words most frequent first) and their
  vectors (count, W); words with white space in them, and repeats, left out. With lower_case,
  the words the file has in lower case, each with its own vector: the release reads lower-cased
  text, and torchtext looks a word up as it is ('I' is not 'i', which is its own entry)."""
  words, vectors, seen = [], [], set(words_lib.SPECIAL_WORDS)
  for word, vector in glove.entries(glove_file):
    if len(words) == count:
      break
    if word in seen or any(c.isspace() for c in word) or (lower_case and word != word.lower()):
      continue
    seen.add(word)
    words.append(word)
    vectors.append(vector)
  return words, np.array(vectors, np.float32).reshape(len(words), -1)


def config_for(tensors: dict, source: str, glove_file: str, lower_case: bool):
  """configs/cove.py with the state dict's sizes: the variant of those sizes (the release's are
  base's), else base resized; the decoder over the stand-in target vocabulary."""
  word_dim, cells, layers = sizes(tensors, source)
  variant = next((name for name, v in cove_configs.VARIANTS.items()
                  if (v['word_dim'], v['hidden_size']) == (word_dim, cells)), 'base')
  config = cove_configs.get_config(variant)
  config.model.word_dim, config.model.hidden_size = word_dim, cells
  config.model.num_encoder_layers = config.model.num_decoder_layers = layers
  config.model.vocab_size = TARGET_VOCAB
  config.data.glove_file = os.path.abspath(glove_file)
  config.data.lower_case = lower_case
  # The release read text tokenized already, split at spaces (salesforce/cove's example reads
  # it with torchtext's default str.split; glove.840B has '1,000' and '...' as words).
  config.data.split_words = 'spaces'
  config.train.num_steps = 0  # step 0 of 0: a finished run that config.init_from accepts
  config.converted_from = os.path.abspath(source)
  config.untrained_params = UNTRAINED
  return config


def convert(input_path: str, workdir: str, glove_file: str,
                 lower_case: bool | None = None) -> str:
  """Writes salesforce/cove's MT-LSTM encoder, over the first data.source_vocab_size words of
  a GloVe file, as a CoVe workdir; returns a summary."""
  if checkpoints.exist(workdir):
    raise ValueError(f'--workdir={workdir} already holds a checkpoint: pass a new directory.')
  if not glove_file:
    raise ValueError('--from=cove needs --glove=glove.840B.300d.txt: the MT-LSTM reads GloVe '
                     'vectors, which the release does not include.')
  tensors = read_tensors(input_path)
  encoder = encoder_params(tensors, input_path)
  word_dim = tensors['weight_ih_l0'].shape[1]
  if glove.width(glove_file) != word_dim:
    raise ValueError(f'{input_path}: weight_ih_l0 reads {word_dim}-d word vectors but --glove='
                     f'{glove_file} has {glove.width(glove_file)}-d ones: pass the GloVe file '
                     'the MT-LSTM was trained over (glove.840B.300d.txt).')
  # The release's recipe lower-cases its text (OpenNMT-py's -lower; salesforce/cove's example,
  # torchtext's lower=True) though glove.840B is cased.
  lower_case = True if lower_case is None else lower_case
  config = config_for(tensors, input_path, glove_file, lower_case)
  init = convert_checkpoint.model_init(config)
  flat = jax.eval_shape(init)
  specials = len(words_lib.SPECIAL_WORDS)
  words, vectors = glove_vocabulary(glove_file, config.data.source_vocab_size - specials,
                                    lower_case)
  table = np.zeros(flat['word_vectors/table/embedding'].shape, np.float32)
  table[specials:specials + len(words)] = vectors
  # torchtext, which feeds the released model, gives words GloVe lacks a zero vector.
  params = {**encoder, 'word_vectors/table/embedding': table,
            'word_vectors/unknown': np.zeros(flat['word_vectors/unknown'].shape, np.float32)}
  for path, x in params.items():
    if path not in flat or flat[path].shape != x.shape:
      raise ValueError(f'convert_cove.py makes our {path} of shape {x.shape}, which '
                       'models/cove.py does not have: fix the CoVe tables.')
  fresh = [path for path in flat if path not in params]
  unmapped = [path for path in fresh if path.split('/')[0] not in UNTRAINED]
  if unmapped:
    raise ValueError(f'convert_cove.py maps nothing to our {unmapped[0]}: add it to the '
                     'CoVe tables.')
  # The decoder as models/cove.py initializes it.
  params |= convert_checkpoint.fresh_params(init, fresh)
  os.makedirs(workdir, exist_ok=True)
  tokenizer_lib.write_lines_atomically([*words_lib.SPECIAL_WORDS, *words],
                                       os.path.join(workdir, words_lib.WordVocab.FILE_NAME))
  target_vocab = tokenizer_lib.learn_bpe(
      [], TARGET_VOCAB, lower_case,
      os.path.join(workdir, tokenizer_lib.ByteLevelBPETokenizer.FILE_NAME))
  convert_checkpoint.write_workdir(workdir, config, traverse_util.unflatten_dict(params, sep='/'), target_vocab)
  return (f'Converted {input_path} (CoVe: {config.model.num_encoder_layers}-layer biLSTM, '
          f'{config.model.hidden_size} cells per direction, over {word_dim}-d vectors) and the '
          f'first {len(words)} words of {glove_file} (lower_case={lower_case}) into {workdir}. '
          f'The release has no decoder: {", ".join(UNTRAINED)} are untrained '
          '(config.json: untrained_params); extract_features.py and '
          'configs/cove_classifier.py read the encoder.')


if __name__ == '__main__':
  sys.exit('convert_cove.py is a module of convert_checkpoint.py: run python '
           'convert_checkpoint.py --from=cove --input=FILE.pth --glove=FILE --workdir=DIR')
