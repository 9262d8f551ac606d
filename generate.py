"""Continues prompts with a trained GPT, decoding with the KV cache (Radford et al. 2018).

    python generate.py --workdir=runs/gpt_tiny --prompt="Return the"
    python generate.py --workdir=runs/gpt_tiny --prompt="Return the" --prompt="The file" \
        --temperature=0.8 --top_k=40 --max_new_tokens=60

--temperature=0 (the default) decodes greedily; top_k=0 samples from the whole
vocabulary. Several --prompt flags decode as one batch. Each prompt starts
with the end-of-text token, as documents do in pretraining, and decoding stops
at the next one; a model that never trained that token (openai-gpt converted
by convert_checkpoint.py, and runs fine-tuned from it: GPT-1 had none)
continues the prompt alone for --max_new_tokens. Tokens that are not text
(padding, the fine-tuning delimiters) are never drawn. Works on a pretraining
or a fine-tuning workdir. A prompt and its continuation stay within the
positions the run trained (configs/gpt.py's tiny trains 128 of its 512, whose
other rows never had a gradient), unless --allow_untrained_positions.
"""

import sys

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
import numpy as np

from models import decoding
from models import gpt
from trainer import checkpoints
from trainer import cli
from trainer import phases
import trainer.state


def load_run(workdir: str) -> tuple[ml_collections.ConfigDict, gpt.Model, dict, object]:
  """The config, model, parameters (latest checkpoint) and tokenizer of a GPT workdir."""
  return trainer.state.load_trained(workdir, 'gpt',
                                    'generate.py (configs/gpt.py, configs/gpt_finetune.py)')


def check_length(longest: int, max_new_tokens: int, table: int, trained: int | None,
                 allow_untrained: bool = False) -> None:
  """A prompt of `longest` tokens and `max_new_tokens` more fit the position table and, unless
  allowed, the positions the run trained (None: the checkpoint does not say)."""
  if longest + max_new_tokens > table:
    raise ValueError(f'A prompt of {longest} tokens plus --max_new_tokens={max_new_tokens} '
                     f'exceeds the {table} positions: shorten the prompt or lower '
                     '--max_new_tokens.')
  trained = min(trained or table, table)
  if longest + max_new_tokens > trained and not allow_untrained:
    raise ValueError(f'A prompt of {longest} tokens plus --max_new_tokens={max_new_tokens} '
                     f'goes past the positions 0-{trained - 1} the run trained (the rest of '
                     f'its {table} never had a gradient): use --max_new_tokens='
                     f'{max(trained - longest, 0)} or less, or --allow_untrained_positions to '
                     'go on.')


def generate(workdir: str, prompts: list[str], *, max_new_tokens: int, temperature: float,
             top_k: int, seed: int, allow_untrained_positions: bool = False) -> list[str]:
  """Each prompt with its continuation, decoded to text."""
  for prompt in prompts:
    try:
      prompt.encode('utf-8')
    except UnicodeEncodeError:  # bytes of another encoding, as the shell passed them
      raise ValueError(f'--prompt={prompt!r} is not UTF-8 text: give it in UTF-8.') from None
  config, model, params, tokenizer = load_run(workdir)
  # Only convert_checkpoint.py's openai-gpt says False; older checkpoints say nothing (None).
  eot_trained = (checkpoints.newest_data(workdir) or {}).get('eot_trained') is not False
  start = [tokenizer.eot_id] if eot_trained else []
  ids = [start + tokenizer.encode(p) for p in prompts]
  if not all(ids):
    raise ValueError(f'{workdir} never trained the end-of-text token that would start an empty '
                     'prompt (a converted openai-gpt): give every --prompt some text.')
  longest = max(map(len, ids))
  check_length(longest, max_new_tokens, config.model.max_position_embeddings,
               phases.trained_positions(workdir), allow_untrained_positions)
  if temperature < 0 or top_k < 0:
    raise ValueError('--temperature and --top_k must be 0 or more.')
  prompt_BL = np.full((len(ids), longest), tokenizer.pad_id, np.int32)
  for row, prompt in zip(prompt_BL, ids):
    row[:len(prompt)] = prompt
  lengths_B = np.array([len(p) for p in ids], np.int32)
  # (On a BERT vocabulary the delimiter is the end-of-text token, [SEP].)
  not_text = {tokenizer.pad_id, tokenizer.start_id, tokenizer.delim_id, tokenizer.extract_id,
              tokenizer.eot_id} - ({tokenizer.eot_id} if eot_trained else set())
  tokens_BN = decoding.sample(model, params, prompt_BL, lengths_B,
                              max_new_tokens=max_new_tokens, rng=jax.random.key(seed),
                              temperature=temperature, top_k=top_k, eot_id=tokenizer.eot_id,
                              banned_ids=tuple(sorted(not_text)))
  texts = []
  for prompt, row in zip(ids, np.asarray(tokens_BN)):
    ends = np.flatnonzero(row == tokenizer.eot_id)
    # Decoded together: byte-level BPE tokens carry their own leading spaces.
    texts.append(tokenizer.decode(prompt[len(start):] + list(row[:ends[0]] if len(ends) else row)))
  return texts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  cli.skip_absent_accelerators()
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if not f.workdir or not f.prompt:
    sys.exit('generate.py: error: pass --workdir=DIR and --prompt="...".')
  try:
    texts = generate(f.workdir, f.prompt, max_new_tokens=f.max_new_tokens,
                     temperature=f.temperature, top_k=f.top_k, seed=f.seed,
                     allow_untrained_positions=f.allow_untrained_positions)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'generate.py: error: {e}')
  for text in texts:
    print(text, flush=True)


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'Workdir of a GPT training run.')
  flags.DEFINE_multi_string('prompt', None, 'Text to continue; repeat for a batch.')
  flags.DEFINE_integer('max_new_tokens', 50, 'Tokens to generate per prompt.')
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 decodes greedily.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; 0 = all.')
  flags.DEFINE_integer('seed', 0, 'Random seed of the sampling.')
  flags.DEFINE_bool('allow_untrained_positions', False, 'Decode past the positions the run '
                    'trained (their rows never had a gradient).')
  app.run(main)
