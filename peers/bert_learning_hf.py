"""BERT tiny's learning beside HF transformers' BertForPreTraining, on the same batches.

    python peers/bert_learning_hf.py --steps=600 --workdir=runs/bert_learning

Trains configs/bert_base.py:tiny in one phase of 128 tokens (train.py's loop, in
--workdir) and BertForPreTraining of the same sizes (dropout 0.1, AdamW with
weight decay 0.01 off biases and LayerNorm, eps 1e-6, clip at global norm 1.0,
the run's linear warmup and decay) on the run's own training batches, then
scores both on the run's eval batches. The masked positions are split by what
the input shows there: [MASK] (80% of them), the token itself (10%), a random
token (10%). Only a [MASK] position's prediction needs the context; the shown
token is a copy away. The unigram row is the add-one unigram model of the
training split's tokens, which reads neither.
"""

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ('mask', 'kept', 'random')


def scores(logits_fn, eval_batches, mask_id: int) -> dict[str, tuple[float, float, int]]:
  """{kind: (accuracy, perplexity, count)} of the masked positions, by what the input shows."""
  logp, correct, kinds = [], [], []
  for batch in eval_batches:
    log_probs = np.asarray(logits_fn(batch), np.float64)
    log_probs = log_probs - np.logaddexp.reduce(log_probs, axis=-1, keepdims=True)
    targets, weights = batch['masked_lm_ids'], batch['masked_lm_weights']
    shown = np.take_along_axis(batch['input_ids'], batch['masked_lm_positions'], axis=1)
    row, col = np.nonzero(weights)
    logp.append(log_probs[row, col, targets[row, col]])
    correct.append(log_probs[row, col].argmax(-1) == targets[row, col])
    kinds.append(np.where(shown[row, col] == mask_id, 0,
                          np.where(shown[row, col] == targets[row, col], 1, 2)))
  logp, correct, kinds = (np.concatenate(x) for x in (logp, correct, kinds))
  out = {}
  for k, name in enumerate(KINDS):
    chosen = kinds == k
    out[name] = (float(correct[chosen].mean()), float(np.exp(-logp[chosen].mean())),
                 int(chosen.sum()))
  out['all'] = (float(correct.mean()), float(np.exp(-logp.mean())), len(correct))
  return out


def train_hf(config, train_batches, steps: int, vocab_size: int):
  """BertForPreTraining trained on `steps` of the batches as configs/bert_base.py trains."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(config.seed)
  m = config.model
  model = transformers.BertForPreTraining(transformers.BertConfig(
      vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
      num_attention_heads=m.num_heads, intermediate_size=m.mlp_dim,
      max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
      hidden_act='gelu', hidden_dropout_prob=m.dropout_rate,
      attention_probs_dropout_prob=m.attention_dropout_rate, layer_norm_eps=m.layer_norm_eps,
      initializer_range=m.initializer_range))
  opt_cfg = config.optimizer
  no_decay = lambda name: 'bias' in name or 'LayerNorm' in name  # noqa: E731
  optimizer = torch.optim.AdamW(
      [{'params': [p for n, p in model.named_parameters() if not no_decay(n)],
        'weight_decay': opt_cfg.weight_decay},
       {'params': [p for n, p in model.named_parameters() if no_decay(n)], 'weight_decay': 0.0}],
      lr=opt_cfg.learning_rate, betas=(opt_cfg.b1, opt_cfg.b2), eps=opt_cfg.eps)
  warmup = opt_cfg.warmup_steps
  schedule = torch.optim.lr_scheduler.LambdaLR(  # trainer/optimizer.py's linear schedule
      optimizer, lambda s: s / warmup if s < warmup else 1.0 - min(s, steps) / steps)
  as_long = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.long)  # noqa: E731

  def logits(batch):
    out = model(input_ids=as_long(batch['input_ids']),
                attention_mask=as_long(batch['input_mask']),
                token_type_ids=as_long(batch['segment_ids']))
    positions = as_long(batch['masked_lm_positions'])
    mlm = torch.gather(out.prediction_logits, 1, positions[..., None].expand(
        -1, -1, out.prediction_logits.shape[-1]))
    return mlm, out.seq_relationship_logits

  model.train()
  for _ in range(steps):
    batch = next(train_batches)
    mlm, nsp = logits(batch)
    weights = torch.as_tensor(batch['masked_lm_weights'], dtype=torch.float32)
    nll = torch.nn.functional.cross_entropy(
        mlm.flatten(0, 1), as_long(batch['masked_lm_ids']).flatten(), reduction='none')
    loss = (nll * weights.flatten()).sum() / weights.sum().clamp(min=1.0)
    loss = loss + torch.nn.functional.cross_entropy(nsp, as_long(batch['next_sentence_labels']))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_norm)
    optimizer.step()
    schedule.step()
  model.eval()

  def eval_logits(batch):
    with torch.no_grad():
      return logits(batch)[0].numpy()
  return eval_logits


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='a new directory for the JAX run')
  parser.add_argument('--steps', type=int, default=600)
  parser.add_argument('--data_dir', default='', help="config.data.data_dir ('' = the cache)")
  args = parser.parse_args()
  if os.path.exists(args.workdir):
    sys.exit(f'--workdir={args.workdir} exists: pass a new directory.')
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax  # pylint: disable=g-import-not-at-top
  from configs import bert_base  # pylint: disable=g-import-not-at-top
  import input_pipeline  # pylint: disable=g-import-not-at-top
  from input_pipeline.common import sources  # pylint: disable=g-import-not-at-top
  from models import bert  # pylint: disable=g-import-not-at-top
  import trainer.checks  # pylint: disable=g-import-not-at-top
  import trainer.loop  # pylint: disable=g-import-not-at-top

  config = bert_base.get_config('tiny')
  config.data.data_dir = args.data_dir
  config.data.later_phases = ()
  config.train.update(num_steps=args.steps, eval_every=args.steps, checkpoint_every=args.steps)
  config.optimizer.warmup_steps = max(1, args.steps // 10)  # tiny's 60 of 600
  state = trainer.loop.train_and_evaluate(config, args.workdir, devices=jax.devices()[:1])
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size,
                                           saved_dir=args.workdir)

  def batches(split, count=None):
    stream = input_pipeline.get_dataset(config.data, split, tokenizer=tokenizer,
                                        batch_size=config.train.batch_size, seed=config.seed)
    return stream if count is None else [next(stream) for _ in range(count)]

  eval_batches = batches('eval', config.train.eval_steps)  # what the run's eval reads
  model = bert.Model(trainer.checks.model_config(config, 'cpu'))
  params = jax.device_get(state.params)
  ours = scores(lambda b: model.apply({'params': params}, b)['mlm_logits'], eval_batches,
                tokenizer.mask_id)
  hf = scores(train_hf(config, batches('train'), args.steps, tokenizer.vocab_size),
              eval_batches, tokenizer.mask_id)

  # The training split's tokens that MLM may mask: [UNK] too, not [PAD], [CLS], [SEP], [MASK].
  never = [i for i in tokenizer.special_ids if i != tokenizer.unk_id]
  sentences = [s for document in sources.documents(config.data, 'train') for s in document]
  ids = np.concatenate([np.asarray(i, np.int64) for i in tokenizer.encode_batch(sentences)])
  counts = np.bincount(ids[~np.isin(ids, never)], minlength=tokenizer.vocab_size) + 1.0
  counts[never] = 0
  unigram = lambda b: np.broadcast_to(np.log(counts / counts.sum() + 1e-30), (  # noqa: E731
      *b['masked_lm_ids'].shape, tokenizer.vocab_size))
  plain = scores(unigram, eval_batches, tokenizer.mask_id)

  print(f'BERT tiny after {args.steps} steps (128 tokens), eval batches of {args.workdir}: '
        'accuracy / perplexity (positions)')
  print('| model | ' + ' | '.join(f'[{k}]' for k in (*KINDS, 'all')) + ' |')
  print('|---|---|---|---|---|')
  for name, result in (('ours (JAX)', ours), ('HF BertForPreTraining', hf), ('unigram', plain)):
    print(f'| {name} | ' + ' | '.join(
        f'{a:.3f} / {p:.0f} ({n})' for a, p, n in (result[k] for k in (*KINDS, 'all'))) + ' |')


if __name__ == '__main__':
  main()
