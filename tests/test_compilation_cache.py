"""The mailbox at a fixed address and JAX's compilation cache: a restarted engine loads its
loop instead of compiling it (docs/ARCHITECTURE.md, "Compilation cache")."""
from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from blink_jax.client import mapping, shm
from blink_jax.engine_config import EngineConfig, default_compilation_cache_dir
from blink_jax.executor import compilation_cache

# A free address of this test's own (the engine's is MAILBOX_ADDRESS).
ADDRESS = mapping.MAILBOX_ADDRESS + (1 << 40)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_FIXED_NOREPLACE")


@linux
def test_memory_maps_at_a_free_address_and_elsewhere_when_it_is_taken():
  first = mapping.map_memory(10_000, address=ADDRESS)
  assert first.ctypes.data == ADDRESS and first.size == mapping.page_bytes(10_000)
  first[:3] = (1, 2, 3)
  assert mapping.map_at(ADDRESS, 4096) is None  # taken: never replaced
  second = mapping.map_memory(4096, address=ADDRESS)
  assert second.ctypes.data != ADDRESS and (second == 0).all()
  assert first[:3].tolist() == [1, 2, 3]
  view = first[1:]
  del first
  gc.collect()
  assert view[:2].tolist() == [2, 3]  # a view keeps the mapping
  del view
  gc.collect()
  again = mapping.map_at(ADDRESS, 4096)  # the last view gone, the address is free again
  assert again is not None and (again == 0).all()


@linux
def test_shared_memory_maps_at_the_address_and_frontends_see_it():
  region = shm.create_region(None, 5000, ADDRESS)
  try:
    assert region.address == ADDRESS and region.buf.size == 5000
    region.write(8, b"\x07\x00\x00\x00")
    other = shm.open_region(region.name)
    assert other.read(8, 4) == b"\x07\x00\x00\x00" and other.buf.size == 5000
    other.close()
  finally:
    region.close()
    region.unlink()
  gc.collect()


def test_defaults_and_validation():
  assert default_compilation_cache_dir().endswith("/.cache/blink-jax/xla")
  for platform in ("cpu", "gpu"):
    assert EngineConfig().resolved(512, platform).compilation_cache_dir \
        == default_compilation_cache_dir()
  assert EngineConfig(compilation_cache_dir="").resolved(512, "gpu").compilation_cache_dir == ""
  assert EngineConfig(compilation_cache_dir="/x").resolved(512, "cpu").compilation_cache_dir \
      == "/x"
  with pytest.raises(ValueError, match="compilation_cache_dir"):
    EngineConfig(compilation_cache_dir=3)


def test_enable_keeps_a_folder_the_process_has(tmp_path):
  import jax
  before = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert compilation_cache.enable("") is None
    assert compilation_cache.enable(str(tmp_path / "a")) == str(tmp_path / "a")
    assert (tmp_path / "a").is_dir()
    assert compilation_cache.enable(str(tmp_path / "b")) == str(tmp_path / "a")
    jax.config.update("jax_compilation_cache_dir", None)
    (tmp_path / "file").write_text("")
    assert compilation_cache.enable(str(tmp_path / "file" / "c")) is None  # not a folder
    assert not jax.config.jax_compilation_cache_dir
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def test_loop_report_is_kept_by_program(tmp_path):
  key = compilation_cache.program_key("module @a", "cpu:0")
  assert key != compilation_cache.program_key("module @b", "cpu:0")
  assert compilation_cache.load_report(str(tmp_path), key) is None
  compilation_cache.save_report(str(tmp_path), key, {"device_while": True, "loop": "while.3"})
  back = compilation_cache.load_report(str(tmp_path), key)
  assert back["device_while"] is True and back["loop"] == "while.3" and "cache" in back["compiled"]


ENGINE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
hits = []
class Hits(logging.Handler):
  def emit(self, record):
    if "cache hit" in record.getMessage().lower():
      hits.append(record.getMessage())
for name in ("jax._src.compiler", "jax._src.compilation_cache"):
  logging.getLogger(name).setLevel(logging.DEBUG)
  logging.getLogger(name).addHandler(Hits())
import jax.numpy as jnp
from flax import nnx
from blink_jax import Engine, SamplingParams
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
model = Gemma(tiny_config("gemma3", vocab_size=64), dtype=jnp.float32, rngs=nnx.Rngs(0))
with Engine(model, None, max_seqs=2, page_size=4, max_context=32, num_slots=8, ring_capacity=8,
            buckets=(2, 8), max_top_logprobs=0, compilation_cache_dir=sys.argv[1]) as e:
  out = e.generate(prompt_token_ids=[[1, 2, 3]], sampling=SamplingParams(max_tokens=4))
  tokens = out[0].token_ids
  print(json.dumps({"mailbox": e.sched.mailbox, "loop_hits": [h for h in hits if "loop" in h],
                    "tokens": list(tokens)}))
"""


@linux
def test_a_restarted_engine_loads_its_loop_from_the_cache(tmp_path):
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", ENGINE, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  assert runs[0]["mailbox"] == runs[1]["mailbox"] == mapping.MAILBOX_ADDRESS
  assert not runs[0]["loop_hits"] and runs[1]["loop_hits"], runs
  assert runs[0]["tokens"] == runs[1]["tokens"]
  assert len(list((tmp_path / "cache").glob("jit__loop_fn-*"))) == 1
