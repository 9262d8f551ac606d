"""GPT fine-tuning with the auxiliary LM loss, L3 = L2 + lambda * L1 (Radford et al. 2018, sec. 3.2, 4.1).

    python train.py --config=configs/gpt_finetune.py:sst2 --config.init_from=runs/gpt --workdir=runs/gpt_sst2
    python train.py --config=configs/gpt_finetune.py:offline_shuffled,tiny \
        --config.init_from=runs/gpt_tiny --workdir=runs/gpt_tiny_shuffled

The argument is `task[,size]`: a task of input_pipeline/gpt_finetune.py
(GLUE and SNLI from TFDS, or an offline task made from the embedded corpus)
and the size of the pretrained model (a variant of configs/gpt.py). Without
a size, the sizes and casing come from config.init_from (a GPT run, or
openai-gpt converted by convert_checkpoint.py), with GPT-1's optimizer. The
vocabulary comes from the init_from workdir.
`--config.loss.lm_coef=0` turns the auxiliary LM loss off.
"""

import math

import ml_collections

from configs import common
from configs import gpt
from input_pipeline import gpt_finetune
from input_pipeline.tasks import task_metrics

# Training examples per TFDS task, for the paper's 3 epochs.
TRAIN_EXAMPLES = {
    'sst2': 67_349, 'cola': 8_551, 'mnli': 392_702, 'mnli_mismatched': 392_702,
    'qnli': 104_743, 'rte': 2_490, 'snli': 549_367, 'snli_test': 549_367, 'stsb': 5_749,
    'qqp': 363_846,
    'mrpc': 3_668, 'piqa': 16_113, 'hellaswag': 39_905,
}
EPOCHS = 3
BATCH_SIZE = 32
# The paper's 6.25e-5 is for GPT-1 size; the tiny model (like its
# pretraining, 4x the paper's rate) needs a larger one to learn in 300 steps.
LEARNING_RATES = {'base': 6.25e-5, 'tiny': 1e-3}
# Offline tasks are small; their step count for a run of a few minutes on a CPU.
OFFLINE_STEPS = 300


def eval_metrics(task_name: str) -> tuple[str, ...]:
  """The eval metrics (results-line names) a run of the task reports as its benchmark does
  (GLUE's per task, task_metrics.reported; accuracy for multiple choice)."""
  spec = gpt_finetune.task_spec(task_name)
  names = (('accuracy',) if spec.kind == 'multiple_choice'
           else task_metrics.reported(task_name, spec.regression))
  return tuple(f'eval_{name}' for name in names)


def get_config(arg: str = 'offline_shuffled') -> ml_collections.ConfigDict:
  task, _, size = arg.partition(',')
  if size and size not in gpt.VARIANTS:
    raise ValueError(f'Unknown size {size!r}: use one of {", ".join(gpt.VARIANTS)}, or none to '
                     'take the sizes from config.init_from.')
  spec = gpt_finetune.task_spec(task)
  v = gpt.VARIANTS[size or 'base']

  config = ml_collections.ConfigDict()
  config.model_name = 'gpt'
  config.objective = 'gpt_finetune'
  config.seed = 0
  config.init_from = ''  # workdir of a GPT pretraining run; empty trains from scratch
  # A start from a run stopped before its train.num_steps is refused unless this is set.
  config.allow_unfinished_init_from = False
  # Longer sequences than init_from trained stop the run unless this is set.
  config.allow_untrained_positions = False

  config.model = gpt.model_config(v)
  # Classes (1 = regression); for the choice head only whether there is a head.
  config.model.num_labels = spec.num_labels
  config.model.head = spec.head

  config.data = gpt.data_config(v)
  config.data.pipeline = 'gpt_finetune'
  config.data.task = task
  config.data.num_choices = spec.num_choices  # sequences per example
  # OpenAI sized the context from the data; 128 keeps most GLUE inputs whole
  # (longer ones are cut longest text first) and the LM logits small.
  config.data.max_seq_length = min(v['max_seq_length'], 128)
  config.data.max_examples = 20_000  # offline tasks: examples made from the embedded corpus
  if spec.source == 'offline':
    config.data.eval_holdout = 10  # about 900-1,500 eval examples rather than 90-150

  config.loss = ml_collections.ConfigDict()
  config.loss.lm_coef = 0.5  # lambda of L3 = L2 + lambda * L1; 0 turns the auxiliary LM off
  config.loss.choices = spec.head == 'choice'  # no class metrics for two choices (PIQA)

  if spec.source == 'offline':
    num_steps = OFFLINE_STEPS
  elif task in TRAIN_EXAMPLES:
    num_steps = math.ceil(EPOCHS * TRAIN_EXAMPLES[task] / BATCH_SIZE)
  else:
    raise ValueError(f'configs/gpt_finetune.py has no training-set size for {task!r}: add it '
                     'to TRAIN_EXAMPLES.')
  # Linear decay with warmup over 0.2% of training (sec. 4.1).
  config.optimizer = gpt.optimizer_config(LEARNING_RATES.get(size, 6.25e-5),
                                          math.ceil(0.002 * num_steps), 'linear')

  config.train = common.finetuning_schedule(BATCH_SIZE, num_steps)
  common.set_mesh_and_rules(config)
  if not size:  # the pretrained run's sizes and casing (a converted openai-gpt's too)
    common.take_sizes_from_init(config)
  return config
