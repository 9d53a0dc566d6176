"""bench/sampling.py: its device loop samples with the mode's parameters (taken at run time,
not folded in) and reports one row per mode, rows count and search width."""
import jax.numpy as jnp
import numpy as np

from bench import sampling as bench_sampling


def test_loop_samples_what_the_mode_asks_for():
  f = bench_sampling.sampler_loop(rows=4, steps=3, ways=3)
  logits = jnp.asarray(np.tile(np.linspace(0, 8, 64, dtype=np.float32), (4, 1)))
  greedy = np.asarray(f(logits, jnp.zeros(4), jnp.ones(4), jnp.zeros(4, jnp.int32))[1])
  assert (greedy == 3 * 63).all()  # three steps, each the top token (the shift keeps it top)
  top1 = np.asarray(f(logits, jnp.ones(4), jnp.ones(4), jnp.ones(4, jnp.int32))[1])
  assert (top1 == greedy).all()  # top-k 1 at temperature 1 is greedy
  spread = np.asarray(f(logits, jnp.full(4, 100.0), jnp.ones(4), jnp.zeros(4, jnp.int32))[1])
  assert (spread != greedy).any()  # a hot temperature draws other tokens


def test_measure_row():
  row = bench_sampling.measure(rows=2, vocab=1000, mode="top_k_p", ways=15, steps=2, repeats=2)
  assert (row["rows"], row["vocab"], row["mode"], row["search_ways"]) == (2, 1000, "top_k_p", 15)
  assert len(row["us_per_sample_call_all"]) == 2 and row["us_per_sample_call_min"] > 0
