"""bench/gemv.py: the projection shapes a step multiplies, and a measured row per variant
(on a CPU the GEMV's partial sums come from its jnp reference, which the loop must still
compute as the kernel would)."""
import jax.numpy as jnp
import numpy as np

from bench import gemv as bench_gemv
from blink_jax.kernels import cuda_gemv
from blink_jax.model.config import get_config


def test_projection_shapes_are_the_fused_weights_of_a_step():
  cfg = get_config("gemma3-1b")
  assert bench_gemv.projection_shape(cfg, "qkv") == (1152, 6 * 256)
  assert bench_gemv.projection_shape(cfg, "out") == (1024, 1152)
  assert bench_gemv.projection_shape(cfg, "down") == (6912, 1152)
  assert bench_gemv.projection_shape(cfg, "gate_up") == (1152, 2 * 6912)
  assert bench_gemv.projection_shape(cfg, "lm_head") == (1152, cfg.vocab_size)


def test_copies_hold_the_asked_bytes():
  assert bench_gemv.copies_for(1152, 1536, 256) == 76  # 3.5 MB each: 266 MB
  assert bench_gemv.copies_for(1152, 262144, 256) == 1  # the LM head alone is 604 MB
  assert bench_gemv.copies_for(64, 64, 0) == 1


def test_loop_feeds_each_output_back():
  x = jnp.ones((1, 64), jnp.bfloat16)
  w = jnp.asarray(np.eye(64, 128) * 2, jnp.bfloat16)
  for variant in ("xla",) + bench_gemv.GEMV_VARIANTS:
    out = np.asarray(bench_gemv.product_loop(variant, 4, steps=3)(x, w), np.float32)
    # x[0, 0] becomes 2 * x[0, 0] * 1e-3 each step: 2e-3, then 4e-6, then 8e-9
    assert abs(out[0, 0] - 8e-9) < 1e-10 and (out.reshape(-1)[1:] == 1).all(), variant
    # Two weights a round, three rounds: six products, each feeding the next.
    out = np.asarray(bench_gemv.product_loop(variant, 4, steps=3)(x, w, w), np.float32)
    assert abs(out[0, 0] / (2e-3)**6 - 1) < 0.03, variant


def test_measure_row_names_its_splits():
  cfg = get_config("gemma3-270m")
  auto = bench_gemv.measure(cfg, "out", "partials", None, steps=2, repeats=2)
  k, n = bench_gemv.projection_shape(cfg, "out")
  assert auto["splits"] == cuda_gemv.default_splits(k, n) and auto["auto_splits"]
  assert len(auto["us_all"]) == 2 and auto["us_min"] > 0 and auto["weight_tb_per_s"] > 0
  xla = bench_gemv.measure(cfg, "out", "xla", None, steps=2, repeats=2)
  assert xla["splits"] is None and not xla["auto_splits"]


def test_every_variant_cycles_its_weight_copies():
  """Rows of each backend at 2 tokens over weights of at least 1 MiB (the 270M's output
  projection: 1024 x 640 bf16, so 2 copies): us per product, no energy off a GPU."""
  cfg = get_config("gemma3-270m")
  for variant in ("xla", "torch"):
    row = bench_gemv.measure(cfg, "out", variant, None, steps=4, repeats=2, tokens=2,
                             weight_mb=2)
    assert row["copies"] == 2 and row["tokens"] == 2 and row["variant"] == variant
    assert len(row["us_all"]) == 2 and row["us_median"] > 0, row
    assert "energy_per_product_j" not in row
