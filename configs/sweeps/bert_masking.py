"""BERT's masking ablations, each pretraining fine-tuned on one task (Devlin et al. 2018,
sec. 5.1 table 5 for NSP, appendix C.2 table 8 for the [MASK]/random/kept mix).

    python sweep.py --sweep=configs/sweeps/bert_masking.py --workdir=runs/sweep_masking
    python sweep.py --sweep=configs/sweeps/bert_masking.py:tiny,offline_capitalized --workdir=...
    python sweep.py --sweep=configs/sweeps/bert_masking.py:base,mnli --workdir=...

The argument is SIZE[,TASK]: a configs/bert_base.py size and a configs/bert_finetune.py task
(offline_next, the pair task, by default: NSP should matter most there). Tiny runs shorten
both stages, and pretrain at 64 tokens a row, then 128 for the last 10% of steps (the tasks'
length), so that the sweep finishes on a laptop; other sizes keep the configs' schedules and
phases (128 tokens, then 512).
"""

import math

from configs import bert_base
from configs import bert_finetune

# The mask rate's variants keep max_predictions_per_seq at the rate's share of each phase's row.
TINY_SEQ_LENGTH, SEQ_LENGTH = 64, 128
TINY_LATER_PHASES = ((0.9, 128, math.ceil(0.15 * 128), False),)


def _rate(rate: float, seq_length: int, later_phases: tuple) -> dict:
  return {'pretrain.data.masked_lm_prob': rate,
          'pretrain.data.max_predictions_per_seq': math.ceil(rate * seq_length),
          'pretrain.data.later_phases': tuple((start, length, math.ceil(rate * length), remat)
                                              for start, length, _, remat in later_phases)}


def get_sweep(arg: str = 'tiny'):
  size, _, task = arg.partition(',')
  task = task or 'offline_next'
  tiny = size == 'tiny'
  seq_length = TINY_SEQ_LENGTH if tiny else SEQ_LENGTH
  later = TINY_LATER_PHASES if tiny else bert_base.get_config(size).data.later_phases
  return dict(
      stages=(('pretrain', f'configs/bert_base.py:{size}',
               {'train.num_steps': 400, 'data.max_seq_length': seq_length,
                'data.max_predictions_per_seq': math.ceil(0.15 * seq_length),
                'data.later_phases': later} if tiny else {}),
              ('finetune', f'configs/bert_finetune.py:{task}',
               {'train.num_steps': 200} if tiny else {})),
      variants=(
          ('15%, 80/10/10, NSP (the paper)', {}),
          ('mask 10%', _rate(0.10, seq_length, later)),
          ('mask 25%', _rate(0.25, seq_length, later)),
          ('mask 40%', _rate(0.40, seq_length, later)),
          ('always [MASK] (100/0/0)', {'pretrain.data.mask_token_prob': 1.0,
                                       'pretrain.data.random_token_prob': 0.0}),
          ('80/0/20', {'pretrain.data.random_token_prob': 0.0}),
          ('80/20/0', {'pretrain.data.random_token_prob': 0.2}),
          ('no NSP', {'pretrain.data.next_sentence_prediction': False}),
      ),
      seeds=(0, 1),
      metrics=bert_finetune.eval_metrics(task) + ('eval_loss',))
