"""A decode step's projections alone: XLA's matmul against the CUDA GEMV
(blink_jax.kernels.cuda_gemv) at each split count and against torch's `F.linear` (cuBLASLt,
what vLLM runs), per projection of a model shape (the LM head too), for steps of --tokens
tokens, in microseconds, in the HBM bandwidth the weights were read at and, on a GPU, in
joules per product (NVML's energy counter, total and above idle).

Why: the GEMV's splits are picked by a rule (`cuda_gemv.default_splits`: every block's rows in
one pass, blocks covering the GPU about twice) that was tuned on the down projection; the
gate/up projection (K 1,152, N 13,824 for the 1B) takes 8 splits, 1,728 blocks, and XLA's GEMM
for it ran at 2.38 TB/s on an H100 where the down GEMV ran at 3.4 (docs/PERFORMANCE.md, "Kernel
profile"). This measures every split count in one call, with what a step's consumer reads:
the partial sums alone (the add + norm and q/k prepare kernels add them up themselves) and the
GEMV with XLA's sum (`cuda_gemv.matmul`, what the gate/up projection would take).

Energy: vLLM's whole batch-1 decode step costs less energy above idle than ours for more
kernel time (docs/PERFORMANCE.md, "vLLM's step beside ours"); the projections are 60 % of our
step's kernel time, so this says, per projection, whose kernel spends the joules.

Each point runs `steps` products inside one device `lax.fori_loop` run as a CUDA graph (XLA's
command buffers, as the engine's loop: without them the host drove every iteration and the
first run's figures, 12-38 us a product, carried about 10 us of that), the input
changed every step by the last output (so nothing is hoisted; that small kernel is in every
figure), bf16 weights of random values. Each product reads one of `copies` weight matrices
in turn, together at least --weight_mb (default 256 MiB: several times an H100's 50 MB of
L2), so its weights come from HBM as a step's 26 layers' do (a loop over one 32 MB matrix
read it from L2). torch's side is the same chain of products captured in a CUDA graph.

  python -m bench.gemv --config gemma3-1b --splits auto,2,4,8,16,32
  python -m bench.gemv --config gemma3-1b --splits auto --tokens 1,8 --variants xla,partials,torch
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax

from bench import common as C
from blink_jax.executor import xla_flags
from blink_jax.kernels import cuda_gemv
from blink_jax.model.config import get_config

FLAGS = flags.FLAGS
PROJECTIONS = ("qkv", "out", "down", "gate_up", "lm_head")
# What each variant computes from x [T, K] and w [K, N]: "xla" the matmul in bf16, "partials"
# the GEMV's f32 partial sums [S, 1, N], "matmul" those added up by XLA into bf16 [1, N]
# (the GEMV's two at one token only), "torch" torch.nn.functional.linear of w's [N, K]
# transpose in bf16 (cuBLASLt, as vLLM's layers).
VARIANTS = ("xla", "partials", "matmul", "torch")
GEMV_VARIANTS = ("partials", "matmul")


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "model shape whose projections are timed")
  flags.DEFINE_list("projections", list(PROJECTIONS), f"which: {list(PROJECTIONS)}")
  flags.DEFINE_list("splits", ["auto", "2", "4", "8", "16", "32"],
                    "the GEMV's split counts ('auto': cuda_gemv.default_splits)")
  flags.DEFINE_list("variants", ["xla", "partials", "matmul"],
                    f"what is timed: {list(VARIANTS)}")
  flags.DEFINE_list("tokens", ["1"], "rows of x (the GEMV's variants at one only)")
  flags.DEFINE_integer("weight_mb", 256, "MiB of distinct weights each loop reads in turn")
  flags.DEFINE_float("energy_s", 1.0, "seconds each point's loop runs again under NVML's "
                     "energy counter (0: no energy)")
  flags.DEFINE_integer("steps", 200, "products per timed device loop")
  flags.DEFINE_integer("repeats", 3, "timed loops per point (median and spread reported)")
  flags.DEFINE_string("out", "bench/results/gemv.json", "JSON result file")


def projection_shape(cfg, name: str) -> tuple[int, int]:
  """(K, N) of a projection's weights as the step multiplies them (fused q/k/v and gate/up)."""
  d, heads = cfg.d_model, cfg.num_heads * cfg.head_dim
  return {"qkv": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim),
          "out": (heads, d), "down": (cfg.ffw_hidden, d),
          "gate_up": (d, 2 * cfg.ffw_hidden), "lm_head": (d, cfg.vocab_size)}[name]


def copies_for(k: int, n: int, weight_mb: int) -> int:
  """Distinct [K, N] bf16 matrices that together hold at least weight_mb MiB."""
  return C.copies_holding(weight_mb, k * n * 2)


def product_loop(variant: str, splits: int | None, steps: int):
  """A jitted loop of `steps` rounds over the weights (x [T, K], *ws each [K, N]): each
  round multiplies x by every w in turn, each product's x having its first element replaced
  by the last output's (a data dependence)."""
  def product(x, w):
    if variant == "xla":
      return x @ w
    if variant == "partials":
      return cuda_gemv.partials(x, w, splits)
    return cuda_gemv.matmul(x, w, splits=splits)

  def run(x, *ws):
    def body(_, x):
      for w in ws:
        y = product(x, w)
        first = y.reshape(-1)[:1].astype(x.dtype).reshape(1, 1)
        x = lax.dynamic_update_slice(x, first * 1e-3, (0, 0))
      return x
    return lax.fori_loop(0, steps, body, x)

  return jax.jit(run)


def _row(projection, k, n, tokens, copies, variant, splits, times, extra) -> dict:
  row = {"projection": projection, "k": k, "n": n, "tokens": tokens, "copies": copies,
         "variant": variant, "splits": splits, **C.stats(times, "us"), **extra}
  row["weight_tb_per_s"] = k * n * 2 / (row["us_median"] * 1e-6) / 1e12
  return row


def measure(cfg, projection: str, variant: str, splits: int | None, steps: int,
            repeats: int, tokens: int = 1, weight_mb: int = 0,
            energy_s: float = 0.0) -> dict:
  """One point: us per product (median of `repeats` loops), TB/s, J per product."""
  k, n = projection_shape(cfg, projection)
  copies = copies_for(k, n, weight_mb)
  rounds = max(1, steps // copies)
  if variant == "torch":
    return torch_measure(projection, k, n, tokens, copies, rounds, repeats, energy_s)
  kx, *kw = jax.random.split(jax.random.PRNGKey(1), copies + 1)
  x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
  ws = [(jax.random.normal(key, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        for key in kw]
  f = product_loop(variant, splits, rounds)
  call = lambda: jax.block_until_ready(f(x, *ws))  # noqa: E731
  times = C.per_unit_us(call, repeats, rounds * copies)  # after a first, compiling call
  gemv = variant in GEMV_VARIANTS
  extra = {"auto_splits": splits is None and gemv,
           **C.repeated_energy(call, energy_s, rounds * copies, "product")}
  return _row(projection, k, n, tokens, copies, variant,
              (cuda_gemv.default_splits(k, n) if splits is None else splits) if gemv else None,
              times, extra)


def torch_measure(projection: str, k: int, n: int, tokens: int, copies: int, rounds: int,
                  repeats: int, energy_s: float) -> dict:
  """The same chain with torch.nn.functional.linear (weights [N, K], as torch's layers keep
  them), captured in a CUDA graph on a GPU (run eagerly elsewhere)."""
  import torch
  import torch.nn.functional as F
  device = "cuda" if torch.cuda.is_available() else "cpu"
  gen = torch.Generator(device=device).manual_seed(1)
  ws = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
        for _ in range(copies)]
  x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16)

  def chain():
    for _ in range(rounds):
      for w in ws:
        y = F.linear(x, w)
        x[:1, :1].copy_(y[:1, :1] * 1e-3)

  call = C.torch_graph(chain)  # cuBLAS' workspace and heuristics before the capture
  times = C.per_unit_us(call, repeats, rounds * copies)
  extra = {"auto_splits": False,
           **C.repeated_energy(call, energy_s, rounds * copies, "product")}
  return _row(projection, k, n, tokens, copies, "torch", None, times, extra)


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
  for tokens in (int(t) for t in FLAGS.tokens):
    for projection in FLAGS.projections:
      for variant in FLAGS.variants:
        if variant in GEMV_VARIANTS and tokens > cuda_gemv.MAX_TOKENS:
          continue
        counts = [None] if variant not in GEMV_VARIANTS else [
            None if s == "auto" else int(s) for s in FLAGS.splits]
        for splits in counts:
          k, _ = projection_shape(cfg, projection)
          if splits is not None and not 1 <= splits <= k:
            continue
          r = measure(cfg, projection, variant, splits, FLAGS.steps, FLAGS.repeats,
                      tokens=tokens, weight_mb=FLAGS.weight_mb, energy_s=FLAGS.energy_s)
          results.append(r)
          joules = r.get("energy_above_idle_per_product_j")
          print(f"T={tokens} {projection:8s} {variant:8s} splits {r['splits']!s:4s}"
                f"{'(auto)' if r['auto_splits'] else '      '} {r['us_median']:8.2f} us "
                f"[{r['us_min']:.2f}-{r['us_max']:.2f}] {r['weight_tb_per_s']:5.2f} TB/s"
                + (f" {1e6 * joules:8.1f} uJ above idle ({r['avg_power_w']:.0f} W)"
                   if joules is not None else ""), flush=True)
  C.write_result(FLAGS.out, "gemv", results, {"config": cfg.name})


if __name__ == "__main__":
  define_flags()
  app.run(main)
