"""The fused down projection (`pallas_ffw.ffw_down`: GELU(gate) x up, then the down matmul,
as split partial sums) and the add + norm kernel that sums them equal the jnp MLP and
`model.add_rms_norm`; Pallas' interpreter on CPU, the compiled kernels on the GPU (`gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax import pallas_ffw
from blink_jax.model import MLP, add_rms_norm, sum_partials
from blink_jax.pallas_ffw import ffw_down
from blink_jax.pallas_norm import add_rms_norm as add_rms_norm_kernel
from tests.cuda_lowering import check_triton_calls, lower_for_cuda, require_gpu


def _case(rng, tokens, hidden, width, dtype):
  gate_up = jnp.asarray(rng.standard_normal((tokens, 2 * hidden)), dtype)
  down = jnp.asarray(rng.standard_normal((hidden, width)) * hidden**-0.5, dtype)
  return gate_up, down


def _check(gate_up, down, *, atol, **kw):
  partials = ffw_down(gate_up, down, **kw)
  assert partials.dtype == jnp.float32
  assert partials.shape[1:] == (gate_up.shape[0], down.shape[1])
  got = sum_partials(partials, gate_up[:, :1])
  want = MLP.down_project(gate_up, down)
  assert got.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=atol, rtol=atol)
  return partials


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, pallas_ffw.MAX_TOKENS),
       hidden=st.sampled_from([16, 48, 128, 320]), width=st.sampled_from([16, 64, 384]),
       splits=st.sampled_from([1, 2, 4, 16]), unroll=st.booleans())
def test_matches_the_jnp_mlp(seed, tokens, hidden, width, splits, unroll):
  # Splits that get no block (more splits than blocks) contribute zeros, unrolled or not.
  _check(*_case(np.random.default_rng(seed), tokens, hidden, width, jnp.float32), atol=1e-5,
         splits=splits, unroll=unroll)


def test_bf16_rounds_like_the_jnp_mlp():
  # Both round GELU(gate) and the product to bf16 before the matmul; sums in another order
  # may move an output by one bf16 step.
  _check(*_case(np.random.default_rng(1), 3, 640, 256, jnp.bfloat16), atol=2e-2)


def test_add_norm_kernel_sums_the_partials():
  rng = np.random.default_rng(2)
  gate_up, down = _case(rng, 4, 256, 128, jnp.float32)
  partials = ffw_down(gate_up, down, splits=4)
  x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
  w1, w2 = (jnp.asarray(rng.standard_normal(128) * 0.2, jnp.float32) for _ in range(2))
  got = add_rms_norm_kernel(x, partials, w1, w2, 1e-6)
  want = add_rms_norm(x, MLP.down_project(gate_up, down), w1, w2, 1e-6)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="do not match"):  # 3 splits: not a power of two
    add_rms_norm_kernel(x, partials[:3], w1, w2, 1e-6)


def test_rejects_what_it_cannot_run():
  gate_up, down = _case(np.random.default_rng(3), 2, 64, 64, jnp.float32)
  with pytest.raises(ValueError, match="do not match"):
    ffw_down(gate_up[:, :100], down)
  with pytest.raises(ValueError, match="do not fit"):
    ffw_down(jnp.zeros((pallas_ffw.MAX_TOKENS + 1, 128)), down)
  with pytest.raises(ValueError, match="power of two"):
    ffw_down(gate_up, down, splits=3)
  assert pallas_ffw.usable(1, 6912, 1152) and pallas_ffw.usable(8, 2048, 640)
  assert not pallas_ffw.usable(9, 6912, 1152)
  assert not pallas_ffw.usable(1, 6912, 1000)  # 1000 = 8 x 125: blocks too small
  assert pallas_ffw.blocks(6912, 1152) == (64, 128)


@pytest.mark.parametrize("unroll", [True, False])
def test_lowers_to_one_triton_kernel_for_cuda(unroll):
  """Gemma 3 1B's MLP (6912 hidden dims, 1152 wide), bf16, batch 1: one Triton call over 9
  column slices x 16 splits."""
  shapes = [jax.ShapeDtypeStruct((1, 2 * 6912), jnp.bfloat16),
            jax.ShapeDtypeStruct((6912, 1152), jnp.bfloat16)]
  text = lower_for_cuda(lambda *a: ffw_down(*a, splits=16, block_n=128, block_k=64,
                                            unroll=unroll, interpret=False), *shapes)
  check_triton_calls(text, 1, (9, 16, 1))


@pytest.mark.gpu
def test_compiled_kernels_match_on_the_gpu():
  require_gpu()
  rng = np.random.default_rng(4)
  with jax.default_matmul_precision("highest"):  # the f32 reference, not TF32
    _check_on_gpu(rng)


def _check_on_gpu(rng):
  for tokens in (1, 8):
    for dtype, atol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
      gate_up, down = _case(rng, tokens, 6912, 1152, dtype)
      _check(gate_up, down, atol=atol, unroll=False, interpret=False)
      partials = _check(gate_up, down, atol=atol, unroll=True, interpret=False)
      x = jnp.asarray(rng.standard_normal((tokens, 1152)), dtype)
      w1, w2 = (jnp.asarray(rng.standard_normal(1152) * 0.2, dtype) for _ in range(2))
      got = add_rms_norm_kernel(x, partials, w1, w2, 1e-6, interpret=False)
      want = add_rms_norm(x, MLP.down_project(gate_up, down), w1, w2, 1e-6)
      for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=atol * 5, rtol=atol * 5)
