"""GPU: the serving loop on the device gives exactly the CPU's tokens (greedy, float32)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from blink_jax import Engine
from blink_jax import SamplingParams
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
from tests.cuda_lowering import gpus



pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpus(), reason="no CUDA GPU")]

KW = dict(max_seqs=4, page_size=4, max_context=128, num_slots=16, ring_capacity=16,
          buckets=(4, 16, 64), max_top_logprobs=3, idle_poll_us=50)


@pytest.mark.parametrize("mode,attention,norm", [
    ("persistent", "reference", "reference"), ("host", "reference", "reference"),
    ("persistent", "pallas", "reference"), ("host", "pallas", "reference"),
    ("persistent", "pallas", "pallas")])
def test_gpu_tokens_equal_cpu_tokens(mode, attention, norm):
  cfg = tiny_config("gemma3", vocab_size=512, num_layers=6)
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (1, 7, 30, 100, 5, 64)]
  sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
  outs = {}
  for dev in (jax.devices("cpu")[0], gpus()[0]):
    with jax.default_device(dev):
      model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    with Engine(model, None, mode=mode, device=dev, attention=attention, norm=norm,
                **KW) as eng:
      outs[dev.platform] = eng.generate(prompt_token_ids=prompts, sampling=sp)
      if dev.platform == "gpu" and mode == "persistent":
        print("loop report:", eng.loop_report)
        # XLA's op-by-op first execution happened before serving (the warm-up), and nothing
        # evicted the graph since, so the serving run is the CUDA graph with its WHILE node.
        # (Evidence comes from XLA's log: device_while is None when that log is off.)
        if eng.loop_report.get("device_while") is not None:
          assert eng.loop_report["device_while"] and eng.loop_report.get("warm_up")
          assert eng.loop_report["serving_run"] == "CUDA graph"
      assert eng.stats()["pages_in_use"] == 0
  for c, g in zip(outs["cpu"], outs["gpu"]):
    assert c.token_ids == g.token_ids
    # XLA runs float32 matmuls as TF32 on the GPU by default: logprobs agree to ~1e-3.
    np.testing.assert_allclose(c.logprobs, g.logprobs, atol=1e-2)


def _tiny_engine_tokens_on_cpu_and_gpu(model_seed: int, prompt_seed: int, **kernels) -> dict:
  """Greedy tokens of a 4-layer tiny model for three prompts (3, 30 and 100 tokens) through
  a Pallas engine on the CPU (Pallas' interpreter) and on the GPU (Triton)."""
  cfg = tiny_config("gemma3", vocab_size=512, num_layers=4)
  rng = np.random.default_rng(prompt_seed)
  prompts = [[int(t) for t in rng.integers(3, 512, n)] for n in (3, 30, 100)]
  sp = SamplingParams(max_tokens=12, ignore_eos=True)
  outs = {}
  for dev in (jax.devices("cpu")[0], gpus()[0]):
    with jax.default_device(dev):
      model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(model_seed))
    with Engine(model, None, device=dev, attention="pallas", norm="pallas", **kernels,
                **KW) as eng:
      outs[dev.platform] = [o.token_ids for o in eng.generate(prompt_token_ids=prompts,
                                                             sampling=sp)]
  return outs


def test_gpu_prefill_kernel_tokens_equal_cpu_tokens():
  # Steps above 4 tokens through the Pallas prefill kernel but for their first 2 rows, which
  # take the decode kernel (prefill="pallas" does this for steps above 64 with the default
  # decode_rows and decode_head=256), with the Pallas norm kernels.
  outs = _tiny_engine_tokens_on_cpu_and_gpu(model_seed=4, prompt_seed=2, prefill="pallas",
                                            decode_rows=4, decode_head=2)
  assert outs["cpu"] == outs["gpu"]


def test_gpu_gemv_partial_sums_tokens_equal_cpu_tokens():
  # Small steps through the CUDA GEMV for all four projections (its jnp stand-in on the
  # CPU), whose output and down partial sums the add + norm kernel adds up, and the q/k/v
  # ones the q/k prepare kernel.
  outs = _tiny_engine_tokens_on_cpu_and_gpu(model_seed=6, prompt_seed=5,
                                            gemv="qkv+out+down+gate_up")
  assert outs["cpu"] == outs["gpu"]


def test_gpu_sampling_reproduces_with_seed():
  cfg = tiny_config("gemma3", vocab_size=512)
  with jax.default_device(gpus()[0]):
    model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
  with Engine(model, None, **KW) as eng:
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    a = eng.generate(prompt_token_ids=[9, 8, 7], sampling=sp).token_ids
    b = eng.generate(prompt_token_ids=[[1, 2], [9, 8, 7], [3] * 40], sampling=sp)[1].token_ids
    assert a == b


def test_gpu_windowed_pages_tokens_equal_cpu_full_pages():
  # Windowed pages (docs/ARCHITECTURE.md, "Windowed pages") on the device, through the Pallas
  # attention and prefill kernels: the sliding-window layers read and write their per-lane
  # rings, the global layers skip local_only rows of a prefix hit (three prompts share 40
  # tokens); the CPU engine pages every layer in full.
  cfg = tiny_config("gemma3", vocab_size=512, num_layers=6)
  rng = np.random.default_rng(7)
  shared = [int(t) for t in rng.integers(3, 512, 40)]
  prompts = [shared + [int(t) for t in rng.integers(3, 512, n)] for n in (1, 9, 60)] + \
      [[int(t) for t in rng.integers(3, 512, 90)]]
  sp = SamplingParams(max_tokens=20, ignore_eos=True)
  outs = {}
  for dev, windowed in ((jax.devices("cpu")[0], False), (gpus()[0], True)):
    with jax.default_device(dev):
      model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(9))
    with Engine(model, None, device=dev, attention="pallas", prefill="pallas", decode_rows=4,
                decode_head=2, windowed_pages=windowed, **KW) as eng:
      assert (eng.executor.ring_pages > 0) == windowed
      outs[dev.platform] = [o.token_ids for o in eng.generate(prompt_token_ids=prompts,
                                                             sampling=sp)]
      assert eng.stats()["pages_in_use"] == 0
  assert outs["cpu"] == outs["gpu"]


def test_from_checkpoint_makes_xlas_pool_the_fraction_of_the_device(tmp_path):
  """In a fresh process (JAX not started) the engine makes XLA's pool the config's share of
  the GPU (vLLM's --gpu-memory-utilization; 0.9 by default, 0.15 here: this test process's
  own JAX holds 75 % of the GPU already) and sizes the KV cache from the device's memory,
  its temporaries within the reserve; the startup lines say so. nvidia-smi gives the
  device's memory independently."""
  import json
  import os
  import subprocess
  import sys
  total_mib = int(subprocess.run(
      ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
      capture_output=True, text=True, check=True).stdout.split()[0])
  code = (
      "import json, logging, sys, jax\n"
      "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
      "from blink_jax import Engine\n"
      "with Engine.from_checkpoint('random:gemma3-270m', max_seqs=4, max_context=256,"
      " num_slots=16, kv_cache_memory_fraction=0.15, compilation_cache_dir='') as eng:\n"
      "  print(json.dumps({'limit': jax.devices()[0].memory_stats()['bytes_limit'],"
      " 'pages': eng.config.kv_pages}))\n")
  environ = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**environ, "CUDA_VISIBLE_DEVICES": "0"}, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  share = got["limit"] / (total_mib << 20)
  print(f"XLA's pool {got['limit'] / 2**30:.1f} GiB = {share:.3f} of {total_mib} MiB; "
        f"{got['pages']} KV pages")
  assert 0.13 <= share <= 0.16, share
  assert "capacity: 4 sequences" in out.stderr and "(0.15 of " in out.stderr, \
      out.stderr[-3000:]
  # The loop's temporaries fit the reserve (the prompt logprobs in pieces), no warning.
  assert "the compiled loop's temporaries:" in out.stderr, out.stderr[-3000:]
