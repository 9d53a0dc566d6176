"""The attention's merge of its splits and the output projection of a decode-sized step as one
Pallas kernel (Triton on the GPU).

`pallas_attention.paged_decode_attention` leaves each (token, KV head) as partial softmaxes of
S splits; at batch 1 merging them and projecting the merged heads back to the model width
are two more kernels per layer (the merge, XLA's GEMM). Here a program owns a slice of
output columns and a block of the heads' dims: it merges the splits for just those dims
(the splits' maxima and sums are a few floats per head), rounds the result to the
activation dtype as the attention's output is, and multiplies it into its tile of the
output weights. The blocks' partial sums go to the next add + norm kernel, which adds them
up as it loads (`pallas_norm.add_rms_norm`), as the fused down projection's do.

Off unless BLINK_PALLAS_OUT=1 (not yet measured on a GPU); used for steps of up to
MAX_TOKENS tokens that run the Pallas attention and norm kernels.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ENABLED = os.environ.get("BLINK_PALLAS_OUT", "0") == "1"
MAX_TOKENS = 8
# Most head dims per block and output columns per program (powers of two).
BLOCK_K = 64
BLOCK_N = 128
_MIN_BLOCK = 16


def blocks(head_dim: int, width: int) -> tuple[int, int]:
  """(head dims per block, output columns per program)."""
  return min(BLOCK_K, head_dim & -head_dim), min(BLOCK_N, width & -width)


def usable(tokens: int, num_heads: int, head_dim: int, width: int) -> bool:
  """Whether a step of `tokens` rows fits: blocks of at least _MIN_BLOCK and a power-of-two
  number of blocks over all heads (the add + norm kernel loads the partial sums as one
  power-of-two block)."""
  block_k, block_n = blocks(head_dim, width)
  num_blocks = num_heads * head_dim // block_k
  return (tokens <= MAX_TOKENS and min(block_k, block_n) >= _MIN_BLOCK
          and num_blocks & (num_blocks - 1) == 0)


def _kernel(o_ref, m_ref, l_ref, w_ref, out_ref, *, group: int, head_dim: int, block_k: int,
            dtype):
  """One (column slice, block of head dims): o_ref [S, T, K, R, h], m_ref, l_ref [S, T, K, R]
  (the attention's splits); w_ref [H * h, N] (this program's N output columns) -> out_ref
  [T, N], the block's float32 partial sums. Loads first, stores last (pallas_norm._kernel
  says why)."""
  tokens = o_ref.shape[1]
  k0 = pl.program_id(1) * block_k
  head = k0 // head_dim
  kv, row = head // group, head % group
  dims = pl.ds(pl.multiple_of(k0 % head_dim, block_k), block_k)
  weight = w_ref[pl.ds(pl.multiple_of(k0, block_k), block_k), :].astype(jnp.float32)
  parts = [(o_ref[:, t, kv, row, dims], m_ref[:, t, kv, row], l_ref[:, t, kv, row])
           for t in range(tokens)]
  sums = []
  for o, m, l in parts:
    # As pallas_attention._merge_kernel: an empty split's weight vanishes.
    w = jnp.exp(m - m.max())
    merged = (o * w[:, None]).sum(axis=0) / jnp.maximum((l * w).sum(), 1e-30)
    merged = merged.astype(dtype).astype(jnp.float32)  # the attention output's rounding
    sums.append(jnp.sum(merged[:, None] * weight, axis=0))
  for t, total in enumerate(sums):
    out_ref[t, :] = total


@functools.partial(jax.jit, static_argnames=("group", "dtype", "interpret"))
def merge_out_project(partials: tuple[jax.Array, jax.Array, jax.Array], o_weight: jax.Array,
                      dtype, *, group: int, interpret: bool | None = None) -> jax.Array:
  """The attention's splits (`paged_decode_attention(..., merged=False)`: o [S, T, K, R, h],
  m, l [S, T, K, R]) and the output weights o_weight [H, h, D] -> float32 partial sums
  [B, T, D] of the merged attention output (rounded to `dtype`) times the weights, over B
  blocks of the heads' dims; their sum, rounded to `dtype`, is `Attention.out` of the
  merged output. group: query heads per KV head. interpret: run the kernel with Pallas'
  interpreter (default: when the default device is not a GPU)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  o, m, l = partials
  splits, tokens, num_kv, rows, head_dim = o.shape
  num_heads, _, width = o_weight.shape
  if (o_weight.shape[1] != head_dim or num_heads != num_kv * group or rows < group
      or m.shape != o.shape[:4] or l.shape != m.shape
      or not usable(tokens, num_heads, head_dim, width)):
    raise ValueError(f"merge_out_project: o {o.shape}, m {m.shape}, l {l.shape}, o_weight "
                     f"{o_weight.shape}, group {group} do not match or do not fit")
  block_k, block_n = blocks(head_dim, width)
  num_blocks = num_heads * head_dim // block_k
  whole = lambda shape: pl.BlockSpec(shape, lambda n, k: (0,) * len(shape))  # noqa: E731
  return pl.pallas_call(
      functools.partial(_kernel, group=group, head_dim=head_dim, block_k=block_k,
                        dtype=jnp.dtype(dtype)),
      grid=(width // block_n, num_blocks),
      in_specs=[whole(o.shape), whole(m.shape), whole(l.shape),
                pl.BlockSpec((num_heads * head_dim, block_n), lambda n, k: (0, n))],
      out_specs=pl.BlockSpec((None, tokens, block_n), lambda n, k: (k, 0, n)),
      out_shape=jax.ShapeDtypeStruct((num_blocks, tokens, width), jnp.float32),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_merge_out_project",
  )(o, m, l, o_weight.reshape(num_heads * head_dim, width).astype(dtype))
