"""Translates a text file, one sentence per line, with a trained translation run; BLEU with sacrebleu.

    python translate.py --workdir=runs/mt_tiny --input=src.txt --output=hyp.txt
    python translate.py --workdir=runs/mt_tiny --input=src.txt --output=hyp.txt \
        --reference=ref.txt --beam_size=4 --alpha=0.6       # prints BLEU too
    python translate.py ... --beam_size=1 --alpha=0          # greedy

Beam search with a length penalty (Vaswani et al. 2017, sec. 6.1: beam 4,
alpha 0.6, at most input length + 50 tokens, the input length the batch's
longest); the defaults come from the
run's config.decode. BLEU is sacrebleu's corpus BLEU on the detokenized
output (the byte-level BPE decodes to the exact text), case-insensitive for a
run that lower-cases its text (data.lower_case). Each translation is one
line of --output (a line break inside one is written as a space).
"""

import sys

from absl import app
from absl import flags

from models.decoding import translate
from objectives.seq2seq import bleu, lowercases_targets
from trainer import cli
from trainer.state import load_trained


def main(argv):
  del argv
  cli.skip_absent_accelerators()
  f = flags.FLAGS
  try:
    config, model, params, tokenizer = load_trained(f.workdir, ('transformer', 'cove'),
                                                    'translate.py')
    if config.get('untrained_params'):  # convert_checkpoint.py --from=cove: no decoder released
      raise ValueError(f'{f.workdir} has an untrained {", ".join(config.untrained_params)} '
                       f'(converted from {config.get("converted_from")}): translate with a '
                       'trained translation run.')
    with open(f.input, encoding='utf-8') as source_file:
      sentences = [line.strip() for line in source_file]
    d = config.decode
    beam_size = d.beam_size if f.beam_size is None else f.beam_size
    alpha = d.alpha if f.alpha is None else f.alpha
    hypotheses = translate(model, params, tokenizer, sentences, beam_size=beam_size,
                           alpha=alpha, max_extra_length=d.max_extra_length,
                           batch_size=f.batch_size)
    with open(f.output, 'w', encoding='utf-8') as out:
      out.writelines(h + '\n' for h in hypotheses)
    if f.reference:
      with open(f.reference, encoding='utf-8') as ref:
        references = [line.strip() for line in ref]
      if len(references) != len(hypotheses):
        raise ValueError(f'--reference has {len(references)} lines and --input '
                         f'{len(hypotheses)}: give line-aligned files.')
      lower = lowercases_targets(tokenizer)
      print(f'BLEU {bleu(hypotheses, references, lower):.2f} '
            f'({len(hypotheses)} sentences, beam {beam_size}, alpha {alpha}'
            + (', case-insensitive: the run lower-cases its text)' if lower else ')'))
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'translate.py: error: {e}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'A translation training run.', required=True)
  flags.DEFINE_string('input', None, 'Source sentences, one per line.', required=True)
  flags.DEFINE_string('output', None, 'Where the translations go, one per line.', required=True)
  flags.DEFINE_string('reference', None, 'Reference translations: print BLEU.')
  flags.DEFINE_integer('beam_size', None, 'Beam size (1 = greedy); default config.decode.')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent; default config.decode.')
  flags.DEFINE_integer('batch_size', 32, 'Sentences decoded together.')
  app.run(main)
