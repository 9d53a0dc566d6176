"""Gemma's norm steps as Pallas kernels (Triton on the GPU): the residual add and the RMSNorm
after it (`model.add_rms_norm`), and the q/k RMSNorm + RoPE + cache row of a step's
projections (`model.prepare_qkv`).

A Gemma layer has two such steps (the post-attention add with the pre-FFW norm, the
post-FFW add with the next layer's pre-attention norm). At batch 1 XLA compiles each into
three kernels (a reduction of the branch to its sum of squares, the residual add fused with
the second reduction, the normalisation: a row reduced to a scalar is its own kernel), and
inside a CUDA graph each kernel costs ~2 us however little it does (docs/NOTES.md, "Pallas
decode attention: splits over the actual context"). Here each step is one launch: a program
per row walks the row in power-of-two chunks
(Triton blocks are powers of two; Gemma's widths are not: 640, 1152, 2560) and does both
norms in registers.

Same math as `model.add_rms_norm`: float32 norms, the normed branch rounded to the
activation dtype before the add, the sum rounded before it is normed again.

Between the QKV projection and the attention XLA runs five kernels per layer at batch 1
(the q/k sums of squares, the k and the q norm + RoPE, the keys and values concatenated
into the cache row, the query padded for the Pallas attention); `prepare_qkv` is one
launch, a program per token, that reads the fused projection in place (or adds up the
CUDA GEMV's partial sums of it, which XLA had added up in a kernel of its own), writes its row
into the (aliased) cache and the query already grouped by KV head and padded (the layout
`pallas_attention.paged_decode_attention` takes); XLA's scatter of the row into the cache
was two more kernels per layer.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


# Widest chunk a program loads at once (elements of one row).
_MAX_CHUNK = 1024
# Narrowest chunk worth a kernel; rows whose width has a smaller power-of-two factor use the
# jnp reference (Triton vectors of fewer elements are legal but such widths are not Gemma's).
_MIN_CHUNK = 16


def chunk_size(width: int) -> int:
  """The largest power of two that divides `width`, at most _MAX_CHUNK."""
  return min(width & -width, _MAX_CHUNK)


def usable(width: int) -> bool:
  """Whether rows of `width` split into chunks the add + norm kernel takes (else the jnp
  reference runs)."""
  return chunk_size(width) >= _MIN_CHUNK


def _sum_rows(ref, index):
  """ref [S, ...] float32 partial sums: the S rows at `index` added one by one. As one
  [S, chunk] reduction (across threads) the add + norm kernel took 5.7 us instead of 2.7
  with the CUDA GEMV's 16-32 partials (docs/NOTES.md, "The CUDA GEMV: one pass per block")."""
  return functools.reduce(operator.add, [ref[s, index] for s in range(ref.shape[0])])


def _kernel(x_ref, branch_ref, add_w_ref, next_w_ref, x_out_ref, y_ref, *, eps: float,
            chunk: int):
  """One row: x_ref, branch_ref [D] (or [S, D] float32 partial sums of the branch);
  add_w_ref, next_w_ref [D] -> x_out_ref (x + normed branch), y_ref (x_out normed), [D]
  each. Every load comes first, every store last: Triton cannot tell the refs apart, so it
  keeps a load that follows a store behind it, and a row walked chunk by chunk paid one
  memory round trip per chunk (a slower step than XLA's)."""
  width = x_ref.shape[0]
  dtype = x_out_ref.dtype
  parts = [pl.ds(start, chunk) for start in range(0, width, chunk)]
  f32 = lambda ref: [ref[p].astype(jnp.float32) for p in parts]
  if len(branch_ref.shape) == 2:  # [S, D] partial sums: added up, rounded as a matmul's output
    branch = [_sum_rows(branch_ref, p).astype(dtype).astype(jnp.float32) for p in parts]
  else:
    branch = f32(branch_ref)
  xs, add_w, next_w = f32(x_ref), f32(add_w_ref), f32(next_w_ref)
  scale = lax.rsqrt(sum(jnp.sum(b * b) for b in branch) / width + eps)
  summed = [(x + (b * scale * (1.0 + w)).astype(dtype).astype(jnp.float32)).astype(dtype)
            for x, b, w in zip(xs, branch, add_w)]
  sums = [x.astype(jnp.float32) for x in summed]
  scale = lax.rsqrt(sum(jnp.sum(x * x) for x in sums) / width + eps)
  for p, x, xf, w in zip(parts, summed, sums, next_w):
    x_out_ref[p] = x
    y_ref[p] = (xf * scale * (1.0 + w)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x: jax.Array, branch: jax.Array, add_weight: jax.Array,
                 next_weight: jax.Array, eps: float, *,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """x, branch [..., D]; add_weight, next_weight [D] -> (x + rms_norm(branch, add_weight),
  rms_norm(that, next_weight)), both [..., D] in x's dtype. branch may also be float32
  partial sums [S, ..., D] (S a power of two; `cuda_gemv.ffw_down`), added up as they are
  loaded. interpret: run the kernel with Pallas' interpreter (default: when the default
  device is not a GPU)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  width = x.shape[-1]
  partial = branch.ndim == x.ndim + 1
  splits = branch.shape[0] if partial else 1
  if (branch.shape[partial:] != x.shape or add_weight.shape != (width,)
      or next_weight.shape != (width,) or splits & (splits - 1)):
    raise ValueError(f"add_rms_norm: x {x.shape}, branch {branch.shape}, weights "
                     f"{add_weight.shape} and {next_weight.shape} do not match")
  chunk = chunk_size(width)
  if chunk < _MIN_CHUNK:
    raise ValueError(f"width {width} has no power-of-two factor >= {_MIN_CHUNK}")
  rows = x.reshape(-1, width)
  row_spec = pl.BlockSpec((None, width), lambda r: (r, 0))
  weight_spec = pl.BlockSpec((width,), lambda r: (0,))
  if partial:
    branch = branch.reshape(splits, *rows.shape)
    branch_spec = pl.BlockSpec((splits, None, width), lambda r: (0, r, 0))
  else:
    branch = branch.astype(x.dtype).reshape(rows.shape)
    branch_spec = row_spec
  x_out, y = pl.pallas_call(
      functools.partial(_kernel, eps=eps, chunk=chunk),
      grid=(rows.shape[0],),
      in_specs=[row_spec, branch_spec, weight_spec, weight_spec],
      out_specs=[row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(rows.shape, x.dtype)] * 2,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_add_rms_norm",
  )(rows, branch, add_weight, next_weight)
  return x_out.reshape(x.shape), y.reshape(x.shape)


def _prepare_kernel(qkv_ref, cos_ref, sin_ref, qw_ref, kw_ref, slots_ref, _, q_out_ref,
                    cache_ref, *, eps: float, normed: bool, num_heads: int):
  """One token t: qkv_ref [(H + 2K) * h] (the fused projection, or [S, (H + 2K) * h] float32
  partial sums of it, added up and rounded as a matmul's output); cos_ref, sin_ref [h/2];
  qw_ref, kw_ref [h]; slots_ref [T] -> q_out_ref [K, R, h] (query head n at KV head n // G,
  row n % G; rows G.. zero) and its row of cache_ref [P, page_size, 2 * K * h] (rotated
  keys, then values) at slots_ref[t], unless that is past the end. Loads first, stores last
  (see `_kernel`)."""
  num_kv, rows, head_dim = q_out_ref.shape
  num_pages, page_size, _ = cache_ref.shape
  group, half = num_heads // num_kv, head_dim // 2
  dtype = q_out_ref.dtype
  first, second = pl.ds(0, half), pl.ds(half, half)

  def load(start, size):
    if len(qkv_ref.shape) == 2:  # [S, W] partial sums
      return _sum_rows(qkv_ref, pl.ds(start, size)).astype(dtype)
    return qkv_ref[pl.ds(start, size)]

  def halves(head):
    return (load(head * head_dim, half).astype(jnp.float32),
            load(head * head_dim + half, half).astype(jnp.float32))
  queries = [halves(n) for n in range(num_heads)]
  keys = [halves(num_heads + kv) for kv in range(num_kv)]
  values = [load((num_heads + num_kv + kv) * head_dim, head_dim) for kv in range(num_kv)]
  cos, sin = cos_ref[...], sin_ref[...]
  weights = [(w[first].astype(jnp.float32), w[second].astype(jnp.float32))
             for w in (qw_ref, kw_ref)] if normed else [None, None]
  slot = slots_ref[pl.program_id(0)]

  def rotate(x, weight):
    x1, x2 = x
    if normed:  # as rms_norm: float32, rounded to the activation dtype before RoPE
      scale = lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / head_dim + eps)
      x1 = (x1 * scale * (1.0 + weight[0])).astype(dtype).astype(jnp.float32)
      x2 = (x2 * scale * (1.0 + weight[1])).astype(dtype).astype(jnp.float32)
    return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

  rotated_q = [rotate(x, weights[0]) for x in queries]
  rotated_k = [rotate(x, weights[1]) for x in keys]
  zeros = jnp.zeros((head_dim,), dtype)
  for n, (o1, o2) in enumerate(rotated_q):
    q_out_ref[n // group, n % group, first] = o1
    q_out_ref[n // group, n % group, second] = o2
  for kv in range(num_kv):
    for r in range(group, rows):
      q_out_ref[kv, r, :] = zeros

  @pl.when(slot < num_pages * page_size)
  def _():
    page, row = slot // page_size, slot % page_size
    for kv, ((o1, o2), v) in enumerate(zip(rotated_k, values)):
      cache_ref[page, row, pl.ds(kv * head_dim, half)] = o1.astype(cache_ref.dtype)
      cache_ref[page, row, pl.ds(kv * head_dim + half, half)] = o2.astype(cache_ref.dtype)
      cache_ref[page, row, pl.ds((num_kv + kv) * head_dim, head_dim)] = v.astype(cache_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "num_heads", "num_kv_heads", "query_rows",
                                             "interpret"))
def prepare_qkv(qkv: jax.Array, cos: jax.Array, sin: jax.Array, q_weight: jax.Array | None,
                k_weight: jax.Array | None, eps: float, kv_pages: jax.Array, slots: jax.Array,
                *, num_heads: int, num_kv_heads: int, query_rows: int | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """`model.prepare_qkv` as one kernel: qkv [T, (H + 2K) * h] (or float32 partial sums of it
  [S, T, (H + 2K) * h], the CUDA GEMV's, added up as they are loaded: no kernel of XLA's
  between the two), cos, sin [T, h/2], kv_pages [P, page_size, 2 * K * h], slots [T]
  (`attention.cache_slots`) -> the query ([T, H, h]; with query_rows, [T, K, query_rows,
  h], grouped by KV head with zero rows after each group) in the projection's dtype (the
  cache's for partial sums) and kv_pages with the tokens' rows written in place (the cache is
  aliased: no copy of it, no separate scatter kernel)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  if qkv.ndim not in (2, 3) or (qkv.ndim == 3 and qkv.dtype != jnp.float32):
    raise ValueError(f"prepare_qkv: qkv {qkv.shape} {qkv.dtype} is not [T, W], nor float32 "
                     f"partial sums [S, T, W]")
  partial = qkv.ndim == 3
  tokens, width = qkv.shape[partial:]
  dtype = kv_pages.dtype if partial else qkv.dtype
  heads = num_heads + 2 * num_kv_heads
  head_dim = width // heads
  group = num_heads // max(num_kv_heads, 1)
  rows = group if query_rows is None else query_rows
  if (not num_kv_heads or num_heads % num_kv_heads or width % heads or head_dim % 2
      or cos.shape != (tokens, head_dim // 2) or sin.shape != cos.shape or rows < group
      or kv_pages.ndim != 3 or kv_pages.shape[2] != 2 * num_kv_heads * head_dim
      or slots.shape != (tokens,)):
    raise ValueError(f"prepare_qkv: qkv {qkv.shape}, {num_heads} query and {num_kv_heads} KV "
                     f"heads, cos {cos.shape}, sin {sin.shape}, query_rows {query_rows}, "
                     f"kv_pages {kv_pages.shape}, slots {slots.shape} do not match")
  normed = q_weight is not None
  if not normed:  # the kernel's signature is fixed: unused weights
    q_weight = k_weight = jnp.zeros((head_dim,), dtype)

  def per_token(*shape):
    return pl.BlockSpec((None, *shape), lambda t: (t,) + (0,) * len(shape))
  whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
  qkv_spec = (pl.BlockSpec((qkv.shape[0], None, width), lambda t: (0, t, 0)) if partial
              else per_token(width))
  query, kv_pages = pl.pallas_call(
      functools.partial(_prepare_kernel, eps=eps, normed=normed, num_heads=num_heads),
      grid=(tokens,),
      in_specs=[qkv_spec, per_token(head_dim // 2), per_token(head_dim // 2),
                whole((head_dim,)), whole((head_dim,)), whole((tokens,)),
                whole(kv_pages.shape)],
      out_specs=[per_token(num_kv_heads, rows, head_dim), whole(kv_pages.shape)],
      out_shape=[jax.ShapeDtypeStruct((tokens, num_kv_heads, rows, head_dim), dtype),
                 jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype)],
      input_output_aliases={6: 1},
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_prepare_qkv",
  )(qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), q_weight, k_weight,
    slots.astype(jnp.int32), kv_pages)
  if query_rows is None:
    query = query.reshape(tokens, num_heads, head_dim)
  return query, kv_pages
