"""Paged attention for prefill-sized steps as a Pallas kernel (Triton on the GPU): the step's
tokens in blocks, each block reading its keys once for all its tokens.

The decode kernel (`pallas_attention`) gives every token its own programs, each re-reading
the token's whole context: a 4k-token prompt would read it 4k times. Here a program takes a
block of consecutive tokens of the step (block x G query rows, G query heads per KV head) and
walks the pages once per sequence in the block. A sequence's tokens are contiguous in a
step's ragged batch, so a prefill chunk's block holds one sequence; a block that straddles
sequences (a chunk's end, decode tokens) walks each of them in turn (its "segments"),
masking the rows of the others. Splits share each segment's pages out as in the decode
kernel, and `pallas_attention.merge_splits` merges them.

Same signature and semantics as `attention.paged_attention_reference`. Runs for steps larger
than `KernelOptions.decode_rows` when `KernelOptions.prefill` is "pallas" (the default on a GPU:
a 1B-shape prefill step of 256 / 1024 / 4096 tokens took 0.89 / 0.72 / 0.35x the reference's
time on the H200; docs/PERFORMANCE.md, "Prefill attention").
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from blink_jax.model.attention import MASK_VALUE, apply_softcap
from blink_jax.kernels.pallas_attention import (TILE_BYTES, default_pages_per_block,
                                                default_splits, kv_heads, merge_splits)

# Query rows (block tokens x query heads per KV head) a program holds: 64 x 256 float32
# accumulators are 128 registers per thread at 4 warps.
_TARGET_ROWS = 64
# Programs the default split count aims at, about one per SM (132 on an H100 or H200): a
# program of 64 rows has more to do than a decode program, and each split costs its rows'
# f32 partials, written and merged. A 1,024-row mixed step's attention took 1,710 us a step
# with 2 splits (128 programs) against 1,981 with the decode kernel's aim of 256 (4 splits)
# and 1,957 with 1 (docs/PERFORMANCE.md, "The decode head's live splits and the attention's
# split counts (revision 16424c5)").
_TARGET_PROGRAMS = 128
_LOG2E = math.log2(math.e)
# Bytes of each of a program's K and V tiles: half the decode kernel's, 32 keys of 256-wide
# bf16 heads. Two pipeline stages of them take 64 KiB of shared memory where 64-key tiles took
# 128, so more programs share an SM: a 4,096-row mixed step's attention (1B shape, H100) took
# 2,965 us a step against 3,516 with 64-key tiles, a 1,024-row one 1,505 against 1,559
# (2,048 rows: 1,993 against 1,970) (docs/PERFORMANCE.md, "The one-stage decode kernel end to
# end and the prefill kernel's key blocks (revision 6edd339)").
_TILE_BYTES = TILE_BYTES // 2


def prefill_pages_per_block(kv_pages: jax.Array, head_dim: int, rows: int) -> int:
  """Pages per step for K and V tiles of _TILE_BYTES, fewer when a block's float32 scores
  [rows, keys] would pass TILE_BYTES: narrow heads get wide K/V tiles, and 64 rows x 512 keys
  of scores asked 228 KiB of shared memory (more than an H200 SM has)."""
  page_size = kv_pages.shape[1]
  score_pages = max(1, TILE_BYTES // (4 * rows * page_size))
  fit = min(default_pages_per_block(kv_pages, head_dim, _TILE_BYTES),
            1 << (score_pages.bit_length() - 1))
  return max(fit, pl.next_power_of_2(pl.cdiv(16, page_size)))


def block_tokens(group: int, rows: int = _TARGET_ROWS) -> int:
  """Tokens per program for `group` query heads per KV head, `rows` query rows a program."""
  return max(1, rows // pl.next_power_of_2(group))


def program_rows(group: int, rows: int = _TARGET_ROWS) -> int:
  """The query rows a program holds (its block's tokens x `group`, padded to a power of two
  and at least 16, the smallest Triton dot)."""
  return max(16, pl.next_power_of_2(block_tokens(group, rows) * group))


def _kernel(q_ref, k_ref, v_ref, table_ref, row_pos_ref, row_run_ref, seg_ref, o_ref, *stats,
            pages_per_block: int, splits: int, window: int | None, softcap: float | None,
            scale: float):
  """One (token block, KV head, split): q_ref [R, h] (row r: token r // G of the block,
  query head r % G); k_ref, v_ref [P, page_size, h]; table_ref [S, W] (every sequence's
  page list, clipped to valid page ids and padded); row_pos_ref, row_run_ref [R] (the
  row's position and segment; -1 for padding rows); seg_ref [3, B] per segment: sequence
  (< 0: none), first page, end page. (A sequence may have two segments in a block, e.g.
  a chunk's tokens around another's: rows match their segment, not their sequence, or
  they would see its keys twice.)
  Writes the split's unnormalised output [R, h] and its softmax max and sum [R] (stats:
  m_ref, l_ref); with one split (no stats) the normalised output in o_ref's dtype, so no
  merge pass reads it again."""
  split = pl.program_id(2)
  page_size = k_ref.shape[1]
  block_keys = pages_per_block * page_size
  q = q_ref[...]
  head_dim = q.shape[1]
  pos, run = row_pos_ref[...], row_run_ref[...]
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  def segment(j, carry):
    sid, lo, hi = seg_ref[0, j], seg_ref[1, j], seg_ref[2, j]
    num_blocks = pl.cdiv(jnp.where(sid >= 0, jnp.maximum(hi - lo, 0), 0), pages_per_block)
    per_split = pl.cdiv(num_blocks, splits)
    first_block = jnp.minimum(split * per_split, num_blocks)
    end_block = jnp.minimum(first_block + per_split, num_blocks)
    mine = run == j  # this segment's rows

    def body(block, carry):
      o, m, l = carry
      page = lo + block * pages_per_block
      ids = table_ref[jnp.maximum(sid, 0), pl.ds(page, pages_per_block)]
      k = k_ref[ids].reshape(block_keys, head_dim)
      v = v_ref[ids].reshape(block_keys, head_dim)
      logits = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
      logits = apply_softcap(logits, softcap)
      key_pos = page * page_size + jnp.arange(block_keys)
      mask = mine[:, None] & (key_pos[None, :] <= pos[:, None])
      if window is not None:
        mask &= pos[:, None] - key_pos[None, :] < window
      logits = jnp.where(mask, logits, MASK_VALUE)
      m_new = jnp.maximum(m, logits.max(axis=-1))
      correction = jnp.exp2((m - m_new) * _LOG2E)
      # Rows of other segments (and rows that have seen no key yet) add nothing.
      p = jnp.where(mask, jnp.exp2((logits - m_new[:, None]) * _LOG2E), 0.0)
      l_new = l * correction + p.sum(axis=-1)
      o_new = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
      return o_new, m_new, l_new

    return lax.fori_loop(first_block, end_block, body, carry)

  rows = q.shape[0]
  init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  o, m, l = lax.fori_loop(0, seg_ref.shape[1], segment, init)
  if not stats:
    # Rows that saw no key (padding) have l = 0: zeros, as the merge gives them.
    o_ref[...] = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    return
  m_ref, l_ref = stats
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def _segments(seq: jax.Array, first: jax.Array,
              end: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per block of tokens [N, B]: its runs of one sequence -> ([N, 3, B] (sequence, first
  page, end page) per run, -1 sequences for unused entries and padding runs; [N, B] each
  token's run)."""
  n, b = seq.shape
  start = jnp.concatenate([jnp.ones((n, 1), bool), seq[:, 1:] != seq[:, :-1]], axis=1)
  run = jnp.cumsum(start, axis=1) - 1  # [N, B]: the run each token belongs to
  member = run[:, :, None] == jnp.arange(b)[None, None, :]  # [N, token, run]
  sid = jnp.where(member, seq[:, :, None], -2).max(axis=1)
  lo = jnp.where(member, first[:, :, None], jnp.iinfo(jnp.int32).max).min(axis=1)
  hi = jnp.where(member, end[:, :, None], 0).max(axis=1)
  sid = jnp.where(sid >= 0, sid, -1)
  segments = jnp.stack([sid, jnp.where(sid >= 0, lo, 0), jnp.where(sid >= 0, hi, 0)], axis=1)
  return segments.astype(jnp.int32), run.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("window", "softcap", "scale", "pages_per_block",
                                             "splits", "block_rows", "num_warps", "num_stages",
                                             "interpret"))
def paged_prefill_attention(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array,
                            seq_ids: jax.Array, positions: jax.Array, *, window: int | None,
                            softcap: float | None, scale: float,
                            pages_per_block: int | None = None, splits: int | None = None,
                            block_rows: int = _TARGET_ROWS, num_warps: int = 4,
                            num_stages: int = 2, interpret: bool | None = None) -> jax.Array:
  """Attention of each token q [T, H, h] over its sequence's cached keys, read in place from
  kv_pages [P, page_size, 2 * K * h] (see `attention.paged_attention_reference`), tokens
  taken `block_tokens(G, block_rows)` at a time. pages_per_block (default
  `prefill_pages_per_block`), splits, interpret: as `pallas_attention.paged_decode_attention`
  (splits: programs that share each block's pages; default from the number of blocks).
  block_rows, num_warps, num_stages: a program's query rows and Triton's warps and pipeline
  stages (the defaults are the engine's; `bench.attention --prefill_configs` times others)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  tokens, num_heads, head_dim = q.shape
  num_pages, page_size, kv_width = kv_pages.shape
  num_kv = kv_heads(num_heads, head_dim, kv_width)
  group = num_heads // num_kv
  per_block = block_tokens(group, block_rows)
  blocks = pl.cdiv(tokens, per_block)
  rows = program_rows(group, block_rows)
  if pages_per_block is None:
    pages_per_block = prefill_pages_per_block(kv_pages, head_dim, rows)
  max_pages = page_table.shape[1]
  if splits is None:
    splits = default_splits(blocks, num_kv, pl.cdiv(max_pages, pages_per_block),
                            target=_TARGET_PROGRAMS)
  width = pl.next_power_of_2(max_pages + pages_per_block)

  # Tokens padded to whole blocks (padding tokens: sequence -1, position -1).
  pad = blocks * per_block - tokens
  seq = jnp.pad(jnp.asarray(seq_ids, jnp.int32), (0, pad), constant_values=-1)
  pos = jnp.pad(jnp.asarray(positions, jnp.int32), (0, pad))
  pos = jnp.where(seq >= 0, jnp.minimum(pos, max_pages * page_size - 1), -1)
  first = jnp.zeros_like(pos) if window is None else jnp.maximum(pos - window + 1, 0) // page_size
  segments, run = _segments(seq.reshape(blocks, per_block), first.reshape(blocks, per_block),
                            (pos // page_size + 1).reshape(blocks, per_block))
  # Row r of a block: token r // G, query head r % G; rows past block x G are padding.
  row_token = jnp.minimum(jnp.arange(rows) // group, per_block - 1)
  real_row = jnp.arange(rows) < per_block * group
  row_pos = jnp.where(real_row, pos.reshape(blocks, per_block)[:, row_token], -1)
  row_run = jnp.where(real_row, run[:, row_token], -1)
  qg = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(blocks, per_block, num_kv, group, head_dim)
  qg = qg.transpose(0, 2, 1, 3, 4).reshape(blocks, num_kv, per_block * group, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - per_block * group), (0, 0)))
  table = jnp.pad(jnp.clip(page_table, 0, num_pages - 1), ((0, 0), (0, width - max_pages)))

  kernel = functools.partial(_kernel, pages_per_block=pages_per_block, splits=splits,
                             window=window, softcap=softcap, scale=scale)
  # Blocks in reverse: a chunk's last blocks read the most keys (causal), so they start
  # first and the short ones fill in behind them instead of trailing the launch.
  last = blocks - 1
  keys_spec = pl.BlockSpec((num_pages, page_size, head_dim), lambda b, k, s: (0, 0, k))
  values_spec = pl.BlockSpec((num_pages, page_size, head_dim), lambda b, k, s: (0, 0, num_kv + k))
  per_row = pl.BlockSpec((None, rows), lambda b, k, s: (last - b, 0))
  in_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, k, s: (last - b, k, 0, 0)),
              keys_spec, values_spec,
              pl.BlockSpec(table.shape, lambda b, k, s: (0, 0)), per_row, per_row,
              pl.BlockSpec((None, 3, per_block), lambda b, k, s: (last - b, 0, 0))]
  if splits == 1:
    # One split: the kernel normalises and writes the output itself (no f32 partials, no
    # merge launch).
    out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, k, s: (last - b, k, 0, 0))
    out_shape = jax.ShapeDtypeStruct((blocks, num_kv, rows, head_dim), q.dtype)
  else:
    out_specs = [pl.BlockSpec((None, None, None, rows, head_dim),
                              lambda b, k, s: (s, last - b, k, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, k, s: (s, last - b, k, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, k, s: (s, last - b, k, 0))]
    out_shape = [jax.ShapeDtypeStruct((splits, blocks, num_kv, rows, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((splits, blocks, num_kv, rows), jnp.float32),
                 jax.ShapeDtypeStruct((splits, blocks, num_kv, rows), jnp.float32)]
  out = pl.pallas_call(
      kernel,
      grid=(blocks, num_kv, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name="blink_paged_prefill_attention",
  )(qg, kv_pages, kv_pages, table, row_pos, row_run, segments)
  if splits > 1:
    out = merge_splits(*out, q.dtype, interpret=interpret)
  out = out[:, :, :per_block * group]
  out = out.reshape(blocks, num_kv, per_block, group, head_dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(blocks * per_block, num_heads, head_dim)[:tokens]
