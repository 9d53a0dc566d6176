"""The MLP's down projection + the residual add + RMSNorm after it, per call: XLA (GELU x up,
split-K GEMM, reduce; then the Pallas add + norm kernel) against the fused Pallas down
projection (`pallas_ffw.ffw_down`, partial sums added up by the add + norm kernel) with
several splits and block sizes, and against the CUDA GEMV (`cuda_gemv.ffw_down`).

Each timed device loop chains `copies` layers with their own weights (more than the L2
cache holds, as the model's 26 layers do), so the weights stream from HBM as in a step.

  python scripts/bench_ffw.py --config gemma3-1b --tokens 1,8 \
      --variants xla,gemv,16:128:64,16:128:64:loop
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from blink_jax import cuda_gemv, pallas_ffw, pallas_norm, xla_flags
from blink_jax.config import get_config, tiny_config
from blink_jax.model import MLP
from scripts import bench_common as C

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "gemma3-1b", "model config name, or 'tiny'")
flags.DEFINE_list("tokens", ["1", "8"], "rows per call (decode batch)")
flags.DEFINE_list("variants", ["xla", "gemv", "cuda", "cuda:8", "cuda:32", "16:128:64",
                               "32:128:64", "32:64:64", "64:128:64"],
                  "'xla', 'gemv' (XLA's down GEMM alone, no GELU or add + norm), "
                  "'cuda[:splits]' (ffi/gemv_cuda.cu, blink_jax/cuda_gemv.py), or "
                  "splits:block_n:block_k[:loop] of the fused kernel (loop: its blocks in a "
                  "loop instead of unrolled)")
flags.DEFINE_integer("copies", 8, "layers (weight copies) chained per loop iteration")
flags.DEFINE_integer("iters", 200, "loop iterations per timed loop")
flags.DEFINE_integer("repeats", 5, "timed loops per point (median and spread reported)")
flags.DEFINE_string("out", "bench/results/ffw_kernel.json", "JSON result file")


def down_fn(variant: str):
  """gate_up, down -> the branch for the add + norm kernel (partial sums for the fused one)."""
  if variant == "xla":
    return MLP.down_project
  parts = variant.split(":")
  if parts[0] == "cuda":  # ffi/gemv_cuda.cu, cuda[:splits]
    splits = int(parts[1]) if len(parts) > 1 else None
    return lambda gate_up, down: cuda_gemv.ffw_down(gate_up, down, splits=splits,
                                                    use_kernel=True)
  splits, block_n, block_k = (int(v) for v in parts[:3])
  unroll = parts[3:] != ["loop"]
  return lambda gate_up, down: pallas_ffw.ffw_down(gate_up, down, splits=splits,
                                                   block_n=block_n, block_k=block_k,
                                                   unroll=unroll)


def layer_loop(variant: str, tokens: int, cfg, dtype):
  """A jitted loop of FLAGS.iters iterations over FLAGS.copies chained down projections +
  add + norm, and its arguments."""
  rng = np.random.default_rng(0)
  d, f = cfg.d_model, cfg.ffw_hidden
  downs = [jnp.asarray(rng.standard_normal((f, d)) * f**-0.5, dtype)
           for _ in range(FLAGS.copies)]
  gate_up = jnp.asarray(rng.standard_normal((tokens, 2 * f)), dtype)
  x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
  w = jnp.asarray(rng.standard_normal(d) * 0.1, dtype)
  if variant == "gemv":  # the down GEMM alone (no GELU x up, no add + norm): XLA's GEMV
    step = lambda x, gate_up, down: (x + gate_up[:, :f] @ down,) * 2
  else:
    project = down_fn(variant)
    step = lambda x, gate_up, down: pallas_norm.add_rms_norm(x, project(gate_up, down), w, w,
                                                             1e-6)

  def body(_, carry):
    x, gate_up = carry
    for down in downs:
      x, y = step(x, gate_up, down)
      # the next layer's input depends on this one's output (no reordering, no overlap)
      gate_up = gate_up.at[:, 0].add(y[:, 0] * 1e-3)
    return x, gate_up

  loop = jax.jit(lambda x, gate_up: lax.fori_loop(0, FLAGS.iters, body, (x, gate_up)))
  return loop, (x, gate_up)


def measure(variant: str, tokens: int, cfg, dtype) -> dict:
  loop, args = layer_loop(variant, tokens, cfg, dtype)
  jax.block_until_ready(loop(*args))  # compile + warm
  per_call = []
  for _ in range(FLAGS.repeats):
    t = time.perf_counter()
    jax.block_until_ready(loop(*args))
    per_call.append((time.perf_counter() - t) / (FLAGS.iters * FLAGS.copies) * 1e6)
  row = {"variant": variant, "tokens": tokens, **C.stats(per_call, "us_per_layer")}
  # The down projection's weight bytes per layer over the time: its effective bandwidth.
  row["weight_gbps"] = cfg.ffw_hidden * cfg.d_model * 2 / row["us_per_layer_median"] / 1e3
  return row


def main(argv):
  del argv
  xla_flags.configure_command_buffers()
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  dtype = jnp.bfloat16
  rows = []
  for tokens in (int(t) for t in FLAGS.tokens):
    for variant in FLAGS.variants:
      try:
        row = measure(variant, tokens, cfg, dtype)
      except Exception as e:  # a variant Triton cannot compile: say so, keep the others
        row = {"variant": variant, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]}
      print(row, flush=True)
      rows.append(row)
  for r in rows:
    base = next((b for b in rows if b["variant"] == "xla" and b["tokens"] == r["tokens"]), None)
    if base and "us_per_layer_median" in r and "us_per_layer_median" in base:
      r["ratio_to_xla"] = r["us_per_layer_median"] / base["us_per_layer_median"]
  print(C.table(rows, ["variant", "tokens", "us_per_layer_median", "us_per_layer_min",
                       "us_per_layer_max", "ratio_to_xla", "weight_gbps", "error"]))
  C.write_result(FLAGS.out, "ffw_kernel", rows,
                 {"config": FLAGS.config, "copies": FLAGS.copies, "iters": FLAGS.iters})


if __name__ == "__main__":
  app.run(main)
