"""GPT-1's language-model train step in HF PyTorch on an NVIDIA GPU: the peer of bench.py's GPT there.

    python peers/gpt_torch_gpu.py --batch_size=64 --mode=compile

OpenAIGPTLMHeadModel at configs/gpt.py's base sizes (12 layers, 768 wide, 12 heads, 40,478
words, 512 positions), dropout 0.1 (residual, embedding, attention), the loss over every next
token in float32, bfloat16 autocast, fused AdamW (decay 0.01 off biases and gains), gradients
clipped at global norm 1.0; eager or under torch.compile. Its attention is PyTorch's fused
scaled_dot_product_attention, causal, with the dropout inside (--attention=sdpa, the default):
the library's OpenAI GPT has no SDPA path and writes every (batch, head, query, key) score to
memory (--attention=eager, what the peer ran before 2026-12-02), so it is no fair peer of a
fused kernel (the BERT peer runs SDPA). One JSON line: mean seconds per step
over --steps after 5 warm-up steps, steps run ahead with one synchronization at the end (as
bench.py lets them run ahead).
"""

import argparse
import json
import time
import types

import torch
from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel
from transformers.models.openai.modeling_openai import Attention


def use_sdpa(model: torch.nn.Module) -> torch.nn.Module:
  """`model` with each attention layer's scores, mask, softmax and dropout in one call of
  torch's scaled_dot_product_attention (causal; dropout at the layer's attention rate while
  training); the same function as the library's, within rounding."""
  def attend(layer, q, k, v, attention_mask=None, output_attentions=False):
    if attention_mask is not None or output_attentions:
      raise ValueError('the SDPA peer takes no attention mask and returns no attention weights')
    # The library passes k transposed, (batch, heads, head_dim, length).
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(-1, -2), v, is_causal=True,
        dropout_p=layer.attn_dropout.p if layer.training else 0.0,
        scale=None if layer.scale else 1.0)
    return [out]

  for module in model.modules():
    if isinstance(module, Attention):
      module._attn = types.MethodType(attend, module)  # pylint: disable=protected-access
  return model


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument('--seq_len', type=int, default=512)
  parser.add_argument('--layers', type=int, default=12)
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--dropout', type=float, default=0.1)
  parser.add_argument('--mode', choices=('eager', 'compile'), default='compile')
  parser.add_argument('--attention', choices=('sdpa', 'eager'), default='sdpa')
  args = parser.parse_args()
  torch.manual_seed(0)
  torch.backends.cuda.matmul.allow_tf32 = True
  model = OpenAIGPTLMHeadModel(OpenAIGPTConfig(
      vocab_size=40478, n_positions=512, n_embd=768, n_layer=args.layers, n_head=12,
      resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)).cuda()
  if args.attention == 'sdpa':
    use_sdpa(model)
  model.train()
  gains_and_biases = [p for p in model.parameters() if p.ndim == 1]
  matrices = [p for p in model.parameters() if p.ndim > 1]
  optimizer = torch.optim.AdamW([{'params': matrices, 'weight_decay': 0.01},
                                 {'params': gains_and_biases, 'weight_decay': 0.0}],
                                lr=2.5e-4, fused=True)
  tokens = torch.randint(40478, (args.batch_size, args.seq_len), device='cuda',
                         generator=torch.Generator('cuda').manual_seed(0))

  def loss_fn():
    with torch.autocast('cuda', dtype=torch.bfloat16):
      logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

  if args.mode == 'compile':
    loss_fn = torch.compile(loss_fn)

  def step():
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss

  start = time.perf_counter()
  for _ in range(5):
    step()
  torch.cuda.synchronize()
  warmup = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(args.steps):
    loss = step()
  torch.cuda.synchronize()
  seconds = (time.perf_counter() - start) / args.steps
  print(json.dumps({
      'peer': f'torch-{args.mode}', 'model': 'OpenAIGPTLMHeadModel', 'torch': torch.__version__,
      'attention': args.attention,
      'gpu': torch.cuda.get_device_name(), 'batch': args.batch_size, 'seq': args.seq_len,
      'dropout': args.dropout, 'step_seconds': round(seconds, 5),
      'tokens_per_sec': round(args.batch_size * args.seq_len / seconds),
      'warmup_seconds': round(warmup, 1),
      'peak_mem_gib': round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
      'loss': float(loss)}))


if __name__ == '__main__':
  main()
