"""The batch-1 matrix-vector product as one CUDA kernel (`ffi/gemv_cuda.cu`, FFI target
blink_gemv): x [1, K] times w [K, N] -> split partial sums [S, 1, N] float32, for steps of one
token (from 2 tokens on XLA's kernels ran the 1B's step faster: docs/PERFORMANCE.md, "The
GEMV at one token only").

XLA runs a batch-1 step's q/k/v, output and down projections (1B shape) as GEMM kernels of
7.6-9 us each whatever their size (3.5 to 16 MB: 0.4-1.9 TB/s; docs/NOTES.md, "The CUDA GEMV:
one pass per block").
This kernel reads each weight byte once with 16-byte loads, every row of a thread in flight
at once, from S x N/64 blocks (S: one pass per block, and enough blocks to cover the GPU).
`KernelOptions.gemv` picks the projections of one-token GPU steps it runs
(`blink_jax.kernels.select`): the output and down projections' partial sums go to the add +
norm kernel and the q/k/v projection's to the q/k prepare kernel (with the Pallas norm
kernels), the gate/up projection's are added up by XLA (`matmul`). Elsewhere (CPU, or no
CUDA library) `partials` computes the same sums with jnp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from blink_jax.kernels import split_matmul
from blink_jax.native import ffi
from blink_jax.model.gemma import MLP, sum_partials

MAX_TOKENS = 1        # rows of x per call
COLUMNS = 64          # output columns per block (ffi/gemv_cuda.cu kColumns)
# About one block per SM of an H100 / H200 (132 SMs): the consumers of the partial sums (the
# add + norm and q/k prepare kernels, one program per row) read S x N floats serially, which
# at batch 1 made them 4.3-5.4 us kernels on an H100 (docs/PERFORMANCE.md, "Kernel profile").
_TARGET_BLOCKS = 132
_MIN_ROWS = 32        # rows of K per split: one per row group of a block
_GROUPS = 32          # rows a block reads at once (ffi/gemv_cuda.cu kGroups)
_MAX_SPLITS = 32      # partial sums cost N x 4 bytes each, written and read again
_ROWS_IN_FLIGHT = 8   # rows of K each thread loads at once (ffi/gemv_cuda.cu kRowsInFlight)


def default_splits(k: int, n: int) -> int:
  """Splits of K: a power of two (the add + norm kernel sums a power of two of partials),
  enough that a block's rows fit one pass of its threads' loads (every load in flight at
  once) and that splits x N/64 blocks cover the GPU about once; at most 32, and at least 32
  rows of K each."""
  one_pass = -(-k // (_GROUPS * _ROWS_IN_FLIGHT))
  cover = -(-_TARGET_BLOCKS // max(1, n // COLUMNS))
  want = min(max(one_pass, cover), _MAX_SPLITS)
  most = max(1, k // _MIN_ROWS)
  return min(1 << (want - 1).bit_length(), 1 << (most.bit_length() - 1))


def usable(tokens: int, k: int, n: int) -> bool:
  """Whether a [tokens, k] x [k, n] product fits the kernel."""
  return 1 <= tokens <= MAX_TOKENS and n % COLUMNS == 0 and k >= 1


def reference_partials(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
  """The kernel's result with jnp: the sums over each split's rows of K, in float32 at the
  highest precision (`split_matmul.partials`' slices)."""
  return split_matmul.partials(x.astype(jnp.float32), w.astype(jnp.float32), splits,
                               precision=jax.lax.Precision.HIGHEST)


def partials(x: jax.Array, w: jax.Array, splits: int | None = None, *,
             use_kernel: bool | None = None) -> jax.Array:
  """x [1, K], w [K, N] -> partial sums [splits, 1, N] float32 (their sum is x @ w).
  use_kernel: the CUDA kernel (default: when it is registered and the default device is a
  GPU) for bfloat16 x and w; otherwise, or for other dtypes, `reference_partials`."""
  tokens, k = x.shape
  n = w.shape[1]
  if w.shape[0] != k or not usable(tokens, k, n):
    raise ValueError(f"blink_gemv takes x [1, K] and w [K, N % {COLUMNS} == 0]; "
                     f"got x {x.shape} and w {w.shape}")
  splits = default_splits(k, n) if splits is None else splits
  if not 1 <= splits <= k:
    raise ValueError(f"splits={splits} must be in [1, K={k}]")
  if (not ffi.use_cuda_kernel(use_kernel) or x.dtype != jnp.bfloat16
      or w.dtype != jnp.bfloat16):  # a bf16 kernel
    return reference_partials(x, w, splits)
  out = jax.ShapeDtypeStruct((splits, tokens, n), jnp.float32)
  return jax.ffi.ffi_call("blink_gemv", out)(x, w)


def ffw_down(gate_up: jax.Array, down: jax.Array, **kw) -> jax.Array:
  """`MLP.down_project` as partial sums [S, T, D] for the add + norm kernel: GELU(gate) x up
  rounded to the activations' dtype (as the jnp MLP rounds it), then the down GEMV."""
  return partials(MLP.activate(gate_up), down, **kw)


def out_project(attn: jax.Array, o_weight: jax.Array, dtype, **kw) -> jax.Array:
  """`Attention.out` as partial sums [S, T, D] for the add + norm kernel: the merged
  attention output attn [T, H, h] (rounded to dtype) times o_weight [H, h, D]."""
  n, h, d = o_weight.shape
  flat = attn.reshape(attn.shape[0], n * h).astype(dtype)
  return partials(flat, o_weight.reshape(n * h, d).astype(dtype), **kw)


def matmul(x: jax.Array, w: jax.Array, **kw) -> jax.Array:
  """x @ w in x's dtype through the GEMV's partial sums, added up by XLA (the q/k/v and the
  gate/up projections)."""
  return sum_partials(partials(x, w, **kw), x)
