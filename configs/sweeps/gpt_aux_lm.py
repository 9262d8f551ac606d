"""GPT fine-tuning with and without the auxiliary LM objective, lambda 0.5 vs 0 (Radford et al.
2018, sec. 3.2 eq. 3, sec. 5 table 5: it helps the larger datasets, not the smaller).

    python sweep.py --sweep=configs/sweeps/gpt_aux_lm.py --workdir=runs/sweep_aux_lm
    python sweep.py --sweep=configs/sweeps/gpt_aux_lm.py:base,mnli --workdir=...

The argument is SIZE[,TASK] (a configs/gpt.py size; a configs/gpt_finetune.py task, the
offline pair task offline_next by default).
"""

from configs import gpt_finetune


def get_sweep(arg: str = 'tiny'):
  size, _, task = arg.partition(',')
  tiny = size == 'tiny'
  return dict(
      stages=(('pretrain', f'configs/gpt.py:{size}', {'train.num_steps': 600} if tiny else {}),
              ('finetune', f'configs/gpt_finetune.py:{task or "offline_next"}',
               {'train.num_steps': 300} if tiny else {})),
      variants=(('lambda 0.5 (the paper)', {}), ('lambda 0', {'finetune.loss.lm_coef': 0.0})),
      seeds=(0, 1),
      metrics=gpt_finetune.eval_metrics(task or 'offline_next') + ('eval_task_loss',
                                                                   'eval_lm_perplexity'))
