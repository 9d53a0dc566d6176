"""Paged attention in jnp over only the keys a step can read: the CPU backend's kernel.

`model.attention.paged_attention_reference` (the oracle) gathers every row's whole page table,
`max_context` keys, whatever the sequence's length: on the CPU that was half of a decode
token's time at a 4096-token context and most of a short prompt's TTFT (docs/NOTES.md,
"Whole-cache copies on the CPU backend"). Here each block of `TOKEN_BLOCK` rows walks its
keys in blocks of `key_block` positions, from the first block a row's window can reach to the
block of the block's last position (a `lax.fori_loop` with bounds computed from the step's
positions), with an online softmax in float32: the work follows the actual context.
Same signature, masks and result as the oracle (within float rounding:
tests/test_blocked_attention.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from blink_jax.model.attention import MASK_VALUE, TOKEN_BLOCK, apply_softcap

# Key positions per block: 128 keys x 2 x K x h of a layer's cache per row (256 KB for the
# 270M's one 256-wide KV head in f32): the gathered block stays in the CPU's caches.
KEY_BLOCK = 128


def paged_attention_blocked(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array,
                            seq_ids: jax.Array, positions: jax.Array, *, window: int | None,
                            softcap: float | None, scale: float,
                            key_block: int = KEY_BLOCK) -> jax.Array:
  """Attention of each token q [T, H, h] over its own sequence's cached keys, reading only the
  key blocks the step's rows can attend to (see the module docstring; the arguments are
  those of `paged_attention_reference`)."""
  page_table, seq_ids, positions = map(jnp.asarray, (page_table, seq_ids, positions))
  tokens, num_heads, head_dim = q.shape
  page_size = kv_pages.shape[1]
  num_kv_heads = kv_pages.shape[2] // (2 * head_dim)
  group = num_heads // num_kv_heads
  max_pages = page_table.shape[1]
  block_pages = max(1, min(max_pages, key_block // page_size))
  keys = block_pages * page_size  # key positions per block

  def attend(q, seq_ids, positions):
    rows = q.shape[0]
    valid = seq_ids >= 0
    tables = page_table[jnp.maximum(seq_ids, 0)]  # [rows, max_pages]
    last = jnp.max(jnp.where(valid, positions, -1))
    hi = jnp.where(last >= 0, last // keys + 1, 0)
    if window is None:
      lo = jnp.int32(0)
    else:
      first = jnp.min(jnp.where(valid, jnp.maximum(positions - window + 1, 0), last))
      lo = jnp.maximum(first, 0) // keys
    qg = q.reshape(rows, num_kv_heads, group, head_dim)

    def block(b, carry):
      m, l, acc = carry
      cols = b * block_pages + jnp.arange(block_pages)
      pages = jnp.take(tables, jnp.minimum(cols, max_pages - 1), axis=1)  # [rows, bp]
      kv = jnp.take(kv_pages, pages, axis=0, mode="clip").reshape(
          rows, keys, 2, num_kv_heads, head_dim)
      k, v = kv[:, :, 0], kv[:, :, 1]
      s = jnp.einsum("rkgh,rlkh->rkgl", qg, k, preferred_element_type=jnp.float32) * scale
      s = apply_softcap(s, softcap)
      key_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)
      mask = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] < max_pages * page_size)
      if window is not None:
        mask &= positions[:, None] - key_pos[None, :] < window
      mask = mask[:, None, None, :]
      s = jnp.where(mask, s, MASK_VALUE)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + jnp.sum(p, axis=-1)
      acc = acc * corr[..., None] + jnp.einsum("rkgl,rlkh->rkgh", p.astype(v.dtype), v,
                                               preferred_element_type=jnp.float32)
      return m_new, l, acc

    shape = (rows, num_kv_heads, group)
    init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, l, acc = lax.fori_loop(lo, hi, block, init)
    # A row without a key (padding) has l == 0: its output is 0, finite.
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
    return out.reshape(rows, num_heads, head_dim).astype(q.dtype)

  # Blocks of rows, each with its own key range (as the oracle's TOKEN_BLOCK bounds its
  # gathers): a prefill chunk's early rows do not walk its late rows' keys.
  outs = [attend(q[i:i + TOKEN_BLOCK], seq_ids[i:i + TOKEN_BLOCK], positions[i:i + TOKEN_BLOCK])
          for i in range(0, tokens, TOKEN_BLOCK)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
