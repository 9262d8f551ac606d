"""Flash attention with dropout on the attention probabilities inside the kernel (Pallas), for
NVIDIA GPUs: BERT's and GPT's attention_probs_dropout_prob without XLA's unfused attention.

The mask is counted, not stored: models/dropout.py's mask of the (B, H, L, S) probabilities, the
one XLA's attention applies for the same RNG. Query i of (b, h) has the word row = mix(key[b, h] ^
mix(i)), with the keys (B, H) drawn from the layer's 'dropout' RNG; the pair of key positions
(2c, 2c + 1) has the word column = mix(c ^ COLUMN_SALT); and mix(row ^ column), `mix` a bijection
of 32-bit words in which every output bit depends on every input bit, gives element (b, h, i, 2c)
its low 16 bits and (b, h, i, 2c + 1) its high 16 bits. An element is dropped where its 16 bits
fall below rate * 2^16. A tile's row words are a
vector, the column words a constant of the program, so two elements cost one xor and one `mix`:
a quarter of what a `mix` of a per-element counter and another of the key cost an element,
which was the largest part of the kernels' per-element work (peers/flash_dropout_ptx.py counts
it). So the masks come from the step's RNG (a resumed run draws the ones an uninterrupted run
would), every layer, step and shard of the batch draws its own, and the backward kernels
recompute the forward's mask instead of reading it. `keep_mask` gives the same mask as an
array: `reference` is this function in XLA ops (the lengths the kernel does not tile take it),
and tests compare the kernel with it.

`self_attention` takes a self-attention's q, k and v as one (B, L, 3, H, K) array (the output of
one projection matmul, models/layers.py) and gives their gradient as one, the kernels reading and
writing it in place.

On a GPU the kernels go through Pallas' Triton backend; elsewhere (tests on a CPU) they run in
Pallas' interpret mode. Each kernel declares its FLOPs in its metadata, so that aot.py's
estimate costs it like cuDNN's attention (trainer/hlo.py).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from models import dropout

try:  # the Triton backend's parameters: a jax that moved them compiles with Pallas' defaults
  from jax.experimental.pallas import triton as pl_triton
except ImportError:
  pl_triton = None

Array = jax.Array

NEG_INF = -1e9  # as layers.NEG_INF: a query that sees no key spreads evenly over what it visits
# The kernels' logit where a key is not seen: a power of two, so that its product with the scale
# (_exp2's) is exact and a query that sees no key has exponents of exactly 0, spreading evenly
# as `reference` does (-1e9 times the scale rounds by up to 8, which a fused multiply-add keeps:
# 2^8 between two tiles' weights).
UNSEEN = -2.0 ** 30
# Tiles (queries x keys) of the forward and the backward kernels; lengths that are not
# multiples of them, and head sizes that are not powers of two of at least 16, take `reference`.
FORWARD_BLOCKS = (128, 64)
BACKWARD_BLOCKS = (64, 64)
# Lengths up to this (powers of two) take one backward kernel a (b, h) that holds all its queries
# (_all_grads: each key tile's scores, mask and exponentials made once, not twice; 5 products a
# tile, not 7), at ALL_GRADS_WARPS warps (at 4, ptxas spills 1.2 KB a thread of BERT-base's;
# peers/flash_dropout_ptx.py). 0, off: checked here in interpret mode, it waits for a GPU's
# check and time (peers/flash_dropout_gpu.py) before BERT's 128 takes it.
WHOLE_QUERIES = 0
ALL_GRADS_WARPS = 8
# On NVIDIA GPUs, each exponential as one fma and one ex2.approx.ftz of inline PTX (_exp2): 2
# instructions an element where jnp.exp2 takes 6. False, off: interpret mode runs jnp.exp2, so
# this CPU cannot run the PTX (only assemble it: peers/flash_dropout_ptx.py); it waits for a
# GPU's check and time (peers/flash_dropout_gpu.py) before it becomes the default.
EXP2_PTX = False
# Triton's launch parameters, as first written (peers/flash_dropout_gpu.py variants times
# other tiles and these on a GPU).
TRITON_PARAMS = {'num_warps': 4, 'num_stages': 2}
_LOG2_E = math.log2(math.e)


def _dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """A tile's matrix product in float32, either side transposed: the dot_general `pl.dot` made
  (jax 0.11 deprecated `pl.dot`, 0.12 removed it)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _threshold(rate: float) -> int:
  """Elements whose 16 bits fall below this are dropped (dropout.threshold), at most 2^16 - 1,
  as keep_pairs' 32-bit comparisons take it (a draw of 0xFFFF is kept at any rate)."""
  return min(dropout.threshold(rate), 2 ** 16 - 1)


def keep_scale(rate: float) -> float:
  """1 / P(keep): what kept probabilities are multiplied by."""
  return dropout.keep_scale(_threshold(rate))


def _keep(row_words: Array, pair_words: Array, rate: float) -> Array:
  """A tile's kept elements (rows, 2 x pairs) of its row words (rows,) and the words of its pairs
  of columns (pairs,): keep_mask's, one `mix` a pair (dropout.keep_pairs)."""
  return dropout.keep_pairs(row_words, pair_words, _threshold(rate))


def dropout_keys(rng: Array, batch: int, heads: int) -> Array:
  """The (B, H) uint32 keys of one call's masks, drawn from `rng` (dropout.draw_keys)."""
  return dropout.draw_keys(rng, (batch, heads))


def keep_mask(keys_BH: Array, length: int, num_keys: int, rate: float) -> Array:
  """The boolean (B, H, L, S) mask the kernels apply for these keys (models/dropout.py's)."""
  return dropout.keep_for_keys(keys_BH, length, num_keys, _threshold(rate))


def visible(q_ids_BL: Array, kv_ids_BS: Array, causal: bool) -> Array:
  """The boolean (B, 1, L, S) attention mask of segment ids: query i sees key j of its own
  segment, never padding (id 0), and with causality none after i (layers.SegmentMask.dense)."""
  mask_BLS = (q_ids_BL[:, :, None] == kv_ids_BS[:, None, :]) & (kv_ids_BS > 0)[:, None, :]
  if causal:
    L, S = q_ids_BL.shape[1], kv_ids_BS.shape[1]
    mask_BLS &= jnp.arange(L)[:, None] >= jnp.arange(S)[None, :]
  return mask_BLS[:, None]


def reference(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, q_ids_BL: Array, kv_ids_BS: Array,
              keys_BH: Array, rate: float, causal: bool) -> Array:
  """The kernels' function in XLA ops: softmax(q k^T / sqrt(K)) with the counted mask, times v."""
  L, S, K = q_BLHK.shape[1], k_BSHK.shape[1], q_BLHK.shape[3]
  logits_BHLS = jnp.einsum('BLHK,BSHK->BHLS', q_BLHK, k_BSHK).astype(jnp.float32) / math.sqrt(K)
  logits_BHLS = jnp.where(visible(q_ids_BL, kv_ids_BS, causal), logits_BHLS, NEG_INF)
  probs_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
  if rate:
    probs_BHLS = jnp.where(keep_mask(keys_BH, L, S, rate),
                           probs_BHLS * keep_scale(rate), 0.0)
  return jnp.einsum('BHLS,BSHK->BLHK', probs_BHLS.astype(v_BSHK.dtype), v_BSHK)


def tiles(length: int, num_keys: int, head_dim: int) -> bool:
  """Whether the kernels take these sizes (else `attention` computes `reference`)."""
  blocks_fit = all(length % bq == 0 and num_keys % bk == 0
                   for bq, bk in (FORWARD_BLOCKS, BACKWARD_BLOCKS))
  return blocks_fit and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def whole_queries(length: int) -> bool:
  """Whether the backward takes a (b, h)'s `length` queries in one tile (_all_grads)."""
  return length <= WHOLE_QUERIES and length & (length - 1) == 0


class _Visible:
  """Which keys of a tile its queries see: a query the keys of its own segment, never padding
  (kv ids of -1, `attention`), and with causality none after it. `where` selects only in a tile
  that `whole` (_whole_tiles' entry) does not call whole, where some query misses some key; in
  the others (most tiles of BERT's and GPT's rows) it leaves the tile as it is: one branch a
  tile instead of a comparison and a select an element."""

  def __init__(self, whole: Array, q_ids, kv_ids, rows, cols, causal: bool):
    self.whole, self.q_ids, self.kv_ids = whole != 0, q_ids, kv_ids
    self.rows, self.cols, self.causal = rows, cols, causal

  def seen(self) -> Array:
    seen = self.q_ids[:, None] == self.kv_ids[None, :]
    if self.causal:
      seen &= self.rows[:, None] >= self.cols[None, :]
    return seen

  def where(self, x: Array, unseen: Array) -> Array:
    """x where seen, `unseen` (one a row) elsewhere."""
    return jax.lax.cond(self.whole, lambda x, unseen: x,
                        lambda x, unseen: jnp.where(self.seen(), x, unseen), x, unseen)


def _scores(q, k, visible: _Visible) -> Array:
  """A tile's logits q k^T, UNSEEN where not visible. `_exp2` scales them (log2(e) / sqrt(K):
  `_scale_log2`)."""
  return visible.where(_dot(q, k, trans_b=True), jnp.full((q.shape[0], 1), UNSEEN, jnp.float32))


def _whole_tiles(q_ids_BL: Array, kv_ids_BS: Array, block_q: int, block_k: int,
                 causal: bool) -> Array:
  """(B, Q, T) int32, Q = L // block_q query tiles by T = S // block_k key tiles: 1 for a tile
  whose every query sees every key (one segment id throughout, no padding query or key, and
  with causality no key after the tile's first query), whose masking the kernels leave out
  (_Visible). The kv ids as `attention` gives them (padding -1)."""
  (B, L), S = q_ids_BL.shape, kv_ids_BS.shape[1]
  q_ids = q_ids_BL.reshape(B, L // block_q, 1, block_q)
  kv_ids = kv_ids_BS.reshape(B, 1, S // block_k, block_k)
  segment = q_ids.max(-1)
  whole = ((q_ids.min(-1) == segment) & (kv_ids.min(-1) == segment)
           & (kv_ids.max(-1) == segment))
  if causal:
    first_rows = jnp.arange(L // block_q)[:, None] * block_q
    last_cols = jnp.arange(S // block_k)[None, :] * block_k + block_k - 1
    whole &= last_cols <= first_rows
  return whole.astype(jnp.int32)


def _scale_log2(head_dim: int) -> float:
  """What turns logits into the base-2 exponents of the softmax: log2(e) / sqrt(K)."""
  return _LOG2_E / math.sqrt(head_dim)


# 2^(x * scale - shift) as one fma and one ex2.approx.ftz an element. jnp.exp2 goes to libdevice's
# exp2f, whose ex2.approx XLA's pipeline compiles without flush-to-zero: ptxas puts a compare and
# two multiplies around it for subnormal results, and the scale and the shift were a multiply and
# a subtraction of their own (6 instructions an element where these take 2; peers/
# flash_dropout_ptx.py counts them). Flushing a result below 2^-126 to 0 changes no probability
# that matters, and the exponents are the same numbers to within the fma's one rounding.
_EXP2_PTX = '{ .reg .f32 t; fma.rn.ftz.f32 t, $1, 0f%08X, $2; ex2.approx.ftz.f32 $0, t; }'


def _unseen_zeros(row_values: Array) -> Array:
  """Zeros, one a row, that the compiler cannot tell from other numbers (the rows' finite
  `row_values` times 0): what a select that a bfloat16 conversion follows keeps where a
  constant 0.0 was. With the constant, LLVM moves the select past the conversion, which then
  converts one element at a time and packs the pairs again: 2.4 instructions an element more
  in the forward's loop (peers/flash_dropout_ptx.py's SASS counts)."""
  return (row_values * 0.0)[:, None]


def _exp2(logits: Array, scale: float, shift: Array, ptx: bool) -> Array:
  """2^(logits * scale - shift), `shift` one number a row: with `ptx` (EXP2_PTX, on an NVIDIA
  GPU) one fma and one ex2 an element (_EXP2_PTX), otherwise in jax ops."""
  if not ptx:
    return jnp.exp2(logits * scale - shift[:, None])
  scale_bits = int(np.float32(scale).view(np.uint32))
  [powers] = pl_triton.elementwise_inline_asm(
      _EXP2_PTX % scale_bits, args=[logits, jnp.broadcast_to(-shift[:, None], logits.shape)],
      constraints='=f,f,f', pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(logits.shape, jnp.float32)])
  return powers


def _pair_span(tile: Array, block_k: int):
  """Where key tile `tile`'s column pairs' words lie in `columns_ref`."""
  return pl.ds(tile * (block_k // 2), block_k // 2)


def _key_blocks(q_block: Array, block_q: int, block_k: int, num_keys: int, causal: bool):
  """How many key tiles a query tile visits: with causality, none past its last query."""
  if causal:
    return jax.lax.div((q_block + 1) * block_q + block_k - 1, block_k)
  return num_keys // block_k


class _Part:
  """q, k or v (part 0, 1, 2) of one (b, h)'s (rows, 3, K) block of a fused (B, L, 3, H, K)
  array (self_attention's), which a kernel takes as one operand (its bytes read once, not
  counted thrice as three operands'), loaded and stored as a (rows, K) ref: each access is one
  index into the block (Triton's lowering takes no index into a view of a ref)."""

  def __init__(self, ref, part: int):
    self.ref, self.part = ref, part

  @property
  def shape(self) -> tuple[int, int]:
    return self.ref.shape[0], self.ref.shape[2]

  @property
  def dtype(self):
    return self.ref.dtype

  def _index(self, index) -> tuple:
    rows, cols = (slice(None), slice(None)) if index is Ellipsis else index
    return rows, self.part, cols

  def __getitem__(self, index):
    return self.ref[self._index(index)]

  def __setitem__(self, index, value):
    self.ref[self._index(index)] = value


def _parts(qkv_ref) -> tuple[_Part, _Part, _Part]:
  """q, k and v of one (rows, 3, K) block."""
  return _Part(qkv_ref, 0), _Part(qkv_ref, 1), _Part(qkv_ref, 2)


def _forward_kernel(*refs, rate: float, causal: bool, block_k: int, fused: bool, ptx: bool):
  """One (b, h, query tile): the online softmax over the key tiles (flash attention), the
  dropout applied to each tile's probabilities before they multiply v. The refs: key, q ids,
  kv ids, column words, whole tiles (the query tile's row of them), q, k and v (with `fused`:
  one (S, 3, K) block of them), out, lse."""
  key_ref, q_ids_ref, kv_ids_ref, columns_ref, whole_ref = refs[:5]
  out_ref, lse_ref = refs[-2:]
  block_q, q_block = out_ref.shape[0], pl.program_id(2)
  if fused:  # the whole (S, 3, K) block: q is its query tile's rows
    q_ref, k_ref, v_ref = _parts(refs[5])
    q = q_ref[pl.ds(q_block * block_q, block_q), :]
  else:
    q_ref, k_ref, v_ref = refs[5:8]
    q = q_ref[...]
  S = k_ref.shape[0]
  rows = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
  q_ids = q_ids_ref[...]
  row_words = dropout.row_words(key_ref[...], rows) if rate else None
  to_log2 = _scale_log2(q.shape[1])

  def visit(t, carry):  # `top`: the rows' largest logit so far
    acc, top, total = carry
    span = pl.ds(t * block_k, block_k)
    cols = t * block_k + jnp.arange(block_k, dtype=jnp.int32)
    logits = _scores(q, k_ref[span, :],
                     _Visible(whole_ref[t], q_ids, kv_ids_ref[span], rows, cols, causal))
    new_top = jnp.maximum(top, logits.max(axis=1))
    decay = jnp.exp2(top * to_log2 - new_top * to_log2)
    p = _exp2(logits, to_log2, new_top * to_log2, ptx)
    total = total * decay + p.sum(axis=1)  # the normalizer counts the dropped ones too
    if rate:
      p = jnp.where(_keep(row_words, columns_ref[_pair_span(t, block_k)], rate), p,
                    _unseen_zeros(new_top))
    v = v_ref[span, :]
    acc = acc * decay[:, None] + _dot(p.astype(v.dtype), v)
    return acc, new_top, total

  start = (jnp.zeros((block_q, q.shape[1]), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  stop = _key_blocks(q_block, block_q, block_k, S, causal)
  acc, top, total = jax.lax.fori_loop(0, stop, visit, start)
  scale = keep_scale(rate) if rate else 1.0
  out_ref[...] = (acc * (scale / total)[:, None]).astype(out_ref.dtype)
  lse_ref[...] = top * to_log2 + jnp.log2(total)


def _tile_grads(q, k, v, dout, visible: _Visible, lse, delta, mask_words, rate: float,
                ptx: bool):
  """One tile's (queries x keys) backward: dS and the tile's part of dV, P'^T dO, both over the
  keep scale (it multiplies dQ, dK and dV once, at the end), P' the kept probabilities. `delta`
  is over the keep scale too; `mask_words` the tile's row and column-pair words (`_keep`)."""
  p = _exp2(_scores(q, k, visible), _scale_log2(q.shape[1]), lse, ptx)
  dprobs = _dot(dout, v, trans_b=True)
  zeros = _unseen_zeros(lse)
  if not rate:
    dv = _dot(p.astype(dout.dtype), dout, trans_a=True)
  else:
    kept = _keep(*mask_words, rate)
    dv = _dot(jnp.where(kept, p, zeros).astype(dout.dtype), dout, trans_a=True)
    dprobs = jnp.where(kept, dprobs, 0.0)
  # A query that sees no key has probabilities over what it visits, but no gradient to them.
  return visible.where(p * (dprobs - delta[:, None]), zeros), dv


def _key_grads(t: Array, refs, rate: float, causal: bool, ptx: bool) -> tuple[Array, Array]:
  """dK and dV of key tile `t`, summed over the query tiles that visit it. `refs` are one
  (b, h)'s whole inputs: key, q ids, kv ids, column words, whole tiles, q, k, v, dout, lse,
  delta."""
  key_ref, q_ids_ref, kv_ids_ref, columns_ref, whole_ref, q_ref, k_ref, v_ref, dout_ref, \
      lse_ref, delta_ref = refs
  L, K = q_ref.shape
  block_q, block_k = BACKWARD_BLOCKS
  span_k = pl.ds(t * block_k, block_k)
  cols = t * block_k + jnp.arange(block_k, dtype=jnp.int32)
  k, v, kv_ids = k_ref[span_k, :], v_ref[span_k, :], kv_ids_ref[span_k]
  key, pair_words = (key_ref[...], columns_ref[_pair_span(t, block_k)]) if rate else (None, None)
  scale = keep_scale(rate) if rate else 1.0

  def visit(i, carry):
    dk, dv = carry
    span = pl.ds(i * block_q, block_q)
    rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
    q = q_ref[span, :]
    words = (dropout.row_words(key, rows), pair_words) if rate else None
    visible = _Visible(whole_ref[i, t], q_ids_ref[span], kv_ids, rows, cols, causal)
    dscores, dv_part = _tile_grads(q, k, v, dout_ref[span, :], visible, lse_ref[span],
                                   delta_ref[span] * (1 / scale), words, rate, ptx)
    return dk + _dot(dscores.astype(q.dtype), q, trans_a=True), dv + dv_part

  zeros = jnp.zeros((block_k, K), jnp.float32)
  first = (t * block_k) // block_q if causal else 0  # query tiles before it see none of it
  dk, dv = jax.lax.fori_loop(first, L // block_q, visit, (zeros, zeros))
  return dk * (scale / math.sqrt(K)), dv * scale


def _all_grads(refs, dq_ref, dk_ref, dv_ref, rate: float, causal: bool, ptx: bool):
  """dQ, dK and dV of one (b, h) whose queries all fit one tile (up to WHOLE_QUERIES): each key
  tile's scores, mask and probabilities are made once for all three (five products, where a
  query tile's dQ and a key tile's dK and dV of their own make them twice in seven), its dK and
  dV complete in its pass, dQ summed over the key tiles. `refs` as _key_grads'."""
  key_ref, q_ids_ref, kv_ids_ref, columns_ref, whole_ref, q_ref, k_ref, v_ref, dout_ref, \
      lse_ref, delta_ref = refs
  (L, K), S = q_ref.shape, k_ref.shape[0]
  block_k = BACKWARD_BLOCKS[1]
  rows = jnp.arange(L, dtype=jnp.int32)
  q, dout, q_ids = q_ref[...], dout_ref[...], q_ids_ref[...]
  row_words = dropout.row_words(key_ref[...], rows) if rate else None
  scale = keep_scale(rate) if rate else 1.0
  lse, delta = lse_ref[...], delta_ref[...] * (1 / scale)

  def visit(j, dq):
    # Every key tile, also one that no real query sees under causality (its dK and dV are
    # zeros but for padding queries, whose outputs are never read).
    span = pl.ds(j * block_k, block_k)
    cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k = k_ref[span, :]
    words = (row_words, columns_ref[_pair_span(j, block_k)]) if rate else None
    visible = _Visible(whole_ref[0, j], q_ids, kv_ids_ref[span], rows, cols, causal)
    dscores, dv = _tile_grads(q, k, v_ref[span, :], dout, visible, lse, delta, words, rate, ptx)
    dk = _dot(dscores.astype(q.dtype), q, trans_a=True)
    dk_ref[span, :] = (dk * (scale / math.sqrt(K))).astype(dk_ref.dtype)
    dv_ref[span, :] = (dv * scale).astype(dv_ref.dtype)
    return dq + _dot(dscores.astype(k.dtype), k)

  dq = jax.lax.fori_loop(0, S // block_k, visit, jnp.zeros((L, K), jnp.float32))
  dq_ref[...] = (dq * (scale / math.sqrt(K))).astype(dq_ref.dtype)


def _query_grads(t: Array, refs, rate: float, causal: bool, ptx: bool) -> Array:
  """dQ of query tile `t`, summed over the key tiles it visits (`refs` as _key_grads')."""
  key_ref, q_ids_ref, kv_ids_ref, columns_ref, whole_ref, q_ref, k_ref, v_ref, dout_ref, \
      lse_ref, delta_ref = refs
  K, S = q_ref.shape[1], k_ref.shape[0]
  block_q, block_k = BACKWARD_BLOCKS
  span_q = pl.ds(t * block_q, block_q)
  rows = t * block_q + jnp.arange(block_q, dtype=jnp.int32)
  q, dout, q_ids = q_ref[span_q, :], dout_ref[span_q, :], q_ids_ref[span_q]
  row_words = dropout.row_words(key_ref[...], rows) if rate else None
  scale = keep_scale(rate) if rate else 1.0
  lse, delta = lse_ref[span_q], delta_ref[span_q] * (1 / scale)

  def visit(j, dq):
    span = pl.ds(j * block_k, block_k)
    cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k = k_ref[span, :]
    visible = _Visible(whole_ref[t, j], q_ids, kv_ids_ref[span], rows, cols, causal)
    p = _exp2(_scores(q, k, visible), _scale_log2(K), lse, ptx)
    dprobs = _dot(dout, v_ref[span, :], trans_b=True)  # over the keep scale, as _key_grads'
    if rate:
      dprobs = jnp.where(_keep(row_words, columns_ref[_pair_span(j, block_k)], rate), dprobs, 0.0)
    dscores = visible.where(p * (dprobs - delta[:, None]), _unseen_zeros(lse))
    return dq + _dot(dscores.astype(k.dtype), k)

  stop = _key_blocks(t, block_q, block_k, S, causal)
  dq = jax.lax.fori_loop(0, stop, visit, jnp.zeros((block_q, K), jnp.float32))
  return dq * (scale / math.sqrt(K))


def _backward_kernel(*refs, rate: float, causal: bool, grads: str, fused: bool, ptx: bool):
  """One (b, h, tile t): `grads` 'q' (dQ of query tile t), 'kv' (dK, dV of key tile t), 'qkv'
  (both: one kernel reads the inputs once, where there are as many query tiles as key tiles) or
  'all' (the (b, h)'s dQ, dK and dV, its queries in one tile: _all_grads). With `fused`, one
  output (rows, 3, K) holds dQ, dK and dV."""
  if fused:  # one (rows, 3, K) block of q, k and v, and one of dq, dk and dv
    inputs, outputs = (*refs[:5], *_parts(refs[5]), *refs[6:9]), list(_parts(refs[9]))
  else:
    inputs, outputs = refs[:11], list(refs[11:])
  if grads == 'all':
    _all_grads(inputs, *outputs, rate, causal, ptx)
    return
  t = pl.program_id(2)
  if 'q' in grads:
    dq_ref = outputs.pop(0)
    dq_ref[...] = _query_grads(t, inputs, rate, causal, ptx).astype(dq_ref.dtype)
  if 'kv' in grads:
    dk_ref, dv_ref = outputs
    dk, dv = _key_grads(t, inputs, rate, causal, ptx)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _flops(B: int, H: int, L: int, S: int, K: int, products: int, causal: bool,
           block: int) -> float:
  """`products` matmuls of (L x K) by (K x S) per (b, h); with causality, those of the tiles
  on or below the diagonal (tiles of `block` queries)."""
  flops = 2.0 * B * H * L * S * K * products
  return flops * (0.5 + 0.5 * block / S) if causal else flops


def _call(kernel, name: str, grid, in_specs, out_specs, out_shape, flops: float, **triton):
  """The pallas_call: through Triton on an NVIDIA GPU (with EXP2_PTX, the kernel given `ptx`:
  _exp2's inline PTX) or an AMD one, in interpret mode elsewhere (decided when the step is
  lowered for its platform, so aot.py on a CPU compiles the GPU kernels). `triton` overrides
  TRITON_PARAMS."""
  def build(platform: str):
    interpret, params = platform == 'cpu', {}
    if pl_triton is not None and not interpret:
      params['compiler_params'] = pl_triton.CompilerParams(**{**TRITON_PARAMS, **triton})
    ptx = EXP2_PTX and platform == 'cuda' and hasattr(pl_triton, 'elementwise_inline_asm')
    return pl.pallas_call(functools.partial(kernel, ptx=ptx), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=interpret,
                          name=name, metadata={'flops': str(int(flops))}, **params)
  return lambda *args: jax.lax.platform_dependent(*args, cuda=build('cuda'), rocm=build('rocm'),
                                                  default=build('cpu'))


def _part(x: Array, rows: int, tiled: bool) -> pl.BlockSpec:
  """The BlockSpec of `rows` positions of one (b, h)'s (B, L, H, K) q, k, v, output or
  gradient: tile t of them (the grid's third index), or the first."""
  K = x.shape[-1]
  if tiled:
    return pl.BlockSpec((None, rows, None, K), lambda b, h, t: (b, t, h, 0))
  return pl.BlockSpec((None, rows, None, K), lambda b, h, t: (b, 0, h, 0))


def _fused_rows(rows: int, K: int, tiled: bool = False) -> pl.BlockSpec:
  """_part's of a (B, L, 3, H, K) array: one (b, h)'s (rows, 3, K) block."""
  if tiled:
    return pl.BlockSpec((None, rows, 3, None, K), lambda b, h, t: (b, t, 0, h, 0))
  return pl.BlockSpec((None, rows, 3, None, K), lambda b, h, t: (b, 0, 0, h, 0))


def _operands(q: Array, k: Array, v: Array, whole_BQT: Array, q_rows: int, tiled: bool,
              fused: bool) -> tuple[list[pl.BlockSpec], tuple[Array, ...]]:
  """The kernels' first operands' BlockSpecs, and the arrays after the column words: the (b,
  h)'s key, the q ids of `q_rows` queries (tile t, or the first), the kv ids, the column words,
  the whole tiles (query tile t's row of `whole_BQT`, or all of it), then q (those rows), k and v
  whole; with `fused`, their one array's (S, 3, K) block instead."""
  S, K = k.shape[1], q.shape[-1]
  if tiled:
    q_ids = pl.BlockSpec((None, q_rows), lambda b, h, t: (b, t))
    tiles = pl.BlockSpec((None, None, whole_BQT.shape[2]), lambda b, h, t: (b, t, 0))
  else:
    q_ids = pl.BlockSpec((None, q_rows), lambda b, h, t: (b, 0))
    tiles = pl.BlockSpec((None, *whole_BQT.shape[1:]), lambda b, h, t: (b, 0, 0))
  specs = [pl.BlockSpec((None, None), lambda b, h, t: (b, h)), q_ids,
           pl.BlockSpec((None, S), lambda b, h, t: (b, 0)),
           pl.BlockSpec((S // 2,), lambda b, h, t: (0,)), tiles]
  if fused:
    return specs + [_fused_rows(S, K)], (whole_BQT, q)
  return (specs + [_part(q, q_rows, tiled), _part(k, S, False), _part(v, S, False)],
          (whole_BQT, q, k, v))


def _sizes(q: Array, k: Array) -> tuple[int, int, int, int, int]:
  """B, L, S, H, K of (B, L, H, K) q and (B, S, H, K) k, or of one (B, L, 3, H, K) array."""
  return q.shape[0], q.shape[1], k.shape[1], q.shape[-2], q.shape[-1]


def _forward(q, k, v, q_ids, kv_ids, keys, rate, causal, fused=False):
  """The output and the rows' log2-sum-exp2; with `fused`, q, k and v are one (B, L, 3, H, K)
  array, read in place."""
  B, L, S, H, K = _sizes(q, k)
  block_q, block_k = FORWARD_BLOCKS
  whole_BQT = _whole_tiles(q_ids, kv_ids, block_q, block_k, causal)
  in_specs, arrays = _operands(q, k, v, whole_BQT, block_q, True, fused)
  out_specs = [_part(q, block_q, True),
               pl.BlockSpec((None, None, block_q), lambda b, h, t: (b, h, t))]
  out_shape = [jax.ShapeDtypeStruct((B, L, H, K), q.dtype),
               jax.ShapeDtypeStruct((B, H, L), jnp.float32)]
  kernel = functools.partial(_forward_kernel, rate=rate, causal=causal, block_k=block_k,
                             fused=fused)
  return _call(kernel, 'flash_dropout_forward', (B, H, L // block_q), in_specs, out_specs,
               out_shape, _flops(B, H, L, S, K, 2, causal, block_q))(
                   keys, q_ids, kv_ids, dropout.column_words(S), *arrays)


def _backward(q, k, v, q_ids, kv_ids, keys, out, lse, dout, rate, causal, fused=False):
  """dq, dk and dv; with `fused` (q, k and v one (B, L, 3, H, K) array, as many query tiles as
  key tiles), their one (B, L, 3, H, K) array, written by the kernel in place."""
  B, L, S, H, K = _sizes(q, k)
  block_q, block_k = BACKWARD_BLOCKS
  delta = jnp.einsum('BLHK,BLHK->BHL', dout.astype(jnp.float32), out.astype(jnp.float32))
  rows = pl.BlockSpec((None, None, L), lambda b, h, t: (b, h, 0))
  whole_BQT = _whole_tiles(q_ids, kv_ids, L if whole_queries(L) else block_q, block_k, causal)
  in_specs, arrays = _operands(q, k, v, whole_BQT, L, False, fused)
  in_specs += [_part(dout, L, False), rows, rows]
  args = (keys, q_ids, kv_ids, dropout.column_words(S), *arrays, dout, lse, delta)

  def call(grads: str, tiles: int):
    whole = grads == 'all'
    if fused:  # one array; a tile of it holds the same rows of dq, dk and dv
      out_specs = [_fused_rows(L, K) if whole else _fused_rows(block_q, K, tiled=True)]
      out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
      out_specs, out_shape = [], []
      if 'q' in grads or whole:
        out_specs.append(_part(q, L if whole else block_q, not whole))
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
      if 'kv' in grads or whole:
        out_specs += [_part(k, S if whole else block_k, not whole)] * 2
        out_shape += [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
    products = 5 if whole else 3 * ('q' in grads) + 4 * ('kv' in grads)
    kernel = functools.partial(_backward_kernel, rate=rate, causal=causal, grads=grads,
                               fused=fused)
    triton = {'num_warps': ALL_GRADS_WARPS} if whole else {}
    return _call(kernel, f'flash_dropout_backward_{grads}', (B, H, tiles), in_specs, out_specs,
                 out_shape, _flops(B, H, L, S, K, products, causal and not whole, block_q),
                 **triton)(*args)

  if whole_queries(L):
    grads = call('all', 1)
  elif L // block_q == S // block_k:
    grads = call('qkv', L // block_q)
  elif fused:
    raise ValueError('a fused backward needs as many query tiles as key tiles')
  else:
    (dq,), (dk, dv) = call('q', L // block_q), call('kv', S // block_k)
    return dq, dk, dv
  return grads[0] if fused else tuple(grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, q_ids, kv_ids, keys, rate, causal):
  return _forward(q, k, v, q_ids, kv_ids, keys, rate, causal)[0]


def _attention_forward(q, k, v, q_ids, kv_ids, keys, rate, causal):
  out, lse = _forward(q, k, v, q_ids, kv_ids, keys, rate, causal)
  return out, (q, k, v, q_ids, kv_ids, keys, out, lse)


def _attention_backward(rate, causal, residuals, dout):
  q, k, v, q_ids, kv_ids, keys, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, q_ids, kv_ids, keys, out, lse, dout, rate, causal)
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_forward, _attention_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _self_attention(qkv, ids, kv_ids, keys, rate, causal):
  return _forward(qkv, qkv, qkv, ids, kv_ids, keys, rate, causal, fused=True)[0]


def _self_attention_forward(qkv, ids, kv_ids, keys, rate, causal):
  out, lse = _forward(qkv, qkv, qkv, ids, kv_ids, keys, rate, causal, fused=True)
  return out, (qkv, ids, kv_ids, keys, out, lse)


def _self_attention_backward(rate, causal, residuals, dout):
  qkv, ids, kv_ids, keys, out, lse = residuals
  dqkv = _backward(qkv, qkv, qkv, ids, kv_ids, keys, out, lse, dout, rate, causal, fused=True)
  return dqkv, None, None, None


_self_attention.defvjp(_self_attention_forward, _self_attention_backward)


def _kv_ids(kv_ids_BS: Array) -> Array:
  """A padding key (id 0) is seen by no query: as id -1, which no query has, a tile's
  visibility is one comparison an element."""
  return jnp.where(kv_ids_BS > 0, kv_ids_BS, -1).astype(jnp.int32)


def attention(q_BLHK: Array, k_BSHK: Array, v_BSHK: Array, q_ids_BL: Array, kv_ids_BS: Array,
              keys_BH: Array, rate: float, causal: bool) -> Array:
  """softmax(q k^T / sqrt(K)) v over what the segment ids let each query see, dropout at `rate`
  on the probabilities with the counted mask of `keys_BH`: the same function as `reference` at
  every real query (a padding query, whose output is never read, spreads over the key tiles it
  visits, which under causality are not all of them)."""
  L, S, K = q_BLHK.shape[1], k_BSHK.shape[1], q_BLHK.shape[3]
  if not tiles(L, S, K):
    return reference(q_BLHK, k_BSHK, v_BSHK, q_ids_BL, kv_ids_BS, keys_BH, rate, causal)
  return _attention(q_BLHK, k_BSHK, v_BSHK, q_ids_BL.astype(jnp.int32), _kv_ids(kv_ids_BS),
                    keys_BH, float(rate), causal)


def reads_in_place(length: int, head_dim: int) -> bool:
  """Whether self_attention's kernels take its one (B, L, 3, H, K) array at these sizes (else
  it gives `attention` the array's three slices): the kernels' tiles, and one backward tile a
  (b, h) holding the same rows of dq, dk and dv."""
  block_q, block_k = BACKWARD_BLOCKS
  return tiles(length, length, head_dim) and (whole_queries(length) or block_q == block_k)


def self_attention(qkv_BL3HK: Array, q_ids_BL: Array, kv_ids_BL: Array, keys_BH: Array,
                   rate: float, causal: bool) -> Array:
  """`attention` of a self-attention whose q, k and v come as one (B, L, 3, H, K) array (one
  projection's output): the kernels read them in place and the backward writes their gradients
  as one array, so that the projection's backward is one matmul, with no sum of three input
  gradients (BERT-base on one H100, aot.py's estimate: attention/query/add_any, 1.13 ms)."""
  L, K = qkv_BL3HK.shape[1], qkv_BL3HK.shape[-1]
  if not reads_in_place(L, K):
    q, k, v = (qkv_BL3HK[:, :, i] for i in range(3))
    return attention(q, k, v, q_ids_BL, kv_ids_BL, keys_BH, rate, causal)
  return _self_attention(qkv_BL3HK, q_ids_BL.astype(jnp.int32), _kv_ids(kv_ids_BL), keys_BH,
                         float(rate), causal)
