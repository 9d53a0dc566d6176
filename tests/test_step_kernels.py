"""Which kernels a serving step runs: `kernels.select.step_kernels` wires the kernel sets
into `Gemma.forward`. Pallas' Triton lowering runs in Python, so the step is lowered for
CUDA here (jax.export, no GPU) and its Triton calls are counted per layer."""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from blink_jax.engine_config import KernelOptions
from blink_jax.kernels import cuda_gemv
from blink_jax.kernels.select import step_kernels
from blink_jax.model.config import get_config
from blink_jax.model.gemma import Gemma, init_kv_cache
from tests.cuda_lowering import TRITON, lower_for_cuda

KERNELS = ("blink_add_rms_norm", "blink_prepare_qkv", "blink_paged_decode_attention",
           "blink_paged_decode_merge", "blink_paged_prefill_attention")


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


def _options(attention: str, norm: str, **kw) -> KernelOptions:
  """Resolved options: no GEMV, the reference prefill attention and no decode head unless
  named."""
  return KernelOptions(attention=attention, norm=norm,
                       **{"gemv": "none", "prefill": "reference", "decode_head": 0, **kw})


def _lowered(cfg, kernels, tokens: int) -> str:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Gemma(cfg, dtype=jnp.bfloat16)))

  def step(state, kv, tokens, positions, seq_ids, page_table):
    return nnx.merge(graphdef, state).forward(tokens, positions, seq_ids, page_table, kv,
                                              kernels)
  kv = jax.eval_shape(lambda: init_kv_cache(cfg, 64, 16, jnp.bfloat16))
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
  return lower_for_cuda(step, state, kv, i32(tokens), i32(tokens), i32(tokens), i32(4, 16))


def _lowered_step(cfg, attention: str, norm: str, tokens: int, **kw) -> collections.Counter:
  kernels = step_kernels(cfg, _options(attention, norm, **kw), tokens, interpret=False)
  return _triton_calls(_lowered(cfg, kernels, tokens))


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


def test_prefill_steps_run_the_prefill_kernel_when_asked():
  cfg = get_config("gemma3-270m")
  layers = cfg.num_layers
  prefill_only = {"blink_paged_prefill_attention": layers, "blink_paged_decode_merge": layers}
  both = {"blink_paged_decode_attention": layers, "blink_paged_prefill_attention": layers,
          "blink_paged_decode_merge": 2 * layers}  # each kernel's splits merged
  assert _lowered_step(cfg, "pallas", "reference", 512, prefill="pallas") == prefill_only
  # With decode_head the first rows, where a step's decode rows are, take the decode kernel.
  assert _lowered_step(cfg, "pallas", "reference", 512, prefill="pallas",
                       decode_head=256) == both
  assert _lowered_step(cfg, "pallas", "reference", 256, prefill="pallas", decode_head=256) == {
      "blink_paged_decode_attention": layers, "blink_paged_decode_merge": layers}
  # Without the Pallas decode kernel the prefill kernel takes every row.
  assert _lowered_step(cfg, "reference", "reference", 512, prefill="pallas",
                       decode_head=256) == prefill_only
  # decode_rows moves the line between decode- and prefill-sized steps.
  assert _lowered_step(cfg, "pallas", "reference", 8, prefill="pallas", decode_rows=4,
                       decode_head=2) == both


def test_step_kernels_take_resolved_options_only():
  with pytest.raises(ValueError, match="resolved"):
    step_kernels(get_config("gemma3-270m"), KernelOptions(), 1, interpret=False)


@pytest.mark.parametrize("gemv,names", [
    ("qkv+out+down", ("qkv_matmul", "out_project", "ffw_down")),
    ("qkv+out+down+gate_up", ("qkv_matmul", "out_project", "ffw_down", "gate_up_matmul")),
    ("down", ("ffw_down",))])
def test_cuda_gemv_takes_the_chosen_projections_of_small_steps(gemv, names):
  # One blink_gemv custom call per chosen projection and layer in a bucket-1 step, none in
  # steps of 2 or 64 tokens (XLA's matmuls: docs/PERFORMANCE.md, "The GEMV at one token only").
  cfg = get_config("gemma3-270m")
  gemv_fns = (cuda_gemv.matmul, cuda_gemv.partials, cuda_gemv.out_project, cuda_gemv.ffw_down)
  for tokens, per_layer in ((1, len(names)), (2, 0), (64, 0)):
    kernels = step_kernels(cfg, _options("pallas", "pallas", gemv=gemv), tokens,
                           interpret=False)
    for name in ("qkv_matmul", "out_project", "ffw_down", "gate_up_matmul"):
      on = getattr(getattr(kernels, name), "func", None) in gemv_fns
      assert on == (name in names and tokens == 1), (name, tokens)
    assert _lowered(cfg, kernels, tokens).count("@blink_gemv") == cfg.num_layers * per_layer


def test_cuda_gemv_hands_the_qkv_partial_sums_to_the_pallas_prepare():
  # With the Pallas norm kernels the prepare kernel adds them up: no XLA sum in between.
  cfg = get_config("gemma3-270m")
  kernels = step_kernels(cfg, _options("pallas", "pallas", gemv="qkv"), 1, interpret=False)
  assert kernels.qkv_matmul.func is cuda_gemv.partials
  assert kernels.gate_up_matmul is None


def test_cuda_gemv_output_and_down_need_the_pallas_add_norm():
  # Their partial sums are added up by the add + norm kernel; with the reference norms only
  # the q/k/v and gate/up projections (added up by XLA) take the GEMV.
  cfg = get_config("gemma3-270m")
  kernels = step_kernels(cfg, _options("pallas", "reference", gemv="qkv+out+down+gate_up"), 1,
                         interpret=False)
  assert kernels.qkv_matmul.func is cuda_gemv.matmul
  assert kernels.gate_up_matmul.func is cuda_gemv.matmul
  assert kernels.out_project is None and kernels.ffw_down is not cuda_gemv.ffw_down


def test_cuda_gemv_interpreted_off_the_gpu():
  # A CPU step given GEMV projections runs the jnp stand-in (use_kernel=False).
  cfg = get_config("gemma3-270m")
  kernels = step_kernels(cfg, _options("pallas", "pallas", gemv="qkv"), 1, interpret=True)
  assert kernels.qkv_matmul.keywords == {"use_kernel": False}
