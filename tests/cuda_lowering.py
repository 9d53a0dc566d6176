"""Pallas kernels lowered for CUDA without a GPU: Pallas' Triton lowering runs in Python, so
`jax.export` for platform "cuda" on a CPU machine shows each kernel's Triton call (and its
grid) or fails where Triton's lowering would. Also the skip of the compiled-kernel tests."""
import jax
import pytest
from jax import export

TRITON = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *shapes) -> str:
  """The StableHLO text of jit(fn) exported for CUDA at `shapes` (jax.ShapeDtypeStruct or
  pytrees of them); Triton calls and ffi/'s FFI targets may appear in it."""
  exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call(name)
      for name in (TRITON, "blink_gemv", "blink_sample_thresholds")])(*shapes)
  return exported.mlir_module()


def check_triton_calls(text: str, calls: int, *grids: tuple[int, int, int]) -> None:
  """The lowered module launches `calls` Triton kernels, among them ones with these grids,
  and no interpreter loop (Pallas' interpreter would loop over the grid)."""
  assert text.count(f"@{TRITON}") == calls
  for x, y, z in grids:
    assert f"grid_x = {x} : i32, grid_y = {y} : i32, grid_z = {z} : i32" in text
  assert "stablehlo.while" not in text


def gpus() -> list:
  """The CUDA devices JAX sees ([] without a GPU backend)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def require_gpu():
  if jax.devices()[0].platform != "gpu":
    pytest.skip("needs a GPU")
