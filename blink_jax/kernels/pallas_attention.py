"""Paged decode attention as one Pallas kernel (Triton on the GPU) that reads the KV pages in
place.

The plain-jnp oracle (`attention.paged_attention_reference`) gathers each token's pages into
a contiguous copy and then runs two GEMMs and a softmax: at batch 1 XLA compiles that into
seven kernels per layer (gather, two GEMM fusions, softmax, two pads, a split-K reduce;
docs/NOTES.md, "Dot-strength reduction off"), and inside a CUDA graph each kernel costs ~2 us
however little
it does. Here a layer's attention is two launches: the first's grid is (program, KV head),
a fixed number of programs shared out among the step's live rows at run time (the splits of
a token: more of them when fewer rows are live); each program walks its share of its token's
pages a block at a time with an online softmax (flash decoding) and writes a partial output;
the second merges each token's splits.

Same signature and semantics as the reference (causal, optional sliding window, soft-cap,
scale, GQA; padding rows come out as zeros). Meant for steps with few tokens per
sequence (decode): every token reads its whole context, so a 256-token prefill chunk would
read it 256 times; steps of up to `KernelOptions.decode_rows` tokens run it
(`blink_jax.kernels.select`).
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

# Triton's dot needs at least 16 rows: the query heads of one KV head are padded to this.
_MIN_ROWS = 16
# Bytes of one K (or V) tile: 64 keys of a 256-wide bf16 head (32 keys in f32), so a K and a
# V tile per pipeline stage fit the SM's shared memory (f32 at 64 keys asked 257 KiB of the
# H200's 227).
TILE_BYTES = 32 * 1024
# Programs the default split count aims at: about two per SM of an H200 (132 SMs), so a
# batch-1 step spreads one token's context over 32 programs instead of a handful.
_TARGET_PROGRAMS = 256
# Triton's pipeline stages of the decode kernel: one K and one V tile in flight, 64 KiB of
# shared memory, room for three programs an SM to hide each other's chains of dependent page
# reads (two stages, 128 KiB, left room for one). A layer's attention took 12.0 / 14.3 us
# against 13.4 / 18.1 at 16 rows (sliding-window / global), 26.1 / 40.5 against 32.5 / 48.3
# at 64 on an H100, as fast as vLLM's FlashAttention 3 on the same pages (docs/PERFORMANCE.md,
# "Our attention beside vLLM's FlashAttention 3 (revision 247bf2e)").
_STAGES = 1
# Most splits the default picks: 32 beat 16 at batch 1 on the H200 (1.81 vs 1.90 ms per 1B
# token; 2.45 vs 2.42 at 64).
_MAX_SPLITS = 32
# Partial-output elements one merge program holds (128 f32 per thread at 4 warps).
_MERGE_ELEMENTS = 16 * 1024
_LOG2E = math.log2(math.e)


def query_rows(group: int) -> int:
  """Rows of the kernel's query block for `group` query heads per KV head (a power of two,
  at least Triton's 16): the layout `pallas_norm.prepare_qkv(query_rows=...)` can write."""
  return max(_MIN_ROWS, pl.next_power_of_2(group))


def _kernel(counts_ref, q_ref, k_ref, v_ref, table_ref, bounds_ref, o_ref, m_ref, l_ref, *,
            pages_per_block: int, window: int | None, softcap: float | None, scale: float):
  """One (program, KV head): counts_ref [2] = (live rows, splits per row) for the step, so
  program p takes split p % splits of row p // splits, and programs past the live rows' do
  nothing (the merge never reads their output). q_ref [T, R, h] (every row's query, its
  G query heads padded to R rows);
  k_ref, v_ref [P, page_size, h]; table_ref [T, W] (each row's page list, entries clipped to
  valid page ids, padded so any block starting before its end fits); bounds_ref [T, 2] =
  (position, first page to read). The blocks of pages that hold keys in [first page *
  page_size, position] are shared out evenly among the splits at run time, whatever the
  context length. Writes the split's unnormalised output [R, h] and its softmax max and sum
  [R]."""
  program = pl.program_id(0)
  live, splits = counts_ref[0], counts_ref[1]
  token, split = program // splits, program % splits

  @pl.when(token < live)
  def _():
    page_size = k_ref.shape[1]
    block_keys = pages_per_block * page_size
    pos, first_page = bounds_ref[token, 0], bounds_ref[token, 1]
    # A padding row (pos < 0) has no pages.
    num_pages = jnp.maximum(pos // page_size + 1 - first_page, 0)
    num_blocks = pl.cdiv(num_pages, pages_per_block)
    per_split = pl.cdiv(num_blocks, splits)
    first_block = jnp.minimum(split * per_split, num_blocks)
    end_block = jnp.minimum(first_block + per_split, num_blocks)

    q = q_ref[token]
    groups, head_dim = q.shape
    # f32 (the CPU == GPU tests): full precision, not Triton's TF32 default.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(block, carry):
      o, m, l = carry
      page = first_page + block * pages_per_block
      ids = table_ref[token, pl.ds(page, pages_per_block)]
      k = k_ref[ids].reshape(block_keys, head_dim)
      v = v_ref[ids].reshape(block_keys, head_dim)
      logits = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
      logits = apply_softcap(logits, softcap)
      key_pos = page * page_size + jnp.arange(block_keys)
      mask = key_pos <= pos
      if window is not None:
        mask &= pos - key_pos < window
      logits = jnp.where(mask[None, :], logits, MASK_VALUE)
      m_new = jnp.maximum(m, logits.max(axis=-1))
      correction = jnp.exp2((m - m_new) * _LOG2E)
      p = jnp.exp2((logits - m_new[:, None]) * _LOG2E)
      l_new = l * correction + p.sum(axis=-1)
      o_new = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
      return o_new, m_new, l_new

    init = (jnp.zeros((groups, head_dim), jnp.float32),
            jnp.full((groups,), MASK_VALUE, jnp.float32), jnp.zeros((groups,), jnp.float32))
    o, m, l = lax.fori_loop(first_block, end_block, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _merged(o, m, l, dtype):
  """Splits' partial softmaxes o [S, G, c], m and l [S, G] -> the normalised output [G, c].
  A split that read nothing has l = 0 and the mask value as its max, so its weight vanishes
  next to any split that read a key."""
  m_all = m.max(axis=0)
  weight = jnp.exp(m - m_all[None, :])
  l_all = (l * weight).sum(axis=0)
  out = (o * weight[:, :, None]).sum(axis=0)
  return (out / jnp.maximum(l_all, 1e-30)[:, None]).astype(dtype)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
  """One (token, KV head, slice of head dims): merges the splits o_ref [S, G, c], m_ref and
  l_ref [S, G] into out_ref [G, c], all splits in one load (a loop over them made a batch-1
  token 0.3 ms slower on the H200)."""
  out_ref[...] = _merged(o_ref[...], m_ref[...], l_ref[...], out_ref.dtype)


def _merge_live_kernel(counts_ref, o_ref, m_ref, l_ref, out_ref, *, most: int):
  """The same for the decode kernel's splits, laid out by program: token t's are rows [t *
  splits, (t + 1) * splits) of o_ref [N, G, c], m_ref and l_ref [N, G], splits from
  counts_ref as in `_kernel`. Loads the most splits a token can have, masked to its own
  (`most`; masked rows are not read); a row past the live ones gets zeros."""
  token = pl.program_id(0)
  live, splits = counts_ref[0], counts_ref[1]
  mine = (jnp.arange(most) < splits) & (token < live)
  rows = pl.ds(token * splits, most)
  m = plgpu.load(m_ref.at[rows], mask=mine[:, None], other=MASK_VALUE)
  l = plgpu.load(l_ref.at[rows], mask=mine[:, None], other=0.0)
  o = plgpu.load(o_ref.at[rows], mask=mine[:, None, None], other=0.0)
  out_ref[...] = _merged(o, m, l, out_ref.dtype)


def default_splits(tokens: int, num_kv_heads: int, num_blocks: int,
                   target: int = _TARGET_PROGRAMS) -> int:
  """Splits per (token, KV head): enough programs to fill the GPU at small batches (about
  `target` in all), at most one per block of the longest page list."""
  want = pl.cdiv(target, tokens * num_kv_heads)
  return max(1, min(pl.next_power_of_2(want), _MAX_SPLITS, pl.next_power_of_2(num_blocks)))


def window_splits(window: int | None, block_keys: int) -> int:
  """Most splits worth a row's context in a sliding-window layer: the largest power of two
  of whole blocks of `block_keys` keys in the window (a window of 512 keys in blocks of 64:
  8), so every split walks at least one block (about two when the window straddles one
  more). A decode step of 16 rows at 1k context took 13.3 us a sliding-window layer with 8
  splits against 15.6 with 16 on an H100 (docs/PERFORMANCE.md, "The decode head's live
  splits and the attention's split counts (revision 16424c5)"). No cap without a window."""
  if window is None:
    return _MAX_SPLITS
  blocks = max(1, window // block_keys)
  return 1 << (blocks.bit_length() - 1)


@functools.partial(jax.jit, static_argnames=("window", "softcap", "scale", "pages_per_block",
                                             "splits", "group", "num_warps", "num_stages",
                                             "interpret"))
def paged_decode_attention(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array,
                           seq_ids: jax.Array, positions: jax.Array, *, window: int | None,
                           softcap: float | None, scale: float,
                           pages_per_block: int | None = None, splits: int | None = None,
                           group: int | None = None, num_warps: int = 4,
                           num_stages: int = _STAGES, interpret: bool | None = None):
  """Attention of each token q [T, H, h] over its sequence's cached keys, read in place from
  kv_pages [P, page_size, 2 * K * h] (see `attention.paged_attention_reference`). q may
  also come grouped by KV head and padded, [T, K, query_rows(G), h] with `group` = G query
  heads per KV head (`pallas_norm.prepare_qkv` writes it so): no padding kernel then.

  pages_per_block: pages per inner step (x page_size keys per dot; a power of two; default:
  tiles of at most TILE_BYTES, at least 16 keys); splits: programs that share one token's
  context (a power of two). Given, every token gets that many. By default the kernel runs
  T x `default_splits` programs (32 at batch 1, so a 1k-token context of 16-token pages is
  one 4-page block for each of 16 programs; in a sliding-window layer no more than
  `window_splits`) and shares them out at run time among the rows
  up to the last live one (sequence >= 0), each getting the largest power of two of them
  that fits, at most one per block of the page list: a step whose rows are mostly padding,
  such as the decode head of a mixed step (`select.head_then_rest`: 256 rows, often a few
  dozen live), spreads each context over several programs instead of walking it in one
  (docs/PERFORMANCE.md, "Pacing that holds while requests keep arriving, against vLLM at 4,
  16 and 32 req/s (revision d27bbfa)"). num_warps, num_stages: Triton's warps and pipeline
  stages of the attention kernel (the defaults are the engine's; `bench.attention
  --decode_configs` times others). interpret: run the
  kernels with Pallas' interpreter (default: when the default device is not a GPU; pass it
  explicitly when computing on another device)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  grouped = q.ndim == 4
  if grouped:
    if group is None or q.shape[2] != query_rows(group):
      raise ValueError(f"a grouped query {q.shape} needs group with query_rows(group) == "
                       f"{q.shape[2]}, got group {group}")
    tokens, _, _, head_dim = q.shape
    num_heads = q.shape[1] * group
  else:
    tokens, num_heads, head_dim = q.shape
  num_pages, page_size, kv_width = kv_pages.shape
  num_kv_heads = kv_heads(num_heads, head_dim, kv_width)
  if grouped and q.shape[1] != num_kv_heads:
    raise ValueError(f"a grouped query {q.shape} has {q.shape[1]} KV heads, the cache "
                     f"{num_kv_heads}")
  group = num_heads // num_kv_heads
  if pages_per_block is None:
    pages_per_block = default_pages_per_block(kv_pages, head_dim)
  if pages_per_block & (pages_per_block - 1):
    raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
  max_pages = page_table.shape[1]
  num_blocks = pl.cdiv(max_pages, pages_per_block)
  if splits is None:
    # The programs of T fully live rows; up to one split per block when fewer are live
    # (default_splits' own cap, so never fewer than per_token); in a sliding-window layer
    # no more than its window's blocks.
    most = min(_MAX_SPLITS, pl.next_power_of_2(num_blocks),
               window_splits(window, pages_per_block * page_size))
    per_token = min(default_splits(tokens, num_kv_heads, num_blocks), most)
  elif splits < 1 or splits & (splits - 1):
    raise ValueError(f"splits must be a power of two, got {splits}")
  else:
    per_token = most = splits
  programs = tokens * per_token
  rows = query_rows(group)
  # Triton blocks are powers of two: the page list is padded to one that holds any block
  # starting before its end.
  width = pl.next_power_of_2(max_pages + pages_per_block)

  seq_ids, positions = jnp.asarray(seq_ids), jnp.asarray(positions)
  valid = seq_ids >= 0
  counts = live_splits(valid, programs, most)
  # Each token's page list, padded to the width, entries clipped to real pages (the masked
  # tail of a list may hold anything; a clipped id reads a real page, then masks it).
  table = jnp.clip(page_table[jnp.maximum(seq_ids, 0)], 0, num_pages - 1)
  table = jnp.pad(table, ((0, 0), (0, width - max_pages)))
  pos = jnp.where(valid, jnp.minimum(positions, max_pages * page_size - 1), -1)
  first = jnp.zeros_like(pos) if window is None else jnp.maximum(pos - window + 1, 0) // page_size
  bounds = jnp.stack([pos, first], axis=1).astype(jnp.int32)
  if grouped:
    qg = q
  else:
    qg = q.reshape(tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

  kernel = functools.partial(_kernel, pages_per_block=pages_per_block, window=window,
                             softcap=softcap, scale=scale)
  # The same array twice: KV head k's keys are the k-th head_dim-wide block of a row, its
  # values the (K + k)-th.
  keys_spec = pl.BlockSpec((num_pages, page_size, head_dim), lambda p, k: (0, 0, k))
  values_spec = pl.BlockSpec((num_pages, page_size, head_dim),
                             lambda p, k: (0, 0, num_kv_heads + k))
  # The partial outputs by program, `most` rows more than the programs write: the merge
  # loads that many from a token's first split (masked to its own, never past the end).
  parts = programs + most
  o, m, l = pl.pallas_call(
      kernel,
      grid=(programs, num_kv_heads),
      in_specs=[pl.BlockSpec((2,), lambda p, k: (0,)),
                pl.BlockSpec((tokens, None, rows, head_dim), lambda p, k: (0, k, 0, 0)),
                keys_spec, values_spec,
                pl.BlockSpec((tokens, width), lambda p, k: (0, 0)),
                pl.BlockSpec((tokens, 2), lambda p, k: (0, 0))],
      out_specs=[pl.BlockSpec((None, None, rows, head_dim), lambda p, k: (p, k, 0, 0)),
                 pl.BlockSpec((None, None, rows), lambda p, k: (p, k, 0)),
                 pl.BlockSpec((None, None, rows), lambda p, k: (p, k, 0))],
      out_shape=[jax.ShapeDtypeStruct((parts, num_kv_heads, rows, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((parts, num_kv_heads, rows), jnp.float32),
                 jax.ShapeDtypeStruct((parts, num_kv_heads, rows), jnp.float32)],
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name="blink_paged_decode_attention",
  )(counts, qg, kv_pages, kv_pages, table, bounds)
  # A power-of-two group is merged straight into the output's layout (the padding rows
  # are never read): no slicing kernel between the merge and the output projection.
  keep = group if group & (group - 1) == 0 else rows
  dims = _merge_dims(most, keep, head_dim)
  out = pl.pallas_call(
      functools.partial(_merge_live_kernel, most=most),
      grid=(tokens, num_kv_heads, pl.cdiv(head_dim, dims)),
      in_specs=[pl.BlockSpec((2,), lambda t, k, d: (0,)),
                pl.BlockSpec((parts, None, keep, dims), lambda t, k, d: (0, k, 0, d)),
                pl.BlockSpec((parts, None, keep), lambda t, k, d: (0, k, 0)),
                pl.BlockSpec((parts, None, keep), lambda t, k, d: (0, k, 0))],
      out_specs=pl.BlockSpec((None, None, keep, dims), lambda t, k, d: (t, k, 0, d)),
      out_shape=jax.ShapeDtypeStruct((tokens, num_kv_heads, keep, head_dim), q.dtype),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_paged_decode_merge",
  )(counts, o, m, l)
  return out[:, :, :group].reshape(tokens, num_heads, head_dim)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, dtype, *,
                 interpret: bool) -> jax.Array:
  """The splits' partial softmaxes o [S, B, K, R, h], m, l [S, B, K, R] -> the normalised
  output [B, K, R, h] in `dtype` (the prefill kernel's; the decode kernel merges its own,
  laid out by program): one more launch (XLA made three kernels of the same few jnp ops);
  each program takes a slice of the head dims, so all splits fit its registers."""
  splits, blocks, num_kv_heads, rows, head_dim = o.shape
  dims = _merge_dims(splits, rows, head_dim)
  return pl.pallas_call(
      _merge_kernel,
      grid=(blocks, num_kv_heads, pl.cdiv(head_dim, dims)),
      in_specs=[pl.BlockSpec((splits, None, None, rows, dims), lambda t, k, d: (0, t, k, 0, d)),
                pl.BlockSpec((splits, None, None, rows), lambda t, k, d: (0, t, k, 0)),
                pl.BlockSpec((splits, None, None, rows), lambda t, k, d: (0, t, k, 0))],
      out_specs=pl.BlockSpec((None, None, rows, dims), lambda t, k, d: (t, k, 0, d)),
      out_shape=jax.ShapeDtypeStruct((blocks, num_kv_heads, rows, head_dim), dtype),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_paged_decode_merge",
  )(o, m, l)


def live_splits(valid: jax.Array, programs: int, most: int) -> jax.Array:
  """[2] int32: the rows up to the last live one (`valid` [T]) and each one's splits, as
  many of `programs` as fit (a power of two, so at least half of the programs work), no more
  than `most`."""
  live = jnp.max(jnp.where(valid, jnp.arange(valid.shape[0], dtype=jnp.int32) + 1, 0))
  fit = jnp.int32(programs) // jnp.maximum(live, 1)
  share = jnp.minimum(jnp.left_shift(jnp.int32(1), 31 - lax.clz(fit)), most)
  return jnp.stack([live, share]).astype(jnp.int32)


def _merge_dims(splits: int, rows: int, head_dim: int) -> int:
  """Head dims a merge program takes: all splits of its rows fit its registers."""
  return min(head_dim, max(16, _MERGE_ELEMENTS // (splits * rows)))


def kv_heads(num_heads: int, head_dim: int, kv_width: int) -> int:
  """KV heads of a cache row kv_width wide (keys, then values), checked against the query's
  heads and head size."""
  num_kv_heads = kv_width // (2 * head_dim)
  if not num_kv_heads or num_heads % num_kv_heads or kv_width % (2 * head_dim):
    raise ValueError(f"{num_heads} query heads and KV width {kv_width} (keys and values) do "
                     f"not match head_dim {head_dim}")
  return num_kv_heads


def default_pages_per_block(kv_pages: jax.Array, head_dim: int,
                            tile_bytes: int = TILE_BYTES) -> int:
  """Pages per inner step: K and V tiles of at most `tile_bytes` each, at least 16 keys (the
  smallest Triton dot)."""
  page_size = kv_pages.shape[1]
  tile_pages = tile_bytes // (kv_pages.dtype.itemsize * head_dim * page_size)
  return pl.next_power_of_2(max(1, tile_pages, pl.cdiv(16, page_size)))
