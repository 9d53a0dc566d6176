"""XLA's matmul as split partial sums, for the q/k/v, output and down projections of GPU
decode steps of 2 to `decode_rows` tokens (`KernelOptions.split_matmul`, off until its step
A/B): x [T, K] @ w [K, N] as a batched bf16 matmul over S slices of K, float32 partial sums
[S, T, N] that the Pallas q/k prepare and add + norm kernels add up as they load them (as
they do the CUDA GEMV's at one token).

Why: a 16-row 1B decode step on an H100 runs three reduction kernels a layer of 1.3-1.5 us,
by their count the split-K reductions XLA puts after its skinny Triton GEMMs (some 100 us of
a 1,623 us step; docs/PERFORMANCE.md, "The one-stage decode kernel end to end and the prefill
kernel's key blocks (revision 6edd339)"). With the split made here the q/k/v, output and
down projections would need none: one launch a projection less, if XLA does not split the
batched matmul again (the step A/B and its kernel profile will say).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from blink_jax.model.gemma import MLP

_COLUMNS = 64          # output columns of a GEMM tile, about
_TARGET_PROGRAMS = 132  # about one per SM of an H100 / H200
_MAX_SPLITS = 16


def default_splits(k: int, n: int) -> int:
  """A power of two of slices of K (the add + norm kernel sums a power of two of partials)
  that, with N / 64 column tiles, covers the GPU about once; at most 16, and at least 64 rows
  of K a slice."""
  cover = -(-_TARGET_PROGRAMS // max(1, n // _COLUMNS))
  want = 1 << (max(1, min(cover, _MAX_SPLITS)) - 1).bit_length()
  while want > 1 and k // want < 64:
    want //= 2
  return want


def partials(x: jax.Array, w: jax.Array, splits: int | None = None,
             precision: jax.lax.Precision | None = None) -> jax.Array:
  """x [T, K], w [K, N] -> float32 partial sums [S, T, N] whose sum is x @ w (split s: rows
  [s * chunk, (s + 1) * chunk) of K, chunk = ceil(K / S), K padded with zeros), in x's dtype
  with float32 accumulation (`cuda_gemv.reference_partials`: float32 at `precision`)."""
  t, k = x.shape
  n = w.shape[1]
  if w.shape[0] != k:
    raise ValueError(f"split_matmul: x {x.shape} and w {w.shape} do not match")
  splits = default_splits(k, n) if splits is None else splits
  chunk = -(-k // splits)
  pad = chunk * splits - k
  xs = jnp.pad(x, ((0, 0), (0, pad))).reshape(t, splits, chunk)
  ws = jnp.pad(w.astype(x.dtype), ((0, pad), (0, 0))).reshape(splits, chunk, n)
  return jnp.einsum("tsk,skn->stn", xs, ws, preferred_element_type=jnp.float32,
                    precision=precision)


def ffw_down(gate_up: jax.Array, down: jax.Array) -> jax.Array:
  """`MLP.down_project` as partial sums [S, T, D] for the add + norm kernel."""
  return partials(MLP.activate(gate_up), down)


def out_project(attn: jax.Array, o_weight: jax.Array, dtype) -> jax.Array:
  """`Attention.out` as partial sums [S, T, D] for the add + norm kernel: the attention
  output attn [T, H, h] (rounded to dtype) times o_weight [H, h, D]."""
  n, h, d = o_weight.shape
  return partials(attn.reshape(attn.shape[0], n * h).astype(dtype),
                  o_weight.reshape(n * h, d))
