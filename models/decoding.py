"""Sampling from a causal LM (greedy, temperature, top-k, with a key/value cache), and
greedy and beam search for sequence-to-sequence models.

Works with any model whose `__call__(batch, decode=...)` takes input_ids and
segment_ids (1 = real token, 0 = padding) and returns float32 'lm_logits',
keeping its decoding state in the 'cache' collection (models/gpt.py).
Prompts of different lengths share one right-padded array; each row
continues right after its own last prompt token:

    ids_BN = decoding.sample(model, params, prompt_ids_BP, prompt_lengths_B,
                             max_new_tokens=50, rng=jax.random.key(0), top_k=40,
                             temperature=0.8, eot_id=tokenizer.eot_id)
"""

import functools
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from input_pipeline import translation

Array = jax.Array


def init_cache(model, batch_size: int, max_length: int) -> Any:
  """An empty decoding cache for `batch_size` rows of up to `max_length` tokens.

  Only shapes are traced: no parameters are made.
  """
  def make():
    ids = jnp.zeros((batch_size, max_length), jnp.int32)
    return model.init(jax.random.key(0), {'input_ids': ids}, decode=True)['cache']
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(make))


def choose_tokens(logits_BV: Array, rng: Array, step: int | Array, *, temperature: float,
                  top_k: int) -> Array:
  """Token `step` of each row: the argmax at temperature 0, else drawn with fold_in(rng, step).

  top_k draws among exactly the k indices of jax.lax.top_k (the lower index first on
  ties), not among every token tied with the k-th logit, so top_k=1 is the argmax.
  """
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  key = jax.random.fold_in(rng, step)
  if not top_k:
    return jax.random.categorical(key, logits_BV).astype(jnp.int32)
  values_BK, indices_BK = jax.lax.top_k(logits_BV, min(top_k, logits_BV.shape[-1]))
  choice_B = jax.random.categorical(key, values_BK)
  return jnp.take_along_axis(indices_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _last(logits_BLV: Array, index_B: Array) -> Array:
  return jnp.take_along_axis(logits_BLV, index_B[:, None, None], axis=1)[:, 0]


def _cached_steps(model, params, prompt_BP, lengths_B, max_new_tokens):
  """The prompt goes through the cache in one call, then one token per call."""
  B, P = prompt_BP.shape

  def start():
    cache = init_cache(model, B, P + max_new_tokens)
    valid_BP = jnp.arange(P)[None] < lengths_B[:, None]
    batch = {'input_ids': prompt_BP, 'segment_ids': valid_BP.astype(jnp.int32)}
    out, variables = model.apply({'params': params, 'cache': cache}, batch, decode=True,
                                 mutable=['cache'])
    return _last(out['lm_logits'], lengths_B - 1), variables['cache']

  def step(cache, token_B, t):
    del t  # the cache knows where it is
    out, variables = model.apply({'params': params, 'cache': cache},
                                 {'input_ids': token_B[:, None]}, decode=True, mutable=['cache'])
    return out['lm_logits'][:, -1], variables['cache']

  return start, step


def _uncached_steps(model, params, prompt_BP, lengths_B, max_new_tokens):
  """The reference: every step recomputes the whole sequence (prompt + tokens so far)."""
  B, P = prompt_BP.shape
  rows_B = jnp.arange(B)

  def logits_at(ids_BS, index_B):
    return _last(model.apply({'params': params}, {'input_ids': ids_BS})['lm_logits'], index_B)

  def start():
    ids_BS = jnp.pad(jnp.where(jnp.arange(P)[None] < lengths_B[:, None], prompt_BP, 0),
                     ((0, 0), (0, max_new_tokens)))
    return logits_at(ids_BS, lengths_B - 1), ids_BS

  def step(ids_BS, token_B, t):
    # Generated token t - 1 sits right after its row's prompt and earlier tokens.
    ids_BS = ids_BS.at[rows_B, lengths_B + t - 1].set(token_B)
    return logits_at(ids_BS, lengths_B + t - 1), ids_BS

  return start, step


@functools.partial(jax.jit, static_argnames=(
    'model', 'max_new_tokens', 'temperature', 'top_k', 'eot_id', 'pad_id', 'use_cache',
    'banned_ids'))
def sample(model, params: Any, prompt_ids_BP: Array, prompt_lengths_B: Array, *,
           max_new_tokens: int, rng: Array, temperature: float = 0.0, top_k: int = 0,
           eot_id: int | None = None, pad_id: int = 0, use_cache: bool = True,
           banned_ids: tuple[int, ...] = ()) -> Array:
  """Continues each prompt by max_new_tokens tokens (B, max_new_tokens), int32.

  prompt_ids_BP: prompts right-padded to a common length P; prompt_lengths_B
  (each >= 1) says how many tokens of each row are real. temperature 0 is
  greedy; top_k 0 keeps the whole vocabulary. After a row generates eot_id,
  its later tokens are pad_id. Step t draws with jax.random.fold_in(rng, t),
  so the cached and uncached (use_cache=False, the reference) paths agree.
  The tokens in banned_ids are never drawn (tokens that are not text, such as padding).
  The cached path scores the whole prompt in one call (B, P, V logits), then
  one token per call; the uncached one reruns all P + max_new_tokens positions.
  """
  B, P = prompt_ids_BP.shape
  N = max_new_tokens
  limit = getattr(getattr(model, 'config', None), 'max_position_embeddings', None)
  if N < 1:
    raise ValueError(f'max_new_tokens={N}: ask for at least one token.')
  if temperature < 0 or top_k < 0:
    raise ValueError(f'temperature={temperature}, top_k={top_k}: use temperature >= 0 (0 is '
                     'greedy) and top_k >= 0 (0 keeps the whole vocabulary).')
  if limit is not None and P + N > limit:
    raise ValueError(f'Prompt length {P} + max_new_tokens={N} exceeds max_position_embeddings='
                     f'{limit}: shorten the prompts or generate fewer tokens.')
  lengths_B = prompt_lengths_B.astype(jnp.int32)
  steps: Callable = _cached_steps if use_cache else _uncached_steps
  start, step = steps(model, params, prompt_ids_BP.astype(jnp.int32), lengths_B, N)
  def choose(logits_BV, step):
    if banned_ids:
      logits_BV = logits_BV.at[:, list(banned_ids)].set(-jnp.inf)
    return choose_tokens(logits_BV, rng, step, temperature=temperature, top_k=top_k)

  finished = ((lambda tok_B: tok_B == eot_id) if eot_id is not None
              else (lambda tok_B: jnp.zeros_like(tok_B, bool)))

  logits_BV, state = start()
  token_B = choose(logits_BV, step=0)
  tokens_BN = jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(token_B)

  def cond(carry):
    t, _, _, done_B, _ = carry
    return (t < N) & ~done_B.all()

  def body(carry):
    t, tokens_BN, token_B, done_B, state = carry
    logits_BV, state = step(state, token_B, t)
    token_B = jnp.where(done_B, pad_id, choose(logits_BV, step=t))
    return t + 1, tokens_BN.at[:, t].set(token_B), token_B, done_B | finished(token_B), state

  carry = (jnp.asarray(1), tokens_BN, token_B, finished(token_B), state)
  return jax.lax.while_loop(cond, body, carry)[1]


# ----------------------------------------------------------------------------
# Search for sequence-to-sequence models (the Transformer, CoVe's MT-LSTM).
#
# A model is reached through `step(tokens_N, state) -> (logits_NV, state)`:
# the logits of the next token of each of N rows after `tokens_N`, whatever
# the model keeps between calls (a key/value cache, LSTM states, the
# encoder's output) in `state`, a pytree whose leaves have N rows first.
# ----------------------------------------------------------------------------

def gather_rows(state: Any, rows_N: Array) -> Any:
  """Every non-scalar leaf of `state` with its rows reordered by `rows_N` (axis 0)."""
  return jax.tree.map(lambda x: x[rows_N] if jnp.ndim(x) else x, state)


def greedy_search(step: Callable, state: Any, batch_size: int, *, bos_id: int, eos_id: int,
                  max_length: int, pad_id: int = 0) -> Array:
  """The argmax token at each step, from BOS until EOS or max_length: (B, max_length) int32.

  EOS is kept; the positions after it hold pad_id.
  """
  B = batch_size

  def cond(carry):
    t, _, _, done_B, _ = carry
    return (t < max_length) & ~done_B.all()

  def body(carry):
    t, tokens_BT, token_B, done_B, state = carry
    logits_BV, state = step(token_B, state)
    token_B = jnp.where(done_B, pad_id, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32))
    return t + 1, tokens_BT.at[:, t].set(token_B), token_B, done_B | (token_B == eos_id), state

  carry = (jnp.asarray(0), jnp.full((B, max_length), pad_id, jnp.int32),
           jnp.full((B,), bos_id, jnp.int32), jnp.zeros((B,), jnp.bool_), state)
  return jax.lax.while_loop(cond, body, carry)[1]


def length_penalty(length: Array, alpha: float) -> Array:
  """((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14), |Y| counting the EOS."""
  return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def beam_search(step: Callable, state: Any, batch_size: int, *, beam_size: int, bos_id: int,
                eos_id: int, max_length: int, alpha: float = 0.6, pad_id: int = 0,
                reorder: Callable = gather_rows) -> tuple[Array, Array]:
  """The best hypothesis of a beam search per row: tokens (B, max_length) and score (B,).

  A hypothesis's score is its log-probability divided by length_penalty
  (alpha 0 scores by log-probability alone; Vaswani et al. 2017 use beam 4
  and alpha 0.6, sec. 6.1). `state` holds B * beam_size rows, beam k of
  example b at row b * beam_size + k (repeat each row beam_size times);
  `reorder(state, rows)` gathers them, by default along axis 0 of every
  leaf. Each step keeps the beam_size best unfinished hypotheses and the
  beam_size best finished ones; the search stops when no unfinished
  hypothesis can still beat the best finished one. A row that finishes no
  hypothesis within max_length returns its best unfinished one.
  """
  B, K = batch_size, beam_size
  neg_inf = jnp.float32(-1e30)
  rows_BK = jnp.arange(B)[:, None] * K

  def top(scores_BX, k):
    return jax.lax.top_k(scores_BX, k)

  def take(x_BX, index_BY):  # per-row gather along axis 1
    return jnp.take_along_axis(x_BX, index_BY.reshape(index_BY.shape + (1,) * (x_BX.ndim - 2)),
                               axis=1)

  def cond(carry):
    t, _, alive_logp_BK, _, finished_BK, _, _ = carry
    # Log-probabilities only fall and the penalty only grows (alpha >= 0), so an unfinished
    # hypothesis scores at most its log-probability now over the penalty of the longest one.
    bound_B = alive_logp_BK[:, 0] / length_penalty(jnp.asarray(max_length), alpha)
    open_B = bound_B > finished_BK[:, 0]
    return (t < max_length) & open_B.any()

  def body(carry):
    t, alive_BKT, alive_logp_BK, fin_BKT, fin_score_BK, token_N, state = carry
    logits_NV, state = step(token_N, state)
    V = logits_NV.shape[-1]
    logp_BKV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1).reshape(B, K, V)
    candidates_BX = (alive_logp_BK[:, :, None] + logp_BKV).reshape(B, K * V)
    # 2K candidates: even if K of them end with EOS, K unfinished ones remain.
    logp_B2, index_B2 = top(candidates_BX, 2 * K)
    beam_B2, token_B2 = index_B2 // V, (index_B2 % V).astype(jnp.int32)
    seqs_B2T = take(alive_BKT, beam_B2).at[:, :, t].set(token_B2)
    ends_B2 = token_B2 == eos_id

    alive_logp_BK, pick_BK = top(jnp.where(ends_B2, neg_inf, logp_B2), K)
    alive_BKT = take(seqs_B2T, pick_BK)
    state = reorder(state, (rows_BK + take(beam_B2, pick_BK)).reshape(-1))
    token_N = take(token_B2, pick_BK).reshape(-1)

    new_score_B2 = jnp.where(ends_B2, logp_B2 / length_penalty(t + 1, alpha), neg_inf)
    fin_score_BX = jnp.concatenate([fin_score_BK, new_score_B2], axis=1)
    fin_score_BK, pick_BK = top(fin_score_BX, K)
    fin_BKT = take(jnp.concatenate([fin_BKT, seqs_B2T], axis=1), pick_BK)
    return t + 1, alive_BKT, alive_logp_BK, fin_BKT, fin_score_BK, token_N, state

  # Only beam 0 is alive at the start, so the first step's K candidates differ.
  alive_logp_BK = jnp.where(jnp.arange(K)[None] == 0, 0.0, neg_inf) * jnp.ones((B, 1))
  carry = (jnp.asarray(0), jnp.full((B, K, max_length), pad_id, jnp.int32), alive_logp_BK,
           jnp.full((B, K, max_length), pad_id, jnp.int32), jnp.full((B, K), neg_inf),
           jnp.full((B * K,), bos_id, jnp.int32), state)
  t, alive_BKT, alive_logp_BK, fin_BKT, fin_score_BK, _, _ = jax.lax.while_loop(
      cond, body, carry)
  none_B = fin_score_BK[:, 0] <= neg_inf
  tokens_BT = jnp.where(none_B[:, None], alive_BKT[:, 0], fin_BKT[:, 0])
  scores_B = jnp.where(none_B, alive_logp_BK[:, 0] / length_penalty(t, alpha),
                       fin_score_BK[:, 0])
  return tokens_BT, scores_B


# ----------------------------------------------------------------------------
# Text to text: a translation model's output for sentences (translate.py and the BLEU of evals).
# ----------------------------------------------------------------------------

LENGTH_BUCKET = 16  # source lengths are padded to a multiple of this: few compiled shapes


@functools.partial(jax.jit, static_argnames=('model', 'beam_size', 'max_length', 'alpha',
                                             'bos_id', 'eos_id'))
def translate_ids(model, params, source_ids_BS: jax.Array, *, beam_size: int, alpha: float,
                  max_length: int, bos_id: int, eos_id: int) -> jax.Array:
  """Output ids (B, max_length) for source ids (B, S), 0 = padding.

  beam_size 1 is greedy search (greedy_search), the others beam
  search. The model's module says how it decodes: its `decoder` gives the
  step function, the starting state of B * beam_size rows and how to
  reorder that state (None: gather_rows).
  """
  B = source_ids_BS.shape[0]
  model_module = importlib.import_module(type(model).__module__)
  step, state, reorder = model_module.decoder(model, params, source_ids_BS,
                                              beam_size=beam_size, max_length=max_length)
  if beam_size == 1:
    return greedy_search(step, state, B, bos_id=bos_id, eos_id=eos_id,
                                  max_length=max_length)
  tokens, _ = beam_search(step, state, B, beam_size=beam_size, bos_id=bos_id,
                                   eos_id=eos_id, max_length=max_length, alpha=alpha,
                                   reorder=reorder or gather_rows)
  return tokens


def translate(model, params, tokenizer, sentences: list[str], *, beam_size: int = 4,
              alpha: float = 0.6, max_extra_length: int = 50, batch_size: int = 32,
              max_length: int | None = None) -> list[str]:
  """The translation of each sentence, in order (batched by length, then restored), on one
  line each: a line break the model writes (byte-level BPE can) is a space."""
  if beam_size < 1:
    raise ValueError(f'beam_size={beam_size}: use 1 (greedy) or more.')
  if alpha < 0 or batch_size < 1:
    raise ValueError(f'alpha={alpha}, batch_size={batch_size}: use alpha >= 0 (the length '
                     'penalty\'s exponent, beam search stops early assuming it) and batch_size '
                     '>= 1.')
  encoded = translation.encode_sources(tokenizer, list(sentences))
  limit = (model.config.max_position_embeddings
           if getattr(model.config, 'positions', None) == 'learned' else None)
  order = np.argsort([len(ids) for ids in encoded], kind='stable')
  outputs = [''] * len(encoded)
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    S = -(-max(len(encoded[i]) for i in rows) // LENGTH_BUCKET) * LENGTH_BUCKET
    T = max_length or S + max_extra_length
    if limit is not None:
      S, T = min(S, limit), min(T, limit)
      if any(len(encoded[i]) > S for i in rows):
        raise ValueError(f'A sentence has more than model.max_position_embeddings={limit} '
                         'tokens: shorten or split it.')
    source = np.zeros((batch_size, S), np.int32)  # a full batch: one compiled shape per S
    for r, i in enumerate(rows):
      source[r, :len(encoded[i])] = encoded[i]
    ids = np.asarray(translate_ids(model, params, jnp.asarray(source), beam_size=beam_size,
                                   alpha=float(alpha), max_length=int(T),
                                   bos_id=tokenizer.start_id, eos_id=tokenizer.eot_id))
    for r, i in enumerate(rows):
      row = list(ids[r])
      end = row.index(tokenizer.eot_id) if tokenizer.eot_id in row else len(row)
      outputs[i] = ' '.join(tokenizer.decode(row[:end]).splitlines())
  return outputs
