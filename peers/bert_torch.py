"""BERT pretraining's train step in HuggingFace PyTorch: the peer of bench.py's BERT.

    python peers/bert_torch.py --shape=mini --variant=gathered

The step is the project's (configs/bert_base.py): MLM over 20 masked positions
per sequence plus NSP, dropout 0.1, AdamW (weight decay 0.01, not on biases
and LayerNorm), gradients clipped at global norm 1.0. Variants:
  stock     BertForPreTraining as is: the MLM head scores every position and
            the loss ignores the unmasked ones (labels -100).
  gathered  the encoder, then the MLM head on the masked positions only, as
            google-research/bert and this project do.
"""

import os
import sys

import torch
from transformers import BertConfig, BertForPreTraining

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHAPES = {  # configs/bert_base.py's variants at bench sizes
    'mini': dict(layers=4, hidden=256, heads=4, mlp=1024, batch_size=32, seq_len=128),
    'base': dict(layers=12, hidden=768, heads=12, mlp=3072, batch_size=8, seq_len=128),
}
VOCAB, PREDICTIONS = 30522, 20


def batch(batch_size: int, seq_len: int, seed: int) -> dict:
  g = torch.Generator().manual_seed(seed)
  predictions = min(PREDICTIONS, seq_len)
  positions = torch.stack([torch.randperm(seq_len, generator=g)[:predictions]
                           for _ in range(batch_size)])
  return {
      'input_ids': torch.randint(VOCAB, (batch_size, seq_len), generator=g),
      'token_type_ids': (torch.arange(seq_len) >= seq_len // 2).long().expand(batch_size, -1),
      'attention_mask': torch.ones(batch_size, seq_len, dtype=torch.long),
      'positions': positions,
      'masked_ids': torch.randint(VOCAB, (batch_size, predictions), generator=g),
      'next_sentence': torch.randint(2, (batch_size,), generator=g),
  }


def loss(model: BertForPreTraining, b: dict, variant: str) -> torch.Tensor:
  inputs = {k: b[k] for k in ('input_ids', 'token_type_ids', 'attention_mask')}
  if variant == 'stock':
    labels = torch.full_like(b['input_ids'], -100).scatter(1, b['positions'], b['masked_ids'])
    return model(**inputs, labels=labels, next_sentence_label=b['next_sentence']).loss
  sequence, pooled = model.bert(**inputs, return_dict=False)[:2]
  index = b['positions'][..., None].expand(-1, -1, sequence.shape[-1])
  mlm_logits = model.cls.predictions(torch.gather(sequence, 1, index))
  nsp_logits = model.cls.seq_relationship(pooled)
  ce = torch.nn.functional.cross_entropy
  return (ce(mlm_logits.flatten(0, 1), b['masked_ids'].flatten())
          + ce(nsp_logits, b['next_sentence']))


def main():
  args = common.parse_flags(__doc__.splitlines()[0], SHAPES, ('gathered', 'stock'))
  s = SHAPES[args.shape]
  batch_size, seq_len = args.batch_size or s['batch_size'], args.seq_len or s['seq_len']
  torch.manual_seed(args.seed)
  model = BertForPreTraining(BertConfig(
      vocab_size=VOCAB, hidden_size=s['hidden'], num_hidden_layers=s['layers'],
      num_attention_heads=s['heads'], intermediate_size=s['mlp'], hidden_dropout_prob=0.1,
      attention_probs_dropout_prob=0.1, max_position_embeddings=max(512, seq_len)))
  model.train()
  no_decay = [p for n, p in model.named_parameters() if 'bias' in n or 'LayerNorm' in n]
  decay = [p for n, p in model.named_parameters() if not ('bias' in n or 'LayerNorm' in n)]
  optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.01},
                                 {'params': no_decay, 'weight_decay': 0.0}],
                                lr=1e-4, betas=(0.9, 0.999), eps=1e-6)
  b = batch(batch_size, seq_len, args.seed)

  def step():
    optimizer.zero_grad(set_to_none=True)
    value = loss(model, b, args.variant)
    value.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return value.detach()

  seconds, last = common.seconds_per_step(step, args.steps, args.warmup)
  common.report(f'HF PyTorch {args.variant}', batch_size, seq_len, seconds,
                final_loss=float(last), torch_threads=torch.get_num_threads())


if __name__ == '__main__':
  main()
