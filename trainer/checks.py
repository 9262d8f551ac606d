"""Config checks: every mistake a user can make is caught here, in one line naming the fix,
before any data is read or anything compiled."""

import dataclasses
import importlib
import inspect
import json
import os
from typing import Any

import jax

import input_pipeline
from models import layers
from trainer import checkpoints
from trainer import phases
from trainer import ranges
from trainer import sharding


KERNEL_PLATFORMS = {'flash': 'tpu', 'cudnn': 'gpu', 'triton': 'gpu'}
CUDNN_DTYPES = ('bfloat16', 'float16')


def model_config(config, platform: str | None = None) -> Any:
  """The model's Config; dtype 'auto' resolves for `platform` (default: this process's backend)."""
  module = importlib.import_module(f'models.{config.model_name}')
  known = {f.name for f in dataclasses.fields(module.Config)}
  unknown = sorted(set(config.model.keys()) - known)
  if unknown:
    raise ValueError(f'config.model has unknown fields {unknown}: remove them or use one of '
                     f'{sorted(known)}.')
  fields = config.model.to_dict()
  if 'frozen' in known and 'frozen' not in fields:  # a model that stops gradients itself (BCN)
    fields['frozen'] = tuple(config.get('optimizer', {}).get('frozen', ()))
  platform = platform or jax.default_backend()
  if fields.get('dtype') == 'auto':  # bfloat16 matmuls are slower than float32 on CPUs
    fields['dtype'] = 'float32' if platform == 'cpu' else 'bfloat16'
  if fields.get('attention') == 'auto':
    fields['attention'] = _auto_attention(fields, platform)
  kernel = fields.get('attention')
  if kernel in KERNEL_PLATFORMS and platform != KERNEL_PLATFORMS[kernel]:
    raise ValueError(f'model.attention={kernel} is a {KERNEL_PLATFORMS[kernel].upper()} kernel '
                     f'and this runs on {platform}: use model.attention=auto or xla.')
  if kernel == 'flash' and layers.tpu_flash is None:
    raise ValueError(f'model.attention=flash: this jax ({jax.__version__}) has no '
                     'jax.experimental.pallas.ops.tpu.flash_attention: use model.attention=auto '
                     'or xla, or the pinned jax of requirements.txt.')
  if kernel == 'cudnn' and fields['dtype'] not in CUDNN_DTYPES:
    raise ValueError(f'model.attention=cudnn computes in {" or ".join(CUDNN_DTYPES)} and '
                     f'model.dtype is {fields["dtype"]}: set model.dtype=auto or use '
                     'model.attention=xla.')
  if kernel == 'cudnn' and fields.get('attention_dropout_rate'):
    _check_cudnn_dropout(fields)
  return module.Config(**fields)


def train_flops_per_example(config, model_cfg) -> float:
  """The model's analytic training FLOPs per example (models/<name>.py's count), given
  config.loss too where the count takes it (GPT's: at loss.lm_coef=0 the LM head runs
  forward only, for its metric)."""
  count = importlib.import_module(f'models.{config.model_name}').train_flops_per_example
  if 'loss_cfg' in inspect.signature(count).parameters:
    return count(model_cfg, config.data, loss_cfg=config.get('loss'))
  return count(model_cfg, config.data)


def _check_cudnn_dropout(fields: dict[str, Any]) -> None:
  """cuDNN's attention dropout where a GPU showed it right (docs/accelerators.md)."""
  if fields.get('scan_layers'):
    raise ValueError('model.attention=cudnn with attention dropout and model.scan_layers=True: '
                     "under scan the layers' backward calls draw other masks than their forward "
                     'calls did (seen on an H200); set model.scan_layers=False or use '
                     'model.attention=xla.')


def _gpus_before_ampere() -> bool:
  """Whether this process runs on GPUs of compute capability below 8.0 (a compile for another
  GPU's target, aot.py's, is for an A100 or later)."""
  if jax.default_backend() != 'gpu':
    return False
  try:
    return float(getattr(jax.devices()[0], 'compute_capability', '') or 'nan') < 8.0
  except ValueError:
    return False


def _auto_attention(fields: dict[str, Any], platform: str) -> str:
  """The fused kernel of the platform where it computes the same function, else XLA's.

  With dropout on the attention probabilities (BERT's and GPT's 0.1): on a GPU ours
  (model.attention=triton, models/flash_dropout.py), whose masks come from the step's RNG and
  which an H200 checked against XLA's attention (docs/accelerators.md); elsewhere XLA's, as the
  TPU flash kernel has no dropout. cuDNN's dropout stays opt-in (model.attention=cudnn): it draws
  its masks from a seed of each layer's own, not from the step's RNG
  (layers.cudnn_dropout_attention), and on an H200 its masks' rates spread twice as wide as
  independent draws would.
  cuDNN takes 16-bit inputs and heads of at most 128 (A100; 256 from H100 on), multiples of 8.
  GPUs before Ampere (a T4, a V100: Colab's free one) compile neither Triton kernels nor cuDNN's
  fused attention: XLA's.
  """
  if platform == 'gpu' and _gpus_before_ampere():
    return 'xla'
  if fields['attention_dropout_rate']:
    return 'triton' if platform == 'gpu' else 'xla'
  if platform == 'tpu':
    return 'flash' if layers.tpu_flash else 'xla'
  head_dim = fields['hidden_size'] // fields['num_heads']
  if platform == 'gpu' and fields['dtype'] in CUDNN_DTYPES and head_dim <= 128 and not head_dim % 8:
    return 'cudnn'
  return 'xla'


def validate(config, mesh, num_hosts: int | None = None) -> None:
  """Raises ValueError with one line naming the fix; `num_hosts` defaults to this job's."""
  num_hosts = num_hosts or jax.process_count()
  ranges.check(config)  # every field in its range (trainer/ranges.py's table)
  model_config(config, mesh.devices.flat[0].platform)  # the model's Config checks its own fields
  seq_len = config.data.get('max_seq_length')
  positions = config.model.get('max_position_embeddings')
  if seq_len and positions and seq_len > positions:
    raise ValueError(f'data.max_seq_length={seq_len} is above model.max_position_embeddings='
                     f'{positions}: lower data.max_seq_length or raise the position table.')
  tc = config.train
  dp = sharding.data_parallel_size(mesh)
  if tc.batch_size % (dp * tc.grad_accum_steps):
    raise ValueError(f'train.batch_size={tc.batch_size} is not divisible by the data-parallel '
                     f'size {dp} (data x fsdp) times train.grad_accum_steps='
                     f'{tc.grad_accum_steps}: use a multiple of {dp * tc.grad_accum_steps}.')
  if tc.batch_size % num_hosts:
    raise ValueError(f'train.batch_size={tc.batch_size} is not divisible by the '
                     f'{num_hosts} hosts: use a multiple of {num_hosts}.')
  if tc.eval_steps and config.data.get('pipeline') in input_pipeline.WHOLE_EVAL:
    raise ValueError(f'train.eval_steps={tc.eval_steps}: a task is scored over its whole eval '
                     'split (EM/F1, span F1, MCC need every example): set train.eval_steps=0.')
  if config.optimizer.warmup_steps > tc.num_steps:
    raise ValueError(f'optimizer.warmup_steps={config.optimizer.warmup_steps} exceeds '
                     f'train.num_steps={tc.num_steps}: lower the warmup.')
  input_pipeline.check_config(config)
  chars = (config.data.get('max_characters_per_token'),
           config.model.get('max_characters_per_token'))
  if None not in chars and chars[0] != chars[1]:
    raise ValueError(f'data.max_characters_per_token={chars[0]} but model.max_characters_per_token'
                     f'={chars[1]}: set both to the same value.')
  model_module = importlib.import_module(f'models.{config.model_name}')
  if hasattr(model_module, 'check_config'):
    model_module.check_config(config)
  if dp % num_hosts:
    raise ValueError(f'The data-parallel size {dp} (data x fsdp) is not a multiple of the '
                     f'{num_hosts} hosts, so hosts would share batch shards: '
                     'give data or fsdp more devices in config.mesh.')
  for phase in phases.of(config)[1:]:  # of() checks the table's form first
    try:
      validate(phase.config, mesh, num_hosts)
    except ValueError as e:
      raise ValueError(f'In phase {phase.index + 1} (data.later_phases[{phase.index - 1}]): '
                       f'{e}') from None


# Fields of config.model that change parameter shapes or names, or what the loaded
# parameters compute (a frozen biLM with other clipping would give other features).
_SHAPE_FIELDS = ('vocab_size', 'hidden_size', 'num_layers', 'num_heads', 'mlp_dim',
                 'max_position_embeddings', 'type_vocab_size', 'scan_layers',
                 'char_dim', 'max_characters_per_token', 'filters', 'num_highway',
                 'projection_dim', 'lstm_dim', 'cell_clip', 'proj_clip', 'skip_connections',
                 'char_activation')
# What a run saved before a field was added computed (ELMo's residual and char activation).
_SHAPE_FIELD_DEFAULTS = {'skip_connections': True, 'char_activation': 'relu',
                         'split_words': 'punctuation'}  # (a CoVe run of before it was one)


def _as_json(value: Any) -> Any:
  """A config value as config.json holds it (tuples become lists)."""
  return json.loads(json.dumps(value))


# Fields besides the model's a run cannot resume with other values: they change the optimizer
# state's form, the ids the data is read as, or what its saved data position counts (the chunks
# of documents and the examples made of each; the model's are checked on its parameters:
# check_resumable_params). data.files is not among them: the same files may have moved (from
# /nfs to local disk, say), and a path says nothing of what a file holds.
_RESUME_FIELDS = (('optimizer', 'name'), ('optimizer', 'frozen'), ('data', 'tokenizer'),
                  ('data', 'lower_case'), ('data', 'split_words'), ('data', 'normalize_words'),
                  ('data', 'docs_per_chunk'), ('data', 'max_seq_length'))
# What a run saved before a field of _RESUME_FIELDS existed did (CVT's words as written).
_RESUME_DEFAULTS = {'normalize_words': False}


def _saved_config(directory: str, what: str) -> dict[str, Any] | None:
  """The config.json of a run's directory; None without one."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f'{path} cannot be read ({e}): {what}.') from None


def check_workdir(config, workdir: str) -> None:
  """A workdir that holds another run stops this one, naming what it holds: another model, or a
  checkpoint this config cannot resume (another optimizer or tokenizer)."""
  new_workdir = 'pass a new --workdir for this run'
  saved = _saved_config(workdir, new_workdir)
  if saved is None:
    return
  theirs = (saved.get('model_name'), saved.get('objective'))
  if theirs[0] is None:
    raise ValueError(f'--workdir={workdir} holds a config.json that is no train.py run\'s (it '
                     f'has no model_name; an HF export\'s?): {new_workdir}.')
  if theirs != (config.model_name, config.objective):
    raise ValueError(f'--workdir={workdir} holds a {theirs[0]} run (objective {theirs[1]}) and '
                     f'this config trains {config.model_name} ({config.objective}): '
                     f'{new_workdir}, or give the config that run was started with to resume it.')
  if not checkpoints.exist(workdir):
    return  # nothing to resume: the run starts afresh there
  for part, field in _RESUME_FIELDS:
    ours = config[part].get(field)
    if field not in saved.get(part, {}) and field in _RESUME_DEFAULTS:
      saved.setdefault(part, {})[field] = _RESUME_DEFAULTS[field]  # a run of before the field
    if ours is None or field not in saved.get(part, {}):
      continue  # unset here (taken from the run), or not a field of this model
    if _as_json(ours) != saved[part][field]:
      raise ValueError(f'--workdir={workdir} holds a checkpoint of a run with {part}.{field}='
                       f'{saved[part][field]} and this config has {ours}, so it cannot resume '
                       f'it: {new_workdir}, or set --config.{part}.{field}='
                       f'{saved[part][field]} to resume that run.')
  # Eval examples held out of the training text move the training stream (its saved position).
  if 'eval_holdout' in saved.get('data', {}) and config.data.get('eval_holdout') is not None:
    theirs, ours = (data['eval_holdout'] if input_pipeline.holds_out(data) else None
                    for data in (saved['data'], config.data))
    if theirs != ours:
      own = 'eval examples from a source of their own'
      theirs_did = (f'took its {own}' if theirs is None else
                    f'held out 1 in data.eval_holdout={theirs} training examples')
      ours_does = f'takes its {own}' if ours is None else f'holds out 1 in {ours}'
      fix = (f'set --config.data.eval_holdout={theirs}' if theirs and ours else
             'give the data fields of that run (its config.json) again')
      raise ValueError(f'--workdir={workdir} holds a checkpoint of a run that {theirs_did} and '
                       f'this config {ours_does}, which is another training stream, so it '
                       f'cannot resume it: {new_workdir}, or {fix} to resume it.')
  # The seed draws the data's order and the dropout masks: another one resumes no run exactly.
  if 'seed' in saved and config.get('seed') is not None and config.seed != saved['seed']:
    raise ValueError(f'--workdir={workdir} holds a checkpoint of a run with seed={saved["seed"]} '
                     f'and this config has {config.seed}, which draws other data and dropout '
                     f'from here on: {new_workdir}, or set --config.seed={saved["seed"]} to '
                     'resume that run.')
  # The schedule runs to train.num_steps, and a run is finished there: fewer would call a run
  # stopped part of the way finished (exit 0, its config.json rewritten, an init_from accepted)
  # or leave a longer schedule's run standing for a shorter one. More trains further.
  theirs, ours = saved.get('train', {}).get('num_steps'), config.train.get('num_steps')
  if theirs is not None and ours is not None and ours < theirs:
    raise ValueError(f'--workdir={workdir} holds a run of train.num_steps={theirs} (its newest '
                     f'checkpoint is step {checkpoints.newest_step(workdir)}) and this config '
                     f'has {ours}: a run is not cut short, its schedule runs to {theirs}: set '
                     f'--config.train.num_steps={theirs} (or more) to resume it, or '
                     f'{new_workdir}.')
  # Clipping on or off is another optimizer state (optax.chain's); its threshold may change.
  theirs, ours = saved.get('optimizer', {}).get('clip_norm'), config.optimizer.get('clip_norm')
  if theirs is not None and ours is not None and bool(theirs) != bool(ours):
    fix = 'a positive one' if theirs else '0'
    raise ValueError(f'--workdir={workdir} holds a checkpoint of a run with optimizer.clip_norm='
                     f'{theirs} and this config has {ours}: clipping on or off is another '
                     f'optimizer state, so it cannot resume it: {new_workdir}, or set '
                     f'--config.optimizer.clip_norm to {fix} to resume that run.')


def check_resumable_params(config, workdir: str, params: Any) -> None:
  """The newest readable checkpoint of `workdir` holds the parameters this config's model has,
  shape for shape; else one line naming the first that differs and the model fields its run
  had."""
  names, saved = checkpoints.shapes_by_name(params), checkpoints.readable_param_shapes(workdir)
  if saved is None or saved == names:
    return
  differ = sorted(set(saved) ^ set(names)) or [n for n in names if saved[n] != names[n]]
  name = differ[0]
  what = (f'has {name} of shape {saved[name]} where this config makes {names[name]}'
          if name in saved and name in names else
          f'{"has" if name in saved else "lacks"} the parameter {name} this config '
          f'{"lacks" if name in saved else "has"}')
  theirs = (_saved_config(workdir, 'pass a new --workdir for this run') or {}).get('model', {})
  fields = [f'model.{f}={theirs[f]}' for f, ours in config.model.items()
            if f in theirs and ours is not None and _as_json(ours) != theirs[f]]
  raise ValueError(f'--workdir={workdir} holds a checkpoint that cannot be resumed with this '
                   f'config: it {what}'
                   + (f' (its run had {", ".join(fields)})' if fields else '') +
                   ': pass a new --workdir for this run, or the config it was started with to '
                   'resume it.')


def check_init_from_run(config, need_checkpoint: bool = True) -> dict[str, Any]:
  """config.init_from is a finished run (without `need_checkpoint`: its config.json is enough,
  for the sizes) of a model this config can start from: its config."""
  source = config.init_from
  fix = 'point config.init_from at the workdir of a pretraining run'
  if not os.path.isdir(source):
    raise ValueError(f'config.init_from={source!r} is not a directory'
                     f'{"" if os.path.exists(source) else " (nothing is there)"}: {fix}.')
  has_checkpoint = checkpoints.exist(source) or not need_checkpoint
  present = {'config.json': os.path.isfile(os.path.join(source, 'config.json')),
             'complete checkpoint in checkpoints/': has_checkpoint}
  missing = [name for name, found in present.items() if not found]
  if missing:
    raise ValueError(f'config.init_from={source!r} has no {" and no ".join(missing)}, so it is '
                     f'not a finished run: {fix} (or run that pretraining to its last step).')
  saved = _saved_config(source, fix)
  # A task model may start from another model's run (the ELMo tagger from an ELMo biLM).
  module = importlib.import_module(f'models.{config.model_name}')
  starts_from = getattr(module, 'PRETRAINED_MODEL', config.model_name)
  if saved.get('model_name') not in (config.model_name, starts_from):
    raise ValueError(f'config.init_from={source!r} is a {saved.get("model_name")!r} run and this '
                     f'config trains {config.model_name!r}: start from a {starts_from!r} run.')
  if need_checkpoint:
    _check_finished(config, saved)
  return saved


def _check_finished(config, saved: dict[str, Any]) -> None:
  """The run in config.init_from reached its train.num_steps (a preempted one did not, and
  starting from it would report results of a model trained part of the way), unless the
  config says that a partial start is meant."""
  reached = checkpoints.newest_step(config.init_from)
  planned = saved.get('train', {}).get('num_steps')
  if planned is None or reached >= planned or config.get('allow_unfinished_init_from'):
    return
  raise ValueError(f'config.init_from={config.init_from!r} stopped at step {reached} of its '
                   f'train.num_steps={planned}: resume it to its last step first (its train.py '
                   'command again), or set --config.allow_unfinished_init_from=True to start '
                   f'from step {reached} on purpose.')


def check_run_directories(config, workdir: str) -> None:
  """The workdir and config.init_from, before any field is taken from them: a run of another
  model, a checkpoint this config cannot resume, or an init_from that is not a finished run
  is said as such."""
  if config.get('init_from') and os.path.abspath(config.init_from) == os.path.abspath(workdir):
    raise ValueError('config.init_from is the workdir itself: give the fine-tuning run a '
                     'workdir of its own.')
  check_workdir(config, workdir)
  if config.get('init_from') and not checkpoints.exist(workdir):
    check_init_from_run(config)


def inherit_unset_fields(config, workdir: str | None) -> None:
  """Fills the model fields, data.lower_case and data.split_words left None (a fine-tuning
  config without a size) from the run the workdir resumes, or else from config.init_from, so
  that a converted or pretrained checkpoint needs no flag for its sizes, casing or word split."""
  unset = [('model', k) for k, v in config.model.items() if v is None]
  unset += [('data', f) for f in ('lower_case', 'split_words')
            if f in config.data and config.data[f] is None]
  if not unset:
    return
  if workdir and checkpoints.exist(workdir):
    source, saved = workdir, _saved_config(workdir, 'pass a new --workdir for this run')
  elif config.get('init_from'):
    source, saved = config.init_from, check_init_from_run(config, need_checkpoint=False)
  else:
    # Without a run to take them from (bench.py and aot.py on synthetic batches), the word
    # split and casing of a word vocabulary (the BCN's: neither changes a compiled step); a size
    # and a subword vocabulary's casing have no such default.
    for field, default in (('split_words', _SHAPE_FIELD_DEFAULTS['split_words']),
                           ('lower_case', False)):
      if ('data', field) in unset and 'split_words' in config.data:
        unset.remove(('data', field))
        config.data[field] = default
    if not unset:
      return
    part, field = unset[0]
    raise ValueError(f'config.{part}.{field} is unset and taken from the pretrained run: set '
                     f'--config.init_from to its workdir (or --config.{part}.{field}; for a '
                     'size: <task>,<size>).')
  for part, field in unset:
    value = (saved or {}).get(part, {}).get(field, _SHAPE_FIELD_DEFAULTS.get(field))
    if value is None:
      raise ValueError(f'{os.path.join(source, "config.json")} has no {part}.{field}: set '
                       f'--config.{part}.{field}.')
    config[part][field] = value


def check_init_from(config) -> None:
  """config.init_from names a finished run whose model this config can start from, with the
  sizes and vocabulary this config has."""
  saved = check_init_from_run(config)
  module = importlib.import_module(f'models.{config.model_name}')
  # Ours -> theirs, where a task model names the pretrained model's sizes otherwise
  # (the BCN's word vocabulary is CoVe's source_vocab_size).
  model_fields = getattr(module, 'INIT_FROM_FIELDS', {f: f for f in _SHAPE_FIELDS})
  fields = ([('model', f, theirs) for f, theirs in model_fields.items() if f in config.model] +
            [('data', f, f) for f in ('tokenizer', 'lower_case', 'split_words')
             if f in config.data])
  for part, field, their_field in fields:
    theirs = saved[part].get(their_field, _SHAPE_FIELD_DEFAULTS.get(their_field))
    if theirs != _as_json(config[part][field]):
      raise ValueError(f'config.{part}.{field}={config[part][field]} but the run in '
                       f'config.init_from has {part}.{their_field}={theirs}: pick the size it '
                       f'was trained with (the config argument <task>,<size>) or set '
                       f'--config.{part}.{field}={theirs}.')
  _check_trained_positions(config)


def _check_trained_positions(config) -> None:
  """A run longer than the positions its init_from trained says so (the table may hold 512
  positions of which a one-phase pretraining at 128 trained 128), unless told to go on."""
  longest = max(phases.lengths(config), default=0)
  table = config.model.get('max_position_embeddings')
  trained = phases.trained_positions(config.init_from)
  # Longer than the table itself is validate's error.
  if (not table or longest > table or trained is None or longest <= trained
      or config.get('allow_untrained_positions')):
    return
  raise ValueError(f'data.max_seq_length={longest} but the run in config.init_from trained '
                   f'positions 0-{trained - 1} only, so positions {trained}-{longest - 1} are '
                   'untrained: pretrain its later phase (data.later_phases), lower '
                   'data.max_seq_length, or set --config.allow_untrained_positions=True to go on.')
