"""Capacity sized like vLLM's: max_seqs and kv_pages by platform, the KV pages a GPU's memory
holds (`kv_pages_for_memory`), the startup line that says why, and the engine's wiring of
the device's figures (stubbed: these run on the CPU)."""
from __future__ import annotations

import dataclasses
import logging
import types

import jax.numpy as jnp
import pytest

from blink_jax.engine_config import DeviceMemory, EngineConfig, kv_pages_for_memory

GiB, MiB = 1 << 30, 1 << 20
# A GPU with 100 GiB usable, 2 GiB of weights, 1.5 GiB of workspace and 1 MiB pages.
MEM = DeviceMemory(bytes_limit=100 * GiB, bytes_in_use=2 * GiB,
                   workspace_bytes=3 * GiB // 2, page_bytes=MiB)


def pages(fraction=0.5, max_seqs=256, max_context=4096, page_size=16, prefix_caching=False,
          **kw):
  return kv_pages_for_memory(**{**dataclasses.asdict(MEM), **kw}, fraction=fraction,
                             max_seqs=max_seqs, max_context=max_context, page_size=page_size,
                             prefix_caching=prefix_caching)


def test_pages_are_what_the_fraction_leaves_after_weights_and_workspace():
  # 50 GiB - 2 - 1.5 = 46.5 GiB of 1 MiB pages; 256 x 4096 tokens could use 65,536.
  assert pages(0.5) == 47_616
  assert pages(0.25) == 25 * 1024 - 3584


def test_pages_are_capped_at_max_context_for_every_sequence():
  assert pages(0.9) == 256 * 4096 // 16  # 88,576 would fit
  assert pages(0.9, max_seqs=8, max_context=100) == 8 * 7  # a partial page counts whole


def test_with_prefix_caching_the_pages_past_the_cap_keep_prefixes():
  """The cache keeps finished requests' pages for later hits: all the room is used, as in
  vLLM, not only what the running sequences could fill."""
  assert pages(0.9, prefix_caching=True) == 88_576
  assert pages(0.5, prefix_caching=True) == pages(0.5) == 47_616  # under the cap: the same
  # A small model's cache: at most PREFIX_CACHE_PAGES_FACTOR times what its sequences use.
  assert pages(0.9, max_seqs=8, max_context=100, prefix_caching=True) == 8 * 7 * 8


def test_pages_round_down_to_whole_pages_and_bytes():
  small = dict(bytes_limit=10_001, bytes_in_use=1000, workspace_bytes=999)
  # int(10_001 * 0.5) = 5000; 5000 - 1999 = 3001 bytes
  assert pages(0.5, max_seqs=8, max_context=64, page_size=16, page_bytes=100, **small) == 30
  assert pages(0.5, max_seqs=8, max_context=16, page_size=16, page_bytes=3001, **small) == 1
  with pytest.raises(ValueError, match="leaves 0 pages of 3002 bytes"):
    pages(0.5, max_seqs=8, max_context=16, page_size=16, page_bytes=3002, **small)


def test_too_little_memory_for_one_max_context_names_the_figures():
  # 0.0364 of 100 GiB = 3.64 GiB; less 3.5 GiB leaves 143 pages, 4096 tokens need 256.
  with pytest.raises(ValueError) as e:
    pages(0.0364)
  msg = str(e.value)
  for part in ("kv_cache_memory_fraction 0.0364 of 100.0 GiB", "less 2.0 GiB in use",
               "1.5 GiB of step workspace", "leaves 143 pages of 1048576 bytes",
               "max_context=4096 needs 256 (0.2 GiB)"):
    assert part in msg, (part, msg)
  with pytest.raises(ValueError, match="leaves 0 pages"):  # the weights alone overflow
    pages(1.0, bytes_in_use=101 * GiB)


@pytest.mark.parametrize("f", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.5"])
def test_bad_memory_fraction_is_refused(f):
  with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
    EngineConfig(kv_cache_memory_fraction=f)


def test_resolution_by_platform():
  gpu = EngineConfig().resolved(model_max_context=32768, platform="gpu")
  assert (gpu.max_seqs, gpu.kv_pages, gpu.kv_cache_memory_fraction, gpu.buckets) == (
      256, None, 0.9, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))  # kv_pages: sized
  cpu = EngineConfig().resolved(model_max_context=32768, platform="cpu")
  assert (cpu.max_seqs, cpu.kv_pages, cpu.kv_cache_memory_fraction, cpu.buckets) == (
      8, 8 * 4096 // 16, None, (1, 2, 4, 8, 16, 32, 64, 256))
  asked = EngineConfig(max_seqs=300, kv_cache_memory_fraction=0.5).resolved(32768, "gpu")
  assert (asked.max_seqs, asked.kv_cache_memory_fraction, asked.buckets[-1]) == (300, 0.5, 4096)
  many = EngineConfig(max_seqs=5000).resolved(32768, "gpu")
  assert many.max_num_batched_tokens == 5000  # a decode row for every sequence
  given = EngineConfig(kv_pages=100).resolved(32768, "gpu")
  assert (given.kv_pages, given.kv_cache_memory_fraction) == (100, None)
  assert EngineConfig().max_seqs_on("gpu") == 256 and EngineConfig().max_seqs_on("cpu") == 8
  assert EngineConfig(max_seqs=3).max_seqs_on("gpu") == 3


def test_the_startup_line_says_what_was_chosen_and_why():
  cpu = EngineConfig().resolved(32768, "cpu").describe()
  assert cpu.startswith("capacity: 8 sequences, 2048 KV pages (max_context worth per "
                        "sequence); max_seqs=8, kv_pages=2048, "), cpu
  given = EngineConfig(kv_pages=100).resolved(32768, "gpu").describe()
  assert given.startswith("capacity: 256 sequences, 100 KV pages (set by kv_pages); "), given
  gpu = dataclasses.replace(EngineConfig(kv_cache_memory_fraction=0.5).resolved(32768, "gpu"),
                            kv_pages=47_616)
  assert gpu.describe(MEM).startswith(
      "capacity: 256 sequences, 47616 KV pages (0.5 of 100.0 GiB: weights 2.0 GiB, "
      "workspace 1.5 GiB, 46.5 GiB of KV); max_seqs=256, kv_pages=47616, "
      "kv_cache_memory_fraction=0.5, "), gpu.describe(MEM)
  capped = dataclasses.replace(EngineConfig(prefix_caching=False).resolved(32768, "gpu"),
                               kv_pages=65_536)
  assert capped.describe(MEM).startswith(
      "capacity: 256 sequences, 65536 KV pages (0.9 of 100.0 GiB: weights 2.0 GiB, "
      "workspace 1.5 GiB, 64.0 GiB of KV; capped at max_context worth per sequence, room "
      "for 88576); "), capped.describe(MEM)
  small = dataclasses.replace(EngineConfig(max_context=256).resolved(32768, "gpu"),
                              kv_pages=32_768)
  assert "; capped at 8x max_context worth per sequence, room for 88576; 28672 past " \
         "max_context worth per sequence keep prefixes); " in small.describe(MEM), \
         small.describe(MEM)
  kept = dataclasses.replace(EngineConfig().resolved(32768, "gpu"), kv_pages=88_576)
  assert kept.describe(MEM).startswith(
      "capacity: 256 sequences, 88576 KV pages (0.9 of 100.0 GiB: weights 2.0 GiB, "
      "workspace 1.5 GiB, 86.5 GiB of KV; 23040 past max_context worth per sequence keep "
      "prefixes); "), kept.describe(MEM)
  assert not EngineConfig().describe().startswith("capacity")  # unresolved: nothing chosen


# ---- the engine's and the executor's side, stubbed (no GPU here) ----

class _Executor:
  workspace_bytes, page_bytes, ring_bytes = MEM.workspace_bytes, MEM.page_bytes, 0
  max_pages = None

  def __init__(self):
    self.sched = types.SimpleNamespace(num_pages=256 * 256)

  def set_num_pages(self, n):
    self.sched = types.SimpleNamespace(num_pages=n)


def _engine(stats, **config):
  from blink_jax.engine import Engine
  eng = types.SimpleNamespace(
      config=EngineConfig(**config).resolved(32768, "gpu"), executor=_Executor(),
      device=types.SimpleNamespace(memory_stats=lambda: stats))
  return Engine, eng


def test_the_fraction_is_of_the_device_as_far_as_xlas_pool_holds():
  """vLLM's --gpu-memory-utilization is a share of the device; XLA's pool (bytes_limit) may
  be a smaller share of it (JAX's default 0.75), and then bounds what the cache gets."""
  pool = dict(bytes_limit=75 * GiB, device_bytes=100 * GiB)
  assert pages(0.5, **pool) == pages(0.5) == 47_616  # 50 GiB of the device: inside the pool
  assert pages(0.9, prefix_caching=True, **pool) == 75 * 1024 - 3584  # the pool binds
  at = dataclasses.replace(EngineConfig().resolved(32768, "gpu"), kv_pages=73_216)
  line = at.describe(dataclasses.replace(MEM, **pool))
  assert line.startswith("capacity: 256 sequences, 73216 KV pages (0.9 of 100.0 GiB (XLA's "
                         "pool 75.0 GiB): weights 2.0 GiB, workspace 1.5 GiB, 71.5 GiB of "
                         "KV; "), line
  with pytest.raises(ValueError, match=r"0.0364 of 100.0 GiB \(XLA's pool 75.0 GiB\)"):
    pages(0.0364, **pool)


def test_the_engine_makes_xlas_pool_the_fraction_of_the_device(monkeypatch):
  """Before JAX starts on a GPU the engine sets XLA_PYTHON_CLIENT_MEM_FRACTION to the
  config's fraction, unless the user set it; after, it leaves the pool as it is."""
  from blink_jax import env
  from blink_jax.executor import xla_flags
  monkeypatch.setenv(env.MEM_FRACTION, "x")
  monkeypatch.delenv(env.MEM_FRACTION)  # restored to unset after the test
  started, plugin = [False], [True]
  monkeypatch.setattr(xla_flags, "backend_started", lambda: started[0])
  monkeypatch.setattr(xla_flags, "cuda_plugin_installed", lambda: plugin[0])
  plugin[0] = False  # a CPU: nothing to size
  assert xla_flags.configure_memory_pool(0.9) == 0.75 and env.get(env.MEM_FRACTION) is None
  plugin[0], started[0] = True, True  # too late: JAX's default pool
  assert xla_flags.configure_memory_pool(0.9) == 0.75 and env.get(env.MEM_FRACTION) is None
  started[0] = False
  assert xla_flags.configure_memory_pool(0.9) == 0.9 and env.get(env.MEM_FRACTION) == "0.9"
  assert xla_flags.configure_memory_pool(0.5) == 0.9  # set already: left alone
  monkeypatch.setenv(env.MEM_FRACTION, "0.95")  # the user's
  assert xla_flags.configure_memory_pool(0.9) == 0.95 and env.get(env.MEM_FRACTION) == "0.95"
  for bad in ("abc", "0", "-1", "nan"):
    monkeypatch.setenv(env.MEM_FRACTION, bad)
    assert xla_flags.pool_fraction() == 0.75


def test_the_engine_sizes_the_cache_from_the_devices_figures(monkeypatch):
  from blink_jax import env
  monkeypatch.setenv(env.MEM_FRACTION, "1")  # the pool is the whole device
  Engine, eng = _engine({"bytes_limit": 100 * GiB, "bytes_in_use": 2 * GiB, "peak": 1},
                        kv_cache_memory_fraction=0.5)
  assert Engine._size_kv_cache(eng) == dataclasses.replace(MEM, device_bytes=100 * GiB)
  assert eng.config.kv_pages == eng.sched.num_pages == eng.executor.sched.num_pages == 47_616
  monkeypatch.delenv(env.MEM_FRACTION)  # JAX's default: the pool is 0.75 of the device
  Engine, eng = _engine({"bytes_limit": 75 * GiB, "bytes_in_use": 2 * GiB},
                        kv_cache_memory_fraction=0.5)
  assert Engine._size_kv_cache(eng).device_bytes == 100 * GiB
  assert eng.config.kv_pages == 47_616  # half the device, not half the pool
  Engine, eng = _engine(None)
  with pytest.raises(ValueError, match="reports no memory figures.*set kv_pages"):
    Engine._size_kv_cache(eng)


def test_a_layers_cache_stays_within_32_bit_offsets(monkeypatch):
  """The pages are capped where a layer's kv_pages array would pass 2**31 elements, which
  the Pallas kernels cannot address; the startup line names that bound."""
  from blink_jax.model.config import get_config
  from blink_jax.model.gemma import max_kv_pages
  small = get_config("gemma3-270m")
  assert max_kv_pages(small, 16) == (2**31 - 1) // (16 * 2 * 1 * 256) == 262_143
  assert max_kv_pages(get_config("gemma3-27b"), 16) == 32_767
  assert pages(0.9, prefix_caching=True, max_pages=50_000) == 50_000
  assert pages(0.9, prefix_caching=False, max_pages=70_000) == 65_536  # the other cap first
  with pytest.raises(ValueError, match="max_context=4096 needs 256 KV pages, more than the 255"):
    pages(0.9, max_pages=255)
  from blink_jax import env
  monkeypatch.setenv(env.MEM_FRACTION, "1")
  Engine, eng = _engine({"bytes_limit": 100 * GiB, "bytes_in_use": 2 * GiB})
  eng.executor.max_pages = 50_000
  memory = Engine._size_kv_cache(eng)
  assert eng.config.kv_pages == eng.executor.sched.num_pages == 50_000
  assert "(0.9 of 100.0 GiB: weights 2.0 GiB, workspace 1.5 GiB, 48.8 GiB of KV; capped at " \
         "the most a layer's cache indexes with 32-bit offsets, room for 88576)" \
         in eng.config.describe(memory), eng.config.describe(memory)


def test_the_compiled_loop_is_checked_against_the_workspace(caplog):
  from blink_jax.engine import Engine
  for temp, level, text in ((2 * GiB, logging.WARNING, "more than the 1.50 GiB"),
                            (GiB, logging.INFO, "1.00 GiB of the 1.50 GiB workspace")):
    eng = types.SimpleNamespace(compiled=types.SimpleNamespace(
        memory_analysis=lambda t=temp: types.SimpleNamespace(temp_size_in_bytes=t)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="blink_jax.engine"):
      Engine._check_workspace(eng, MEM)
    assert [(r.levelno, text in r.getMessage()) for r in caplog.records] == [(level, True)]


def test_page_bytes_are_what_the_cache_allocates():
  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.model.gemma import init_kv_cache, kv_page_bytes
  cfg = tiny_config("gemma3")
  cache = init_kv_cache(cfg, 3, 4, jnp.float32)
  assert kv_page_bytes(cfg, 4, jnp.float32) * 3 == sum(x.nbytes for x in cache)
  # Gemma 3 1B in bf16: 26 layers x 16 tokens x K and V x 1 head x 256 x 2 bytes (416 KiB).
  assert kv_page_bytes(get_config("gemma3-1b"), 16, jnp.bfloat16) == 425_984


@pytest.mark.parametrize("budget,max_seqs,gib", [
    (256, 256, 1.5), (4096, 256, 2.5), (4096, 1024, 4.5), (300, 8, 1.671875)])
def test_the_workspace_reserve_of_the_1b_shape(budget, max_seqs, gib):
  """Four float32 [rows, vocab] arrays: the samples' or a piece of the prompt-logprob rows
  (at most 512 of them at once), whichever is more, never more than the step's budget."""
  from blink_jax.executor.loop import Executor
  ex = types.SimpleNamespace(sched=types.SimpleNamespace(token_budget=budget,
                                                         max_seqs=max_seqs),
                             cfg=types.SimpleNamespace(vocab_size=262_144))
  ex.logit_rows = Executor.logit_rows.fget(ex)
  assert Executor.workspace_bytes.fget(ex) == int(gib * GiB)


def test_kv_pages_past_the_bound_are_refused_before_anything_is_allocated():
  from flax import nnx

  from blink_jax import Engine
  from blink_jax.model.config import tiny_config
  from blink_jax.model.gemma import Gemma, max_kv_pages
  cfg = tiny_config("gemma3", vocab_size=64)
  bound = max_kv_pages(cfg, 4)
  model = Gemma(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=f"kv_pages {bound + 1} exceeds {bound}, the most pages"):
    Engine(model, None, max_seqs=2, page_size=4, max_context=32, num_slots=4,
           kv_pages=bound + 1)


def test_from_checkpoint_sizes_the_pool_from_its_config_before_jax_starts(monkeypatch):
  """The config (validated first) gives the pool its share: the fraction asked for, or the
  GPU default."""
  from blink_jax.engine import engine as engine_mod
  seen = []

  class Stop(Exception):
    pass

  def configure(fraction):
    seen.append(fraction)
    raise Stop

  monkeypatch.setattr(engine_mod, "configure_memory_pool", configure)
  for kw, want in (({"kv_cache_memory_fraction": 0.6}, 0.6), ({}, 0.9)):
    with pytest.raises(Stop):
      engine_mod.Engine.from_checkpoint("random:gemma3-270m", **kw)
    assert seen.pop() == want
  with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
    engine_mod.Engine.from_checkpoint("random:gemma3-270m", kv_cache_memory_fraction=2)
  assert not seen  # refused before anything was configured
