"""The MLP's down projection of a decode-sized step as one Pallas kernel (Triton on the GPU),
with GELU(gate) x up applied as the hidden activations are loaded.

At batch 1 XLA runs the down projection as three kernels (finding 26 in docs/NOTES.md): the
GELU x up multiply, a split-K GEMM (its K, the hidden width, is 6912 in the 1B shape) and a
reduction of the splits. Here one launch does the first two, and the splits' partial sums
go to the next residual add + RMSNorm kernel (`pallas_norm.add_rms_norm` sums them as it
loads the branch), so the reduction needs no kernel either.

A program owns a slice of output columns and a share of the hidden dims (a split): it walks
its share in blocks, computes GELU(gate) x up for every token of the step from the fused
gate/up projection (`MLP.gate_up`), rounds it to the activation dtype (as the jnp MLP does
before its down matmul), and accumulates hidden x down-weight tile products in float32. For
the few tokens of a decode step a broadcast multiply + sum is the matmul (Triton's dot wants
at least 16 rows). Off unless BLINK_PALLAS_FFW=1 (not yet measured on a GPU); the executor
uses it for steps of up to MAX_TOKENS tokens, with the Pallas norm kernels.
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ENABLED = os.environ.get("BLINK_PALLAS_FFW", "0") == "1"
# Largest step (tokens) the kernel serves: one broadcast multiply per token and block.
MAX_TOKENS = 8
# Most hidden dims per block and output columns per program (Triton blocks are powers of
# two: a dimension's largest power-of-two factor up to these, at least _MIN_BLOCK), and the
# splits of the hidden dims (enough programs to fill the GPU with the 1B's 9 column
# slices). Guesses until measured: the environment overrides them (scripts/bench_ffw.py).
BLOCK_K = int(os.environ.get("BLINK_PALLAS_FFW_BLOCK_K", "64"))
BLOCK_N = int(os.environ.get("BLINK_PALLAS_FFW_BLOCK_N", "128"))
SPLITS = int(os.environ.get("BLINK_PALLAS_FFW_SPLITS", "16"))
UNROLL = os.environ.get("BLINK_PALLAS_FFW_UNROLL", "1") == "1"
_MIN_BLOCK = 16


def blocks(hidden: int, width: int, block_k: int | None = None,
           block_n: int | None = None) -> tuple[int, int]:
  """(hidden dims per block, output columns per program) for these sizes, at most block_k
  and block_n (default BLOCK_K, BLOCK_N)."""
  block_k = BLOCK_K if block_k is None else block_k
  block_n = BLOCK_N if block_n is None else block_n
  return min(block_k, hidden & -hidden), min(block_n, width & -width)


def usable(tokens: int, hidden: int, width: int) -> bool:
  """Whether a step of `tokens` rows, `hidden` MLP dims and a `width`-wide output fits."""
  return tokens <= MAX_TOKENS and min(blocks(hidden, width)) >= _MIN_BLOCK


def gelu_tanh(x: jax.Array) -> jax.Array:
  """jax.nn.gelu(x, approximate=True), written out (the kernel's float32 math)."""
  return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _kernel(gate_up_ref, down_ref, out_ref, *, hidden: int, block_k: int,
            blocks_per_split: int, unroll: bool):
  """One (column slice, split): gate_up_ref [T, 2F] (gate, then up); down_ref [F, N] (this
  program's N columns) -> out_ref [T, N], the split's float32 partial sums. unroll: the
  split's blocks as straight-line code (a block past the split's end reads the last block
  and adds nothing), so Triton can issue every load before the math; else a loop, whose
  loads wait for one another unless Triton pipelines it."""
  tokens = gate_up_ref.shape[0]
  dtype = gate_up_ref.dtype
  num_blocks = hidden // block_k
  first = pl.program_id(1) * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, num_blocks)

  def block(kb):
    """The block's contribution to each token's partial sums."""
    k = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
    up_k = pl.ds(pl.multiple_of(hidden + kb * block_k, block_k), block_k)
    weight = down_ref[k, :].astype(jnp.float32)
    out = []
    for t in range(tokens):
      gate = gate_up_ref[t, k].astype(jnp.float32)
      up = gate_up_ref[t, up_k].astype(jnp.float32)
      # As the jnp MLP: GELU and the product rounded to the activation dtype.
      h = (gelu_tanh(gate).astype(dtype).astype(jnp.float32) * up).astype(dtype)
      out.append(jnp.sum(h.astype(jnp.float32)[:, None] * weight, axis=0))
    return out

  acc = [jnp.zeros((out_ref.shape[1],), jnp.float32) for _ in range(tokens)]
  if unroll:
    for i in range(blocks_per_split):
      kb = first + i
      part = block(jnp.minimum(kb, num_blocks - 1))
      acc = [a + jnp.where(kb < last, p, 0.0) for a, p in zip(acc, part)]
  else:
    acc = lax.fori_loop(first, last,
                        lambda kb, acc: tuple(a + p for a, p in zip(acc, block(kb))),
                        tuple(acc))
  for t in range(tokens):
    out_ref[t, :] = acc[t]


@functools.partial(jax.jit, static_argnames=("splits", "block_k", "block_n", "unroll",
                                             "interpret"))
def ffw_down(gate_up: jax.Array, down: jax.Array, *, splits: int | None = None,
             block_k: int | None = None, block_n: int | None = None,
             unroll: bool | None = None, interpret: bool | None = None) -> jax.Array:
  """gate_up [T, 2F] (the fused gate/up projection), down [F, D] -> float32 partial sums
  [S, T, D] of (GELU(gate) x up) @ down over S splits of the hidden dims (S a power of two,
  as `pallas_norm.add_rms_norm` loads them); their sum, rounded to the activation dtype, is
  the jnp MLP's output. splits, block_k, block_n, unroll (`_kernel`): default SPLITS,
  BLOCK_K, BLOCK_N, UNROLL. interpret: run the kernel with Pallas' interpreter (default:
  when the default device is not a GPU)."""
  if interpret is None:
    interpret = jax.devices()[0].platform != "gpu"
  splits = SPLITS if splits is None else splits
  unroll = UNROLL if unroll is None else unroll
  tokens, fused = gate_up.shape
  hidden, width = down.shape
  if fused != 2 * hidden or not usable(tokens, hidden, width):
    raise ValueError(f"ffw_down: gate_up {gate_up.shape} and down {down.shape} do not match "
                     f"or do not fit (at most {MAX_TOKENS} tokens; hidden and width need "
                     f"power-of-two factors of at least {_MIN_BLOCK})")
  if splits < 1 or splits & (splits - 1):
    raise ValueError(f"splits must be a power of two, got {splits}")
  block_k, block_n = blocks(hidden, width, block_k, block_n)
  if min(block_k, block_n) < _MIN_BLOCK:
    raise ValueError(f"blocks of {block_k} hidden dims x {block_n} columns: at least "
                     f"{_MIN_BLOCK} each")
  blocks_per_split = pl.cdiv(hidden // block_k, splits)
  return pl.pallas_call(
      functools.partial(_kernel, hidden=hidden, block_k=block_k,
                        blocks_per_split=blocks_per_split, unroll=unroll),
      grid=(width // block_n, splits),
      in_specs=[pl.BlockSpec((tokens, fused), lambda n, s: (0, 0)),
                pl.BlockSpec((hidden, block_n), lambda n, s: (0, n))],
      out_specs=pl.BlockSpec((None, tokens, block_n), lambda n, s: (s, 0, n)),
      out_shape=jax.ShapeDtypeStruct((splits, tokens, width), jnp.float32),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      name="blink_ffw_down",
  )(gate_up, down.astype(gate_up.dtype))
