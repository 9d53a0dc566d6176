"""Gemma's residual add and the RMSNorm after it (`model.add_rms_norm`) as one Pallas kernel
(Triton on the GPU).

A Gemma layer has two such steps (the post-attention add with the pre-FFW norm, the
post-FFW add with the next layer's pre-attention norm). At batch 1 XLA compiles each into
three kernels (a reduction of the branch to its sum of squares, the residual add fused with
the second reduction, the normalisation: a row reduced to a scalar is its own kernel), and
inside a CUDA graph each kernel costs ~2 us however little it does (docs/NOTES.md, finding
23). Here each step is one launch: a program per row walks the row in power-of-two chunks
(Triton blocks are powers of two; Gemma's widths are not: 640, 1152, 2560) and does both
norms in registers.

Same math as `model.add_rms_norm`: float32 norms, the normed branch rounded to the
activation dtype before the add, the sum rounded before it is normed again.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from blink_jax.model import add_rms_norm as add_rms_norm_reference

# Widest chunk a program loads at once (elements of one row).
_MAX_CHUNK = 1024
# Narrowest chunk worth a kernel; rows whose width has a smaller power-of-two factor use the
# jnp reference (Triton vectors of fewer elements are legal but such widths are not Gemma's).
_MIN_CHUNK = 16


def chunk_size(width: int) -> int:
  """The largest power of two that divides `width`, at most _MAX_CHUNK."""
  return min(width & -width, _MAX_CHUNK)


def select(kind: str, width: int, *, interpret: bool | None = None):
  """The add-norm function for rows of `width`: this kernel for kind "pallas" when the width
  splits into chunks of at least _MIN_CHUNK, `model.add_rms_norm` otherwise."""
  if kind not in ("reference", "pallas"):
    raise ValueError(f"norm kind must be resolved to 'reference' or 'pallas', got {kind!r}")
  if kind == "pallas" and chunk_size(width) >= _MIN_CHUNK:
    return functools.partial(add_rms_norm, interpret=interpret)
  return add_rms_norm_reference


def _kernel(x_ref, branch_ref, add_w_ref, next_w_ref, x_out_ref, y_ref, *, eps: float,
            chunk: int):
  """One row: x_ref, branch_ref [D]; add_w_ref, next_w_ref [D] -> x_out_ref (x + normed
  branch), y_ref (x_out normed), [D] each."""
  width = x_ref.shape[0]
  dtype = x_out_ref.dtype
  parts = [pl.ds(start, chunk) for start in range(0, width, chunk)]
  branch = [branch_ref[p].astype(jnp.float32) for p in parts]
  scale = lax.rsqrt(sum(jnp.sum(b * b) for b in branch) / width + eps)
  summed = []
  for p, b in zip(parts, branch):
    normed = (b * scale * (1.0 + add_w_ref[p].astype(jnp.float32))).astype(dtype)
    x = (x_ref[p].astype(jnp.float32) + normed.astype(jnp.float32)).astype(dtype)
    x_out_ref[p] = x
    summed.append(x.astype(jnp.float32))
  scale = lax.rsqrt(sum(jnp.sum(x * x) for x in summed) / width + eps)
  for p, x in zip(parts, summed):
    y_ref[p] = (x * scale * (1.0 + next_w_ref[p].astype(jnp.float32))).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x: jax.Array, branch: jax.Array, add_weight: jax.Array,
                 next_weight: jax.Array, eps: float, *,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """x, branch [..., D]; add_weight, next_weight [D] -> (x + rms_norm(branch, add_weight),
  rms_norm(that, next_weight)), both [..., D] in x's dtype. interpret: run the kernel with
  Pallas' interpreter (default: when the default device is not a GPU)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  width = x.shape[-1]
  if branch.shape != x.shape or add_weight.shape != (width,) or next_weight.shape != (width,):
    raise ValueError(f"add_rms_norm: x {x.shape}, branch {branch.shape}, weights "
                     f"{add_weight.shape} and {next_weight.shape} do not match")
  chunk = chunk_size(width)
  if chunk < _MIN_CHUNK:
    raise ValueError(f"width {width} has no power-of-two factor >= {_MIN_CHUNK}")
  rows = x.reshape(-1, width)
  row_spec = pl.BlockSpec((None, width), lambda r: (r, 0))
  weight_spec = pl.BlockSpec((width,), lambda r: (0,))
  x_out, y = pl.pallas_call(
      functools.partial(_kernel, eps=eps, chunk=chunk),
      grid=(rows.shape[0],),
      in_specs=[row_spec, row_spec, weight_spec, weight_spec],
      out_specs=[row_spec, row_spec],
      out_shape=[jax.ShapeDtypeStruct(rows.shape, x.dtype)] * 2,
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      name="blink_add_rms_norm",
  )(rows, branch.astype(x.dtype).reshape(rows.shape), add_weight, next_weight)
  return x_out.reshape(x.shape), y.reshape(x.shape)
