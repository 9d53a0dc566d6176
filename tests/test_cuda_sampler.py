"""The sampler's thresholds by radix selection (`cuda_sampler`, ffi/sampler_cuda.cu): its
sort-based stand-in's answers, where the engine's step takes the kernel, and the CUDA kernel
against the sorting reference on the GPU (`gpu`)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blink_jax.engine_config import KernelOptions
from blink_jax.kernels import cuda_sampler
from blink_jax.native import ffi
from blink_jax.kernels.select import step_kernels
from blink_jax.model.config import get_config
from blink_jax.model.sampling import _filtered, sample
from tests.cuda_lowering import require_gpu
from tests.test_sampling import _threshold_keep


def test_reference_thresholds_are_the_kth_value_and_the_nucleus_edge():
  x = jnp.asarray([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
  hi = x.max(axis=1)
  got = np.asarray(cuda_sampler.reference_thresholds(
      x, hi, jnp.asarray([2, 0]), jnp.asarray([1.0, 0.5])))
  # row 0: top-2 -> 2.0, no top-p; row 1: the top token holds most of the mass -> 5.0
  np.testing.assert_array_equal(got, [[2.0, -np.inf], [-np.inf, 5.0]])
  none = cuda_sampler.reference_thresholds(x, hi, jnp.asarray([0, 4]), jnp.asarray([1.0, 1.0]))
  assert np.all(np.isneginf(np.asarray(none)))  # k = 0 or k >= V keeps every token


def test_rejects_shapes_it_cannot_take():
  with pytest.raises(ValueError, match="thresholds takes x"):
    cuda_sampler.thresholds(jnp.zeros((2, 5)), jnp.zeros(3), jnp.zeros(2, jnp.int32),
                            jnp.ones(2), use_kernel=False)


def test_sample_draws_the_same_tokens_with_the_thresholds_found_at_once():
  # Same seeds, same kept sets: the same tokens as the bisection's.
  rng = np.random.default_rng(3)
  rows, vocab = 6, 700
  logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
  temp = jnp.full(rows, 0.8)
  top_p = jnp.asarray([1.0, 0.9, 0.5, 0.95, 1.0, 0.7])
  top_k = jnp.asarray([0, 0, 40, 10, 5, 0], jnp.int32)
  args = (logits, temp, top_p, top_k, jnp.arange(rows, dtype=jnp.int32),
          jnp.zeros(rows, jnp.int32), jnp.full(rows, 7, jnp.int32), -jnp.ones(rows, jnp.int32),
          (jnp.zeros(rows), jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0))))
  searched = sample(*args, max_top=0)[0]
  at_once = sample(*args, max_top=0,
                   thresholds=functools.partial(cuda_sampler.thresholds, use_kernel=False))[0]
  assert np.asarray(searched).tolist() == np.asarray(at_once).tolist()


def test_gpu_steps_take_the_kernel_and_other_devices_search():
  cfg = get_config("gemma3-270m")
  options = KernelOptions(attention="pallas", norm="pallas", gemv="none", prefill="reference",
                          decode_head=0)
  for rows in (1, 8, 64, 256):
    assert step_kernels(cfg, options, rows, interpret=False).thresholds.func is \
        cuda_sampler.thresholds
    assert step_kernels(cfg, options, rows, interpret=True).thresholds is None


@pytest.mark.gpu
def test_cuda_thresholds_keep_what_the_sorting_reference_keeps_on_the_gpu():
  # Gemma's vocabulary and a small one, rows asking for top-k, top-p, both or neither, ties
  # (a coarse grid) and spread-out logits.
  require_gpu()
  assert ffi.cuda_targets_available()
  rng = np.random.default_rng(9)
  kernel = jax.jit(functools.partial(_filtered, ways=1, thresholds=functools.partial(
      cuda_sampler.thresholds, use_kernel=True)))
  for vocab, rows in ((262144, 5), (1000, 64), (37, 3)):
    for coarse in (False, True):
      x = rng.normal(size=(rows, vocab)) * 3
      x = (np.round(x * 2) / 2 if coarse else x).astype(np.float32)
      k = rng.choice([0, 1, 40, vocab, vocab + 3], size=rows).astype(np.int32)
      p = rng.choice([1.0, 0.95, 0.5, 0.1], size=rows).astype(np.float32)
      out = np.asarray(kernel(jnp.asarray(x), jnp.ones(rows), jnp.asarray(k), jnp.asarray(p)))
      for r in range(rows):
        ref = _threshold_keep(x[r], k[r], p[r])
        if ref is not None:
          np.testing.assert_array_equal(np.isfinite(out[r]), ref,
                                        err_msg=f"vocab {vocab} row {r} k {k[r]} p {p[r]}")
      # the top-k threshold is exactly the k-th largest value
      t = np.asarray(jax.jit(functools.partial(cuda_sampler.thresholds, use_kernel=True))(
          jnp.asarray(x), jnp.asarray(x.max(1)), jnp.asarray(k), jnp.asarray(p)))
      for r in range(rows):
        if 0 < k[r] < vocab:
          assert t[r, 0] == np.sort(x[r])[::-1][k[r] - 1]


def test_sampler_with_the_kernel_lowered_for_cuda_is_one_custom_call_and_no_sort():
  # What a CUDA-graph loop can hold (docs/ARCHITECTURE.md, "CUDA-graph rules"): the
  # thresholds' FFI call and no sort, scan or loop.
  import re

  from tests.cuda_lowering import lower_for_cuda
  rows, vocab = 4, 1000
  s = jax.ShapeDtypeStruct
  z = (s((rows,), jnp.float32), s((rows, 2), jnp.int32), s((rows, 2), jnp.float32))
  args = (s((rows, vocab), jnp.float32), s((rows,), jnp.float32), s((rows,), jnp.float32),
          *(s((rows,), jnp.int32),) * 5, z)
  kernel = functools.partial(cuda_sampler.thresholds, use_kernel=True)
  text = lower_for_cuda(lambda *a: sample(*a, max_top=2, thresholds=kernel), *args)
  assert re.findall(r"custom_call @(\w+)", text) == ["blink_sample_thresholds"]
  ops = set(re.findall(r"\b(?:stablehlo|chlo)\.[a-z_]+", text))
  assert not ops & {"stablehlo.sort", "chlo.scan", "stablehlo.reduce_window", "stablehlo.while"}
