"""A decode step's projections alone: XLA's matmul against the CUDA GEMV
(blink_jax.kernels.cuda_gemv) at each split count, per projection of a model shape, for a
one-token step, in microseconds and in the HBM bandwidth the weights were read at.

Why: the GEMV's splits are picked by a rule (`cuda_gemv.default_splits`: every block's rows in
one pass, blocks covering the GPU about twice) that was tuned on the down projection; the
gate/up projection (K 1,152, N 13,824 for the 1B) takes 8 splits, 1,728 blocks, and XLA's GEMM
for it ran at 2.38 TB/s on an H100 where the down GEMV ran at 3.4 (docs/PERFORMANCE.md, "Kernel
profile"). This measures every split count in one call, with what a step's consumer reads:
the partial sums alone (the add + norm and q/k prepare kernels add them up themselves) and the
GEMV with XLA's sum (`cuda_gemv.matmul`, what the gate/up projection would take).

Each point runs `steps` products inside one device `lax.fori_loop` run as a CUDA graph (XLA's
command buffers, as the engine's loop: without them the host drove every iteration and the
first run's figures, 12-38 us a product, carried about 10 us of that), the input
changed every step by the last output (so nothing is hoisted; that small kernel is in every
figure), bf16 weights of random values.

  python -m bench.gemv --config gemma3-1b --splits auto,2,4,8,16,32
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax

from bench import common as C
from blink_jax.executor import xla_flags
from blink_jax.kernels import cuda_gemv
from blink_jax.model.config import get_config

FLAGS = flags.FLAGS
PROJECTIONS = ("qkv", "out", "down", "gate_up")
# What each variant computes from x [1, K] and w [K, N]: "xla" the matmul in bf16, "partials"
# the GEMV's f32 partial sums [S, 1, N], "matmul" those added up by XLA into bf16 [1, N].
VARIANTS = ("xla", "partials", "matmul")


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "model shape whose projections are timed")
  flags.DEFINE_list("projections", list(PROJECTIONS), f"which: {list(PROJECTIONS)}")
  flags.DEFINE_list("splits", ["auto", "2", "4", "8", "16", "32"],
                    "the GEMV's split counts ('auto': cuda_gemv.default_splits)")
  flags.DEFINE_list("variants", list(VARIANTS), f"what is timed: {list(VARIANTS)}")
  flags.DEFINE_integer("steps", 200, "products per timed device loop")
  flags.DEFINE_integer("repeats", 3, "timed loops per point (median and spread reported)")
  flags.DEFINE_string("out", "bench/results/gemv.json", "JSON result file")


def projection_shape(cfg, name: str) -> tuple[int, int]:
  """(K, N) of a projection's weights as the step multiplies them (fused q/k/v and gate/up)."""
  d, heads = cfg.d_model, cfg.num_heads * cfg.head_dim
  return {"qkv": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
          "out": (heads, d), "down": (cfg.ffw_hidden, d),
          "gate_up": (d, 2 * cfg.ffw_hidden)}[name]


def product_loop(variant: str, splits: int | None, steps: int):
  """A jitted loop of `steps` products of x [1, K] and w [K, N]; each step's x has its first
  element replaced by the last output's (a data dependence)."""
  def product(x, w):
    if variant == "xla":
      return x @ w
    if variant == "partials":
      return cuda_gemv.partials(x, w, splits)
    return cuda_gemv.matmul(x, w, splits=splits)

  def run(x, w):
    def body(_, x):
      y = product(x, w)
      first = y.reshape(-1)[:1].astype(x.dtype).reshape(1, 1)
      return lax.dynamic_update_slice(x, first * 1e-3, (0, 0))
    return lax.fori_loop(0, steps, body, x)

  return jax.jit(run)


def measure(cfg, projection: str, variant: str, splits: int | None, steps: int,
            repeats: int) -> dict:
  k, n = projection_shape(cfg, projection)
  kx, kw = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (1, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  f = product_loop(variant, splits, steps)
  jax.block_until_ready(f(x, w))  # compile + warm
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(x, w))
    times.append((time.perf_counter() - t) / steps * 1e6)
  row = {"projection": projection, "k": k, "n": n, "variant": variant,
         "splits": splits if variant == "xla" else
         (cuda_gemv.default_splits(k, n) if splits is None else splits),
         "auto_splits": splits is None and variant != "xla", **C.stats(times, "us")}
  row["weight_tb_per_s"] = k * n * 2 / (row["us_median"] * 1e-6) / 1e12
  return row


def main(argv):
  del argv
  xla_flags.configure_command_buffers()  # before the backend starts
  cfg = get_config(FLAGS.config)
  print(f"device {C.describe_device()}, {cfg.name}")
  for name, allowed in (("projections", PROJECTIONS), ("variants", VARIANTS)):
    bad = set(getattr(FLAGS, name)) - set(allowed)
    if bad:
      raise app.UsageError(f"--{name}: {sorted(bad)} not in {list(allowed)}")
  results = []
  for projection in FLAGS.projections:
    for variant in FLAGS.variants:
      counts = [None] if variant == "xla" else [
          None if s == "auto" else int(s) for s in FLAGS.splits]
      for splits in counts:
        k, _ = projection_shape(cfg, projection)
        if splits is not None and not 1 <= splits <= k:
          continue
        r = measure(cfg, projection, variant, splits, FLAGS.steps, FLAGS.repeats)
        results.append(r)
        print(f"{projection:8s} {variant:8s} splits {r['splits']!s:4s}"
              f"{'(auto)' if r['auto_splits'] else '      '} {r['us_median']:8.2f} us "
              f"[{r['us_min']:.2f}-{r['us_max']:.2f}] {r['weight_tb_per_s']:5.2f} TB/s",
              flush=True)
  C.write_result(FLAGS.out, "gemv", results, {"config": cfg.name})


if __name__ == "__main__":
  define_flags()
  app.run(main)
