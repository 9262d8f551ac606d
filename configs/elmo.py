"""ELMo biLM pretraining: char-CNN tokens, forward and backward LSTM LMs (Peters et al. 2018, sec. 3).

    python train.py --config=configs/elmo.py:tiny --workdir=runs/elmo_tiny
    python train.py --config=configs/elmo.py --workdir=runs/elmo \
        --config.data.source=tfds --config.data.tfds_name=lm1b \
        --config.data.split_words=spaces                          # the paper's size and data
    python extract_features.py --workdir=runs/elmo_tiny --input=sentences.txt --output=features.h5

Every field can be overridden, e.g. `--config.model.num_sampled=0` (full softmax).
"""

import ml_collections

from configs import common

# The released ELMo (bilm-tf options.json and train_elmo.py): 2048 char-CNN
# filters, 2 highway layers, 4096-cell LSTMs projected to 512, a 793,471-word
# vocabulary (1B Word Benchmark) with 8192 sampled classes, 3 GPUs x 128
# windows of 20 tokens, Adagrad at 0.2 for 10 epochs of 768.6M tokens
# (10 * 768,648,884 / (384 * 20) = 1,000,845 steps).
FULL_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))

VARIANTS = {
    'tiny': dict(filters=((1, 16), (2, 16), (3, 32), (4, 64)), projection_dim=128, lstm_dim=256,
                 vocab_size=8192, num_sampled=0, max_seq_length=20, batch_size=32,
                 num_steps=600, learning_rate=0.2),
    'small': dict(filters=((1, 32), (2, 32), (3, 64), (4, 128), (5, 256)), projection_dim=256,
                  lstm_dim=1024, vocab_size=100_000, num_sampled=4096, max_seq_length=20,
                  batch_size=128, num_steps=200_000, learning_rate=0.2),
    'base': dict(filters=FULL_FILTERS, projection_dim=512, lstm_dim=4096, vocab_size=793_471,
                 num_sampled=8192, max_seq_length=20, batch_size=384, num_steps=1_000_845,
                 learning_rate=0.2),
}


def model_config(v: dict) -> ml_collections.ConfigDict:
  """The biLM's fields for a variant (shared with configs/elmo_tagger.py)."""
  model = ml_collections.ConfigDict()
  model.vocab_size = v['vocab_size']  # the softmax's words; the learned vocabulary may be smaller
  model.char_dim = 16
  model.max_characters_per_token = 50
  model.filters = v['filters']  # (width, count) per convolution
  model.num_highway = 2
  model.projection_dim = v['projection_dim']  # token layer and LSTM projection width
  model.lstm_dim = v['lstm_dim']  # LSTM cells
  model.num_layers = 2
  model.cell_clip = 3.0
  model.proj_clip = 3.0
  model.skip_connections = True  # residual around the LSTM layers after the first
  model.char_activation = 'relu'
  model.dropout_rate = 0.1
  model.num_sampled = v['num_sampled']  # sampled softmax classes in training; 0 = full softmax
  model.sample_unique = True  # sample without replacement, as TF's sampled_softmax_loss
  model.dtype = 'auto'  # compute dtype: auto = float32 on CPU, bfloat16 on TPU/GPU
  return model


def data_config(v: dict) -> ml_collections.ConfigDict:
  """Word vocabulary and character ids from the configured text (shared with the tagger)."""
  data = ml_collections.ConfigDict()
  data.pipeline = 'bilm'  # a module of input_pipeline/
  common.set_text_source(data)
  data.tokenizer = 'words'  # a word vocabulary for the softmax, characters for the input
  data.vocab_file = ''  # words.txt, one word per line; empty learns one from the training text
  data.lower_case = False  # ELMo is cased
  # 'punctuation' splits raw text's punctuation off its words; 'spaces' keeps the tokens of text
  # tokenized already (lm1b, as bilm-tf reads it; a converted release's input).
  data.split_words = 'punctuation'
  data.max_seq_length = v['max_seq_length']  # tokens per window (bilm-tf's unroll_steps)
  data.max_characters_per_token = 50
  data.docs_per_chunk = 2000  # windows are cut and shuffled within chunks of documents
  return data


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  v = VARIANTS[arg]

  config = ml_collections.ConfigDict()
  config.model_name = 'elmo'
  config.objective = 'bilm'
  config.seed = 0
  config.model = model_config(v)
  config.data = data_config(v)

  config.loss = ml_collections.ConfigDict()
  # bilm-tf differentiates the loss times unroll_steps (bilm/training.py); metrics are unscaled.
  config.loss.gradient_scale = float(v['max_seq_length'])

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = 'adagrad'  # bilm-tf: Adagrad, lr 0.2, accumulators start at 1.0
  config.optimizer.learning_rate = v['learning_rate']
  config.optimizer.initial_accumulator_value = 1.0
  config.optimizer.eps = 1e-7
  config.optimizer.schedule = 'constant'
  config.optimizer.warmup_steps = 0
  config.optimizer.clip_norm = 10.0  # bilm-tf clips the global gradient norm at 10

  config.train = common.pretraining_schedule(v['batch_size'], v['num_steps'], arg == 'tiny')
  if arg == 'tiny':
    config.data.eval_holdout = common.TINY_EVAL_HOLDOUT
  common.set_mesh_and_rules(config)
  return config
