"""GPT pretraining: a causal Transformer LM on contiguous text (Radford et al. 2018, sec. 3.1, 4.1).

    python train.py --config=configs/gpt.py:tiny --workdir=runs/gpt_tiny
    python train.py --config=configs/gpt.py --workdir=runs/gpt        # GPT-1 size
    python generate.py --workdir=runs/gpt_tiny --prompt="Return the"

Every field can be overridden, e.g. `--config.data.tokenizer=wordpiece`.
"""

import ml_collections

from configs import common

# Sizes and schedules per variant. GPT-1 (sec. 4.1): 12 layers, 768 wide, 12
# heads, 3072 inner, 512 positions, a 40,000-merge BPE, 64 x 512 tokens per
# step, Adam at 2.5e-4 with 2000 warmup steps then cosine annealing to 0. The
# paper trains 100 epochs of BooksCorpus; base's num_steps is a placeholder:
# 100 epochs are 100 * (corpus tokens) / 32,768 steps.
VARIANTS = {
    'tiny': dict(num_layers=2, hidden_size=128, num_heads=2, mlp_dim=512, vocab_size=4096,
                 max_seq_length=128, batch_size=32, num_steps=600, warmup_steps=60,
                 learning_rate=1e-3),
    'mini': dict(num_layers=4, hidden_size=256, num_heads=4, mlp_dim=1024, vocab_size=16384,
                 max_seq_length=256, batch_size=32, num_steps=100_000, warmup_steps=2000,
                 learning_rate=5e-4),
    'base': dict(num_layers=12, hidden_size=768, num_heads=12, mlp_dim=3072, vocab_size=40478,
                 max_seq_length=512, batch_size=64, num_steps=1_000_000, warmup_steps=2000,
                 learning_rate=2.5e-4),
}


def model_config(v: dict) -> ml_collections.ConfigDict:
  """GPT's model fields for a variant (shared with configs/gpt_finetune.py)."""
  model = ml_collections.ConfigDict()
  model.vocab_size = v['vocab_size']  # 40,000 merges + specials at base size
  model.hidden_size = v['hidden_size']
  model.num_layers = v['num_layers']
  model.num_heads = v['num_heads']
  model.mlp_dim = v['mlp_dim']
  model.max_position_embeddings = 512
  model.dropout_rate = 0.1  # residual, embedding and attention dropout (sec. 4.1)
  model.attention_dropout_rate = 0.1
  # OpenAI's code drops the embedding tables' elements, one mask per row a step, the tied
  # output layer's too ('tokens': per looked-up token, as HF's openai-gpt).
  model.embedding_dropout = 'table'
  model.initializer_range = 0.02  # N(0, 0.02)
  model.layer_norm_eps = 1e-5
  model.dtype = 'auto'  # compute dtype: auto = float32 on CPU, bfloat16 on TPU/GPU
  # auto: TPU flash or GPU cuDNN without attention dropout; with it, our Triton kernel on GPUs.
  model.attention = 'auto'
  model.scan_layers = False
  model.remat = False
  model.num_labels = 0  # no task head in pretraining
  model.head = 'classify'
  model.classifier_dropout_rate = 0.1
  return model


def data_config(v: dict) -> ml_collections.ConfigDict:
  """The text source and tokenizer fields (shared with configs/gpt_finetune.py)."""
  data = ml_collections.ConfigDict()
  data.pipeline = 'packed_lm'  # a module of input_pipeline/
  common.set_text_source(data)
  data.tokenizer = 'bpe'  # 'bpe' (byte-level) | 'wordpiece'
  data.vocab_file = ''  # tokenizer.json (bpe) or vocab.txt (wordpiece); empty learns one
  data.lower_case = False  # GPT-1 lower-cased its text; byte-level BPE needs no lower-casing
  data.max_seq_length = v['max_seq_length']
  data.docs_per_chunk = 2000  # rows are packed and shuffled within chunks of documents
  return data


def optimizer_config(learning_rate: float, warmup_steps: int,
                     schedule: str) -> ml_collections.ConfigDict:
  """Adam with decoupled weight decay as in OpenAI's code (sec. 4.1)."""
  optimizer = ml_collections.ConfigDict()
  optimizer.learning_rate = learning_rate
  optimizer.warmup_steps = warmup_steps
  optimizer.schedule = schedule  # 'linear' | 'cosine' decay to 0 after the warmup
  optimizer.b1 = 0.9
  optimizer.b2 = 0.999
  optimizer.eps = 1e-8
  optimizer.weight_decay = 0.01  # the paper's modified L2 (w = 0.01), decoupled, not on biases/gains
  optimizer.clip_norm = 1.0
  return optimizer


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  v = VARIANTS[arg]

  config = ml_collections.ConfigDict()
  config.model_name = 'gpt'
  config.objective = 'lm'
  config.seed = 0
  config.model = model_config(v)
  config.data = data_config(v)
  config.optimizer = optimizer_config(v['learning_rate'], v['warmup_steps'], 'cosine')

  config.train = common.pretraining_schedule(v['batch_size'], v['num_steps'], arg == 'tiny')
  if arg == 'tiny':
    config.data.eval_holdout = common.TINY_EVAL_HOLDOUT
    config.train.eval_steps = 7  # 224 rows of the 247 held out (10 batches read some twice)
  common.set_mesh_and_rules(config)
  return config
