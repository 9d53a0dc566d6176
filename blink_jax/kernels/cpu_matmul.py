"""The projections' matmuls in the form XLA's CPU backend runs fast in bfloat16.

XLA's CPU backend runs a bfloat16 matmul on its native kernels (YNNPACK, AMX or AVX-512 BF16
where the CPU has them) only when the product is float32 and the left operand has at least
two rows. A one-row product, or a bfloat16 one, is converted to float32 first, the weights
included: every decode step then converted every weight of the model (measured on a 2-core
Xeon, 270M shape: the tied output layer 195 ms at one row, 25-29 ms at two to eight rows
with a float32 product; a bfloat16 product 205-225 ms at any row count). So each matmul here
has a float32 product, rounded to the activations' dtype afterwards (what the plain matmul
computes too: float32 accumulation, one rounding), and a one-row left operand gets a zero
second row. In float32 they are the plain matmul (one row is XLA's fast case there).
The functions have the signatures of the `StepKernels` hooks they fill.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from blink_jax.model.gemma import MLP


def _dot(x: jax.Array, w: jax.Array, spec: str, out_dtype) -> jax.Array:
  """einsum(spec) of x [..., K] and the weights, in out_dtype (the form described above)."""
  w = w.astype(x.dtype)
  if x.dtype == jnp.float32:
    return jnp.einsum(spec, x, w).astype(out_dtype)
  lead, k = x.shape[:-1], x.shape[-1]
  flat = x.reshape(-1, k)
  rows = flat.shape[0]
  if rows == 1:
    flat = jnp.concatenate([flat, jnp.zeros_like(flat)])
  out = jnp.einsum(spec, flat, w, preferred_element_type=jnp.float32)[:rows]
  return out.astype(out_dtype).reshape(*lead, -1)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N] in x's dtype."""
  return _dot(x, w, "...k,kn->...n", x.dtype)


def out_project(attn: jax.Array, o_weight: jax.Array, dtype) -> jax.Array:
  """`Attention.out`: attn [..., H, h] and the output weights [H, h, D] -> [..., D]."""
  n, h, d = o_weight.shape
  return matmul(attn.reshape(*attn.shape[:-2], n * h).astype(dtype), o_weight.reshape(n * h, d))


def ffw_down(gate_up: jax.Array, down: jax.Array) -> jax.Array:
  """`MLP.down_project`: GELU(gate) x up, then the down projection."""
  return matmul(MLP.activate(gate_up), down)


def logits(x: jax.Array, embed: jax.Array) -> jax.Array:
  """The tied output layer: x [..., D] and the embedding [V, D] -> float32 logits [..., V]
  (contracting both on D: with `x @ embed.T` XLA converted the embedding to float32)."""
  return _dot(x, embed, "...d,vd->...v", jnp.float32)
