"""CoVe's comparison: the downstream classifier on GloVe alone vs [GloVe; CoVe] (McCann et al.
2017, sec. 5, table 2 and figure 4).

    python sweep.py --sweep=configs/sweeps/cove_glove.py --workdir=runs/sweep_cove
    python sweep.py --sweep=configs/sweeps/cove_glove.py:tiny,offline_next --workdir=...
    python sweep.py --sweep=configs/sweeps/cove_glove.py:base,sst2,runs/cove_released \
        --workdir=runs/sweep_cove_sst2        # the released MT-LSTM (convert_checkpoint.py)

The argument is SIZE[,TASK[,ENCODER]]: configs/cove.py's size (its translation run) and a task of
configs/cove_classifier.py (offline_shuffled by default). For the paper's setting add
'cove.data.glove_file': 'glove.840B.300d.txt' to the first stage's overrides; without it
CoVe's word vectors are random and frozen, so on tiny 'GloVe alone' is a random-vector
baseline and the comparison asks what the MT-LSTM adds on its own. ENCODER, the workdir of a
CoVe run of that size (a converted release: convert_checkpoint.py --from=cove, size base), replaces
the translation stage: the classifier starts from it.
"""

import os


def get_sweep(arg: str = 'tiny'):
  size, _, rest = arg.partition(',')
  task, _, encoder = rest.partition(',')
  tiny = size == 'tiny'
  classifier = ('classifier', f'configs/cove_classifier.py:{task or "offline_shuffled"},{size}',
                {'train.num_steps': 300} if tiny else {})
  if encoder:
    stages = ((*classifier[:2], {**classifier[2], 'init_from': os.path.abspath(encoder)}),)
  else:
    stages = (('cove', f'configs/cove.py:{size}', {'train.num_steps': 600} if tiny else {}),
              classifier)
  return dict(
      stages=stages,
      variants=(('[GloVe; CoVe]', {}), ('GloVe alone', {'classifier.model.use_cove': False})),
      seeds=(0, 1),
      metrics=('eval_accuracy', 'eval_loss'))
