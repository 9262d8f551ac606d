"""BERT's feature-based approach: a 2-layer biLSTM tagger over a frozen BERT (Devlin et al. 2018,
sec. 5.3, table 7).

    python train.py --config=configs/bert_feature_tagger.py:conll2003 --config.init_from=DIR \
        --config.model.feature_layers=concat_last_four --workdir=RUN
    python train.py --config=configs/bert_feature_tagger.py:offline_capitalized \
        --config.init_from=runs/bert_tiny --config.model.feature_layers=last \
        --config.model.task_lstm_dim=128 --workdir=runs/bert_tiny_features

The argument is `task[,size]` as in configs/bert_finetune.py (a tagging task:
conll2003 from TFDS, or offline_capitalized / offline_replaced from the
embedded corpus; sizes and casing from init_from unless a size is given).
model.feature_layers picks the row of table 7: embeddings, second_to_last,
last, sum_last_four, concat_last_four or sum_all (the last-four rows need a
BERT of 4 layers or more: mini, base, large). Running each of the six
against the fine-tuning run of configs/bert_finetune.py on the same task
reproduces the paper's comparison. BERT stays frozen (optimizer.frozen);
only the biLSTM and the classifier learn.
"""

import ml_collections

from configs import bert_finetune
from input_pipeline import bert_finetune as pipeline

# The paper does not give the task model's optimizer; Adam at 1e-3 is the usual rate of a
# biLSTM tagger over fixed features (as configs/elmo_tagger.py).
LEARNING_RATE = 1e-3


def get_config(arg: str = 'offline_capitalized') -> ml_collections.ConfigDict:
  task_name = arg.partition(',')[0]
  if not pipeline.is_tagging(pipeline.task_spec(task_name)):
    raise ValueError(f'{task_name!r} is not a tagging task: use conll2003, offline_capitalized or '
                     'offline_replaced (configs/bert_finetune.py fine-tunes the others).')
  config = bert_finetune.get_config(arg)
  config.model_name = 'bert_feature_tagger'
  config.model.feature_layers = 'concat_last_four'  # table 7's best row
  config.model.task_lstm_dim = 768  # "a two-layer 768-dimensional BiLSTM" (sec. 5.3)
  config.model.task_num_layers = 2
  config.model.task_dropout_rate = 0.5
  config.optimizer.frozen = ('bert',)
  config.optimizer.learning_rate = LEARNING_RATE
  return config
