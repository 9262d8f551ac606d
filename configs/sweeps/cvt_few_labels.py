"""Cross-View Training against supervised-only training as labels get scarce (Clark et al.
2018, sec. 5, figure 3: CVT's gain grows as the labeled data shrinks).

    python sweep.py --sweep=configs/sweeps/cvt_few_labels.py --workdir=runs/sweep_cvt

configs/cvt.py:tiny on its offline names task; data.unlabeled_ratio=0 is the supervised-only
baseline (the same model and steps, no consistency loss on unlabeled sentences).
"""


def get_sweep(arg: str = 'tiny'):
  return dict(
      stages=(('cvt', f'configs/cvt.py:{arg or "tiny"}', {}),),
      variants=(('CVT', {}), ('supervised only', {'data.unlabeled_ratio': 0.0})),
      axes=(('data.max_train_examples', (50, 200)),),
      seeds=(0, 1),
      metrics=('eval_offline_names_span_f1', 'eval_offline_names_accuracy'))
