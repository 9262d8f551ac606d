"""BERT's feature-based comparison: the six layer choices of table 7 (Devlin et al. 2018,
sec. 5.3), a 2-layer biLSTM tagger over a frozen BERT's features.

    python sweep.py --sweep=configs/sweeps/bert_features.py --workdir=runs/sweep_features
    python sweep.py --sweep=configs/sweeps/bert_features.py:base,conll2003 --workdir=...

The argument is SIZE[,TASK] (a configs/bert_base.py size; a tagging task of
configs/bert_feature_tagger.py, offline_replaced by default: finding the replaced words needs
the context, while offline_capitalized asks an uncased BERT for casing it never saw, which
fine-tuning can learn word by word but a frozen tiny BERT's features did not give, span F1 0).
The last-four choices need four layers: tiny pretrains a 4-layer tiny BERT, and its taggers'
biLSTMs have 128 units a direction (the paper's 768 is for BERT-base), no dropout and a
learning rate of 3e-3 (with dropout 0.5 at 1e-3 they stayed at the all-O answer in 300 steps).
"""

LAYERS = ('embeddings', 'second_to_last', 'last', 'sum_last_four', 'concat_last_four',
          'sum_all')


def get_sweep(arg: str = 'tiny'):
  size, _, task = arg.partition(',')
  tiny = size == 'tiny'
  return dict(
      stages=(('pretrain', f'configs/bert_base.py:{size}',
               {'model.num_layers': 4, 'train.num_steps': 600} if tiny else {}),
              ('features', f'configs/bert_feature_tagger.py:{task or "offline_replaced"}',
               {'train.num_steps': 300, 'model.task_lstm_dim': 128,
                'model.task_dropout_rate': 0.0, 'optimizer.learning_rate': 3e-3}
               if tiny else {})),
      variants=tuple((layers, {'features.model.feature_layers': layers}) for layers in LAYERS),
      seeds=(0, 1),
      metrics=('eval_span_f1', 'eval_accuracy'))
