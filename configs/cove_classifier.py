"""The Biattentive Classification Network on [GloVe(w); CoVe(w)] from a CoVe run (McCann et al. 2017, sec. 5).

    python train.py --config=configs/cove_classifier.py:offline_shuffled,tiny \
        --config.init_from=runs/cove_tiny --workdir=runs/bcn_tiny
    python train.py --config=configs/cove_classifier.py:sst2 --config.init_from=runs/cove \
        --workdir=runs/bcn_sst2
    # GloVe alone, the paper's baseline (the word vectors still come from the CoVe run):
    python train.py --config=configs/cove_classifier.py:snli --config.init_from=runs/cove \
        --config.model.use_cove=False --workdir=runs/bcn_snli_glove

The argument is `task[,size]`; size (tiny or base; default base) must be the
configs/cove.py variant of the run in init_from, whose word vectors, encoder
and word vocabulary the BCN reads (train.py checks the sizes against it).
Tasks: input_pipeline/word_classification.py (GLUE and SNLI from TFDS; the
offline tasks offline_shuffled, offline_next, offline_same_doc).
"""

import math

import ml_collections

from configs import common
from configs import gpt_finetune
from input_pipeline import word_classification

# The CoVe encoder of each configs/cove.py variant: vocab_size is its source words
# (model.source_vocab_size there).
COVE = {
    'tiny': dict(vocab_size=4000, word_dim=50, hidden_size=64, num_encoder_layers=2),
    'base': dict(vocab_size=100_000, word_dim=300, hidden_size=300, num_encoder_layers=2),
}
# The BCN's sizes. base: AllenNLP's reproduction of the paper's model (300-d ReLU layer and
# biLSTMs, maxout 1200 and 600 with pool size 4).
BCN = {
    'tiny': dict(feedforward_dim=64, bilstm_dim=64, integrator_dim=64, maxout_dims=(128, 64)),
    'base': dict(feedforward_dim=300, bilstm_dim=300, integrator_dim=300,
                 maxout_dims=(1200, 600)),
}
# A power of two near the reproduction's 100, so that it divides the usual meshes.
BATCH_SIZE = 64
# Adam at 1e-3 as the reproduction; the paper stopped on dev accuracy, this runs fixed epochs.
LEARNING_RATE = 1e-3
EPOCHS = 5
# Offline tasks are small; their step count for a run of a few minutes on a CPU.
OFFLINE_STEPS = 300
# Words per text: the offline sentences are short; 64 keeps nearly every SST and SNLI text whole.
MAX_SEQ_LENGTH = {'offline': 32, 'tfds': 64}


def get_config(arg: str = 'offline_shuffled') -> ml_collections.ConfigDict:
  task, _, size = arg.partition(',')
  size = size or 'base'
  if size not in COVE:
    raise ValueError(f'Unknown size {size!r}: use one of {", ".join(COVE)}, the configs/cove.py '
                     'variant of the run in init_from.')
  spec = word_classification.task_spec(task)

  config = ml_collections.ConfigDict()
  config.model_name = 'bcn'
  # The objective of GPT's fine-tuning heads: with no LM logits it is exactly the mean
  # cross-entropy over the examples, with accuracy (and F1, Matthews for two labels).
  config.objective = 'gpt_finetune'
  config.seed = 0
  config.init_from = ''  # required: the workdir of a configs/cove.py run of the same size
  # A start from a run stopped before its train.num_steps is refused unless this is set.
  config.allow_unfinished_init_from = False

  model = config.model = ml_collections.ConfigDict()
  for field, value in COVE[size].items():
    model[field] = value  # checked against init_from's config.json
  model.use_cove = True  # False: GloVe(w) alone, the paper's baseline
  model.num_labels = spec.num_labels
  for field, value in BCN[size].items():
    model[field] = value
  model.maxout_pool_size = 4
  model.embedding_dropout_rate = 0.25
  model.feedforward_dropout_rate = 0.25
  model.integrator_dropout_rate = 0.1
  model.maxout_dropout_rates = (0.2, 0.3)
  model.dtype = 'auto'

  data = config.data = ml_collections.ConfigDict()
  data.pipeline = 'word_classification'
  data.task = task
  data.max_seq_length = MAX_SEQ_LENGTH[spec.source]
  # The CoVe run's casing (its config.json's: the release's and base's lower-case, tiny's not).
  data.lower_case = ml_collections.FieldReference(None, field_type=bool)
  # The CoVe run's word split (its config.json's; 'spaces' for a converted release).
  data.split_words = ml_collections.FieldReference(None, field_type=str)
  data.max_examples = 20_000  # offline tasks: examples made from the embedded corpus
  data.eval_holdout = 10 if spec.source == 'offline' else 100
  data.data_dir = ''  # cache of the embedded corpus; '' = ~/.cache/lm_lineage
  data.tfds_data_dir = ''

  if spec.source == 'offline':
    num_steps = OFFLINE_STEPS
  elif task in gpt_finetune.TRAIN_EXAMPLES:
    num_steps = math.ceil(EPOCHS * gpt_finetune.TRAIN_EXAMPLES[task] / BATCH_SIZE)
  else:
    raise ValueError(f'configs/gpt_finetune.py has no training-set size for {task!r}: add it '
                     'to TRAIN_EXAMPLES.')

  opt = config.optimizer = ml_collections.ConfigDict()
  opt.name = 'adamw'  # with weight_decay 0: Adam, as the paper trained the BCN
  opt.learning_rate = LEARNING_RATE
  opt.schedule = 'constant'
  opt.warmup_steps = 0
  opt.b1, opt.b2, opt.eps = 0.9, 0.999, 1e-8
  opt.weight_decay = 0.0
  opt.clip_norm = 5.0
  opt.frozen = ('word_vectors', 'encoder')  # GloVe and CoVe stay as the CoVe run left them

  config.train = common.finetuning_schedule(BATCH_SIZE, num_steps)
  common.set_mesh_and_rules(config)
  return config
