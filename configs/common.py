"""Config parts shared by every experiment."""

import ml_collections


def set_mesh_and_rules(config: ml_collections.ConfigDict) -> None:
  """The device mesh, the logical-axis rules and the host's input workers of every model."""
  # Processes per host that make the training input (input_pipeline/common/workers.py); any
  # number gives the same batches. -1: none on a CPU run, else up to 4 per local accelerator.
  if 'data' in config:  # a step-only config (tests) has none
    config.data.workers = -1
  # Mesh axis sizes; -1 takes the remaining devices.
  config.mesh = (('data', -1), ('fsdp', 1), ('tensor', 1))
  # Logical axis -> mesh axes. Parameters shard over fsdp (embed) and tensor
  # (vocab, heads, mlp); the batch over data and fsdp.
  config.logical_axis_rules = (
      ('batch', ('data', 'fsdp')),
      ('vocab', 'tensor'),
      ('embed', 'fsdp'),
      ('mlp', 'tensor'),
      ('heads', 'tensor'),
      ('kv', None),
      ('length', None),
      ('act_embed', None),
      ('act_mlp', 'tensor'),
      ('act_heads', 'tensor'),
      ('cell', 'tensor'),  # LSTM cells (ELMo, CVT, CoVe)
      ('filters', None),  # char-CNN filters
  )


# A tiny pretraining run's eval split: 1 in 10 documents of the embedded corpus, so that its eval
# (train.eval_steps batches) reads each held-out example once at most (1 in 100 had 49 of BERT's
# 128-token instances for its 320 rows).
TINY_EVAL_HOLDOUT = 10


def pretraining_schedule(batch_size: int, num_steps: int, tiny: bool) -> ml_collections.ConfigDict:
  """config.train of a pretraining run; tiny runs log, evaluate and checkpoint more often."""
  train = ml_collections.ConfigDict()
  train.batch_size = batch_size  # global, across all hosts and devices
  train.num_steps = num_steps
  train.grad_accum_steps = 1
  train.log_every = 20 if tiny else 100
  train.eval_every = 200 if tiny else 10_000
  train.eval_steps = 10 if tiny else 100
  train.checkpoint_every = 200 if tiny else 10_000
  train.keep_checkpoints = 3
  return train


def finetuning_schedule(batch_size: int, num_steps: int) -> ml_collections.ConfigDict:
  """config.train of a fine-tuning run: the whole eval split once, at the end."""
  train = ml_collections.ConfigDict()
  train.batch_size = batch_size
  train.num_steps = num_steps
  train.grad_accum_steps = 1
  train.log_every = 20 if num_steps < 2000 else 100
  train.eval_every = num_steps  # at the end; eval_steps = 0 takes the whole eval split
  train.eval_steps = 0
  train.checkpoint_every = min(num_steps, 1000)
  train.keep_checkpoints = 2
  return train


def set_text_source(data: ml_collections.ConfigDict) -> None:
  """The fields naming the training text: the embedded corpus by default, or files, or TFDS."""
  data.source = 'embedded'  # 'embedded' | 'files' | 'tfds'
  data.files = ''  # glob, reference format: one sentence per line, blank line between documents
  data.eval_files = ''  # glob; empty holds out every eval_holdout-th document of `files`
  data.tfds_name = ''  # e.g. 'wikipedia/20230601.en' or 'lm1b'
  data.tfds_split = 'train'
  data.tfds_eval_split = ''  # empty holds out every eval_holdout-th document of tfds_split
  data.tfds_text_feature = 'text'
  data.tfds_data_dir = ''
  data.eval_holdout = 100  # 1 in N documents go to the eval split
  data.data_dir = ''  # cache for the embedded corpus and learned vocabularies; '' = ~/.cache/lm_lineage


def translation_data(tiny: bool, tfds_name: str, max_seq_length: int) -> ml_collections.ConfigDict:
  """config.data of a translation run: English to German pairs from TFDS, or the offline task."""
  data = ml_collections.ConfigDict()
  data.pipeline = 'translation'
  data.pairs = 'offline' if tiny else 'tfds'
  data.source_language = 'en'
  data.target_language = 'de'
  data.source_files = ''  # with data.pairs='files': globs of line-aligned text
  data.target_files = ''
  data.eval_source_files = ''
  data.eval_target_files = ''
  data.offline_max_words = 12  # the offline task's longest sentence, in words
  data.tokenizer = 'bpe'
  data.vocab_file = ''  # a tokenizer.json; empty learns one from both sides of the pairs
  data.lower_case = False
  data.max_seq_length = max_seq_length  # tokens of a row, each side
  data.docs_per_chunk = 2000 if tiny else 100_000  # pairs shuffled (and packed) together
  set_text_source(data)  # the offline task's English text (the embedded corpus)
  if not tiny:
    data.tfds_name = tfds_name
    data.tfds_split = 'train'
    data.tfds_eval_split = 'validation'
  data.eval_holdout = 20 if tiny else 100
  return data


# The model fields that a fine-tuning run takes from its init_from when no size is given.
PRETRAINED_SIZE_FIELDS = ('vocab_size', 'hidden_size', 'num_layers', 'num_heads', 'mlp_dim',
                          'max_position_embeddings', 'type_vocab_size', 'initializer_range',
                          'layer_norm_eps')


def take_sizes_from_init(config: ml_collections.ConfigDict,
                         fields: tuple[str, ...] = PRETRAINED_SIZE_FIELDS) -> None:
  """Leaves the pretrained model's sizes, data.lower_case and data.split_words (where the
  config has it) unset (None, typed, so the command line can still set them); train.py fills
  them from config.init_from before any check."""
  for field in fields:
    if field in config.model:
      value = config.model[field]
      config.model[field] = ml_collections.FieldReference(None, field_type=type(value))
  config.data.lower_case = ml_collections.FieldReference(None, field_type=bool)
  if 'split_words' in config.data:
    config.data.split_words = ml_collections.FieldReference(None, field_type=str)
