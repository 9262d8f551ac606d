"""Cross-View Training: a biLSTM tagger taught by labeled and unlabeled sentences (Clark et al. 2018).

    python train.py --config=configs/cvt.py:tiny --workdir=runs/cvt_tiny
    python train.py --config=configs/cvt.py:conll2003 --workdir=runs/cvt_ner
    python train.py --config=configs/cvt.py:multitask --workdir=runs/cvt_multitask
    # the supervised-only baseline: the same model, no unlabeled batches
    python train.py --config=configs/cvt.py:tiny --config.data.unlabeled_ratio=0 \
        --workdir=runs/cvt_tiny_supervised

Variants:
  tiny               the offline synthetic NER task (input_pipeline/tasks/synthetic_tagging.py)
                     with 200 labeled sentences and its unlabeled text; minutes on a CPU.
  tiny_multitask     its names and part-of-speech tasks sharing one encoder.
  conll2003          CoNLL 2003 NER from TFDS, unlabeled sentences from lm1b (the 1 Billion
                     Word Benchmark, the paper's unlabeled data) in TFDS; change
                     data.source / data.files / data.tfds_name for other text.
  multitask          CoNLL 2003's NER, part-of-speech and chunk columns as three tasks.
The model and optimizer of the full variants are cvt_text's (research/cvt_text
base/configure.py): GloVe-sized 300-dim words (learned here), char CNN of widths
2-4 x 100, biLSTMs of 1024 and 512 cells projected to 512, SGD with momentum
0.9 at 0.5 with 5000 warmup steps and 1 / (1 + 0.005 sqrt(step)) decay.
"""

import ml_collections

from configs import common
from input_pipeline import tagging

VARIANTS = {
    'tiny': dict(tasks=('offline_names',), size='tiny'),
    'tiny_multitask': dict(tasks=('offline_names', 'offline_pos'), size='tiny'),
    'conll2003': dict(tasks=('conll2003',), size='base'),
    'multitask': dict(tasks=('conll2003', 'conll2003_pos', 'conll2003_chunk'), size='base'),
}
MODELS = {
    'tiny': dict(vocab_size=8192, word_dim=32, char_dim=16, filters=((2, 16), (3, 16), (4, 16)),
                 first_lstm_dim=64, second_lstm_dim=64, projection_dim=64),
    'base': dict(vocab_size=100_000, word_dim=300, char_dim=50,
                 filters=((2, 100), (3, 100), (4, 100)), first_lstm_dim=1024,
                 second_lstm_dim=512, projection_dim=512),
}


def get_config(arg: str = 'conll2003') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  tasks, size = VARIANTS[arg]['tasks'], VARIANTS[arg]['size']
  tiny = size == 'tiny'
  encoding = 'BIOES'  # cvt_text's label encoding for entity tasks; spans are scored as BIO

  config = ml_collections.ConfigDict()
  config.model_name = 'cvt'
  config.objective = 'consistency'
  config.seed = 0

  config.model = ml_collections.ConfigDict(MODELS[size])
  config.model.num_labels = tuple(tagging.num_labels(tagging.task_spec(t), encoding)
                                  for t in tasks)
  # cvt_text's max_word_length of 20 characters, and the begin- and end-of-word markers.
  config.model.max_characters_per_token = 22
  config.model.labeled_dropout_rate = 0.5  # cvt_text: keep_prob 0.5 on labeled batches
  config.model.unlabeled_dropout_rate = 0.2  # and 0.8 for the students on unlabeled ones
  config.model.dtype = 'auto'

  config.loss = ml_collections.ConfigDict()
  config.loss.tasks = tasks
  config.loss.span_tags = tuple(tagging.span_tags(tagging.task_spec(t)) for t in tasks)
  config.loss.to_bio = tuple(tagging.to_bio_ids(tagging.task_spec(t), encoding) for t in tasks)
  config.loss.label_smoothing = 0.1  # cvt_text's, on gold labels only (not the soft targets)

  config.data = ml_collections.ConfigDict()
  config.data.pipeline = 'cvt'
  config.data.tasks = tasks
  config.data.label_encoding = encoding
  config.data.unlabeled_ratio = 1.0  # unlabeled batches per labeled one; 0 = supervised only
  config.data.max_train_examples = 200 if tiny else 0  # labeled sentences per task (0 = all)
  config.data.max_eval_examples = 1000 if tiny else 0
  config.data.max_seq_length = 32 if tiny else 128  # CoNLL 2003's longest sentence: 124 words
  config.data.max_characters_per_token = config.model.max_characters_per_token
  config.data.tokenizer = 'words'
  config.data.vocab_file = ''  # learned from the unlabeled text when empty
  config.data.lower_case = False
  # Word ids of lower-cased words, each digit 0 (cvt_text's normalize_word: 'Paris' and 'paris'
  # one vector, every year '0000'); the char CNN still reads the word as written.
  config.data.normalize_words = True
  config.data.docs_per_chunk = 100 if tiny else 1000
  common.set_text_source(config.data)  # the unlabeled text
  if tiny:
    config.data.source = 'synthetic'
    config.data.split_words = 'punctuation'  # input_pipeline/common/words.py
  else:
    config.data.source = 'tfds'
    config.data.tfds_name = 'lm1b'
    config.data.tfds_eval_split = 'test'
    config.data.split_words = 'spaces'  # lm1b is tokenized already, as cvt_text reads it

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = 'sgd'
  config.optimizer.momentum = 0.9
  config.optimizer.learning_rate = 0.5
  config.optimizer.schedule = 'inverse_sqrt'
  config.optimizer.warmup_steps = 100 if tiny else 5000
  config.optimizer.decay_rate = 0.005
  config.optimizer.clip_norm = 1.0
  # A module outside a step's loss (the primary ones on unlabeled batches, the auxiliary ones
  # on labeled batches) keeps its weights and momentum, as TF leaves them in cvt_text.
  config.optimizer.skip_without_gradient = True
  # And a word or character not in a step's batch keeps its row and momentum: cvt_text reads
  # the tables by embedding_lookup, whose gradients TF's momentum applies row by row.
  config.optimizer.sparse_rows = ('encoder/word_embed/embedding', 'encoder/char_cnn/char_embed')

  batch_size = 32 if tiny else 64
  # Tiny: 1600 steps (800 labeled, 800 unlabeled). At 800 the auxiliary modules had not
  # learned enough to teach: CVT 0.915-0.938 against supervised only 0.922-0.928; at 1600,
  # 0.985 against 0.917 (one device, at d85723d's optimizer).
  config.train = common.finetuning_schedule(batch_size, 1600 if tiny else 200_000)
  if not tiny:
    config.train.eval_every = 5000  # cvt_text evaluates on dev every 500 steps
  common.set_mesh_and_rules(config)
  return config
