"""Sampling on the device, per row: greedy, temperature, top-k, top-p, seeded, with logprobs.

A row's random key depends only on its request's seed and the position of the token being
sampled, so the same seed and prompt give the same tokens whatever else is in the batch (and
after a preemption and recompute).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _row_key(seed_lo, seed_hi, position):
  key = jax.random.PRNGKey(seed_lo.astype(jnp.uint32))
  key = jax.random.fold_in(key, seed_hi.astype(jnp.uint32))
  return jax.random.fold_in(key, position.astype(jnp.uint32))


def _bisect(lo, hi, keep_upper, steps: int = 32):
  """Largest t in [lo, hi] with keep_upper(t) true, per row (keep_upper is monotone).

  Sorting the vocabulary would be the obvious way, but XLA runs large sorts as a CUB custom
  call that cannot live in a CUDA-graph loop; 32 fused reductions can.
  """
  for _ in range(steps):
    mid = (lo + hi) * 0.5
    ok = keep_upper(mid)
    lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
  return lo


def _filtered(logits, temperature, top_k, top_p):
  """Logits scaled by temperature with everything outside top-k / top-p set to -inf."""
  x = logits / jnp.maximum(temperature, 1e-6)[:, None]
  vocab = x.shape[-1]
  hi = jnp.max(x, axis=-1)
  lo = jnp.min(x, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab).astype(jnp.float32)
  # Top-k: the k-th largest value is the largest t with count(x >= t) >= k.
  kth = _bisect(lo, hi, lambda t: jnp.sum(x >= t[:, None], axis=-1) >= k)
  # Top-p: keep the most probable tokens whose mass first reaches p (the top one always).
  probs = jax.nn.softmax(x, axis=-1)
  pmax = jnp.max(probs, axis=-1)
  pth = _bisect(jnp.zeros_like(pmax), pmax,
                lambda t: jnp.sum(jnp.where(probs >= t[:, None], probs, 0.0), axis=-1) >= top_p)
  pth = jnp.where(top_p >= 1.0, 0.0, jnp.minimum(pth, pmax))  # p = 1: no rounding losses
  keep = (x >= kth[:, None]) & (probs >= pth[:, None])
  return jnp.where(keep, x, -jnp.inf)


def top_n(lp, n: int):
  """Top-n values and ids per row by n masked argmax passes (no sort, see _bisect)."""
  ids, vals = [], []
  cols = jnp.arange(lp.shape[-1])
  for _ in range(n):
    i = jnp.argmax(lp, axis=-1)
    vals.append(jnp.take_along_axis(lp, i[:, None], axis=-1)[:, 0])
    ids.append(i.astype(jnp.int32))
    lp = jnp.where(cols[None, :] == i[:, None], -jnp.inf, lp)
  return jnp.stack(vals, axis=1), jnp.stack(ids, axis=1)


def sample(logits, temperature, top_p, top_k, seed_lo, seed_hi, position, num_logprobs,
           zeros, *, max_top: int):
  """Samples one token per row of float32 `logits` [R, V].

  Returns tokens [R] int32, the logprob of each sampled token [R], and the top `max_top`
  alternatives (ids [R, max_top], logprobs [R, max_top]); logprobs are those of the model's
  distribution (before temperature and filtering), as OpenAI and vLLM report them.
  `zeros` = (f32 [R], i32 [R, max_top], f32 [R, max_top]) are returned when no row asks for
  logprobs: passed in rather than made here, since a zero-fill is a memset, which XLA cannot
  put into a CUDA graph.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def stochastic():
    filt = lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                    lambda: _filtered(logits, temperature, top_k, top_p),
                    lambda: logits / jnp.maximum(temperature, 1e-6)[:, None])
    keys = jax.vmap(_row_key)(seed_lo, seed_hi, position)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filt).astype(jnp.int32)
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
