"""BERT pretraining (MLM + NSP), Devlin et al. 2018, section 3.1 and appendix A.2: 90% of the
steps at 128 tokens, then 10% at 512 (data.later_phases), in one run.

    python train.py --config=configs/bert_base.py:tiny --workdir=runs/bert_tiny
    python train.py --config=configs/bert_base.py --workdir=runs/bert_base
    python train.py --config=configs/bert_base.py:large --workdir=runs/bert_large

Every field can be overridden, e.g. `--config.optimizer.learning_rate=5e-5`.
"""

import ml_collections

from configs import common

# Sizes and schedules per variant (Devlin et al. 2018, sec. 3 and appendix A.2).
VARIANTS = {
    'tiny': dict(num_layers=2, hidden_size=128, num_heads=2, mlp_dim=512, vocab_size=4096,
                 batch_size=32, num_steps=600, warmup_steps=60, learning_rate=1e-3),
    'mini': dict(num_layers=4, hidden_size=256, num_heads=4, mlp_dim=1024, vocab_size=30522,
                 batch_size=32, num_steps=100_000, warmup_steps=10_000, learning_rate=1e-4),
    'base': dict(num_layers=12, hidden_size=768, num_heads=12, mlp_dim=3072, vocab_size=30522,
                 batch_size=256, num_steps=1_000_000, warmup_steps=10_000, learning_rate=1e-4),
    'large': dict(num_layers=24, hidden_size=1024, num_heads=16, mlp_dim=4096, vocab_size=30522,
                  batch_size=256, num_steps=1_000_000, warmup_steps=10_000, learning_rate=1e-4),
}


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  v = VARIANTS[arg]

  config = ml_collections.ConfigDict()
  config.model_name = 'bert'
  config.objective = 'mlm_nsp'
  config.seed = 0

  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = v['vocab_size']
  config.model.hidden_size = v['hidden_size']
  config.model.num_layers = v['num_layers']
  config.model.num_heads = v['num_heads']
  config.model.mlp_dim = v['mlp_dim']
  config.model.max_position_embeddings = 512
  config.model.type_vocab_size = 2
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.1
  config.model.initializer_range = 0.02
  config.model.layer_norm_eps = 1e-12
  config.model.dtype = 'auto'  # compute dtype: auto = float32 on CPU, bfloat16 on TPU/GPU
  # auto: TPU flash or GPU cuDNN without attention dropout; with it, our Triton kernel on GPUs.
  config.model.attention = 'auto'
  config.model.scan_layers = False  # halves compile time at 24 layers, slower steps on CPU
  config.model.remat = False

  config.data = ml_collections.ConfigDict()
  config.data.pipeline = 'bert_pretraining'  # a module of input_pipeline/
  common.set_text_source(config.data)
  config.data.tokenizer = 'wordpiece'  # 'wordpiece' | 'bpe' (byte-level)
  config.data.vocab_file = ''  # empty learns a WordPiece vocabulary of model.vocab_size from the training text
  config.data.lower_case = True
  config.data.max_seq_length = 128  # the first phase: the paper's first 90% of steps
  config.data.max_predictions_per_seq = 20  # the reference's 20 (about 0.15 x 128; 80 for 512)
  # The phases after the first (trainer/phases.py): (from this fraction of train.num_steps,
  # max_seq_length, max_predictions_per_seq, model.remat). The paper's last 10% at 512 tokens
  # "to learn the positional embeddings" (sec. A.2); remat makes that step fit a TPU v4-8.
  # () trains one phase.
  config.data.later_phases = ((0.9, 512, 80, arg in ('base', 'large')),)
  config.data.masked_lm_prob = 0.15
  config.data.mask_token_prob = 0.8  # of the chosen tokens: 80% [MASK], then half random, half kept
  config.data.random_token_prob = 0.1
  config.data.short_seq_prob = 0.1
  config.data.next_sentence_prediction = True
  config.data.whole_word_masking = False
  config.data.docs_per_chunk = 2000  # instances are built and shuffled within chunks of documents

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = v['learning_rate']
  config.optimizer.warmup_steps = v['warmup_steps']
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.999
  config.optimizer.eps = 1e-6
  config.optimizer.weight_decay = 0.01
  config.optimizer.clip_norm = 1.0

  config.train = common.pretraining_schedule(v['batch_size'], v['num_steps'], arg == 'tiny')
  if arg == 'tiny':
    config.data.eval_holdout = common.TINY_EVAL_HOLDOUT

  common.set_mesh_and_rules(config)
  return config
