"""The batch-1 GEMV (`cuda_gemv`): its partial sums add up to x @ w, the add + norm kernel
sums them, the engine's down projection through it equals the jnp MLP; the CUDA kernel
against the jnp partial sums on the GPU (`gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax.kernels import cuda_gemv
from blink_jax.native import ffi
from blink_jax.model.gemma import MLP, add_rms_norm, sum_partials
from blink_jax.kernels.pallas_norm import add_rms_norm as add_rms_norm_kernel
from tests.cuda_lowering import require_gpu


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
  # On a GPU XLA runs float32 matmuls in TF32 by default (a 10-bit mantissa, errors ~5e-4):
  # these tests check how sums are split, against references that must be exact.
  with jax.default_matmul_precision("highest"):
    yield


def _case(rng, k, n, dtype):
  x = jnp.asarray(rng.standard_normal((1, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
  return x, w


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 300), n=st.sampled_from([64, 128, 192]),
       splits=st.integers(1, 40))
def test_partials_add_up_to_the_product(seed, k, n, splits):
  # Split s sums rows [s * chunk, (s + 1) * chunk) of K; splits past the end are zeros.
  splits = min(splits, k)
  x, w = _case(np.random.default_rng(seed), k, n, jnp.float32)
  p = cuda_gemv.partials(x, w, splits)
  assert p.shape == (splits, 1, n) and p.dtype == jnp.float32
  chunk = -(-k // splits)
  for s in range(splits):
    rows = slice(s * chunk, min(k, (s + 1) * chunk))
    np.testing.assert_allclose(np.asarray(p[s]), np.asarray(x[:, rows] @ w[rows]), atol=1e-4,
                               rtol=1e-4)


def test_matmul_is_the_product_in_the_input_dtype():
  x, w = _case(np.random.default_rng(6), 96, 128, jnp.float32)
  got = cuda_gemv.matmul(x, w)
  assert got.dtype == jnp.float32 and got.shape == (1, 128)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), atol=1e-5, rtol=1e-5)


def test_default_splits_put_every_load_in_flight_and_cover_the_gpu():
  # Gemma 3 1B's projections at batch 1: down [6912, 1152] needs 27 splits for one pass of
  # 32 x 8 rows per block; q/k/v [1152, 1536] and out [1024, 1152] need 6 and 8 to cover the
  # GPU's 132 SMs (24 and 18 column blocks); gate/up [1152, 13824] needs 5 for one pass.
  assert cuda_gemv.default_splits(6912, 1152) == 32
  assert cuda_gemv.default_splits(1152, 1536) == 8
  assert cuda_gemv.default_splits(1024, 1152) == 8
  assert cuda_gemv.default_splits(1152, 13824) == 8
  assert cuda_gemv.default_splits(4 * 6912, 1152) == 32  # capped: partials cost bytes
  assert cuda_gemv.default_splits(64, 64) == 2        # at least 32 rows per split
  for k, n in ((6912, 1152), (1152, 1536), (100, 64), (1, 64)):
    s = cuda_gemv.default_splits(k, n)
    assert s & (s - 1) == 0 and 1 <= s <= 32 and (s == 1 or k // s >= 32)


def test_rejects_what_it_cannot_run():
  x, w = _case(np.random.default_rng(1), 64, 64, jnp.float32)
  with pytest.raises(ValueError, match=r"got x \(1, 64\) and w \(64, 100\)"):
    cuda_gemv.partials(x, jnp.zeros((64, 100)))
  with pytest.raises(ValueError, match=r"blink_gemv takes x \[1, K\].*got x \(2, 64\)"):
    cuda_gemv.partials(jnp.zeros((2, 64)), w)  # steps of 2 tokens or more: XLA's matmuls
  with pytest.raises(ValueError, match=r"splits=65 must be in \[1, K=64\]"):
    cuda_gemv.partials(x, w, 65)
  assert cuda_gemv.usable(1, 6912, 1152) and not cuda_gemv.usable(2, 6912, 1152)
  assert not cuda_gemv.usable(1, 6912, 1000)


def test_down_projection_through_the_add_norm_kernel():
  rng = np.random.default_rng(2)
  gate_up = jnp.asarray(rng.standard_normal((1, 2 * 256)), jnp.float32)
  down = jnp.asarray(rng.standard_normal((256, 128)) * 256**-0.5, jnp.float32)
  partials = cuda_gemv.ffw_down(gate_up, down, splits=4)
  want = MLP.down_project(gate_up, down)
  np.testing.assert_allclose(np.asarray(sum_partials(partials, gate_up[:, :1])),
                             np.asarray(want), atol=1e-5, rtol=1e-5)
  x = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
  w1, w2 = (jnp.asarray(rng.standard_normal(128) * 0.2, jnp.float32) for _ in range(2))
  got = add_rms_norm_kernel(x, partials, w1, w2, 1e-6)
  for g, w in zip(got, add_rms_norm(x, want, w1, w2, 1e-6)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_cuda_kernel_matches_the_jnp_partials_on_the_gpu():
  require_gpu()
  assert ffi.cuda_targets_available(), "blink_gemv is not registered (no CUDA build of ffi/?)"
  rng = np.random.default_rng(3)
  shapes = [(6912, 1152), (1152, 13824), (1152, 1536), (1024, 1152), (100, 64)]
  for k, n in shapes:
    x, w = _case(rng, k, n, jnp.bfloat16)
    for splits in (1, cuda_gemv.default_splits(k, n), min(k, 64)):
      got = jax.jit(lambda a, b, s=splits: cuda_gemv.partials(a, b, s, use_kernel=True))(x, w)
      want = cuda_gemv.reference_partials(x, w, splits)
      # bf16 products are exact in f32: only the order of the sums differs.
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=1e-4,
                                 err_msg=f"k={k} n={n} splits={splits}")


@pytest.mark.gpu
def test_down_projection_with_the_add_norm_kernel_on_the_gpu():
  # As the engine runs it at batch 1 (1B shape, bf16): GELU x up, the CUDA GEMV's 32
  # partial sums, the Pallas add + norm kernel adding them up.
  require_gpu()
  rng = np.random.default_rng(5)
  gate_up = jnp.asarray(rng.standard_normal((1, 2 * 6912)), jnp.bfloat16)
  down = jnp.asarray(rng.standard_normal((6912, 1152)) * 6912**-0.5, jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((1, 1152)), jnp.bfloat16)
  w1, w2 = (jnp.asarray(rng.standard_normal(1152) * 0.2, jnp.bfloat16) for _ in range(2))
  got = jax.jit(lambda g, d, a: add_rms_norm_kernel(
      a, cuda_gemv.ffw_down(g, d, use_kernel=True), w1, w2, 1e-6, interpret=False))(
          gate_up, down, x)
  want = add_rms_norm(x, MLP.down_project(gate_up, down), w1, w2, 1e-6)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=0.1, rtol=0.1)


@pytest.mark.gpu
def test_gate_up_matmul_on_the_gpu():
  # The 1B shape's gate/up projection at batch 1: its splits added up by XLA, in bf16.
  require_gpu()
  x, w = _case(np.random.default_rng(7), 1152, 13824, jnp.bfloat16)
  got = jax.jit(lambda a, b: cuda_gemv.matmul(a, b, use_kernel=True))(x, w)
  assert got.dtype == jnp.bfloat16
  want = jnp.dot(x, w, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2,
                             rtol=2e-2)
