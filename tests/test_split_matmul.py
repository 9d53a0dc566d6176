"""`kernels.split_matmul`: XLA's matmul as float32 partial sums over slices of K, for the
q/k/v, output and down projections of GPU decode steps of 2 to decode_rows tokens, added up
by the Pallas prepare and add + norm kernels."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blink_jax.engine_config import KernelOptions
from blink_jax.kernels import cuda_gemv, split_matmul
from blink_jax.kernels.pallas_norm import add_rms_norm as add_rms_norm_kernel
from blink_jax.kernels.select import step_kernels
from blink_jax.model.config import get_config
from blink_jax.model.gemma import MLP, add_rms_norm, sum_partials
from tests.cuda_lowering import require_gpu
from tests.test_step_kernels import _lowered


@pytest.mark.parametrize("t,k,n,splits", [(2, 1024, 1152, 8), (16, 6912, 1152, None),
                                          (64, 100, 64, 4), (5, 7, 32, 8)])
def test_partials_add_up_to_the_product(t, k, n, splits):
  rng = np.random.default_rng(t + k)
  x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, jnp.bfloat16)
  parts = split_matmul.partials(x, w, splits)
  want_splits = split_matmul.default_splits(k, n) if splits is None else splits
  assert parts.shape == (want_splits, t, n) and parts.dtype == jnp.float32
  want = jnp.einsum("tk,kn->tn", x, w, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(parts.sum(axis=0)), np.asarray(want),
                             atol=1e-4, rtol=1e-4)


def test_default_splits_cover_the_gpu_about_once():
  # 1B: N = 1152 is 18 column tiles of 64, so 8 slices (144 tiles); wider outputs take
  # fewer, a short K no slice under 64 rows.
  assert split_matmul.default_splits(1024, 1152) == 8
  assert split_matmul.default_splits(6912, 1152) == 8
  assert split_matmul.default_splits(10240, 2560) == 4
  assert split_matmul.default_splits(21504, 5376) == 2
  assert split_matmul.default_splits(128, 640) == 2
  assert split_matmul.default_splits(32, 640) == 1
  for k, n in ((1024, 1152), (6912, 1152), (1024, 640), (2048, 640)):
    s = split_matmul.default_splits(k, n)
    assert s & (s - 1) == 0  # the add + norm kernel adds a power of two of partials


def test_down_projection_through_the_add_norm_kernel():
  rng = np.random.default_rng(5)
  gate_up = jnp.asarray(rng.standard_normal((16, 2 * 256)), jnp.bfloat16)
  down = jnp.asarray(rng.standard_normal((256, 128)) * 256**-0.5, jnp.bfloat16)
  parts = split_matmul.ffw_down(gate_up, down)
  want = MLP.down_project(gate_up, down)
  x = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(sum_partials(parts, x), np.float32),
                             np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
  w1, w2 = (jnp.asarray(rng.standard_normal(128) * 0.2, jnp.bfloat16) for _ in range(2))
  got = add_rms_norm_kernel(x, parts, w1, w2, 1e-6, interpret=True)
  for g, w in zip(got, add_rms_norm(x, parts, w1, w2, 1e-6)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_out_projection_is_the_attention_output_times_its_weights():
  rng = np.random.default_rng(6)
  attn = jnp.asarray(rng.standard_normal((8, 4, 32)), jnp.float32)
  o = jnp.asarray(rng.standard_normal((4, 32, 64)) * 128**-0.5, jnp.bfloat16)
  parts = split_matmul.out_project(attn, o, jnp.bfloat16)
  want = attn.astype(jnp.bfloat16).reshape(8, 128) @ o.reshape(128, 64)
  np.testing.assert_allclose(np.asarray(parts.sum(axis=0)), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def _options(**kw) -> KernelOptions:
  return KernelOptions(**{"attention": "pallas", "norm": "pallas", "gemv": "qkv+out+down",
                          "prefill": "pallas", "decode_head": 0, "split_matmul": True, **kw})


@pytest.mark.parametrize("tokens", [2, 16, 64])
def test_gpu_decode_steps_of_several_tokens_split_their_projections(tokens):
  cfg = get_config("gemma3-270m")
  kernels = step_kernels(cfg, _options(), tokens, interpret=False)
  assert kernels.qkv_matmul is split_matmul.partials
  assert kernels.out_project is split_matmul.out_project
  assert kernels.ffw_down is split_matmul.ffw_down
  # Three batched matmuls a layer (batching dimension: the slices of K), none elsewhere.
  text = _lowered(cfg, kernels, tokens)
  batched = re.findall(r"stablehlo\.dot_general.*batching_dims = \[1\] x \[0\]", text)
  assert len(batched) == 3 * cfg.num_layers


def test_split_matmul_is_a_bool_off_by_default_and_for_one_device():
  from blink_jax.engine_config import EngineConfig
  assert KernelOptions().split_matmul is False
  assert KernelOptions().resolved("gpu").split_matmul is False
  with pytest.raises(ValueError, match="split_matmul must be True or False"):
    KernelOptions(split_matmul="yes")
  EngineConfig(kernels=KernelOptions(split_matmul=True))
  with pytest.raises(ValueError, match="split_matmul is for one device"):
    EngineConfig(tensor_parallel=2, kernels=KernelOptions(split_matmul=True))


def test_other_steps_keep_their_projections():
  cfg = get_config("gemma3-270m")
  one = step_kernels(cfg, _options(), 1, interpret=False)  # the CUDA GEMV's partials
  assert one.out_project.func is cuda_gemv.out_project and one.ffw_down.func is cuda_gemv.ffw_down
  assert one.qkv_matmul.func is cuda_gemv.partials
  for kernels in (step_kernels(cfg, _options(), 65, interpret=False),   # prefill-sized
                  step_kernels(cfg, _options(split_matmul=False), 16, interpret=False),
                  step_kernels(cfg, _options(norm="reference"), 16, interpret=False),
                  step_kernels(cfg, _options(), 16, interpret=True)):   # not on a GPU
    assert kernels.out_project is not split_matmul.out_project
    assert kernels.ffw_down is not split_matmul.ffw_down
    assert kernels.qkv_matmul is not split_matmul.partials


def _step(cfg, dtype, rows: int, kernels_of):
  """A decode step of `rows` sequences at position 100 with random weights: {split: (hidden
  states, caches)} for kernels_of(split) -> StepKernels."""
  from flax import nnx

  from blink_jax.model.gemma import Gemma, init_kv_cache
  model = Gemma(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  pages = 8
  kv = init_kv_cache(cfg, rows * pages + 1, 16, dtype)
  table = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages) + 1
  tokens = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, rows), jnp.int32)
  positions = jnp.full((rows,), 100, jnp.int32)
  seq_ids = jnp.arange(rows, dtype=jnp.int32)
  out = {}
  with jax.default_matmul_precision("highest"):
    for on in (False, True):
      kernels = kernels_of(on)
      out[on] = jax.jit(lambda kv: model.forward(tokens, positions, seq_ids, table, kv,
                                                 kernels))(kv)
  return out


def _relative(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-4), (jnp.bfloat16, 0.03)])
def test_a_decode_step_with_split_matmul_matches_xla_matmuls_on_the_gpu(dtype, bound):
  # The 1B shape's 16-row decode step (random weights) with the split projections and with
  # XLA's: the same hidden states and KV caches. In float32 (highest precision) exactly but
  # for the order of the sums (on a CPU, interpreted: 2.6e-6 apart); in bfloat16 up to the
  # rounding that 26 layers of random weights amplify (on a CPU, the 270M shape's 18
  # layers: 1.4 % apart).
  require_gpu()
  cfg = get_config("gemma3-1b")

  def kernels_of(on):
    kernels = step_kernels(cfg, _options(split_matmul=on), 16, interpret=False)
    assert (kernels.ffw_down is split_matmul.ffw_down) == on
    return kernels
  out = _step(cfg, dtype, 16, kernels_of)
  (hidden_off, cache_off), (hidden_on, cache_on) = out[False], out[True]
  assert _relative(hidden_on, hidden_off) < bound
  assert max(_relative(a, b) for a, b in zip(cache_on, cache_off)) < bound


def test_a_step_through_the_interpreted_kernels_is_the_same_step():
  # Off the GPU the engine never splits (XLA's CPU matmuls have no split-K reductions to
  # save); here the split projections go through the Pallas prepare and add + norm kernels
  # in Pallas' interpreter, against the same kernels fed XLA's whole products, in float32.
  import dataclasses

  from blink_jax.model.config import tiny_config
  cfg = tiny_config("gemma3")
  base = step_kernels(cfg, _options(attention="reference", prefill="reference", gemv="none"),
                      8, interpret=True)
  split = dataclasses.replace(base, qkv_matmul=split_matmul.partials,
                              out_project=split_matmul.out_project,
                              ffw_down=split_matmul.ffw_down)
  out = _step(cfg, jnp.float32, 8, lambda on: split if on else base)
  (hidden_off, cache_off), (hidden_on, cache_on) = out[False], out[True]
  assert _relative(hidden_on, hidden_off) < 1e-5
  assert max(_relative(a, b) for a, b in zip(cache_on, cache_off)) < 1e-5
