"""A biLSTM tagger on ELMo from a frozen biLM, with learned layer weights (Peters et al. 2018, sec. 3.3).

    python train.py --config=configs/elmo_tagger.py:conll2003 --config.init_from=runs/elmo \
        --workdir=runs/elmo_ner
    python train.py --config=configs/elmo_tagger.py:offline_replaced,tiny \
        --config.init_from=runs/elmo_tiny --workdir=runs/elmo_tiny_replaced
    # the same task model without ELMo, the baseline:
    python train.py --config=configs/elmo_tagger.py:offline_replaced,tiny \
        --config.model.use_elmo=False --workdir=runs/tiny_replaced_baseline

The argument is `task[,size]`. Without a size the biLM's sizes come from
init_from (a configs/elmo.py run, or a release converted by
`convert_checkpoint.py --from=bilm`) and the task model is base's; a size
(tiny, small, base) must be the one the biLM in init_from was trained with.
The word vocabulary comes from the init_from workdir. Tasks: see
input_pipeline/tagging.py TASKS.
"""

import ml_collections

from configs import common
from configs import elmo
from input_pipeline import tagging

BATCH_SIZE = 32
EPOCHS = {'conll2003': 10, 'offline_replaced': 4}
# Adam as allennlp's NER model; the tiny task model learns faster at a higher rate.
LEARNING_RATES = {'tiny': 3e-3}
# Task model sizes. base: the paper's NER model (sec. 5.1 and its supplement):
# 2 biLSTM layers of 200 cells per direction on 50-dim words (GloVe in the paper).
TASK_MODEL = {
    'tiny': dict(word_dim=50, task_lstm_dim=64, task_num_layers=1),
    'small': dict(word_dim=50, task_lstm_dim=200, task_num_layers=2),
    'base': dict(word_dim=50, task_lstm_dim=200, task_num_layers=2),
}
# The biLM's fields taken from config.init_from when no size is given.
BILM_SIZE_FIELDS = ('vocab_size', 'char_dim', 'max_characters_per_token', 'filters', 'num_highway',
                    'projection_dim', 'lstm_dim', 'num_layers', 'cell_clip', 'proj_clip',
                    'skip_connections', 'char_activation')
# Longest sentence in tokens, <S> and </S> included (CoNLL-2003's longest has 124 words).
MAX_SEQ_LENGTH = {'conll2003': 128, 'offline_replaced': 32}


def get_config(arg: str = 'offline_replaced') -> ml_collections.ConfigDict:
  task, _, size = arg.partition(',')
  if size and size not in elmo.VARIANTS:
    raise ValueError(f'Unknown size {size!r}: use one of {", ".join(elmo.VARIANTS)}, the size of '
                     'the biLM in init_from, or none to take its sizes from init_from.')
  spec = tagging.task_spec(task)
  v = elmo.VARIANTS[size or 'base']

  config = ml_collections.ConfigDict()
  config.model_name = 'elmo_tagger'
  config.objective = 'tagging'
  config.seed = 0
  config.init_from = ''  # workdir of an ELMo pretraining run (configs/elmo.py, same size)
  # A start from a run stopped before its train.num_steps is refused unless this is set.
  config.allow_unfinished_init_from = False

  config.model = elmo.model_config(v)  # the biLM's fields, checked against init_from's
  config.model.num_labels = spec.num_labels
  config.model.use_elmo = True  # False: the same task model without ELMo
  config.model.elmo_at_output = False  # also [h_k; ELMo_k] at the biLSTM's output
  config.model.elmo_top_only = False  # ELMo = gamma * top layer instead of the scalar mix
  config.model.elmo_layer = -1  # >= 0: gamma * that biLM layer alone (0 = char-CNN tokens)
  config.model.elmo_layer_norm = False
  config.model.elmo_dropout_rate = 0.5
  for field, value in TASK_MODEL[size or 'base'].items():
    config.model[field] = value
  config.model.task_dropout_rate = 0.5

  config.loss = ml_collections.ConfigDict()
  config.loss.mix_l2_coef = 0.001  # lambda of sec. 3.2; large values make the mix an average
  config.loss.span_tags = tagging.span_tags(spec)  # (B-X, I-X) ids per type: span F1

  config.data = elmo.data_config(v)
  config.data.pipeline = 'tagging'
  config.data.task = task
  config.data.max_seq_length = MAX_SEQ_LENGTH.get(task, 128)
  config.data.max_train_examples = 3000  # offline tasks: sentences made from the embedded corpus
  config.data.max_eval_examples = 500

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = 'adamw'
  config.optimizer.learning_rate = LEARNING_RATES.get(size, 1e-3)
  config.optimizer.warmup_steps = 0
  config.optimizer.schedule = 'constant'
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.999
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.0
  config.optimizer.clip_norm = 5.0
  config.optimizer.frozen = ('bilm',)  # the biLM's weights are fixed (sec. 3.3)

  if not size:  # the biLM's sizes, filled in from config.init_from by train.py
    common.take_sizes_from_init(config, BILM_SIZE_FIELDS)
    config.data.max_characters_per_token = config.model.get_ref('max_characters_per_token')
  num_steps = -(-EPOCHS.get(task, 10) * spec.train_examples(config.data) // BATCH_SIZE)
  config.train = common.finetuning_schedule(BATCH_SIZE, num_steps)
  common.set_mesh_and_rules(config)
  return config
