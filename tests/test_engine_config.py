"""The engine's one configuration: validation, keyword overrides, flags, resolution."""
from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from blink_jax.engine_config import EngineConfig, KernelOptions, define_flags, from_flags


def test_defaults_are_valid_and_frozen():
  c = EngineConfig()
  assert c.kernels == KernelOptions()
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.max_seqs = 3


@pytest.mark.parametrize("kw,match", [
    (dict(max_seqs=0), "max_seqs must be an integer >= 1"),
    (dict(max_seqs=True), "max_seqs must be an integer >= 1"),
    (dict(kv_pages=-1), "kv_pages must be an integer >= 1"),
    (dict(kv_cache_memory_fraction=0), "kv_cache_memory_fraction must be in"),
    (dict(mode="device"), "mode must be one of"),
    (dict(buckets=(8, 1)), "buckets must be increasing"),
    (dict(max_context=1), "max_context must be at least 2"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(gemv="qkv+lm_head"), "unknown projection"),
    (dict(decode_rows=0), "decode_rows must be an integer >= 1"),
])
def test_bad_values_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    EngineConfig.from_kwargs(**kw)


def test_unknown_option_is_refused():
  with pytest.raises(TypeError, match="unknown engine option"):
    EngineConfig.from_kwargs(max_seq=3)


def test_kernel_fields_at_the_top_level_go_to_kernel_options():
  c = EngineConfig.from_kwargs(max_seqs=16, attention="pallas", gemv="none")
  assert c.max_seqs == 16 and c.kernels == KernelOptions(attention="pallas", gemv="none")
  base = EngineConfig(kernels=KernelOptions(norm="reference"))
  assert EngineConfig.from_kwargs(base, prefill="pallas").kernels == KernelOptions(
      norm="reference", prefill="pallas")


def test_resolved_fills_model_and_device_defaults():
  c = EngineConfig(max_seqs=4).resolved(model_max_context=32768, platform="cpu")
  assert (c.max_context, c.kv_pages, c.buckets, c.warm_up, c.idle_poll_us) == (
      4096, 4096 // 16 * 4, (1, 2, 4, 8, 16, 32, 64, 256), False, 50_000)
  assert c.kernels == KernelOptions("blocked", "blocked", "reference", "none", decode_head=0)
  g = EngineConfig(max_context=100, page_size=16).resolved(128, "gpu")
  # kv_pages: sized by the engine from the GPU's memory (tests/test_capacity.py)
  assert (g.max_seqs, g.kv_pages, g.kv_cache_memory_fraction) == (256, None, 0.9)
  assert g.warm_up is True and g.idle_poll_us == 200
  assert g.buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
  assert (g.kernels.attention, g.kernels.prefill, g.kernels.norm, g.kernels.gemv) == (
      "pallas", "pallas", "pallas", "qkv+out+down")
  assert KernelOptions(gemv="down+qkv").resolved("cpu").gemv == "qkv+down"
  assert (c.kernels.decode_head, g.kernels.decode_head) == (0, 256)
  assert "max_seqs=4" in c.describe() and "kernels: attention=blocked" in c.describe()


def test_step_token_budget_and_its_buckets():
  """max_num_batched_tokens is the largest bucket; past 256 the default buckets double."""
  gpu = lambda **kw: EngineConfig(**kw).resolved(4096, "gpu")  # noqa: E731
  assert gpu().buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
  assert gpu().max_num_batched_tokens == 4096 and gpu(max_seqs=5000).max_num_batched_tokens == 5000
  assert gpu(max_num_batched_tokens=256).buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256)
  assert gpu(max_num_batched_tokens=3000).buckets == (
      1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3000)
  assert gpu(max_seqs=512, max_num_batched_tokens=512).buckets == (
      1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
  assert gpu(max_num_batched_tokens=8192).buckets == (
      1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
  # A budget whose doubling sizes would pass the scheduler's 16 grows 4x (8x ...) past 256.
  assert gpu(max_num_batched_tokens=1 << 20).buckets == (
      1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20)
  assert len(EngineConfig(buckets=tuple(range(1, 17))).buckets) == 16
  with pytest.raises(ValueError, match="at most 16 buckets"):
    EngineConfig(buckets=tuple(range(1, 18)))
  cpu = EngineConfig(max_num_batched_tokens=1000).resolved(4096, "cpu")
  assert cpu.buckets == (1, 2, 4, 8, 16, 32, 64, 256, 512, 1000)
  assert EngineConfig(max_num_batched_tokens=48).resolved(4096, "cpu").buckets == (
      1, 2, 4, 8, 16, 32, 48)
  # Given buckets: the budget is their largest.
  assert gpu(max_seqs=4, buckets=(4, 32)).max_num_batched_tokens == 32
  assert gpu(max_seqs=4, buckets=(4, 32), max_num_batched_tokens=32).buckets == (4, 32)
  with pytest.raises(ValueError, match="max_num_batched_tokens .*largest bucket"):
    EngineConfig(buckets=(4, 32), max_num_batched_tokens=64)
  with pytest.raises(ValueError, match="must hold a decode row for each of max_seqs"):
    gpu(max_num_batched_tokens=128)  # 256 sequences on a GPU
  with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
    EngineConfig(max_num_batched_tokens=0)


def test_one_flag_per_field_and_back():
  fv = flags.FlagValues()
  define_flags(fv)
  for cls in (EngineConfig, KernelOptions):
    for f in dataclasses.fields(cls):
      if f.name != "kernels":
        assert f.name in fv, f.name
  assert fv["kv_cache_memory_fraction"].flag_type() == "float"
  fv(["prog", "--max_seqs=16", "--warm_up", "--gemv=none", "--attention=reference",
      "--buckets=1,8,32", "--mode=host", "--kv_cache_memory_fraction", "0.5"])
  c = from_flags(fv)
  assert c == EngineConfig(max_seqs=16, warm_up=True, buckets=(1, 8, 32), mode="host",
                           kv_cache_memory_fraction=0.5,
                           kernels=KernelOptions(attention="reference", gemv="none"))
  unset = flags.FlagValues()
  define_flags(unset)
  unset(["prog"])
  assert from_flags(unset) == EngineConfig()
  assert (from_flags(unset).max_seqs, from_flags(unset).kv_cache_memory_fraction) == (None, None)
  bad = flags.FlagValues()
  define_flags(bad)
  bad(["prog", "--kv_cache_memory_fraction=1.5"])
  with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"):
    from_flags(bad)


def test_decode_head_defaults_to_max_seqs_where_both_attention_kernels_are_pallas():
  # A step's decode rows (one per decoding sequence, at most max_seqs) go first; by default
  # they all take the decode kernel (docs/PERFORMANCE.md, "Decode rows in mixed steps").
  assert KernelOptions().resolved("gpu").decode_head == 256
  assert KernelOptions().resolved("gpu", max_seqs=512).decode_head == 512
  assert EngineConfig(max_seqs=100).resolved(4096, "gpu").kernels.decode_head == 100
  # Asked for, kept; no split without both Pallas kernels.
  assert KernelOptions(decode_head=0).resolved("gpu", max_seqs=512).decode_head == 0
  assert KernelOptions(decode_head=7).resolved("cpu").decode_head == 7
  assert KernelOptions().resolved("cpu").decode_head == 0
  assert KernelOptions(prefill="reference").resolved("gpu").decode_head == 0
  assert KernelOptions(attention="pallas", prefill="pallas").resolved("cpu", 8).decode_head == 8
  # The executor's fallback to the reference attention drops the split it no longer runs.
  gpu = KernelOptions().resolved("gpu")
  assert gpu.without_pallas(("attention",)).decode_head == 0
  assert gpu.without_pallas(("norm",)).decode_head == 256
  with pytest.raises(ValueError, match="decode_head"):
    KernelOptions(decode_head=-1)
