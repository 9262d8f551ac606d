"""Converts released BERT, GPT, ELMo and CoVe checkpoints to workdirs of ours, BERT back to HF.

    python convert_checkpoint.py --from=hf --input=HF_DIR --workdir=DIR          # HF BERT
    python convert_checkpoint.py --from=tf --input=BERT_TF_DIR --workdir=DIR     # google's release
    python convert_checkpoint.py --from=hf --input=OPENAI_GPT_DIR --workdir=DIR  # HF openai-gpt
    python convert_checkpoint.py --to=hf --workdir=DIR --output=HF_DIR           # an HF BERT
    python convert_checkpoint.py --from=bilm --input=ELMO_DIR --workdir=DIR      # bilm-tf ELMo
    python convert_checkpoint.py --from=cove --input=wmtlstm-8f474287.pth \
        --glove=glove.840B.300d.txt --workdir=DIR                                # salesforce/cove

ELMo's options.json + weights.hdf5 are read by convert_elmo.py, CoVe's .pth by
convert_cove.py; their docstrings say what the references compute otherwise. The rest of
this docstring is about BERT and GPT.

A converted workdir is what a pretraining run leaves: config.json (configs/
bert_base.py or configs/gpt.py with the checkpoint's sizes), the vocabulary
and its casing, an orbax checkpoint; --config.init_from, trainer.state.load_trained
and --to=hf read it with no further flag. The casing: HF's
tokenizer_config.json do_lower_case; for a TF release the directory's name
(uncased_L-12_H-768_A-12, cased_...); else the vocabulary (capitalized pieces
make it cased); --lower_case overrides.

Every tensor goes to one parameter of the tree our model's init makes, shapes
checked; a missing or unexpected tensor is an error naming it. Skipped on
purpose: TF optimizer slots (*/adam_m, */adam_v, global_step), buffers
(position_ids, GPT's causal mask attn.bias) and tied copies (HF's decoder and
lm_head), which must equal what they repeat. An HF BertModel (no bert. prefix,
no cls.*) gets fresh MLM and NSP heads, which the summary lists.

Where the references compute otherwise:
- google-research/bert's modeling.py computes GELU by the tanh approximation;
  our BERT, like HF's, uses the exact erf GELU (they differ by under 5e-4).
- HF openai-gpt's afn='gelu' is the tanh approximation (its ACT_FNS maps it to
  gelu_new), as in OpenAI's code and our GPT.
- Our GPT special tokens (BPE_SPECIAL_TOKENS) get the ids after openai-gpt's
  40,478 and embedding rows from N(0, initializer_range), as OpenAI's
  fine-tuning code appends its own.
"""

import glob
import importlib
import json
import math
import os
import re
import shutil
import sys

from absl import app
from absl import flags
from absl import logging
from flax import traverse_util
import flax.linen as nn
import jax
import numpy as np

from configs import bert_base
from configs import gpt as gpt_configs
import input_pipeline
from input_pipeline.common import tokenizer as tokenizer_lib
from trainer import checkpoints
from trainer import cli
from trainer import phases
import trainer.checks
import trainer.state

# Leaves of each kind of module: ours, HF's, TF's, and the formats storing the matrix (out, in).
LINEAR = (('kernel', 'weight', 'kernel', ('hf',)), ('bias', 'bias', 'bias', ()))  # torch Linear
NSP = (('kernel', 'weight', 'output_weights', ('hf', 'tf')), ('bias', 'bias', 'output_bias', ()))
CONV1D = (('kernel', 'weight', None, ()), ('bias', 'bias', None, ()))  # GPT's Conv1D is (in, out)
NORM = (('scale', 'weight', 'gamma', ()), ('bias', 'bias', 'beta', ()))
TABLE = (('embedding', 'weight', '', ()),)
PARAM = (('', '', '', ()),)

_L, _HF, _TF = 'layer_{i}', 'bert.encoder.layer.{i}', 'bert/encoder/layer_{i}'
# Our module, HF's (BertForPreTraining) and TF's (google-research/bert modeling.py), leaves.
BERT = (
    ('token_embed', 'bert.embeddings.word_embeddings', 'bert/embeddings/word_embeddings', TABLE),
    ('position_embed', 'bert.embeddings.position_embeddings', 'bert/embeddings/position_embeddings',
     TABLE),
    ('segment_embed', 'bert.embeddings.token_type_embeddings',
     'bert/embeddings/token_type_embeddings', TABLE),
    ('embed_ln', 'bert.embeddings.LayerNorm', 'bert/embeddings/LayerNorm', NORM),
    *((f'{_L}/attention/{p}', f'{_HF}.attention.self.{p}', f'{_TF}/attention/self/{p}', LINEAR)
      for p in ('query', 'key', 'value')),
    (f'{_L}/attention/out', f'{_HF}.attention.output.dense', f'{_TF}/attention/output/dense',
     LINEAR),
    (f'{_L}/attention_ln', f'{_HF}.attention.output.LayerNorm', f'{_TF}/attention/output/LayerNorm',
     NORM),
    (f'{_L}/mlp/wi', f'{_HF}.intermediate.dense', f'{_TF}/intermediate/dense', LINEAR),
    (f'{_L}/mlp/wo', f'{_HF}.output.dense', f'{_TF}/output/dense', LINEAR),
    (f'{_L}/mlp_ln', f'{_HF}.output.LayerNorm', f'{_TF}/output/LayerNorm', NORM),
    ('pooler', 'bert.pooler.dense', 'bert/pooler/dense', LINEAR),
    ('mlm_transform', 'cls.predictions.transform.dense', 'cls/predictions/transform/dense', LINEAR),
    ('mlm_ln', 'cls.predictions.transform.LayerNorm', 'cls/predictions/transform/LayerNorm', NORM),
    ('mlm_output_bias', 'cls.predictions.bias', 'cls/predictions/output_bias', PARAM),
    ('nsp_head', 'cls.seq_relationship', 'cls/seq_relationship', NSP),
)
# GPT from HF openai-gpt; the fifth column takes a third (q|k|v) of c_attn's output axis.
GPT = (
    ('token_embed', 'tokens_embed', None, TABLE),
    ('position_embed', 'positions_embed', None, TABLE),
    *((f'{_L}/attention/{p}', 'h.{i}.attn.c_attn', None, CONV1D, j)
      for j, p in enumerate(('query', 'key', 'value'))),
    (f'{_L}/attention/out', 'h.{i}.attn.c_proj', None, CONV1D),
    (f'{_L}/attention_ln', 'h.{i}.ln_1', None, NORM),
    (f'{_L}/mlp/wi', 'h.{i}.mlp.c_fc', None, CONV1D),
    (f'{_L}/mlp/wo', 'h.{i}.mlp.c_proj', None, CONV1D),
    (f'{_L}/mlp_ln', 'h.{i}.ln_2', None, NORM),
)
# Tied copies: checked equal to the tensor they repeat, then dropped.
TIED = {'cls.predictions.decoder.weight': 'bert.embeddings.word_embeddings.weight',
        'cls.predictions.decoder.bias': 'cls.predictions.bias',
        'lm_head.weight': 'tokens_embed.weight'}
BUFFERS = re.compile(r'(^|\.)position_ids$|^h\.\d+\.attn\.(bias|masked_bias)$')
TF_SKIPPED = re.compile(r'/adam_[mv]$|^global_step$')

# Our model field, the checkpoint config's field, its default (None: required).
BERT_FIELDS = (
    ('vocab_size', 'vocab_size', None), ('hidden_size', 'hidden_size', None),
    ('num_layers', 'num_hidden_layers', None), ('num_heads', 'num_attention_heads', None),
    ('mlp_dim', 'intermediate_size', None),
    ('max_position_embeddings', 'max_position_embeddings', None),
    ('type_vocab_size', 'type_vocab_size', 2), ('dropout_rate', 'hidden_dropout_prob', 0.1),
    ('attention_dropout_rate', 'attention_probs_dropout_prob', 0.1),
    ('initializer_range', 'initializer_range', 0.02),
    ('layer_norm_eps', 'layer_norm_eps', 1e-12))  # TF: contrib layer_norm's epsilon
GPT_FIELDS = (
    ('vocab_size', 'vocab_size', None), ('hidden_size', 'n_embd', None),
    ('num_layers', 'n_layer', None), ('num_heads', 'n_head', None),
    ('max_position_embeddings', 'n_positions', None), ('dropout_rate', 'resid_pdrop', 0.1),
    ('attention_dropout_rate', 'attn_pdrop', 0.1), ('initializer_range', 'initializer_range', 0.02),
    ('layer_norm_eps', 'layer_norm_epsilon', 1e-5))
# What our models compute: a checkpoint config field and the values it may have (None: absent).
BERT_COMPUTES = (('hidden_act', ('gelu', None)), ('position_embedding_type', ('absolute', None)),
                 ('is_decoder', (False, None)), ('add_cross_attention', (False, None)))
GPT_COMPUTES = (('afn', ('gelu', None)),)
# Fine-tuning heads of our BERT (the others go with BertForPreTraining's names).
FINETUNING_HEADS = ('classifier', 'span_head', 'tagger')


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise ValueError(f'{path} does not exist: pass the directory of a released checkpoint.')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def name_map(rows, fmt: str, num_layers: int) -> dict[str, tuple[str, bool, int | None]]:
  """Our parameter path -> (the checkpoint's name, stored (out, in), third of c_attn)."""
  column, sep = {'hf': (1, '.'), 'tf': (2, '/')}[fmt]
  join = lambda a, b, s: f'{a}{s}{b}' if b else a  # noqa: E731
  names = {}
  for row in rows:
    for i in range(num_layers) if '{i}' in row[0] else [0]:
      for ours, *theirs, transposed in row[3]:
        names[join(row[0].format(i=i), ours, '/')] = (
            join(row[column].format(i=i), theirs[column - 1], sep), fmt in transposed,
            row[4] if len(row) > 4 else None)
  return names


def reference_shape(path: str, flat: dict) -> tuple[int, ...]:
  """Our array's shape as the references store it: a kernel as (in, out), the bias's axes being
  out (models/layers.Einsum); embedding tables as they are; other vectors flat."""
  shape = tuple(flat[path].shape)
  if path.endswith('kernel'):
    n_out = len(flat[path[:-len('kernel')] + 'bias'].shape)
    return math.prod(shape[:-n_out]), math.prod(shape[-n_out:])
  return shape if path.endswith('embedding') else (math.prod(shape),)


# What an HF BERT checkpoint may lack, initialized instead: BertModel's heads, and
# BertForMaskedLM's pooler (it builds BERT without one; HF's run_mlm.py saves those).
HF_BERT_OPTIONAL = ('cls.', 'bert.pooler.')


def to_params(tensors: dict, flat: dict, names: dict, source: str,
              optional: tuple[str, ...] = ()):
  """Our params (flat, of the shapes in `flat`) from the checkpoint's tensors; the paths absent
  from it whose name starts with one of `optional` are returned to be initialized instead."""
  params, fresh, used = {}, [], set()
  for path in flat:
    if path not in names:
      raise ValueError(f'convert_checkpoint.py maps no tensor to our {path}: add it to the tables.')
    theirs, transposed, third = names[path]
    if theirs not in tensors:
      if optional and theirs.startswith(optional):
        fresh.append(path)
        continue
      raise ValueError(f'{source} has no tensor {theirs} (our {path}): convert a complete '
                       'checkpoint of the architecture its config names.')
    ref = reference_shape(path, flat)
    expected = ref[::-1] if transposed else ref
    if third is not None:
      expected = (*expected[:-1], 3 * expected[-1])
    x = tensors[theirs]
    used.add(theirs)
    if tuple(x.shape) != expected:
      raise ValueError(f'{source}: {theirs} has shape {tuple(x.shape)} but our {path} needs '
                       f'{expected}: the checkpoint does not match its config.json.')
    x = x.T if transposed else x
    x = x[..., third * ref[-1]:(third + 1) * ref[-1]] if third is not None else x
    params[path] = np.ascontiguousarray(x, np.float32).reshape(flat[path].shape)
  unexpected = sorted(set(tensors) - used)
  if unexpected:
    raise ValueError(f'{source} has {len(unexpected)} tensor(s) our model has no parameter for: '
                     f'{", ".join(unexpected[:5])}: convert a checkpoint of the architecture '
                     'its config names.')
  return params, fresh


def our_config(family: str, ref: dict, source: str, lower_case: bool):
  """configs/bert_base.py or configs/gpt.py with the checkpoint config's sizes and casing."""
  bert = family == 'bert'
  for field, allowed in BERT_COMPUTES if bert else GPT_COMPUTES:
    if ref.get(field) not in allowed:
      raise ValueError(f'{source} has {field}={ref.get(field)!r}, which our {family} does not '
                       f'compute (it has {allowed[0]!r}): convert a checkpoint that has.')
  config = (bert_base if bert else gpt_configs).get_config('base')
  for ours, theirs, default in BERT_FIELDS if bert else GPT_FIELDS:
    value = ref.get(theirs, default)
    if value is None:
      raise ValueError(f'{source} has no {theirs}: add it, or convert a complete checkpoint.')
    config.model[ours] = type(config.model[ours])(value)
  if not bert:
    if ref.get('embd_pdrop', 0.1) != config.model.dropout_rate:
      raise ValueError(f'{source} has embd_pdrop={ref.get("embd_pdrop")} and resid_pdrop='
                       f'{config.model.dropout_rate}: our GPT has one dropout rate; make them so.')
    config.model.mlp_dim = 4 * config.model.hidden_size  # fixed in openai-gpt
    config.model.vocab_size += len(tokenizer_lib.BPE_SPECIAL_TOKENS)
  config.model.scan_layers = False
  # The checkpoint is the whole of this workdir's training, step 0 of 0: a finished run that
  # config.init_from accepts (trainer/checks.py).
  config.train.num_steps = 0
  config.data.vocab_file = ''
  config.data.lower_case = lower_case
  config.data.max_seq_length = min(config.data.max_seq_length, config.model.max_position_embeddings)
  return config


def model_init(config):
  """A function making the params of our model built from `config`, as its `init` makes them."""
  model = importlib.import_module(f'models.{config.model_name}').Model(
      trainer.checks.model_config(config))
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=1)
  return lambda: traverse_util.flatten_dict(nn.meta.unbox(  # noqa: E731
      model.init(jax.random.key(config.seed), example, deterministic=True)['params']), sep='/')


def fresh_params(init, paths) -> dict[str, np.ndarray]:
  """The parameters at `paths` as `init` (model_init's) makes them: one jitted init, traced
  once, returning only those."""
  def made():
    params = init()
    return {path: params[path] for path in paths}
  return jax.device_get(jax.jit(made)())


def read_hf_tensors(input_dir: str) -> tuple[dict[str, np.ndarray], str]:
  """The tensors of an HF model directory (safetensors, sharded safetensors or torch)."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = os.path.join(input_dir, 'model.safetensors')
  index = path + '.index.json'
  if os.path.isfile(path):
    return load_file(path), path
  if os.path.isfile(index):
    shards = sorted(set(_read_json(index)['weight_map'].values()))
    return {k: v for s in shards for k, v in load_file(os.path.join(input_dir, s)).items()}, index
  path = os.path.join(input_dir, 'pytorch_model.bin')
  if os.path.isfile(path):
    try:
      import torch  # pylint: disable=g-import-not-at-top (only .bin checkpoints need it)
    except ImportError:
      raise ValueError(f'{path} is a PyTorch file: pip install -r requirements-parity.txt (torch) '
                       'to read it, or save the model with safe_serialization=True.') from None
    state = torch.load(path, map_location='cpu', weights_only=True)
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}, path
  raise ValueError(f'{input_dir} has no model.safetensors or pytorch_model.bin: pass the '
                   'directory save_pretrained wrote.')


def read_tf_tensors(input_dir: str) -> tuple[dict[str, np.ndarray], str]:
  """The variables of a TF checkpoint in `input_dir`, optimizer slots skipped on purpose."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  indexes = glob.glob(os.path.join(input_dir, '*.index'))
  prefix = tf.train.latest_checkpoint(input_dir) or (
      indexes[0][:-len('.index')] if len(indexes) == 1 else None)
  if prefix is None:
    raise ValueError(f'{input_dir} holds {len(indexes)} TF checkpoints (*.index): pass a directory '
                     'with one, such as bert_model.ckpt.')
  reader = tf.train.load_checkpoint(prefix)
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
          if not TF_SKIPPED.search(name)}, prefix


def read_tensors(fmt: str, family: str, input_dir: str) -> tuple[dict, str]:
  """The checkpoint's tensors under the names of our tables (tied copies checked and dropped,
  buffers dropped), and the file they came from."""
  tensors, source = (read_hf_tensors if fmt == 'hf' else read_tf_tensors)(input_dir)
  if family == 'gpt':
    tensors = {k.removeprefix('transformer.'): v for k, v in tensors.items()}
  elif fmt == 'hf':  # older files name LayerNorm's parameters gamma and beta
    tensors = {re.sub(r'LayerNorm\.gamma$', 'LayerNorm.weight',
                      re.sub(r'LayerNorm\.beta$', 'LayerNorm.bias', k)): v
               for k, v in tensors.items()}
    if not any(k.startswith(('bert.', 'cls.')) for k in tensors):  # a BertModel
      tensors = {f'bert.{k}': v for k, v in tensors.items()}
  for copy, original in TIED.items():
    if copy in tensors and original in tensors:
      if not np.array_equal(tensors[copy], tensors[original]):
        raise ValueError(f'{source}: {copy} differs from {original}, which our model ties it to: '
                         'convert a checkpoint with tied weights.')
      del tensors[copy]
  return {k: v for k, v in tensors.items() if not BUFFERS.search(k)}, source


def unstack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A scan_layers=True run's 'layers/block/...' arrays (layers stacked first) as 'layer_{i}/...'."""
  out = {}
  for path, x in flat.items():
    if path.startswith('layers/block/'):
      for i, layer in enumerate(x):
        out[f'layer_{i}/' + path[len('layers/block/'):]] = layer
    else:
      out[path] = x
  return out


def casing(input_dir: str, fmt: str) -> bool:
  """Whether the checkpoint's WordPiece vocabulary is uncased (lower-cased text): as the
  checkpoint says (HF's tokenizer_config.json, the TF release's uncased_/cased_ name), else
  read off the vocabulary (a cased one has capitalized pieces)."""
  if fmt == 'hf':
    path = os.path.join(input_dir, 'tokenizer_config.json')
    settings = _read_json(path) if os.path.isfile(path) else {}
    lower = settings.get('do_lower_case')
    if lower is not None and settings.get('strip_accents') not in (None, lower):
      raise ValueError(f'{path} has strip_accents={settings["strip_accents"]} and do_lower_case='
                       f'{lower}: our tokenizer strips accents exactly when lower-casing.')
    if lower is not None:
      return lower
  else:
    found = re.search(r'(^|_)(un)?cased_', os.path.basename(os.path.normpath(input_dir)))
    if found:
      return found.group(2) is not None
  vocab = os.path.join(input_dir, 'vocab.txt')
  if not os.path.isfile(vocab):
    raise ValueError(f'{input_dir} has no vocab.txt: pass the directory with the checkpoint\'s '
                     'vocabulary.')
  return not tokenizer_lib.vocab_is_cased(vocab)


def grow_token_embedding(tensors: dict, config) -> None:
  """openai-gpt's token embedding with a row per special token of ours, from N(0,
  initializer_range) (seeded)."""
  table = tensors.get('tokens_embed.weight')
  if table is not None:
    shape = (len(tokenizer_lib.BPE_SPECIAL_TOKENS), table.shape[1])
    rows = np.random.default_rng(config.seed).normal(0.0, config.model.initializer_range, shape)
    tensors['tokens_embed.weight'] = np.concatenate([table, rows.astype(table.dtype)])


def convert(fmt: str, input_dir: str, workdir: str, lower_case: bool | None = None) -> str:
  """Writes the checkpoint in `input_dir` (fmt 'hf' or 'tf') as a workdir; returns a summary."""
  if not os.path.isdir(input_dir):
    raise ValueError(f'--input={input_dir} is not a directory: pass a checkpoint directory.')
  if checkpoints.exist(workdir):
    raise ValueError(f'--workdir={workdir} already holds a checkpoint: pass a new directory.')
  config_path = os.path.join(input_dir, 'config.json' if fmt == 'hf' else 'bert_config.json')
  ref = _read_json(config_path)
  model_type = ref.get('model_type') or ('openai-gpt' if 'n_embd' in ref else 'bert')
  family = {'bert': 'bert', 'openai-gpt': 'gpt'}.get(model_type)
  if family is None:
    raise ValueError(f'{config_path} has model_type={model_type!r}: convert_checkpoint.py reads '
                     "'bert' and 'openai-gpt'.")
  if family == 'gpt' and lower_case is False:
    raise ValueError("openai-gpt's BPE is lower-cased: drop --lower_case=false.")
  if lower_case is None:
    lower_case = True if family == 'gpt' else casing(input_dir, fmt)
  config = our_config(family, ref, config_path, lower_case)
  os.makedirs(workdir, exist_ok=True)
  if family == 'gpt':  # with our specials appended (and their embedding rows, below)
    vocab_file = tokenizer_lib.write_gpt1_bpe(*(os.path.join(input_dir, name) for name in (
        'vocab.json', 'merges.txt')), os.path.join(workdir, 'tokenizer.json'))
  else:
    vocab_file = os.path.join(input_dir, 'vocab.txt')
    if not os.path.isfile(vocab_file):
      raise ValueError(f'{input_dir} has no vocab.txt: add the WordPiece vocabulary of the model.')
  tokenizer = tokenizer_lib.load(vocab_file, lower_case)
  if tokenizer.vocab_size > config.model.vocab_size or (
      family == 'gpt' and tokenizer.vocab_size != config.model.vocab_size):
    raise ValueError(f'{vocab_file} has {tokenizer.vocab_size} tokens but the model '
                     f'{config.model.vocab_size} rows: pass the vocabulary of this checkpoint.')
  tensors, source = read_tensors(fmt, family, input_dir)
  if family == 'gpt':
    grow_token_embedding(tensors, config)
  init = model_init(config)
  names = name_map(BERT if family == 'bert' else GPT, fmt, config.model.num_layers)
  params, fresh = to_params(tensors, jax.eval_shape(init), names, source,
                            optional=HF_BERT_OPTIONAL if fmt == 'hf' and family == 'bert' else ())
  if fresh:  # jitted, and only these: initializing every parameter compiles for long on CPUs
    params |= fresh_params(init, fresh)
  write_workdir(workdir, config, traverse_util.unflatten_dict(params, sep='/'), vocab_file)
  return (f'Converted {source} ({family}, {config.model.num_layers} layers, '
          f'{config.model.hidden_size} wide, lower_case={lower_case}) into {workdir}.'
          + (f' Not in the checkpoint, initialized: {", ".join(fresh)}.' if fresh else ''))


def _copy(source: str, destination: str) -> None:
  """A byte-for-byte copy that readers never see half-written."""
  shutil.copyfile(source, destination + '.tmp')
  os.replace(destination + '.tmp', destination)


def write_workdir(workdir: str, config, params, vocab_file: str) -> None:
  """config.json and the vocabulary, then the checkpoint: only a finished workdir has one."""
  os.makedirs(workdir, exist_ok=True)
  tokenizer_lib.write_lines_atomically([config.to_json_best_effort(indent=2)],
                                       os.path.join(workdir, 'config.json'))
  saved = os.path.join(workdir, os.path.basename(vocab_file))
  if os.path.abspath(vocab_file) != os.path.abspath(saved):
    _copy(vocab_file, saved)
  mngr = checkpoints.manager(workdir, 1)
  # The released models trained every position of their table (BERT's last phase at 512);
  # ELMo's biLM has no position table. openai-gpt had no end-of-text token: its row is one of
  # grow_token_embedding's, which generate.py does not put before a prompt.
  checkpoints.save(mngr, 0, {'step': np.zeros((), np.int32), 'params': params}, {0: {}}, 1,
                   positions=config.model.get('max_position_embeddings'),
                   eot_trained=False if config.model_name == 'gpt' else None)
  checkpoints.wait(mngr)
  mngr.close()


def check_hf_output(workdir: str, output: str) -> None:
  """--output is a directory of its own: not a file, not the run's workdir nor any run's (its
  config.json would be replaced by HF's, and the run could no longer be resumed or read)."""
  if os.path.exists(output) and not os.path.isdir(output):
    raise ValueError(f'--output={output} is a file: pass a new directory.')
  same = os.path.exists(output) and os.path.exists(workdir) and os.path.samefile(output, workdir)
  saved = os.path.join(output, 'config.json')
  holds_run = os.path.isdir(os.path.join(output, 'checkpoints'))
  if not holds_run and os.path.isfile(saved):
    try:
      with open(saved, encoding='utf-8') as f:
        holds_run = 'model_name' in json.load(f)
    except (OSError, ValueError):
      holds_run = True  # not HF's either: leave it alone
  if same or holds_run:
    raise ValueError(f'--output={output} holds a training run (its checkpoints or config.json), '
                     'which HF\'s config.json would replace: pass a new directory.')


def export_hf(workdir: str, output: str) -> str:
  """Writes a BERT workdir as an HF BertForPreTraining directory; returns a summary."""
  check_hf_output(workdir, output)
  config, _, params, tokenizer = trainer.state.load_trained(workdir, 'bert', '--to=hf')
  # HF truncates to, and warns beyond, a tokenizer's model_max_length: the trained positions.
  trained = min(phases.trained_positions(workdir) or config.model.max_position_embeddings,
                config.model.max_position_embeddings)
  weights = os.path.join(output, 'model.safetensors')
  if os.path.exists(weights):
    raise ValueError(f'--output={output} already holds model.safetensors: pass a new directory.')
  flat = unstack_layers(traverse_util.flatten_dict(jax.device_get(params), sep='/'))
  names = name_map(BERT, 'hf', config.model.num_layers)
  left_out = sorted({p.split('/')[0] for p in flat} & set(FINETUNING_HEADS))
  unnamed = [p for p in flat if p not in names and p.split('/')[0] not in left_out]
  if unnamed:
    raise ValueError(f'{workdir} has parameters BertForPreTraining has no name for: '
                     f'{", ".join(unnamed[:5])}: add them to the tables.')
  tensors = {}
  for path, (theirs, transposed, _) in names.items():
    if path in flat:  # a fine-tuned run has no MLM head
      x = np.asarray(flat[path], np.float32).reshape(reference_shape(path, flat))
      tensors[theirs] = np.ascontiguousarray(x.T if transposed else x)
  absent = [theirs for path, (theirs, _, _) in names.items() if path not in flat]
  files = {'config.json': {'architectures': ['BertForPreTraining'], 'model_type': 'bert',
                           **{theirs: config.model[ours] for ours, theirs, _ in BERT_FIELDS},
                           'hidden_act': 'gelu', 'position_embedding_type': 'absolute',
                           'pad_token_id': tokenizer.pad_id, 'tie_word_embeddings': True},
           'tokenizer_config.json': {'tokenizer_class': 'BertTokenizer',
                                     'do_lower_case': tokenizer.lower_case,
                                     'model_max_length': trained}}
  os.makedirs(output, exist_ok=True)
  for name, content in files.items():
    path = os.path.join(output, name)
    tokenizer_lib.write_lines_atomically([json.dumps(content, indent=2)], path)
  _copy(tokenizer.vocab_file, os.path.join(output, 'vocab.txt'))
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file(tensors, weights + '.tmp', metadata={'format': 'pt'})
  os.replace(weights + '.tmp', weights)  # last: only a finished export has its weights
  return (f'Wrote {len(tensors)} tensors of {workdir} to {output} (BertForPreTraining).'
          + (f' Left out (fine-tuning heads): {", ".join(left_out)}.' if left_out else '')
          + (f' Not in the run (HF initializes them): {", ".join(absent)}.' if absent else '')
          + (f' The run trained positions 0-{trained - 1} of {config.model.max_position_embeddings}'
             f' (data.later_phases): tokenizer_config.json has model_max_length {trained}.'
             if trained < config.model.max_position_embeddings else ''))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  cli.skip_absent_accelerators()
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  source, lower_case = f['from'].value, {'true': True, 'false': False, None: None}[f.lower_case]
  try:
    if source == 'bilm' and not f.to and f.input and f.workdir:
      import convert_elmo  # pylint: disable=g-import-not-at-top (it imports this module)
      summary = convert_elmo.convert(f.input, f.workdir)
    elif source == 'cove' and not f.to and f.input and f.workdir:
      import convert_cove  # pylint: disable=g-import-not-at-top (it imports this module)
      summary = convert_cove.convert(f.input, f.workdir, f.glove, lower_case)
    elif source and not f.to and f.input and f.workdir:
      summary = convert(source, f.input, f.workdir, lower_case)
    elif f.to and not source and f.workdir and f.output:
      summary = export_hf(f.workdir, f.output)
    else:
      raise ValueError('pass --from=hf|tf|bilm --input=DIR --workdir=DIR, --from=cove '
                       '--input=FILE.pth --glove=FILE --workdir=DIR, or --to=hf --workdir=DIR '
                       '--output=DIR.')
  except (ValueError, OSError) as e:  # OSError: a path that is a file, unwritable, ...
    sys.exit(f'convert_checkpoint.py: error: {e}')
  print(summary, flush=True)


if __name__ == '__main__':
  flags.DEFINE_enum('from', None, ('hf', 'tf', 'bilm', 'cove'), 'Convert a checkpoint of this '
                    "format (bilm: an ELMo options.json and weights.hdf5; cove: salesforce/cove's "
                    'wmtlstm-*.pth).')
  flags.DEFINE_enum('to', None, ('hf',), 'Export a BERT workdir to this format.')
  flags.DEFINE_string('input', None, 'Directory of the checkpoint to convert (CoVe: its .pth).')
  flags.DEFINE_string('workdir', None, 'Our workdir: written by --from, read by --to.')
  flags.DEFINE_string('output', None, 'Directory to write with --to.')
  flags.DEFINE_enum('lower_case', None, ('true', 'false'), 'Casing of the vocabulary (overrides).')
  flags.DEFINE_string('glove', None, 'CoVe: the GloVe text file the MT-LSTM reads '
                      '(glove.840B.300d.txt).')
  app.run(main, flags_parser=cli.parse_flags)
