"""CoVe's MT-LSTM, trained on English-German translation (McCann et al. 2017, sec. 3-4).

    python train.py --config=configs/cove.py:tiny --workdir=runs/cove_tiny
    python train.py --config=configs/cove.py --workdir=runs/cove \
        --config.data.glove_file=glove.840B.300d.txt          # the paper's MT-Large recipe
    python translate.py --workdir=runs/cove_tiny --input=src.txt --output=hyp.txt
    python extract_features.py --workdir=runs/cove --input=sentences.txt --output=cove.h5 \
        [--glove=glove.840B.300d.txt]                          # [GloVe(x); CoVe(x)] per word

Variants:
  tiny  the offline task (input_pipeline/translation.py: embedded-corpus sentences and
        their cipher), random frozen 50-d word vectors, 64 cells per direction; minutes
        on a CPU.
  base  wmt17_translate/de-en from TFDS, English to German (MT-Large, sec. 4), GloVe
        (data.glove_file, 300-d, frozen), the released model's OpenNMT run: 2-layer
        biLSTM of 300 cells per direction, 2-layer 600-cell decoder with input feeding,
        dropout 0.2, uniform(-0.1, 0.1) initialization, SGD at 1.0, gradient norm
        clipped at 5, batch 64, 13 epochs.
The target side is subwords (the shared byte-level BPE) rather than OpenNMT's
50,000 words; decoding is OpenNMT's beam 5 without a length penalty.
"""

import ml_collections

from configs import common

VARIANTS = {
    'tiny': dict(word_dim=50, hidden_size=64, target_embed_dim=64, vocab_size=1024,
                 source_vocab_size=4000, max_seq_length=32, batch_size=32, num_steps=600),
    # WMT 2017 en-de has 5,906,184 training pairs in TFDS: 13 epochs of 64 pairs.
    'base': dict(word_dim=300, hidden_size=300, target_embed_dim=300, vocab_size=32_000,
                 source_vocab_size=100_000, max_seq_length=80, batch_size=64,
                 num_steps=1_200_000),
}


def get_config(arg: str = 'base') -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f'Unknown variant {arg!r}: use one of {", ".join(VARIANTS)}.')
  v = VARIANTS[arg]
  tiny = arg == 'tiny'

  config = ml_collections.ConfigDict()
  config.model_name = 'cove'
  config.objective = 'seq2seq'
  config.seed = 0

  # MT-Large (sec. 4); max_seq_length counts source words and target subwords.
  data = config.data = common.translation_data(tiny, 'wmt17_translate/de-en',
                                               v['max_seq_length'])
  # The released model's recipe lower-cases both sides (salesforce/cove's OpenNMT-py README:
  # lowercase.perl and preprocess.py -lower) though glove.840B is cased; a lower-cased word
  # reads GloVe's own entry of it (input_pipeline/common/glove.py). Tiny's cipher keeps case.
  data.lower_case = not tiny
  data.source_tokenizer = 'words'  # the encoder reads word vectors
  # How a source text becomes words (input_pipeline/common/words.py): 'punctuation' for raw
  # text; 'spaces' for text tokenized already (convert_cove.py's release reads text so).
  data.split_words = 'punctuation'
  data.source_vocab_size = v['source_vocab_size']  # the most frequent source words (GloVe's)
  data.glove_file = ''  # GloVe's text format, e.g. glove.840B.300d.txt; '' = random vectors
  data.pack = False  # one pair per row: the LSTMs read whole rows

  model = config.model = ml_collections.ConfigDict()
  model.vocab_size = v['vocab_size']  # the target's subwords
  model.source_vocab_size = data.get_ref('source_vocab_size')  # one value for both fields
  model.word_dim = v['word_dim']
  model.hidden_size = v['hidden_size']  # per encoder direction; the decoder has twice as many
  model.num_encoder_layers = 2
  model.num_decoder_layers = 2
  model.target_embed_dim = v['target_embed_dim']
  model.dropout_rate = 0.1 if tiny else 0.2
  model.init_scale = 0.1
  model.dtype = 'auto'

  config.loss = ml_collections.ConfigDict()
  config.loss.label_smoothing = 0.0  # OpenNMT's NLL
  # Summed and divided by the batch's sentences, as OpenNMT-py's trainer does: with SGD at 1
  # and clipping at 5, a mean per token would be a step some 25 times smaller. Tiny's Adam
  # (below) takes the mean per token: Adam does not see the scale, but the clipping would
  # (per sentence, tests/test_cove_train.py's BLEU at step 600 fell from 9.34 to 5.58).
  config.loss.normalize = 'tokens' if tiny else 'sentences'

  opt = config.optimizer = ml_collections.ConfigDict()
  if tiny:  # Adam learns the small model in fewer steps than SGD at 1.0
    opt.name, opt.learning_rate, opt.schedule, opt.warmup_steps = 'adamw', 1e-2, 'constant', 0
  else:
    opt.name, opt.learning_rate, opt.schedule, opt.warmup_steps = 'sgd', 1.0, 'constant', 0
  opt.momentum = 0.0
  opt.b1, opt.b2, opt.eps = 0.9, 0.999, 1e-8
  opt.weight_decay = 0.0
  opt.clip_norm = 5.0
  # GloVe stays fixed (sec. 3), and so do random vectors; the unknown-word vector learns.
  opt.frozen = ('word_vectors/table',)

  config.train = common.pretraining_schedule(v['batch_size'], v['num_steps'], tiny)
  config.train.eval_steps = 10 if tiny else 100
  if not tiny:
    config.train.eval_every = 20_000
    config.train.checkpoint_every = 10_000

  decode = config.decode = ml_collections.ConfigDict()
  decode.beam_size = 5
  decode.alpha = 0.0
  decode.max_extra_length = 50
  decode.bleu_examples = 200 if tiny else 1000
  decode.batch_size = 32
  common.set_mesh_and_rules(config)
  return config
