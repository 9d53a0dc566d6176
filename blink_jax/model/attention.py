"""Paged KV-cache writes and the plain-jnp paged attention oracle.

Layout (docs/ARCHITECTURE.md, "Ragged paged forward"): per layer one array
`kv_pages [P, page_size, 2 * K * h]`, a row's keys (K heads side by side) then its values; sequence slot `s` keeps its position `p`
at page `page_table[s, p // page_size]`, row `p % page_size`. One array per layer makes a
token's K/V one contiguous row: one cache write per layer and step, not two.
Padding rows have `seq_id == -1`: they write nothing and their outputs are garbage (but finite).

`paged_attention_reference` is deliberately simple and runs on any backend; it is the oracle
that faster kernels (Pallas, CUDA) are tested against, and it shares its signature with them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": a fully masked row (a padding token) softmaxes to a uniform average
# of finite values instead of NaN.
MASK_VALUE = -1e30

# Tokens attended together (vmapped) per step of the reference's sequential loop; bounds the
# gathered K/V copy to [TOKEN_BLOCK, max_pages * page_size, K, h] however large T is.
TOKEN_BLOCK = 64


def apply_softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """Gemma's tanh soft-capping: cap * tanh(x / cap); identity when cap is None."""
  if cap is None:
    return x
  return cap * jnp.tanh(x / cap)


def kv_rows(k: jax.Array, v: jax.Array) -> jax.Array:
  """k, v [T, K, h] -> each token's cache row [T, 2 * K * h]: its keys, then its values."""
  return jnp.concatenate([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], axis=1)


def cache_slots(page_table: jax.Array, seq_ids: jax.Array, positions: jax.Array,
                num_pages: int, page_size: int) -> jax.Array:
  """Each token's row of the cache seen as [P * page_size, width] (its page * page_size + its
  position % page_size), int32 [T]; `num_pages * page_size` (one past the end) for a token
  that must write nothing: padding (seq_id < 0), a position past the page table, an
  out-of-range page id (rather than overwriting some other slot). The same for every layer:
  computed once per step."""
  page_table, seq_ids, positions = map(jnp.asarray, (page_table, seq_ids, positions))
  max_pages = page_table.shape[1]
  page_idx = positions // page_size
  valid = (seq_ids >= 0) & (page_idx >= 0) & (page_idx < max_pages)
  page_idx = jnp.clip(page_idx, 0, max_pages - 1)
  page = page_table[jnp.maximum(seq_ids, 0), page_idx]
  valid &= (page >= 0) & (page < num_pages)
  return jnp.where(valid, page * page_size + positions % page_size,
                   num_pages * page_size).astype(jnp.int32)


def write_rows(kv_pages: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
  """Writes each token's cache row (rows [T, 2 * K * h], `kv_rows`) at its `cache_slots`
  slot; a slot one past the end is dropped (mode="drop"; a negative one would wrap)."""
  num_pages, page_size, width = kv_pages.shape
  flat = kv_pages.reshape(num_pages * page_size, width)
  if slots.shape[0] == 1:
    # XLA turns a one-row dropping scatter into a dynamic-update-slice plus a read of the old
    # row, which its CPU backend does not update in place: it copied the whole cache, three
    # times per layer and step. A second row, always dropped, keeps it a scatter, which is in
    # place; the values written are the same (docs/NOTES.md, "Whole-cache copies on the CPU
    # backend").
    slots = jnp.concatenate([slots, jnp.full((1,), num_pages * page_size, slots.dtype)])
    rows = jnp.concatenate([rows, jnp.zeros_like(rows)])
  flat = flat.at[slots].set(rows.astype(kv_pages.dtype), mode="drop")
  return flat.reshape(kv_pages.shape)


def write_kv(kv_pages: jax.Array, rows: jax.Array, page_table: jax.Array,
             seq_ids: jax.Array, positions: jax.Array) -> jax.Array:
  """Writes each token's cache row (rows [T, 2 * K * h], `kv_rows`) at its (sequence,
  position) row of the pages; tokens without a valid slot write nothing (`cache_slots`)."""
  return write_rows(kv_pages, rows, cache_slots(page_table, seq_ids, positions,
                                                *kv_pages.shape[:2]))


def paged_attention_reference(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array,
                              seq_ids: jax.Array, positions: jax.Array, *, window: int | None,
                              softcap: float | None, scale: float) -> jax.Array:
  """Attention of each token q [T, H, h] over its own sequence's cached keys.

  Token t attends to the keys of sequence `seq_ids[t]` at positions p with
  p <= positions[t] and, when `window` is set, positions[t] - p < window (HF Gemma's sliding
  window: the token itself plus window - 1 earlier ones). The K/V of the current step must
  already be written (see `write_kv`). Logits and softmax are float32; returns [T, H, h] in
  q's dtype.
  """
  page_table, seq_ids, positions = map(jnp.asarray, (page_table, seq_ids, positions))
  _, num_heads, head_dim = q.shape
  page_size = kv_pages.shape[1]
  num_kv_heads = kv_pages.shape[2] // (2 * head_dim)  # [P, page_size, K * h keys | K * h values]
  group = num_heads // num_kv_heads
  seq_len = page_table.shape[1] * page_size
  key_pos = jnp.arange(seq_len, dtype=jnp.int32)

  def one_token(args):
    q_t, seq_id, pos = args
    pages = page_table[jnp.maximum(seq_id, 0)]  # [max_pages]
    # Entries past the sequence's length may be garbage: clip them; they are masked below.
    kv = jnp.take(kv_pages, pages, axis=0, mode="clip").reshape(seq_len, 2, num_kv_heads,
                                                                 head_dim)
    k, v = kv[:, 0], kv[:, 1]
    q_t = q_t.reshape(num_kv_heads, group, head_dim)  # query head n uses kv head n // group
    logits = jnp.einsum("kgh,lkh->kgl", q_t, k, preferred_element_type=jnp.float32) * scale
    logits = apply_softcap(logits, softcap)
    mask = key_pos <= pos
    if window is not None:
      mask &= pos - key_pos < window
    logits = jnp.where(mask, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgl,lkh->kgh", probs, v)
    return out.reshape(num_heads, head_dim).astype(q.dtype)

  # Static blocks of TOKEN_BLOCK tokens bound the gathered K/V copies. Not lax.map: its scan
  # zero-fills an output buffer (a memset), which keeps XLA from capturing the serving loop
  # in a CUDA graph.
  outs = [jax.vmap(one_token)((q[i:i + TOKEN_BLOCK], seq_ids[i:i + TOKEN_BLOCK],
                               positions[i:i + TOKEN_BLOCK]))
          for i in range(0, q.shape[0], TOKEN_BLOCK)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
