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

import os
import sys

from absl import app
from absl import flags
from absl import logging

from models.decoding import translate
from objectives.seq2seq import bleu, lowercases_targets
from trainer import cli
from trainer.state import load_trained


def check_files(f) -> tuple[list[str], list[str] | None]:
  """The input's sentences and the reference's lines, and the output writable, checked before
  the model loads (and before a long decode whose result could not be written)."""
  sentences = cli.read_lines(f.input, '--input')
  if not sentences:
    raise ValueError(f'--input={f.input} is empty: give one source sentence a line.')
  references = cli.read_lines(f.reference, '--reference') if f.reference else None
  if references is not None and len(references) != len(sentences):
    raise ValueError(f'--reference has {len(references)} lines and --input {len(sentences)}: '
                     'give line-aligned files.')
  folder = os.path.dirname(os.path.abspath(f.output))
  if (os.path.isdir(f.output) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)
      or (os.path.exists(f.output) and not os.access(f.output, os.W_OK))):
    raise ValueError(f'--output={f.output} cannot be written (a directory, read-only, or its '
                     'folder missing or read-only): pass a writable file.')
  for flag, value, least in (('beam_size', f.beam_size, 1), ('batch_size', f.batch_size, 1),
                             ('alpha', f.alpha, 0)):
    if value is not None and value < least:
      raise ValueError(f'--{flag}={value}: use {least} or more.')
  return sentences, references


def main(argv):
  del argv
  cli.skip_absent_accelerators()
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs its restore at INFO
  f = flags.FLAGS
  try:
    sentences, references = check_files(f)
    config, model, params, tokenizer = load_trained(f.workdir, ('transformer', 'cove'),
                                                    'translate.py')
    if config.get('untrained_params'):  # convert_checkpoint.py --from=cove: no decoder released
      raise ValueError(f'{f.workdir} has an untrained {", ".join(config.untrained_params)} '
                       f'(converted from {config.get("converted_from")}): translate with a '
                       'trained translation run.')
    d = config.decode
    beam_size = d.beam_size if f.beam_size is None else f.beam_size
    alpha = d.alpha if f.alpha is None else f.alpha
    hypotheses = translate(model, params, tokenizer, sentences, beam_size=beam_size,
                           alpha=alpha, max_extra_length=d.max_extra_length,
                           batch_size=f.batch_size)
    with open(f.output, 'w', encoding='utf-8') as out:
      out.writelines(h + '\n' for h in hypotheses)
    if references is not None:
      lower = lowercases_targets(tokenizer)
      print(f'BLEU {bleu(hypotheses, references, lower):.2f} '
            f'({len(hypotheses)} sentences, beam {beam_size}, alpha {alpha}'
            + (', case-insensitive: the run lower-cases its text)' if lower else ')'))
  except (ValueError, OSError) as e:
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
