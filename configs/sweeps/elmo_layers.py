"""ELMo's layers per task: the scalar mix, the top layer, and each layer alone (Peters et al.
2018, sec. 5.2 table 2 for top vs mix; sec. 5.3: the first biLM layer serves syntax (POS)
better, the second semantics (word sense)).

    python sweep.py --sweep=configs/sweeps/elmo_layers.py --workdir=runs/sweep_elmo
    python sweep.py --sweep=configs/sweeps/elmo_layers.py:runs/elmo_released --workdir=...

The argument is a size of configs/elmo.py (tiny by default): one biLM per seed, then the
tagger (configs/elmo_tagger.py) on two offline tasks from the embedded corpus:
offline_capitalized, the syntax-like one (which words are written capitalized: names, the
word's own form and its neighbours), and offline_replaced, the semantics-like one (which words
were swapped for another word of the corpus: only the sentence's meaning tells). Or it is the
workdir of a biLM, such as a released one converted by `convert_checkpoint.py --from=bilm`:
then the taggers start from it, with its sizes, and no biLM is trained. Layer 0 is the
char-CNN's context-free token layer.
"""

import os

SIZES = ('tiny', 'small', 'base')  # configs/elmo.py VARIANTS


def get_sweep(arg: str = 'tiny'):
  size = arg or 'tiny'
  tiny = size == 'tiny'
  if size in SIZES:
    stages = (('bilm', f'configs/elmo.py:{size}', {'train.num_steps': 600} if tiny else {}),
              ('tagger', f'configs/elmo_tagger.py:offline_replaced,{size}',
               {'train.num_steps': 300} if tiny else {}))
  elif os.path.isdir(arg):
    stages = (('tagger', 'configs/elmo_tagger.py:offline_replaced', {'init_from': arg}),)
  else:
    raise ValueError(f'configs/sweeps/elmo_layers.py:{arg}: not a size ({", ".join(SIZES)}) '
                     'nor a directory; pass a size or the workdir of a biLM (a configs/elmo.py '
                     'run or convert_checkpoint.py --from=bilm).')
  return dict(
      stages=stages,
      variants=(('scalar mix', {}),
                ('top layer', {'tagger.model.elmo_top_only': True}),
                ('layer 0 (tokens)', {'tagger.model.elmo_layer': 0}),
                ('layer 1', {'tagger.model.elmo_layer': 1}),
                ('layer 2', {'tagger.model.elmo_layer': 2})),
      axes=(('tagger.data.task', ('offline_capitalized', 'offline_replaced')),),
      seeds=(0, 1),
      metrics=('eval_span_f1', 'eval_accuracy'))
