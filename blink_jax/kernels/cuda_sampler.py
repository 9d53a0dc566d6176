"""The top-k and top-p thresholds of a step's sampled rows as one CUDA kernel
(`ffi/sampler_cuda.cu`, FFI target blink_sample_thresholds): radix selection over the
rows' values, three passes over the logits where `model.sampling`'s bisection makes 32
(docs/ARCHITECTURE.md, "Sampling"), each pass several blocks per row.

`select.step_kernels` hands it to the sampler of every GPU step (`StepKernels.thresholds`);
other devices bisect.
`reference_thresholds` is the same answer by a sort, for the tests.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from blink_jax.native import ffi

# 32-bit words of a row's workspace (ffi/sampler_cuda.cu kRowWords: a histogram of counts and
# one of masses, 2,048 bins each, and 8 words of state between passes).
ROW_WORDS = 2 * 2048 + 8


def reference_thresholds(x: jax.Array, hi: jax.Array, top_k: jax.Array,
                         top_p: jax.Array) -> jax.Array:
  """`thresholds` by a sort of each row (a test oracle: a sort cannot live in a CUDA-graph
  loop)."""
  rows, vocab = x.shape
  desc = -jnp.sort(-x, axis=-1)
  k = jnp.clip(top_k, 1, vocab) - 1
  t_k = jnp.where((top_k > 0) & (top_k < vocab),
                  jnp.take_along_axis(desc, k[:, None], axis=-1)[:, 0], -jnp.inf)
  mass = jnp.cumsum(jnp.exp(desc - hi[:, None]), axis=-1)
  need = mass[:, -1] * top_p
  first = jnp.minimum(jnp.sum(mass < need[:, None], axis=-1), vocab - 1)  # mass reaches need
  t_p = jnp.where(top_p < 1.0, jnp.take_along_axis(desc, first[:, None], axis=-1)[:, 0],
                  -jnp.inf)
  return jnp.stack([t_k, t_p], axis=1)


def thresholds(x: jax.Array, hi: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
               use_kernel: bool | None = None) -> jax.Array:
  """Scaled logits x [R, V] float32, their row maxima hi [R], top_k [R] int32 (0: none; V
  or more: every token), top_p [R] float32 (1: none) -> [R, 2] float32: each row's k-th
  largest value and the largest t with sum(exp(x - hi) over x >= t) >= top_p times the
  row's whole sum; -inf where a row does not ask. use_kernel: the CUDA kernel (default: when
  it is registered and the default device is a GPU), else `reference_thresholds`."""
  if x.ndim != 2 or hi.shape != x.shape[:1] or top_k.shape != hi.shape or \
      top_p.shape != hi.shape:
    raise ValueError(f"thresholds takes x [R, V], hi, top_k, top_p [R]; got {x.shape}, "
                     f"{hi.shape}, {top_k.shape}, {top_p.shape}")
  args = (x.astype(jnp.float32), hi.astype(jnp.float32), top_k.astype(jnp.int32),
          top_p.astype(jnp.float32))
  if not ffi.use_cuda_kernel(use_kernel):
    return reference_thresholds(*args)
  rows = x.shape[0]
  out = (jax.ShapeDtypeStruct((rows, 2), jnp.float32),
         jax.ShapeDtypeStruct((rows, ROW_WORDS), jnp.uint32))  # the kernels' workspace
  return jax.ffi.ffi_call("blink_sample_thresholds", out)(*args)[0]
