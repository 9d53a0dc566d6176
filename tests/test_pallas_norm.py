"""The Pallas residual add + RMSNorm equals `model.add_rms_norm` (Pallas' interpreter on CPU;
the compiled Triton kernel on the GPU, marked `gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from blink_jax import pallas_norm
from blink_jax.model import add_rms_norm as reference
from blink_jax.pallas_norm import add_rms_norm, chunk_size


def _case(rng, rows, width, dtype):
  x = jnp.asarray(rng.standard_normal((rows, width)), dtype)
  branch = jnp.asarray(rng.standard_normal((rows, width)) * 4, dtype)
  weights = [jnp.asarray(rng.standard_normal(width) * 0.2, dtype) for _ in range(2)]
  return x, branch, *weights


def _check(args, *, eps=1e-6, atol, **kw):
  got = add_rms_norm(*args, eps, **kw)
  want = reference(*args, eps)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               atol=atol, rtol=atol)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 9),
       width=st.sampled_from([16, 48, 64, 80, 144, 640, 1152]))
def test_matches_the_reference(seed, rows, width):
  # Widths with 1 to 9 chunks (Gemma 3 270M: 640 = 5 x 128; 1B: 1152 = 9 x 128).
  _check(_case(np.random.default_rng(seed), rows, width, jnp.float32), atol=1e-5)


def test_bf16_rounds_like_the_reference():
  # Both round the normed branch, then the sum, to bf16; float32 sums in another order may
  # move a value by one bf16 step.
  args = _case(np.random.default_rng(1), 5, 1152, jnp.bfloat16)
  _check(args, atol=1e-2)


def test_keeps_leading_axes():
  x, b, w1, w2 = _case(np.random.default_rng(2), 6, 64, jnp.float32)
  got = add_rms_norm(x.reshape(2, 3, 64), b.reshape(2, 3, 64), w1, w2, 1e-6)
  want = reference(x, b, w1, w2, 1e-6)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g).reshape(6, 64), np.asarray(w), atol=1e-5)


def test_chunks_and_fallback():
  assert chunk_size(1152) == 128 and chunk_size(640) == 128 and chunk_size(2560) == 512
  assert chunk_size(4096) == 1024
  assert pallas_norm.select("pallas", 1152).func is add_rms_norm
  assert pallas_norm.select("pallas", 1000) is reference  # 1000 = 8 x 125: chunks too small
  assert pallas_norm.select("reference", 1152) is reference
  with pytest.raises(ValueError, match="resolved"):
    pallas_norm.select("auto", 1152)


def test_rejects_mismatched_shapes():
  x, b, w1, w2 = _case(np.random.default_rng(3), 2, 64, jnp.float32)
  with pytest.raises(ValueError, match="do not match"):
    add_rms_norm(x, b[:, :32], w1, w2, 1e-6)
  with pytest.raises(ValueError, match="power-of-two factor"):
    add_rms_norm(x[:, :40], b[:, :40], w1[:40], w2[:40], 1e-6)  # 40 = 8 x 5


@pytest.mark.parametrize("width", [640, 1152])
def test_lowers_to_one_triton_kernel_for_cuda(width):
  """Pallas' Triton lowering runs in Python, so the CUDA lowering of the Gemma 3 widths
  (rows that are not a power of two, loaded in 128-wide chunks) is checked without a GPU."""
  from jax import export
  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, width), (1, width), (width,),
                                                             (width,))]
  f = jax.jit(lambda *a: add_rms_norm(*a, eps=1e-6, interpret=False))
  triton = "__gpu$xla.gpu.triton"
  exported = export.export(f, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(triton)])(*shapes)
  text = exported.mlir_module()
  assert text.count(f"@{triton}") == 1
  assert "stablehlo.while" not in text  # the interpreter would loop over the grid


@pytest.mark.gpu
def test_compiled_kernel_matches_the_reference_on_the_gpu():
  """The Triton kernel at the Gemma 3 widths, one row and a batch, f32 and bf16."""
  if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(4)
  for width in (640, 1152):
    for rows in (1, 64):
      _check(_case(rng, rows, width, jnp.float32), atol=1e-5, interpret=False)
      _check(_case(rng, rows, width, jnp.bfloat16), atol=1e-2, interpret=False)
