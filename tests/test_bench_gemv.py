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


def test_loop_feeds_each_output_back():
  x = jnp.ones((1, 64), jnp.bfloat16)
  w = jnp.asarray(np.eye(64, 128) * 2, jnp.bfloat16)
  for variant in bench_gemv.VARIANTS:
    out = np.asarray(bench_gemv.product_loop(variant, 4, steps=3)(x, w), np.float32)
    # x[0, 0] becomes 2 * x[0, 0] * 1e-3 each step: 2e-3, then 4e-6, then 8e-9
    assert abs(out[0, 0] - 8e-9) < 1e-10 and (out.reshape(-1)[1:] == 1).all(), variant


def test_measure_row_names_its_splits():
  cfg = get_config("gemma3-270m")
  auto = bench_gemv.measure(cfg, "out", "partials", None, steps=2, repeats=2)
  k, n = bench_gemv.projection_shape(cfg, "out")
  assert auto["splits"] == cuda_gemv.default_splits(k, n) and auto["auto_splits"]
  assert len(auto["us_all"]) == 2 and auto["us_min"] > 0 and auto["weight_tb_per_s"] > 0
  xla = bench_gemv.measure(cfg, "out", "xla", None, steps=2, repeats=2)
  assert xla["splits"] is None and not xla["auto_splits"]
