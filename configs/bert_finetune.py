"""BERT fine-tuning: classification, sentence pairs, SQuAD spans and tagging (Devlin et al. 2018,
sec. 4 and appendix A.3).

    python train.py --config=configs/bert_finetune.py:sst2 --config.init_from=runs/bert --workdir=runs/bert_sst2
    python train.py --config=configs/bert_finetune.py:squad --config.init_from=DIR --workdir=RUN
    python train.py --config=configs/bert_finetune.py:conll2003 --config.init_from=DIR --workdir=RUN
    python train.py --config=configs/bert_finetune.py:offline_next,tiny \
        --config.init_from=runs/bert_tiny --workdir=runs/bert_tiny_next

The argument is `task[,size]`. Tasks: the GLUE tasks and SNLI (TFDS), squad
(TFDS squad/v1.1), conll2003 (TFDS), and four made from the embedded corpus
with no download: offline_shuffled (one sentence), offline_next (a pair),
offline_span (spans, as SQuAD) and offline_capitalized or offline_replaced
(tagging). Without a
size, the model's sizes and casing come from config.init_from (a
pretraining run of configs/bert_base.py, or a checkpoint converted by
convert_checkpoint.py), so no flag has to repeat them; a size (tiny, mini,
base, large of configs/bert_base.py) sets them, e.g. to train from scratch.
The vocabulary always comes from the init_from workdir when there is one.
"""

import math

import ml_collections

from configs import bert_base
from configs import common
from input_pipeline import bert_finetune
from input_pipeline import tagging
from input_pipeline.tasks import task_metrics

SPAN_TASKS = ('squad', 'offline_span')
# Training examples (SQuAD: questions) per TFDS task, for the step count of the epochs.
TRAIN_EXAMPLES = {
    'sst2': 67_349, 'cola': 8_551, 'mnli': 392_702, 'mnli_mismatched': 392_702,
    'qnli': 104_743, 'rte': 2_490, 'snli': 549_367, 'snli_test': 549_367, 'stsb': 5_749,
    'qqp': 363_846,
    'mrpc': 3_668, 'squad': 87_599, 'conll2003': 14_041,
}
# Appendix A.3: batch 32, 3 epochs (GLUE, sec. 4.1; SQuAD v1.1 at 5e-5, sec. 4.2); the paper
# picks the rate among 5e-5, 3e-5 and 2e-5 on the dev set. Warmup over the first 10%
# (run_classifier.py's warmup_proportion).
BATCH_SIZE = 32
EPOCHS = 3
LEARNING_RATES = {'squad': 5e-5, 'conll2003': 5e-5}
DEFAULT_LEARNING_RATE = 2e-5
# Offline tasks are small: a run of a few minutes on a CPU, at a rate a tiny model learns at.
OFFLINE_STEPS = 300
OFFLINE_LEARNING_RATE = 1e-3
MAX_SEQ_LENGTH = {'squad': 384, 'offline_span': 128, 'offline_shuffled': 64, 'offline_next': 128,
                  'offline_replaced': 64, 'offline_capitalized': 64}


def _task(name: str):
  if name in SPAN_TASKS:
    return None
  return bert_finetune.task_spec(name)


def eval_metrics(task_name: str) -> tuple[str, ...]:
  """The eval metrics (results-line names) a run of the task reports as its benchmark does:
  F1 and exact match for span tasks, span F1 and word accuracy for tagging (word accuracy for
  tags that are no spans), GLUE's per task (task_metrics.reported) for the others."""
  task = _task(task_name)
  if task is None:
    names = ('f1', 'exact_match')
  elif bert_finetune.is_tagging(task):
    names = ('span_f1', 'word_accuracy') if tagging.span_tags(task) else ('word_accuracy',)
  elif task_name == 'stsb':  # BERT's Table 1 reports Spearman's (GLUE both, Pearson's first)
    names = ('spearman', 'pearson')
  else:
    names = task_metrics.reported(task_name, task.regression)
  return tuple(f'eval_{name}' for name in names)


def get_config(arg: str = 'offline_shuffled') -> ml_collections.ConfigDict:
  task_name, _, size = arg.partition(',')
  if size and size not in bert_base.VARIANTS:
    raise ValueError(f'Unknown size {size!r}: use one of {", ".join(bert_base.VARIANTS)}, or none '
                     'to take the sizes from config.init_from.')
  task = _task(task_name)
  config = bert_base.get_config(size or 'base')
  config.init_from = ''  # workdir of a BERT run (pretrained or converted); empty trains from scratch
  # A start from a run stopped before its train.num_steps is refused unless this is set.
  config.allow_unfinished_init_from = False
  # Longer sequences than init_from trained (its later_phases) stop the run unless this is set.
  config.allow_untrained_positions = False

  if task is None:
    config.objective, head, num_labels = 'span', 'span', 2
  elif bert_finetune.is_tagging(task):
    config.objective, head, num_labels = 'tagging', 'tag', task.num_labels
  else:
    config.objective, head, num_labels = 'classification', 'classify', task.num_labels
  config.model.head = head
  config.model.num_labels = num_labels

  data = config.data
  offline = task_name.startswith('offline_')
  for field in ('max_predictions_per_seq', 'masked_lm_prob', 'mask_token_prob',
                'random_token_prob', 'short_seq_prob', 'next_sentence_prediction',
                'whole_word_masking', 'docs_per_chunk', 'later_phases'):
    del data[field]
  data.pipeline = 'squad' if task is None else 'bert_finetune'
  data.task = task_name
  data.max_seq_length = MAX_SEQ_LENGTH.get(task_name, 128)
  data.max_examples = 20_000  # offline sequence tasks: examples made from the embedded corpus
  data.max_train_examples = 4000 if offline else 0  # offline tagging and span tasks (0 = all)
  data.max_eval_examples = 1000 if offline else 0
  if offline:
    data.eval_holdout = 10  # the offline tasks' eval split: every 10th document
  if task is None:  # SQuAD windows (run_squad.py's flags)
    data.doc_stride = 32 if offline else 128
    data.max_query_length = 64
    data.n_best_size = 20
    data.max_answer_length = 30

  if offline:
    num_steps, learning_rate = OFFLINE_STEPS, OFFLINE_LEARNING_RATE
  elif task_name in TRAIN_EXAMPLES:
    num_steps = math.ceil(EPOCHS * TRAIN_EXAMPLES[task_name] / BATCH_SIZE)
    learning_rate = LEARNING_RATES.get(task_name, DEFAULT_LEARNING_RATE)
  else:
    raise ValueError(f'configs/bert_finetune.py has no training-set size for {task_name!r}: add '
                     'it to TRAIN_EXAMPLES.')
  config.optimizer.learning_rate = learning_rate
  config.optimizer.warmup_steps = math.ceil(0.1 * num_steps)
  config.train = common.finetuning_schedule(BATCH_SIZE, num_steps)
  if not size:  # the pretrained run's sizes and casing, filled in by train.py
    common.take_sizes_from_init(config)
  return config
