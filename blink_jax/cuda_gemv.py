"""Small-batch matrix-vector products as one CUDA kernel (`ffi/gemv_cuda.cu`, FFI target
blink_gemv): x [T, K] times w [K, N] -> split partial sums [S, T, N] float32, for steps of up
to MAX_TOKENS tokens.

A batch-1 layer of the 1B shape moved its weights at ~1 TB/s effective through XLA's GEMM
kernels (docs/NOTES.md finding 32); this kernel reads each weight byte once with 16-byte
loads, several rows in flight per thread, from S x N/64 blocks (S chosen to cover the GPU
about twice). Like the fused down projection (`pallas_ffw`), it leaves the S partial sums to
the add + norm kernel. BLINK_CUDA_GEMV=1 runs the MLP's projections of small GPU steps
through it: the down projection's partial sums go to the add + norm kernel (with the Pallas
norm kernels), the gate/up projection's are added up by XLA (`matmul`). Elsewhere (CPU, or
no CUDA library) `partials` computes the same sums with jnp.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from blink_jax import ffi
from blink_jax.model import MLP, sum_partials

ENABLED = os.environ.get("BLINK_CUDA_GEMV", "0") == "1"
MAX_TOKENS = 8      # rows per call (ffi/gemv_cuda.cu kMaxTokens)
COLUMNS = 64          # output columns per block (ffi/gemv_cuda.cu kColumns)
_TARGET_BLOCKS = 264  # about two blocks per SM of an H200 (132 SMs)
_MIN_ROWS = 32        # rows of K per split: one per row group of a block


def default_splits(k: int, n: int) -> int:
  """Splits of K so that splits x N/64 blocks cover the GPU about twice: a power of two (the
  add + norm kernel sums a power of two of partials), at least 32 rows of K each."""
  want = -(-_TARGET_BLOCKS // max(1, n // COLUMNS))
  most = max(1, k // _MIN_ROWS)
  return min(1 << (want - 1).bit_length(), 1 << (most.bit_length() - 1))


def usable(tokens: int, k: int, n: int) -> bool:
  """Whether a [tokens, k] x [k, n] product fits the kernel."""
  return 1 <= tokens <= MAX_TOKENS and n % COLUMNS == 0 and k >= 1


def kernel_available() -> bool:
  """Whether the CUDA kernel is registered (a CUDA build of ffi/ and a GPU jax)."""
  return "cuda" in ffi.register_targets()


def reference_partials(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
  """The kernel's result with jnp: the sums over each split's rows of K
  (split s: rows [s * chunk, (s + 1) * chunk), chunk = ceil(K / splits))."""
  k = x.shape[1]
  chunk = -(-k // splits)
  pad = chunk * splits - k
  xs = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad))).reshape(x.shape[0], splits, chunk)
  ws = jnp.pad(w.astype(jnp.float32), ((0, pad), (0, 0))).reshape(splits, chunk, w.shape[1])
  return jnp.einsum("tsk,skn->stn", xs, ws, precision=jax.lax.Precision.HIGHEST)


def partials(x: jax.Array, w: jax.Array, splits: int | None = None, *,
             use_kernel: bool | None = None) -> jax.Array:
  """x [T, K], w [K, N] -> partial sums [splits, T, N] float32 (their sum is x @ w).
  use_kernel: the CUDA kernel (default: when it is registered and the default device is a
  GPU) for bfloat16 x and w; otherwise, or for other dtypes, `reference_partials`."""
  tokens, k = x.shape
  n = w.shape[1]
  if w.shape[0] != k or not usable(tokens, k, n):
    raise ValueError(f"blink_gemv takes x [T<={MAX_TOKENS}, K] and w [K, N % {COLUMNS} == 0]; "
                     f"got x {x.shape} and w {w.shape}")
  splits = default_splits(k, n) if splits is None else splits
  if not 1 <= splits <= k:
    raise ValueError(f"splits={splits} must be in [1, K={k}]")
  if use_kernel is None:
    use_kernel = jax.devices()[0].platform == "gpu" and kernel_available()
  elif use_kernel:
    kernel_available()  # registers blink_gemv where it can (XLA names it if it could not)
  if not use_kernel or x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:  # bf16 kernel
    return reference_partials(x, w, splits)
  out = jax.ShapeDtypeStruct((splits, tokens, n), jnp.float32)
  return jax.ffi.ffi_call("blink_gemv", out)(x, w)


def ffw_down(gate_up: jax.Array, down: jax.Array, **kw) -> jax.Array:
  """`MLP.down_project` as partial sums [S, T, D] for the add + norm kernel: GELU(gate) x up
  rounded to the activations' dtype (as the jnp MLP rounds it), then the down GEMV."""
  return partials(MLP.activate(gate_up), down, **kw)


def matmul(x: jax.Array, w: jax.Array, **kw) -> jax.Array:
  """x @ w in x's dtype through the GEMV's partial sums (XLA adds them up; for the MLP's
  gate/up projection: 2 splits of a [1152, 13824] weight at batch 1 in the 1B shape)."""
  return sum_partials(partials(x, w, **kw), x)
