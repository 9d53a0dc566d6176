"""Tensor parallelism of the model (docs/ARCHITECTURE.md, "Tensor parallelism (design)"): the
ragged paged step with its weights and KV cache split over 2 and 4 host devices gives the
single-device step's hidden states, logits and cache contents. XLA's CPU backend makes several
devices only when told before JAX starts, so each check runs in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink_jax.model.config import tiny_config
from blink_jax.model.tensor_parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[1]


def check_split_step_equals_single_device(n: int) -> None:
  """Two steps (two prompts' prefill, then a decode row each, reading the cache the first
  step wrote) of the tiny Gemma 3 (4 query heads, 2 KV heads), alone and split n ways."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from blink_jax.model.gemma import Gemma, init_kv_cache

  assert len(jax.devices()) >= n, jax.devices()
  cfg = tiny_config("gemma3", vocab_size=512)
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
  tp = TensorParallel(cfg, n)
  mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
  params = tp.place(mesh, model.to_params())
  step = jax.jit(tp.forward(mesh, dtype=jnp.float32))
  logits = jax.jit(step.logits)
  ref_step = jax.jit(model.forward)

  rng = np.random.default_rng(2)
  lens = (11, 6)
  page_table = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
  steps = [  # (tokens, positions, seq_ids)
      (np.concatenate([rng.integers(3, 512, k) for k in lens]),
       np.concatenate([np.arange(k) for k in lens]),
       np.concatenate([np.full(k, s) for s, k in enumerate(lens)])),
      (rng.integers(3, 512, 2), np.array(lens), np.array([0, 1]))]
  kv_ref = init_kv_cache(cfg, 8, 4, jnp.float32)
  kv_tp = tp.init_kv_cache(mesh, 8, 4, jnp.float32)
  for tokens, positions, seq_ids in steps:
    args = [jnp.asarray(a, jnp.int32) for a in (tokens, positions, seq_ids)]
    h_ref, kv_ref = ref_step(*args, page_table, kv_ref)
    h_tp, kv_tp = step(params, *args, page_table, kv_tp)
    np.testing.assert_allclose(h_tp, h_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(logits(params, h_tp), model.logits(h_ref), rtol=2e-5, atol=2e-4)
  # Device d's cache holds its KV heads: head d * K // n of the model's (keys, then values).
  k_heads, h = cfg.num_kv_heads, cfg.head_dim
  local = tp.kv_heads // n
  for ref, split in zip(kv_ref, kv_tp):
    ref = np.asarray(ref).reshape(8, 4, 2, k_heads, h)
    split = np.asarray(split).reshape(8, 4, n, 2, local, h)
    for d in range(n):
      heads = [(d * local + j) * k_heads // tp.kv_heads for j in range(local)]
      np.testing.assert_allclose(split[:, :, d], ref[:, :, :, heads], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_split_step_equals_single_device(n):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
         "JAX_PLATFORMS": "cpu"}
  code = ("from tests.test_tensor_parallel import check_split_step_equals_single_device as c; "
          f"c({n})")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]


def test_a_shape_that_does_not_split_names_its_sizes():
  with pytest.raises(ValueError, match="num_heads 4.*not divisible by 3"):
    TensorParallel(tiny_config("gemma3"), 3)
  with pytest.raises(ValueError, match="positive integer"):
    TensorParallel(tiny_config("gemma3"), 0)
  assert TensorParallel(tiny_config("gemma3"), 4).local_config().num_kv_heads == 1
