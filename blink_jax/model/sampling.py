"""Sampling on the device, per row: greedy, temperature, top-k, top-p, seeded, with logprobs.

A row's random key depends only on its request's seed and the position of the token being
sampled, so the same seed and prompt give the same tokens whatever else is in the batch (and
after a preemption and recompute); row by row, up to how a backend rounds a row's sums (the
top-p mass, the blocks' masses of the draw), which could move a draw that falls within
rounding of a boundary.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _row_key(seed_lo, seed_hi, position):
  key = jax.random.PRNGKey(seed_lo.astype(jnp.uint32))
  key = jax.random.fold_in(key, seed_hi.astype(jnp.uint32))
  return jax.random.fold_in(key, position.astype(jnp.uint32))


def _search(lo, hi, ok_at, ways: int):
  """Largest t in [lo, hi] with ok(t) true, per row (ok is monotone: true up to a bound).

  Sorting the vocabulary would be the obvious way, but XLA runs large sorts as a CUB custom
  call that cannot live in a CUDA-graph loop. Each pass tests `ways` thresholds spread over
  the interval (`ok_at(t)`: t [rows] -> bool [rows], a reduction over the [rows, vocab]
  logits) and narrows it (ways + 1)-fold, as finely in all as 32 halvings: 1 way is 32
  passes of one comparison per logit, 15 ways 8 passes of 15. A CPU is bound by the
  comparisons; a GPU by the passes over memory (docs/PERFORMANCE.md, "Sampling"). A pass's
  thresholds are reduced separately, as sibling reductions of the same logits, which a GPU
  compiler can fuse into one read of them (one reduction over a [rows, ways, vocab]
  broadcast read the logits once per threshold on the H200); bench.sampling --search_ways
  measures it.
  """
  passes = math.ceil(32 / math.log2(ways + 1))
  frac = jnp.arange(1, ways + 1, dtype=jnp.float32) / (ways + 1)
  for _ in range(passes):
    ts = lo[:, None] + (hi - lo)[:, None] * frac  # non-decreasing along each row
    # ok holds for the first n thresholds
    n = sum(ok_at(ts[:, w]).astype(jnp.int32) for w in range(ways))
    if ways == 1:  # a bisection: the one threshold is both neighbours, no gathers (which
      below = above = ts[:, 0]  # tripled the sampler's HLO, and its compile time per bucket)
    else:
      below = jnp.take_along_axis(ts, jnp.maximum(n - 1, 0)[:, None], axis=-1)[:, 0]
      above = jnp.take_along_axis(ts, jnp.minimum(n, ways - 1)[:, None], axis=-1)[:, 0]
    lo, hi = jnp.where(n > 0, below, lo), jnp.where(n < ways, above, hi)
  return lo


def _filtered(logits, temperature, top_k, top_p, ways: int = 1, thresholds=None):
  """Logits scaled by temperature with everything outside top-k / top-p set to -inf.

  Top-k keeps the k largest (ties at the k-th all kept); top-p the most probable tokens
  whose mass under the whole distribution first reaches p (the top one always); a row that
  asks for both keeps what both keep. Each search runs only when some row asks for it.
  thresholds: a function that finds both thresholds at once (`cuda_sampler.thresholds`'s
  signature and answer) instead of the searches.
  """
  x = logits / jnp.maximum(temperature, 1e-6)[:, None]
  hi = jnp.max(x, axis=-1)
  if thresholds is not None:
    t = jnp.max(thresholds(x, hi, top_k, top_p), axis=-1)
  else:
    t = _searched_threshold(x, hi, top_k, top_p, ways)
  return jnp.where(x >= jnp.minimum(t, hi)[:, None], x, -jnp.inf)


def _searched_threshold(x, hi, top_k, top_p, ways: int):
  """Per row of scaled logits x, the larger of the top-k and top-p thresholds (-inf where a
  row asks for neither), each found by `_search` when some row asks for it."""
  vocab = x.shape[-1]
  lo = jnp.min(x, axis=-1)
  # -inf per row, made from the data: a branch that returns a broadcast constant is a memset,
  # which a CUDA-graph loop cannot hold (docs/ARCHITECTURE.md, "CUDA-graph rules").
  none = lo - jnp.inf

  def kth():  # the k-th largest value: the largest t with count(x >= t) >= k
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.float32)
    t = _search(lo, hi, lambda t: jnp.sum((x >= t[:, None]).astype(jnp.float32), axis=-1)
                >= k, ways)
    return jnp.where(top_k > 0, t, -jnp.inf)

  def pth():  # the largest t with mass(x >= t) >= p, in units of x (mass relative to the top)
    e = jnp.exp(x - hi[:, None])
    need = jnp.sum(e, axis=-1) * top_p
    t = _search(lo, hi, lambda t: jnp.sum(jnp.where(x >= t[:, None], e, 0.0), axis=-1)
                >= need, ways)
    return jnp.where(top_p < 1.0, t, -jnp.inf)  # p = 1: no rounding losses

  return jnp.maximum(lax.cond(jnp.any(top_k > 0), kth, lambda: none),
                     lax.cond(jnp.any(top_p < 1.0), pth, lambda: none))


# Tokens per block of the two-level draw and argmax (see _draw, argmax).
_BLOCK = 512


def _blocks(x):
  """x [R, V] as [R, ceil(V / _BLOCK), _BLOCK], padded with -inf."""
  rows, vocab = x.shape
  nb = -(-vocab // _BLOCK)
  if nb * _BLOCK != vocab:
    x = jnp.pad(x, ((0, 0), (0, nb * _BLOCK - vocab)), constant_values=-jnp.inf)
  return x.reshape(rows, nb, _BLOCK)


def argmax(x):
  """jnp.argmax(x, axis=-1) of x [R, V] (the first of equal maxima), int32: the block
  holding the row's maximum by a plain max per block, then the position inside it. XLA's CPU
  backend runs an argmax over a whole row (a reduction of value-index pairs) about 25x
  slower than that max. A row with a NaN gets some index below V (a max reduction may drop
  NaNs where argmax takes the first)."""
  blocks = _blocks(x)
  b = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  i = jnp.argmax(jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0], axis=-1)
  return jnp.minimum(b * _BLOCK + i, x.shape[-1] - 1).astype(jnp.int32)


def top_n(lp, n: int):
  """Top-n values and ids per row by n masked argmax passes (no sort, see _search)."""
  ids, vals = [], []
  cols = jnp.arange(lp.shape[-1])
  for _ in range(n):
    i = argmax(lp)
    vals.append(jnp.take_along_axis(lp, i[:, None], axis=-1)[:, 0])
    ids.append(i)
    lp = jnp.where(cols[None, :] == i[:, None], -jnp.inf, lp)
  return jnp.stack(vals, axis=1), jnp.stack(ids, axis=1)


def top_n_by_reductions(lp, n: int):
  """top_n's values and ids per row (the id: the first column at the maximum), every result
  a reduction over lp [R, V]. XLA fuses top_n's gathers from lp into whatever consumes
  their results, which keeps lp alive until then; it does not recompute a reduction there
  (the executor's prompt logprobs in pieces rely on that: executor/loop.py)."""
  cols = jnp.arange(lp.shape[-1], dtype=jnp.int32)[None, :]
  ids, vals = [], []
  for _ in range(n):
    vals.append(jnp.max(lp, axis=-1))
    ids.append(jnp.min(jnp.where(lp == vals[-1][:, None], cols, lp.shape[-1] - 1), axis=-1))
    lp = jnp.where(cols == ids[-1][:, None], -jnp.inf, lp)
  return jnp.stack(vals, axis=1), jnp.stack(ids, axis=1)


def _draw(keys, x):
  """One token per row of scaled, filtered logits x [R, V] (-inf: never), drawn with
  probability softmax(x) in two levels: a block of _BLOCK tokens with probability its share
  of the row's mass, then a token of that block with probability its share of the block's
  (the product is the token's share of the row's). Each level is a Gumbel-max draw
  (jax.random.categorical) over _BLOCK values; drawing over the whole row at once needs a
  random number and two logarithms for every logit, here the whole row costs one exp per
  logit (the blocks' masses). No prefix sums: XLA may make a cumulative sum a CUB scan,
  which a CUDA-graph loop cannot hold (docs/ARCHITECTURE.md, "Sampling")."""
  blocks = _blocks(x)
  top = jnp.max(x, axis=-1)
  mass = jnp.sum(jnp.exp(blocks - top[:, None, None]), axis=-1)  # [R, nb]; the top's block >= 1
  pick_block, pick_token = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  categorical = jax.vmap(jax.random.categorical)
  b = categorical(pick_block, jnp.log(mass))  # a block of no mass has log 0 = -inf: never
  i = categorical(pick_token, jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0])
  return jnp.minimum(b * _BLOCK + i, x.shape[-1] - 1).astype(jnp.int32)  # NaNs: in range


def sample(logits, temperature, top_p, top_k, seed_lo, seed_hi, position, num_logprobs,
           zeros, *, max_top: int, search_ways: int = 1, thresholds=None):
  """Samples one token per row of float32 `logits` [R, V].

  Returns tokens [R] int32, the logprob of each sampled token [R], and the top `max_top`
  alternatives (ids [R, max_top], logprobs [R, max_top]); logprobs are those of the model's
  distribution (before temperature and filtering), as OpenAI and vLLM report them.
  `zeros` = (f32 [R], i32 [R, max_top], f32 [R, max_top]) are returned when no row asks for
  logprobs: passed in rather than made here, since a zero-fill is a memset, which XLA cannot
  put into a CUDA graph. `search_ways`: thresholds per pass of the top-k / top-p searches
  (see _search); `thresholds`: a kernel that finds them instead (see _filtered).
  """
  greedy = argmax(logits)

  def stochastic():
    filt = lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                    lambda: _filtered(logits, temperature, top_k, top_p, search_ways,
                                      thresholds),
                    lambda: logits / jnp.maximum(temperature, 1e-6)[:, None])
    drawn = _draw(jax.vmap(_row_key)(seed_lo, seed_hi, position), filt)
    return jnp.where(temperature > 0, drawn, greedy)

  tokens = lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)

  def with_logprobs():
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if max_top == 0:
      return chosen, zeros[1], zeros[2]
    top_lp, top_id = top_n(lp, max_top)
    return chosen, top_id, top_lp

  def without():
    return zeros

  chosen, top_id, top_lp = lax.cond(jnp.any(num_logprobs >= 0), with_logprobs, without)
  return tokens, chosen, top_id, top_lp
