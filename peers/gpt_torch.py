"""GPT-1's language-model train step in HuggingFace PyTorch: the peer of bench.py's GPT.

    python peers/gpt_torch.py --shape=base --batch_size=4

OpenAIGPTLMHeadModel at configs/gpt.py's sizes: next-token cross-entropy over
every position, dropout 0.1 (residual, embedding, attention), Adam with
decoupled weight decay 0.01 (not on biases and gains), gradients clipped at
global norm 1.0.
"""

import os
import sys

import torch
from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHAPES = {  # configs/gpt.py's variants at bench sizes
    'mini': dict(layers=4, hidden=256, heads=4, vocab=16384, batch_size=32, seq_len=256),
    'base': dict(layers=12, hidden=768, heads=12, vocab=40478, batch_size=4, seq_len=512),
}


def main():
  args = common.parse_flags(__doc__.splitlines()[0], SHAPES)
  s = SHAPES[args.shape]
  batch_size, seq_len = args.batch_size or s['batch_size'], args.seq_len or s['seq_len']
  torch.manual_seed(args.seed)
  model = OpenAIGPTLMHeadModel(OpenAIGPTConfig(
      vocab_size=s['vocab'], n_positions=seq_len, n_embd=s['hidden'], n_layer=s['layers'],
      n_head=s['heads'], resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
  model.train()
  no_decay = [p for p in model.parameters() if p.ndim == 1]  # biases and LayerNorm gains
  decay = [p for p in model.parameters() if p.ndim > 1]
  optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.01},
                                 {'params': no_decay, 'weight_decay': 0.0}],
                                lr=2.5e-4, betas=(0.9, 0.999), eps=1e-8)
  g = torch.Generator().manual_seed(args.seed)
  tokens = torch.randint(s['vocab'], (batch_size, seq_len), generator=g)

  def step():
    optimizer.zero_grad(set_to_none=True)
    value = model(input_ids=tokens, labels=tokens).loss  # shifted inside
    value.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return value.detach()

  seconds, last = common.seconds_per_step(step, args.steps, args.warmup)
  common.report('HF PyTorch OpenAIGPTLMHeadModel', batch_size, seq_len, seconds,
                final_loss=float(last), torch_threads=torch.get_num_threads())


if __name__ == '__main__':
  main()
