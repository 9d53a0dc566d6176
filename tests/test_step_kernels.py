"""Which kernels a serving step runs: `kernels.step_kernels` wires the Pallas kernel sets
into `Gemma.forward`. Pallas' Triton lowering runs in Python, so the step is lowered for
CUDA here (jax.export, no GPU) and its Triton calls are counted per layer."""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from blink_jax.config import get_config
from blink_jax.kernels import step_kernels
from blink_jax.model import Gemma, init_kv_cache
from tests.cuda_lowering import TRITON, lower_for_cuda
KERNELS = ("blink_add_rms_norm", "blink_prepare_qkv", "blink_paged_decode_attention",
           "blink_paged_decode_merge", "blink_paged_prefill_attention", "blink_ffw_down",
           "blink_merge_out_project")


def _triton_calls(text: str) -> collections.Counter:
  """Triton kernels one run of the exported module launches, by kernel name (jitted helpers
  become private functions called once per layer: calls are followed)."""
  funcs: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    m = re.match(r"\s*func\.func (?:private |public )?@([\w$.\-]+)", line)
    if m:
      current = funcs.setdefault(m.group(1), [])
    elif current is not None:
      current.append(line)

  def count(name):
    out = collections.Counter()
    for line in funcs.get(name, []):
      out.update(k for k in KERNELS if TRITON in line and k in line)
      for callee in re.findall(r"call @([\w$.\-]+)", line):
        out += count(callee)
    return out
  return count("main")


def _lowered_step(cfg, attention: str, norm: str, tokens: int) -> collections.Counter:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Gemma(cfg, dtype=jnp.bfloat16)))
  kernels = step_kernels(cfg, attention, norm, tokens, interpret=False)

  def step(state, kv, tokens, positions, seq_ids, page_table):
    return nnx.merge(graphdef, state).forward(tokens, positions, seq_ids, page_table, kv,
                                              **kernels)
  kv = jax.eval_shape(lambda: init_kv_cache(cfg, 64, 16))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
  return _triton_calls(lower_for_cuda(step, state, kv, i32(tokens), i32(tokens), i32(tokens),
                                      i32(4, 16)))


@pytest.mark.parametrize("tokens", [1, 64])
def test_both_pallas_sets_run_five_kernels_per_layer(tokens):
  cfg = get_config("gemma3-270m")
  layers = cfg.num_layers
  assert _lowered_step(cfg, "pallas", "pallas", tokens) == {
      "blink_prepare_qkv": layers, "blink_paged_decode_attention": layers,
      "blink_paged_decode_merge": layers,
      # two residual steps per layer, each ending in the next norm; the last layer's
      # second one ends the stack (the final norm belongs to the logits).
      "blink_add_rms_norm": 2 * layers - 1}


def test_kernel_sets_are_independent():
  cfg = get_config("gemma3-270m")
  layers = cfg.num_layers
  assert _lowered_step(cfg, "pallas", "reference", 1) == {
      "blink_paged_decode_attention": layers, "blink_paged_decode_merge": layers}
  assert _lowered_step(cfg, "reference", "pallas", 1) == {
      "blink_prepare_qkv": layers, "blink_add_rms_norm": 2 * layers - 1}
  assert _lowered_step(cfg, "reference", "reference", 1) == {}
  # Prefill-sized buckets keep the reference attention (every token would re-read its context).
  assert "blink_paged_decode_attention" not in _lowered_step(cfg, "pallas", "pallas", 256)


def test_prefill_buckets_run_the_prefill_kernel_when_enabled(monkeypatch):
  from blink_jax import pallas_prefill
  monkeypatch.setattr(pallas_prefill, "ENABLED", True)
  cfg = get_config("gemma3-270m")
  layers = cfg.num_layers
  assert _lowered_step(cfg, "pallas", "reference", 256) == {
      "blink_paged_prefill_attention": layers, "blink_paged_decode_merge": layers}


@pytest.mark.parametrize("module,kernel,replaces", [
    ("pallas_ffw", "blink_ffw_down", None),  # XLA's down projection
    ("pallas_out", "blink_merge_out_project", "blink_paged_decode_merge")])
def test_small_steps_run_the_partial_sum_kernels_when_enabled(monkeypatch, module, kernel,
                                                             replaces):
  import importlib
  from blink_jax import cuda_gemv
  monkeypatch.setattr(cuda_gemv, "ENABLED", frozenset())  # it would take these projections
  monkeypatch.setattr(importlib.import_module(f"blink_jax.{module}"), "ENABLED", True)
  cfg = get_config("gemma3-270m")
  layers = cfg.num_layers
  want = {"blink_prepare_qkv": layers, "blink_paged_decode_attention": layers,
          "blink_paged_decode_merge": layers, "blink_add_rms_norm": 2 * layers - 1,
          kernel: layers}
  if replaces:
    del want[replaces]
  assert _lowered_step(cfg, "pallas", "pallas", 1) == want
  # Larger steps, and steps without the add + norm kernel that sums the partials, do not.
  assert kernel not in _lowered_step(cfg, "pallas", "pallas", 64)
  assert kernel not in _lowered_step(cfg, "pallas", "reference", 1)


@pytest.mark.parametrize("value,names", [
    ("1", ("qkv_fn", "out_fn", "ffw_down_fn")),
    ("qkv+out+down+gate_up", ("qkv_fn", "out_fn", "ffw_down_fn", "gate_up_fn")),
    ("down", ("ffw_down_fn",))])
def test_cuda_gemv_takes_the_chosen_projections_of_small_steps(monkeypatch, value, names):
  # BLINK_CUDA_GEMV: one blink_gemv custom call per chosen projection and layer in a
  # bucket-1 step (the fused Pallas down projection and the merge + output projection, if
  # also on, are not used), none in a bucket-64 step.
  from blink_jax import cuda_gemv, pallas_ffw, pallas_out
  monkeypatch.setattr(cuda_gemv, "ENABLED", cuda_gemv.projections_from(value))
  monkeypatch.setattr(pallas_ffw, "ENABLED", True)
  monkeypatch.setattr(pallas_out, "ENABLED", True)
  cfg = get_config("gemma3-270m")
  for tokens, per_layer in ((1, len(names)), (64, 0)):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Gemma(cfg, dtype=jnp.bfloat16)))
    kernels = step_kernels(cfg, "pallas", "pallas", tokens, interpret=False)
    for name in ("qkv_fn", "out_fn", "ffw_down_fn", "gate_up_fn"):
      on = kernels[name] is not None and getattr(kernels[name], "func", None) in (
          cuda_gemv.matmul, cuda_gemv.out_project, cuda_gemv.ffw_down)
      assert on == (name in names and tokens == 1), (name, tokens)

    def step(state, kv, tokens, positions, seq_ids, page_table):
      return nnx.merge(graphdef, state).forward(tokens, positions, seq_ids, page_table, kv,
                                                **kernels)
    kv = jax.eval_shape(lambda: init_kv_cache(cfg, 64, 16, jnp.bfloat16))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    text = lower_for_cuda(step, state, kv, i32(tokens), i32(tokens), i32(tokens), i32(4, 16))
    assert text.count("@blink_gemv") == cfg.num_layers * per_layer
    if tokens == 1:
      assert "blink_ffw_down" not in text and ("blink_merge_out" in text) == (
          "out_fn" not in names)


def test_cuda_gemv_by_default_on_the_gpu_only(monkeypatch):
  # BLINK_CUDA_GEMV unset: a GPU step takes q/k/v, output and down projections through it; an
  # interpreted (CPU) step keeps XLA's matmuls.
  from blink_jax import cuda_gemv
  monkeypatch.setattr(cuda_gemv, "AUTO", True)
  monkeypatch.setattr(cuda_gemv, "ENABLED", cuda_gemv.projections_from("1"))
  cfg = get_config("gemma3-270m")
  on_gpu = step_kernels(cfg, "pallas", "pallas", 1, interpret=False)
  on_cpu = step_kernels(cfg, "pallas", "pallas", 1, interpret=True)
  for name in ("qkv_fn", "out_fn", "ffw_down_fn"):
    assert on_gpu[name].func in (cuda_gemv.matmul, cuda_gemv.out_project, cuda_gemv.ffw_down)
    assert on_cpu[name] is None
  assert on_gpu["gate_up_fn"] is None


def test_qkv_partials_go_to_the_pallas_prepare_kernel_only(monkeypatch):
  from blink_jax import cuda_gemv
  monkeypatch.setattr(cuda_gemv, "ENABLED", cuda_gemv.projections_from("qkv"))
  monkeypatch.setattr(cuda_gemv, "QKV_PARTIALS", True)
  cfg = get_config("gemma3-270m")
  assert step_kernels(cfg, "pallas", "pallas", 1, interpret=False)["qkv_fn"].func is (
      cuda_gemv.partials)
  assert step_kernels(cfg, "pallas", "reference", 1, interpret=False)["qkv_fn"].func is (
      cuda_gemv.matmul)


def test_cuda_gemv_projection_names():
  from blink_jax import cuda_gemv
  assert cuda_gemv.projections_from("0") == frozenset()
  assert cuda_gemv.projections_from("1") == {"qkv", "out", "down"}
  assert cuda_gemv.projections_from("down,gate_up") == {"down", "gate_up"}
  with pytest.raises(ValueError, match=r"BLINK_CUDA_GEMV='qkv\+oops': unknown .*\['oops'\]"):
    cuda_gemv.projections_from("qkv+oops")
