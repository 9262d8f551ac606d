"""Translates a text file, one sentence per line, with a trained translation run; BLEU with sacrebleu.

    python translate.py --workdir=runs/mt_tiny --input=src.txt --output=hyp.txt
    python translate.py --workdir=runs/mt_tiny --input=src.txt --output=hyp.txt \
        --reference=ref.txt --beam_size=4 --alpha=0.6       # prints BLEU too
    python translate.py ... --beam_size=1 --alpha=0          # greedy

Beam search with a length penalty (Vaswani et al. 2017, sec. 6.1: beam 4,
alpha 0.6, at most input length + 50 tokens); the defaults come from the
run's config.decode. BLEU is sacrebleu's corpus BLEU on the detokenized
output (the byte-level BPE decodes to the exact text).
"""

import functools
import importlib
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

import decoding
import train
from input_pipeline import translation

LENGTH_BUCKET = 16  # source lengths are padded to a multiple of this: few compiled shapes


@functools.partial(jax.jit, static_argnames=('model', 'beam_size', 'max_length', 'alpha',
                                             'bos_id', 'eos_id'))
def translate_ids(model, params, source_ids_BS: jax.Array, *, beam_size: int, alpha: float,
                  max_length: int, bos_id: int, eos_id: int) -> jax.Array:
  """Output ids (B, max_length) for source ids (B, S), 0 = padding.

  beam_size 1 is greedy search (decoding.greedy_search), the others beam
  search. The model's module says how it decodes: its `decoder` gives the
  step function, the starting state of B * beam_size rows and how to
  reorder that state (None: decoding.gather_rows).
  """
  B = source_ids_BS.shape[0]
  model_module = importlib.import_module(type(model).__module__)
  step, state, reorder = model_module.decoder(model, params, source_ids_BS,
                                              beam_size=beam_size, max_length=max_length)
  if beam_size == 1:
    return decoding.greedy_search(step, state, B, bos_id=bos_id, eos_id=eos_id,
                                  max_length=max_length)
  tokens, _ = decoding.beam_search(step, state, B, beam_size=beam_size, bos_id=bos_id,
                                   eos_id=eos_id, max_length=max_length, alpha=alpha,
                                   reorder=reorder or decoding.gather_rows)
  return tokens


def translate(model, params, tokenizer, sentences: list[str], *, beam_size: int = 4,
              alpha: float = 0.6, max_extra_length: int = 50, batch_size: int = 32,
              max_length: int | None = None) -> list[str]:
  """The translation of each sentence, in order (batched by length, then restored)."""
  if beam_size < 1:
    raise ValueError(f'beam_size={beam_size}: use 1 (greedy) or more.')
  encoded = translation.encode_sources(tokenizer, list(sentences))
  limit = (model.config.max_position_embeddings
           if getattr(model.config, 'positions', None) == 'learned' else None)
  order = np.argsort([len(ids) for ids in encoded], kind='stable')
  outputs = [''] * len(encoded)
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    S = -(-max(len(encoded[i]) for i in rows) // LENGTH_BUCKET) * LENGTH_BUCKET
    T = max_length or S + max_extra_length
    if limit is not None:
      S, T = min(S, limit), min(T, limit)
      if any(len(encoded[i]) > S for i in rows):
        raise ValueError(f'A sentence has more than model.max_position_embeddings={limit} '
                         'tokens: shorten or split it.')
    source = np.zeros((batch_size, S), np.int32)  # a full batch: one compiled shape per S
    for r, i in enumerate(rows):
      source[r, :len(encoded[i])] = encoded[i]
    ids = np.asarray(translate_ids(model, params, jnp.asarray(source), beam_size=beam_size,
                                   alpha=float(alpha), max_length=int(T),
                                   bos_id=tokenizer.start_id, eos_id=tokenizer.eot_id))
    for r, i in enumerate(rows):
      row = list(ids[r])
      end = row.index(tokenizer.eot_id) if tokenizer.eot_id in row else len(row)
      outputs[i] = tokenizer.decode(row[:end])
  return outputs


def bleu(hypotheses: list[str], references: list[str]) -> float:
  """sacrebleu's corpus BLEU (13a tokenization, as its default signature says)."""
  return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def evaluate_bleu(config, params, tokenizer) -> dict[str, float]:
  """BLEU of config.decode.bleu_examples eval pairs, decoded as config.decode says (train.py)."""
  pairs = translation.eval_pairs(config.data, config.decode.bleu_examples)
  model = importlib.import_module(f'models.{config.model_name}').Model(train.model_config(config))
  d = config.decode
  hypotheses = translate(model, params, tokenizer, [p[0] for p in pairs],
                         beam_size=d.beam_size, alpha=d.alpha,
                         max_extra_length=d.max_extra_length, batch_size=d.batch_size)
  return {'bleu': bleu(hypotheses, [p[1] for p in pairs])}


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    config, model, params, tokenizer = train.load_trained(f.workdir, ('transformer', 'cove'),
                                                          'translate.py')
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
      print(f'BLEU {bleu(hypotheses, references):.2f} '
            f'({len(hypotheses)} sentences, beam {beam_size}, alpha {alpha})')
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
