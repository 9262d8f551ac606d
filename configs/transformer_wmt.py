"""The Transformer on WMT 2014 English-German (Vaswani et al. 2017, sec. 5-6).

    python train.py --config=configs/transformer_wmt.py:tiny --workdir=runs/mt_tiny
    python train.py --config=configs/transformer_wmt.py --workdir=runs/mt_base
    python translate.py --workdir=runs/mt_tiny --input=src.txt --output=hyp.txt

Variants:
  tiny    the offline task (input_pipeline/translation.py: embedded-corpus sentences
          and their cipher), a 2+2-layer model; minutes on a CPU.
  base    wmt14_translate/de-en from TFDS, English to German, Table 3's base model:
          N=6, d_model 512, d_ff 2048, 8 heads, dropout 0.1, label smoothing 0.1,
          Adam (0.9, 0.98, 1e-9), lr = d^-0.5 min(step^-0.5, step warmup^-1.5),
          4000 warmup steps, 100k steps, about 25k source and 25k target tokens a batch.
  big     the big model: d_model 1024, d_ff 4096, 16 heads, dropout 0.3, 300k steps.
Beam search with beam 4 and length penalty alpha 0.6 (sec. 6.1) decodes for BLEU.
"""

import ml_collections

from configs import common

VARIANTS = {
    'tiny': dict(hidden_size=64, layers=2, num_heads=4, mlp_dim=256, dropout_rate=0.1,
                 vocab_size=1024, max_seq_length=64, batch_size=32, num_steps=600,
                 warmup_steps=100),
    'base': dict(hidden_size=512, layers=6, num_heads=8, mlp_dim=2048, dropout_rate=0.1,
                 vocab_size=37000, max_seq_length=256, batch_size=96, num_steps=100_000,
                 warmup_steps=4000),
    'big': dict(hidden_size=1024, layers=6, num_heads=16, mlp_dim=4096, dropout_rate=0.3,
                vocab_size=37000, max_seq_length=256, batch_size=96, num_steps=300_000,
                warmup_steps=4000),
}


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  v = VARIANTS[arg]
  tiny = arg == 'tiny'

  config = ml_collections.ConfigDict()
  config.model_name = 'transformer'
  config.objective = 'seq2seq'
  config.seed = 0

  model = config.model = ml_collections.ConfigDict()
  model.vocab_size = v['vocab_size']  # shared by both languages (sec. 5.1: about 37000 BPE tokens)
  model.hidden_size = v['hidden_size']
  model.num_encoder_layers = v['layers']
  model.num_decoder_layers = v['layers']
  model.num_heads = v['num_heads']
  model.mlp_dim = v['mlp_dim']
  model.dropout_rate = v['dropout_rate']
  model.attention_dropout_rate = 0.0
  model.positions = 'sinusoidal'  # or 'learned' (Table 3, row E)
  model.max_position_embeddings = v['max_seq_length']
  model.share_embeddings = True
  model.dtype = 'auto'
  model.attention = 'auto'  # TPU flash or GPU cuDNN kernel (no attention dropout in the paper)
  model.scan_layers = False
  model.remat = False

  config.loss = ml_collections.ConfigDict()
  config.loss.label_smoothing = 0.1  # eps_ls (sec. 5.4)
  config.loss.normalize = 'tokens'  # per target token (objectives/seq2seq.py)

  # validation is newstest2013, the paper's development set.
  config.data = common.translation_data(tiny, 'wmt14_translate/de-en', v['max_seq_length'])

  opt = config.optimizer = ml_collections.ConfigDict()
  opt.name = 'adamw'
  # The peak of d^-0.5 min(step^-0.5, step warmup^-1.5), reached at the end of the warmup.
  opt.learning_rate = (6e-3 if tiny else
                       v['hidden_size'] ** -0.5 * v['warmup_steps'] ** -0.5)
  opt.schedule = 'rsqrt'
  opt.warmup_steps = v['warmup_steps']
  opt.b1, opt.b2, opt.eps = 0.9, 0.98, 1e-9
  opt.weight_decay = 0.0
  opt.clip_norm = 1.0 if tiny else 0.0  # 0 = none, as in the paper

  config.train = common.pretraining_schedule(v['batch_size'], v['num_steps'], tiny)
  config.train.eval_steps = 10 if tiny else 100  # batches of packed eval rows for the loss
  if not tiny:
    config.train.eval_every = 5000
    config.train.checkpoint_every = 5000

  # Decoding for BLEU at each eval and in translate.py (sec. 6.1).
  decode = config.decode = ml_collections.ConfigDict()
  decode.beam_size = 4
  decode.alpha = 0.6
  decode.max_extra_length = 50  # output up to input length + 50 tokens
  decode.bleu_examples = 200 if tiny else 1000  # eval pairs translated at each eval (0 = none)
  decode.batch_size = 32
  common.set_mesh_and_rules(config)
  return config
