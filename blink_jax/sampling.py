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


def _filtered(logits, temperature, top_k, top_p):
  """Logits scaled by temperature with everything outside top-k / top-p set to -inf."""
  x = logits / jnp.maximum(temperature, 1e-6)[:, None]
  srt = -jnp.sort(-x, axis=-1)  # descending
  vocab = x.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
  probs = jax.nn.softmax(srt, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
  before = jnp.cumsum(probs, axis=-1) - probs
  keep = before < top_p[:, None]
  pth = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
  threshold = jnp.maximum(kth, pth)
  return jnp.where(x >= threshold, x, -jnp.inf)


def sample(logits, temperature, top_p, top_k, seed_lo, seed_hi, position, num_logprobs,
           *, max_top: int):
  """Samples one token per row of float32 `logits` [R, V].

  Returns tokens [R] int32, the logprob of each sampled token [R], and the top `max_top`
  alternatives (ids [R, max_top], logprobs [R, max_top]); logprobs are those of the model's
  distribution (before temperature and filtering), as OpenAI and vLLM report them.
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
      return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros(
          (logits.shape[0], 0), jnp.float32)
    top_lp, top_id = lax.top_k(lp, max_top)
    return chosen, top_id.astype(jnp.int32), top_lp

  def without():
    r = logits.shape[0]
    return (jnp.zeros((r,), jnp.float32), jnp.zeros((r, max_top), jnp.int32),
            jnp.zeros((r, max_top), jnp.float32))

  chosen, top_id, top_lp = lax.cond(jnp.any(num_logprobs >= 0), with_logprobs, without)
  return tokens, chosen, top_id, top_lp
