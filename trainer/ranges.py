"""The valid values of every config field, one table for every family, checked before anything
is read or compiled.

A field means the same in every config that has it (model.dropout_rate is a
dropout probability in BERT and in CoVe), so the table is keyed by the field's
path; `<model_name>:<path>` keys the few fields whose range differs by model.
A config is checked only on the fields it has. tests/test_ranges.py checks that
every field of every config in configs/ has an entry here, so a new field comes
with its range, and that each entry rejects a value outside it. Booleans need
none (ml_collections keeps a field's type). What depends on several fields (a
warmup within the steps, a batch divisible by the mesh) is trainer/checks.py's.
The pipelines and models keep their own checks of what they need, for the
programs and tests that build them without a whole config.
"""

import dataclasses
import importlib
import math
import pkgutil
from typing import Any, Callable

import input_pipeline
from trainer import phases
from trainer import sharding


@dataclasses.dataclass(frozen=True)
class Interval:
  """A number in [low, high], either end open or absent; `integer`: a whole number."""
  low: float | None = None
  high: float | None = None
  open_low: bool = False
  open_high: bool = False
  what: str = 'a value'
  integer: bool = False

  def __str__(self) -> str:
    low = '-inf' if self.low is None else f'{self.low:g}'
    high = 'inf' if self.high is None else f'{self.high:g}'
    return f'{"(" if self.open_low or self.low is None else "["}{low}, {high}' + (
        ')' if self.open_high or self.high is None else ']')

  def problem(self, value: Any, path: str) -> str | None:
    inside = (isinstance(value, int if self.integer else (int, float))
              and not isinstance(value, bool) and math.isfinite(value) and
              (self.low is None or value > self.low or (value == self.low and not self.open_low))
              and (self.high is None or value < self.high or
                   (value == self.high and not self.open_high)))
    if inside:
      return None
    return f'{path}={value!r} is outside {self} ({self.what}): set a value in {self}.'

  def outside(self, default: Any) -> list[Any]:
    """Values of the default's type that this interval rejects, below and above it."""
    bad = []
    if self.low is not None:
      bad.append(self.low if self.open_low else self.low - 1)
    if self.high is not None:
      bad.append(self.high if self.open_high else self.high + 1)
    return [type(default)(b) for b in bad]


@dataclasses.dataclass(frozen=True)
class OneOf:
  """One of a set of names; `choices` gives them when the field is checked (the tuple of the
  code that reads the field where it has one)."""
  choices: Callable[[], tuple[str, ...]]
  what: str = 'a name'

  def problem(self, value: Any, path: str) -> str | None:
    choices = self.choices()
    if value in choices:
      return None
    return f'{path}={value!r} is not {self.what} this code knows: use one of {", ".join(choices)}.'

  def outside(self, default: Any) -> list[Any]:
    del default
    return ['no_such_name']


@dataclasses.dataclass(frozen=True)
class Each:
  """A tuple whose every element passes `rule`; `nonempty`: at least one."""
  rule: Any
  nonempty: bool = False

  def problem(self, value: Any, path: str) -> str | None:
    if not isinstance(value, (tuple, list)):
      return f'{path}={value!r} is not a tuple: write it as ( ..., ).'
    if self.nonempty and not value:
      return f'{path}=() is empty: give at least one.'
    for i, element in enumerate(value):
      problem = self.rule.problem(element, f'{path}[{i}]')
      if problem:
        return problem
    return None

  def outside(self, default: Any) -> list[Any]:
    return [(bad,) for bad in self.rule.outside(default[0])] if default else []


@dataclasses.dataclass(frozen=True)
class Checked:
  """A field whose form the code that reads it checks, given the whole config (`check` raises
  ValueError in one line); `bad` is a value it rejects."""
  check: Callable[[Any], None]
  bad: Any

  def outside(self, default: Any) -> list[Any]:
    del default
    return [self.bad]


@dataclasses.dataclass(frozen=True)
class Free:
  """Any value of the field's type: a path or name checked when it is read, or a value a
  config file derives from others."""
  why: str

  def problem(self, value: Any, path: str) -> str | None:
    del value, path
    return None


def _modules(package: str, attribute: str) -> Callable[[], tuple[str, ...]]:
  """The modules of `package` that define `attribute` (the models, the objectives)."""
  def names() -> tuple[str, ...]:
    module = importlib.import_module(package)
    return tuple(m.name for m in pkgutil.iter_modules(module.__path__)
                 if hasattr(importlib.import_module(f'{package}.{m.name}'), attribute))
  return names


def _constant(module: str, name: str) -> Callable[[], tuple[str, ...]]:
  return lambda: tuple(getattr(importlib.import_module(module), name))


def _mesh(config) -> None:
  sharding.check_mesh_config(config.mesh)


def _axis_rules(config) -> None:
  sharding.check_axis_rules(config.logical_axis_rules)


POSITIVE_INT = Interval(1, what='a count or size, at least 1', integer=True)
COUNT = Interval(0, what='a count, 0 or more', integer=True)
POSITIVE = Interval(0, open_low=True, what='a positive number')
NONNEGATIVE = Interval(0, what='0 or more')
DROPOUT = Interval(0, 1, open_high=True, what='a dropout rate: 1 would drop everything')
PROBABILITY = Interval(0, 1, what='a probability')
DECAY = Interval(0, 1, open_high=True, what="a moment's decay, below 1")
PATH = Free('a path, checked when it is read')
NAME = Free('a name the reader looks up when it reads (TFDS names, splits, features, languages)')

RANGES: dict[str, Any] = {
    # The run.
    'model_name': OneOf(_modules('models', 'Model'), 'a model'),
    'objective': OneOf(_modules('objectives', 'loss_fn'), 'an objective'),
    'seed': Interval(0, what='a seed: numpy takes no negative one', integer=True),
    'init_from': PATH,
    'mesh': Checked(_mesh, (('data', 0), ('fsdp', 1), ('tensor', 1))),
    'logical_axis_rules': Checked(_axis_rules, (('batch', 'pipeline'),)),
    # model: sizes, rates, kinds.
    'model.vocab_size': POSITIVE_INT,
    'model.source_vocab_size': POSITIVE_INT,
    'model.hidden_size': POSITIVE_INT,
    'model.num_layers': POSITIVE_INT,
    'model.num_encoder_layers': POSITIVE_INT,
    'model.num_decoder_layers': POSITIVE_INT,
    'model.num_heads': POSITIVE_INT,
    'model.mlp_dim': POSITIVE_INT,
    'model.max_position_embeddings': POSITIVE_INT,
    'model.type_vocab_size': POSITIVE_INT,
    'bert:model.type_vocab_size': Interval(2, what='segment types, at least A and B',
                                           integer=True),
    'model.word_dim': POSITIVE_INT,
    'model.target_embed_dim': POSITIVE_INT,
    'model.char_dim': POSITIVE_INT,
    'model.max_characters_per_token': Interval(3, what='characters of a token with its begin '
                                                       'and end marks, at least 3', integer=True),
    'model.filters': Each(Each(POSITIVE_INT), nonempty=True),
    'model.num_highway': COUNT,
    'model.projection_dim': POSITIVE_INT,
    'model.lstm_dim': POSITIVE_INT,
    'model.first_lstm_dim': POSITIVE_INT,
    'model.second_lstm_dim': POSITIVE_INT,
    'model.bilstm_dim': POSITIVE_INT,
    'model.task_lstm_dim': POSITIVE_INT,
    'model.task_num_layers': POSITIVE_INT,
    'model.feedforward_dim': POSITIVE_INT,
    'model.integrator_dim': POSITIVE_INT,
    'model.maxout_dims': Each(POSITIVE_INT, nonempty=True),
    'model.maxout_pool_size': POSITIVE_INT,
    'model.cell_clip': Interval(0, what='an LSTM cell clip, 0 for none'),
    'model.proj_clip': Interval(0, what='an LSTM projection clip, 0 for none'),
    'model.num_sampled': Interval(0, what='sampled softmax classes, 0 for the full softmax',
                                  integer=True),
    'model.num_labels': Interval(0, what='classes of the task head (1: regression), 0 for none',
                                 integer=True),
    'bcn:model.num_labels': Interval(2, what="the task's classes", integer=True),
    'elmo_tagger:model.num_labels': Interval(1, what="the task's tags", integer=True),
    'bert_feature_tagger:model.num_labels': Interval(1, what="the task's tags", integer=True),
    'cvt:model.num_labels': Each(POSITIVE_INT, nonempty=True),
    'model.initializer_range': POSITIVE,
    'model.init_scale': POSITIVE,
    'model.layer_norm_eps': POSITIVE,
    'model.dropout_rate': DROPOUT,
    'model.attention_dropout_rate': DROPOUT,
    'model.classifier_dropout_rate': DROPOUT,
    'model.embedding_dropout_rate': DROPOUT,
    'model.feedforward_dropout_rate': DROPOUT,
    'model.integrator_dropout_rate': DROPOUT,
    'model.elmo_dropout_rate': DROPOUT,
    'model.task_dropout_rate': DROPOUT,
    'model.labeled_dropout_rate': DROPOUT,
    'model.unlabeled_dropout_rate': DROPOUT,
    'model.maxout_dropout_rates': Each(DROPOUT),
    'model.elmo_layer': Interval(-1, what='a biLM layer, or -1 for the scalar mix', integer=True),
    'model.dtype': OneOf(lambda: ('auto', 'float32', 'bfloat16', 'float16'), 'a compute dtype'),
    'model.attention': OneOf(_constant('models.layers', 'ATTENTION_KERNELS'), 'an attention'),
    'model.positions': OneOf(_constant('models.transformer', 'POSITIONS'), 'a position kind'),
    'model.char_activation': OneOf(_constant('models.char_cnn', 'ACTIVATIONS'),
                                   'a char CNN activation'),
    'model.feature_layers': OneOf(_constant('models.bert_feature_tagger', 'FEATURE_LAYERS'),
                                  'a combination of layers'),
    'model.head': OneOf(_constant('models.bert', 'HEADS'), 'a head'),
    'model.embedding_dropout': OneOf(_constant('models.gpt', 'EMBEDDING_DROPOUTS'),
                                     'an embedding dropout'),
    'gpt:model.head': OneOf(_constant('models.gpt', 'HEADS'), 'a head'),
    'bert_feature_tagger:model.head': OneOf(lambda: ('tag',), 'a head'),
    # data: what is read, and how it is cut.
    'data.pipeline': OneOf(_constant('input_pipeline', 'PIPELINES'), 'a pipeline'),
    'data.source': OneOf(_constant('input_pipeline.common.sources', 'SOURCES'), 'a text source'),
    'data.pairs': OneOf(_constant('input_pipeline.translation', 'PAIR_SOURCES'),
                        'a source of sentence pairs'),
    'data.tokenizer': OneOf(_constant('input_pipeline.common.sources', 'TOKENIZERS'),
                            'a tokenizer'),
    'data.source_tokenizer': OneOf(lambda: ('words', 'bpe'), 'a source tokenizer'),
    'data.split_words': OneOf(_constant('input_pipeline.common.words', 'SPLITS'),
                              'a way to split words'),
    'data.label_encoding': OneOf(_constant('input_pipeline.tagging', 'ENCODINGS'),
                                 'a tag encoding'),
    'data.task': Checked(input_pipeline.check_config, 'no_such_task'),
    'data.tasks': Checked(input_pipeline.check_config, ('no_such_task',)),
    'data.later_phases': Checked(phases.check, ((1.5, 512, 80, False),)),
    'data.max_seq_length': POSITIVE_INT,
    'data.max_predictions_per_seq': POSITIVE_INT,
    'data.max_characters_per_token': Interval(3, what='characters of a token with its begin and '
                                                      'end marks, at least 3', integer=True),
    'data.masked_lm_prob': Interval(0, 1, open_low=True, what='the share of tokens masked'),
    'data.mask_token_prob': PROBABILITY,
    'data.random_token_prob': PROBABILITY,
    'data.short_seq_prob': PROBABILITY,
    'data.unlabeled_ratio': Interval(0, what='unlabeled batches per labeled one'),
    'data.docs_per_chunk': POSITIVE_INT,
    'data.eval_holdout': Interval(2, what='1 in N documents held out for eval, N at least 2',
                                  integer=True),
    'data.num_choices': POSITIVE_INT,
    'data.offline_max_words': POSITIVE_INT,
    'data.source_vocab_size': POSITIVE_INT,
    'data.max_examples': Interval(0, what='offline examples made, 0 for all', integer=True),
    'data.max_train_examples': Interval(0, what='training examples kept, 0 for all', integer=True),
    'data.max_eval_examples': Interval(0, what='eval examples kept, 0 for all', integer=True),
    'data.doc_stride': POSITIVE_INT,
    'data.max_query_length': POSITIVE_INT,
    'data.n_best_size': POSITIVE_INT,
    'data.max_answer_length': POSITIVE_INT,
    'data.workers': Interval(-1, what='input processes per host, 0 for none, -1 for automatic',
                             integer=True),
    'data.data_dir': PATH, 'data.files': PATH, 'data.eval_files': PATH, 'data.vocab_file': PATH,
    'data.glove_file': PATH, 'data.source_files': PATH, 'data.target_files': PATH,
    'data.eval_source_files': PATH, 'data.eval_target_files': PATH, 'data.tfds_data_dir': PATH,
    'data.tfds_name': NAME, 'data.tfds_split': NAME, 'data.tfds_eval_split': NAME,
    'data.tfds_text_feature': NAME, 'data.source_language': NAME, 'data.target_language': NAME,
    # optimizer.
    'optimizer.name': OneOf(_constant('trainer.optimizer', 'OPTIMIZERS'), 'an optimizer'),
    'optimizer.schedule': OneOf(_constant('trainer.optimizer', 'SCHEDULES'), 'a schedule'),
    'optimizer.learning_rate': POSITIVE,
    'optimizer.warmup_steps': COUNT,
    'optimizer.decay_rate': NONNEGATIVE,
    'optimizer.b1': DECAY,
    'optimizer.b2': DECAY,
    'optimizer.momentum': DECAY,
    'optimizer.eps': POSITIVE,
    'optimizer.weight_decay': NONNEGATIVE,
    'optimizer.clip_norm': Interval(0, what='a global gradient norm, 0 for no clipping'),
    'optimizer.initial_accumulator_value': NONNEGATIVE,
    'optimizer.frozen': Free('parameter paths, checked against the model by '
                             'trainer/optimizer.check_frozen'),
    'optimizer.sparse_rows': Free('parameter paths, checked against the model by '
                                  'trainer/optimizer.check_sparse_rows'),
    # train.
    'train.batch_size': POSITIVE_INT,
    'train.num_steps': POSITIVE_INT,
    'train.grad_accum_steps': POSITIVE_INT,
    'train.log_every': POSITIVE_INT,
    'train.eval_every': POSITIVE_INT,
    'train.checkpoint_every': POSITIVE_INT,
    'train.eval_steps': Interval(0, what='eval batches, 0 for one pass of the eval split',
                                 integer=True),
    'train.keep_checkpoints': POSITIVE_INT,
    # loss.
    'loss.label_smoothing': Interval(0, 1, open_high=True, what="the target's share given to "
                                                                 'the other classes'),
    'loss.lm_coef': NONNEGATIVE,
    'loss.choices': Free('derived from data.task by configs/gpt_finetune.py'),
    'loss.normalize': OneOf(_constant('objectives.seq2seq', 'NORMALIZE'),
                            'a loss normalization'),
    'loss.mix_l2_coef': NONNEGATIVE,
    'loss.gradient_scale': POSITIVE,
    'loss.tasks': Free('data.tasks again (the CVT pipeline checks they are equal)'),
    'loss.span_tags': Free('derived from data.tasks by configs/cvt.py'),
    'loss.to_bio': Free('derived from data.tasks by configs/cvt.py'),
    # decode.
    'decode.beam_size': POSITIVE_INT,
    'decode.alpha': NONNEGATIVE,
    'decode.batch_size': POSITIVE_INT,
    'decode.max_extra_length': COUNT,
    'decode.bleu_examples': Interval(0, what='eval pairs translated at each eval, 0 for none',
                                     integer=True),
}


def leaves(config, prefix: str = '') -> list[tuple[str, Any]]:
  """(dotted path, value) of every field of a ConfigDict."""
  found = []
  for key, value in config.items():
    if hasattr(value, 'items'):
      found += leaves(value, f'{prefix}{key}.')
    else:
      found.append((f'{prefix}{key}', value))
  return found


def rule(config, path: str) -> Any:
  """The table's entry for `path` in this config (its model's own first); None without one."""
  return RANGES.get(f'{config.get("model_name")}:{path}', RANGES.get(path))


def check(config) -> None:
  """ValueError in one line naming the first field outside its range, its value and the fix;
  the fields checked by the code that reads them come last, once each other field is in range."""
  checked = []
  # Top-level fields first: the model's own entries depend on model_name.
  for path, value in sorted(leaves(config), key=lambda leaf: '.' in leaf[0]):
    entry = rule(config, path)
    if entry is None or value is None or isinstance(value, bool):
      continue  # unset fields come from init_from first (trainer.checks.inherit_unset_fields)
    if isinstance(entry, Checked):
      checked.append((path, value, entry))
      continue
    problem = entry.problem(value, path)
    if problem:
      raise ValueError(problem)
  for check_fn in dict.fromkeys(entry.check for _, _, entry in checked):  # each reader once
    check_fn(config)
