"""PyTorch peer of ELMo's biLM train step, beside `bench.py --config=configs/elmo.py:small` (or :tiny).

    python peers/elmo_torch.py --shape=small --steps=5 --warmup=2

The model of models/elmo.py at the sizes of configs/elmo.py (Peters et al.
2018, sec. 3.1): char-CNN with 2 highway layers and a projection, forward and
backward 2-layer LSTM LMs (nn.LSTM with proj_size, residual from layer 2 on,
dropout 0.1 on each layer's input and on the top states), one softmax shared
by both directions, sampled as TF's sampled_softmax_loss (log-uniform classes
drawn without replacement by Gumbel top-k, as objectives/bilm.py), Adagrad
0.2 with accumulators at 1.0, global norm clipped at 10, loss x max_seq_length.
Deviations, each making this step cheaper, so the comparison is conservative:
nn.LSTM cannot clip the cell or the projection (cell_clip/proj_clip 3.0 are
dropped), and the softmax scores only the L - 1 rows with a target per
direction where the project scores all L. nn.LSTM also has a second bias
(4S more parameters per layer), and torch's Adagrad divides by sqrt(acc) + eps
where optax uses sqrt(acc + eps).
"""

import math
import os
import sys

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (peers/common.py)

# configs/elmo.py VARIANTS (max_seq_length is also the loss's gradient_scale).
SHAPES = {
    'tiny': dict(filters=((1, 16), (2, 16), (3, 32), (4, 64)), projection_dim=128, lstm_dim=256,
                 vocab_size=8192, num_sampled=0, max_seq_length=20, batch_size=32),
    'small': dict(filters=((1, 32), (2, 32), (3, 64), (4, 128), (5, 256)), projection_dim=256,
                  lstm_dim=1024, vocab_size=100_000, num_sampled=4096, max_seq_length=20,
                  batch_size=128),
}
NUM_CHARS, CHAR_DIM, MAX_CHARS = 262, 16, 50  # models/elmo.py, configs/elmo.py
NUM_LAYERS, DROPOUT, FORGET_BIAS, HIGHWAY_GATE_BIAS = 2, 0.1, 1.0, -2.0


class CharCNN(nn.Module):
  """Char ids (B, L, W) -> (B, L, D): embed, convolve, max-pool, relu, highway, project (when
  the filters are not D wide)."""

  def __init__(self, filters, output_dim):
    super().__init__()
    N = sum(n for _, n in filters)
    self.embed = nn.Embedding(NUM_CHARS, CHAR_DIM, padding_idx=0)  # id 0 (no token) is zeros
    nn.init.uniform_(self.embed.weight, -1.0, 1.0)
    with torch.no_grad():
      self.embed.weight[0].zero_()
    self.convs = nn.ModuleList(nn.Conv1d(CHAR_DIM, n, w) for w, n in filters)
    for conv in self.convs:
      nn.init.uniform_(conv.weight, -0.05, 0.05)
      nn.init.zeros_(conv.bias)
    self.highways = nn.ModuleList(nn.Linear(N, 2 * N) for _ in range(2))  # [gate; transform]
    # As bilm-tf and models/elmo.py: no projection when the filters are output_dim wide.
    self.projection = nn.Linear(N, output_dim) if N != output_dim else nn.Identity()
    for layer in [*self.highways, *([self.projection] if N != output_dim else [])]:
      nn.init.normal_(layer.weight, std=N ** -0.5)
      nn.init.zeros_(layer.bias)
    for highway in self.highways:
      nn.init.constant_(highway.bias[:N], HIGHWAY_GATE_BIAS)

  def forward(self, char_ids_BLW):
    B, L, W = char_ids_BLW.shape
    e_XEW = self.embed(char_ids_BLW.reshape(B * L, W)).transpose(1, 2)
    x_XN = torch.cat([F.relu(conv(e_XEW).amax(dim=2)) for conv in self.convs], dim=1)
    for highway in self.highways:
      gate_XN, transform_XN = highway(x_XN).chunk(2, dim=1)
      gate_XN = torch.sigmoid(gate_XN)
      x_XN = gate_XN * F.relu(transform_XN) + (1.0 - gate_XN) * x_XN
    return self.projection(x_XN).reshape(B, L, -1)


def lstm_layer(D, S):
  """One projected LSTM layer, initialized as models/lstm.py (Glorot over [input; recurrent])."""
  lstm = nn.LSTM(input_size=D, hidden_size=S, proj_size=D, batch_first=True)
  limit = math.sqrt(6.0 / (D + D + 4 * S))
  nn.init.uniform_(lstm.weight_ih_l0, -limit, limit)
  nn.init.uniform_(lstm.weight_hh_l0, -limit, limit)
  nn.init.xavier_uniform_(lstm.weight_hr_l0)
  nn.init.zeros_(lstm.bias_ih_l0)
  nn.init.zeros_(lstm.bias_hh_l0)
  with torch.no_grad():
    lstm.bias_ih_l0[S:2 * S] = FORGET_BIAS  # the project adds it to f's pre-activation
  return lstm


class BiLM(nn.Module):
  """Token encoder, forward and backward LSTM LMs and the shared (V, D) softmax; returns the loss."""

  def __init__(self, shape):
    super().__init__()
    D, S, V = shape['projection_dim'], shape['lstm_dim'], shape['vocab_size']
    self.char_cnn = CharCNN(shape['filters'], D)
    self.forward_lm = nn.ModuleList(lstm_layer(D, S) for _ in range(NUM_LAYERS))
    self.backward_lm = nn.ModuleList(lstm_layer(D, S) for _ in range(NUM_LAYERS))
    self.softmax_kernel = nn.Parameter(torch.randn(V, D) * D ** -0.5)
    self.softmax_bias = nn.Parameter(torch.zeros(V))
    self.dropout = nn.Dropout(DROPOUT)

  def run(self, lstms, x_BLD):
    for i, lstm in enumerate(lstms):
      x_BLD = self.dropout(x_BLD)
      h_BLD, _ = lstm(x_BLD)
      x_BLD = h_BLD + x_BLD if i else h_BLD
    return self.dropout(x_BLD)

  def forward(self, char_ids_BLW, token_ids_BL, sample):
    token_BLD = self.char_cnn(char_ids_BLW)
    forward_BLD = self.run(self.forward_lm, token_BLD)
    backward_BLD = self.run(self.backward_lm, token_BLD.flip(1)).flip(1)
    D = token_BLD.shape[-1]
    # Full rows: the forward target at t is token t + 1, the backward one token t - 1.
    nlls = [self.nll(states.reshape(-1, D), targets.reshape(-1), sample)
            for states, targets in ((forward_BLD[:, :-1], token_ids_BL[:, 1:]),
                                    (backward_BLD[:, 1:], token_ids_BL[:, :-1]))]
    return 0.5 * (nlls[0].mean() + nlls[1].mean())

  def nll(self, states_ND, targets_N, sample):
    if sample is None:
      return F.cross_entropy(states_ND @ self.softmax_kernel.T + self.softmax_bias, targets_N,
                             reduction='none')
    sampled_K, log_q_V = sample  # TF's sampled_softmax_loss, as objectives/bilm.py
    true_N = ((states_ND * self.softmax_kernel[targets_N]).sum(-1) + self.softmax_bias[targets_N]
              - log_q_V[targets_N])
    sampled_NK = (states_ND @ self.softmax_kernel[sampled_K].T
                  + (self.softmax_bias[sampled_K] - log_q_V[sampled_K]))
    hit_NK = sampled_K[None, :] == targets_N[:, None]
    sampled_NK = sampled_NK.masked_fill(hit_NK, torch.finfo(torch.float32).min)
    return torch.logsumexp(torch.cat([true_N[:, None], sampled_NK], dim=1), dim=1) - true_N


def log_uniform(V, K):
  """log q (V,) and the log expected counts (V,) of K ids drawn without replacement (TF's tries)."""
  q_V = np.log1p(1.0 / (np.arange(V) + 1.0)) / math.log(V + 1.0)
  log1m_q_V = np.log1p(-q_V)
  counts = lambda log_tries: -np.expm1(np.exp(log_tries) * log1m_q_V)  # noqa: E731
  low, high = math.log(K), math.log(30.0 / q_V.min())
  for _ in range(60):  # the number of tries T whose expected counts sum to K
    middle = 0.5 * (low + high)
    low, high = (low, middle) if counts(middle).sum() > K else (middle, high)
  return (torch.tensor(np.log(q_V), dtype=torch.float32),
          torch.tensor(np.log(counts(0.5 * (low + high))), dtype=torch.float32))


def main():
  args = common.parse_flags(__doc__.splitlines()[0], SHAPES)
  shape = SHAPES[args.shape]
  B = args.batch_size or shape['batch_size']
  L = args.seq_len or shape['max_seq_length']
  V, K = shape['vocab_size'], shape['num_sampled']
  if L < 2:
    sys.exit(f'--seq_len={L} leaves no neighbour token to predict: use 2 or more.')
  if K >= V:
    sys.exit(f'num_sampled={K} >= vocab_size={V}: use the full softmax (num_sampled 0).')
  torch.manual_seed(args.seed)
  rng = np.random.default_rng(args.seed)
  char_ids = torch.from_numpy(rng.integers(1, NUM_CHARS, (B, L, MAX_CHARS)))
  token_ids = torch.from_numpy(rng.integers(0, V, (B, L)))

  model = BiLM(shape).train()
  optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=1.0,
                                  eps=1e-7)
  log_q_V, log_counts_V = log_uniform(V, K) if K else (None, None)

  first_loss = []

  def step():
    sample = None
    if K:  # K classes without replacement: Gumbel top-k over log q, once per step
      gumbel_V = -torch.log(-torch.log(torch.rand(V).clamp_min(1e-20)))
      sample = (torch.topk(log_q_V + gumbel_V, K).indices, log_counts_V)
    optimizer.zero_grad(set_to_none=True)
    loss = model(char_ids, token_ids, sample)
    (loss * shape['max_seq_length']).backward()  # configs/elmo.py's loss.gradient_scale
    nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    optimizer.step()
    first_loss[:] = first_loss or [loss.item()]
    return loss.detach()

  step_seconds, loss = common.seconds_per_step(step, args.steps, args.warmup)
  common.report('pytorch nn.LSTM, sampled softmax', B, L, step_seconds,
                softmax=f'sampled {K}' if K else 'full', first_loss=round(first_loss[0], 4),
                final_loss=round(float(loss), 4),
                torch_threads=torch.get_num_threads(),
                params=sum(p.numel() for p in model.parameters()))


if __name__ == '__main__':
  main()
