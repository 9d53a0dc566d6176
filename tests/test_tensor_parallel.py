"""Tensor parallelism (docs/ARCHITECTURE.md, "Tensor parallelism (design)"): the ragged paged
step with its weights and KV cache split over 2 and 4 host devices gives the single-device
step's hidden states, logits and cache contents; the engine's persistent loop over them (one
leader scheduling) gives the single-device engine's greedy tokens under arrivals while steps
run, cancellations and preemption. XLA's CPU backend makes several devices only when told
before JAX starts, so each check runs in a fresh interpreter. The bundled 270M split over 2
devices gives the single-device engine's greedy tokens too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink_jax.model.config import tiny_config
from blink_jax.model.tensor_parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[1]


def check_split_step_equals_single_device(n: int) -> None:
  """Two steps (two prompts' prefill, then a decode row each, reading the cache the first
  step wrote) of the tiny Gemma 3 (4 query heads, 2 KV heads), alone and split n ways."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh

  from blink_jax.model.gemma import Gemma, init_kv_cache

  assert len(jax.devices()) >= n, jax.devices()
  cfg = tiny_config("gemma3", vocab_size=512)
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
  tp = TensorParallel(cfg, n)
  mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
  params = tp.place(mesh, model.to_params())
  step = jax.jit(tp.forward(mesh, dtype=jnp.float32))
  logits = jax.jit(step.logits)
  ref_step = jax.jit(model.forward)

  rng = np.random.default_rng(2)
  lens = (11, 6)
  page_table = jnp.array([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
  steps = [  # (tokens, positions, seq_ids)
      (np.concatenate([rng.integers(3, 512, k) for k in lens]),
       np.concatenate([np.arange(k) for k in lens]),
       np.concatenate([np.full(k, s) for s, k in enumerate(lens)])),
      (rng.integers(3, 512, 2), np.array(lens), np.array([0, 1]))]
  kv_ref = init_kv_cache(cfg, 8, 4, jnp.float32)
  kv_tp = tp.init_kv_cache(mesh, 8, 4, jnp.float32)
  for tokens, positions, seq_ids in steps:
    args = [jnp.asarray(a, jnp.int32) for a in (tokens, positions, seq_ids)]
    h_ref, kv_ref = ref_step(*args, page_table, kv_ref)
    h_tp, kv_tp = step(params, *args, page_table, kv_tp)
    np.testing.assert_allclose(h_tp, h_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(logits(params, h_tp), model.logits(h_ref), rtol=2e-5, atol=2e-4)
  # Device d's cache holds its KV heads: head d * K // n of the model's (keys, then values).
  k_heads, h = cfg.num_kv_heads, cfg.head_dim
  local = tp.kv_heads // n
  for ref, split in zip(kv_ref, kv_tp):
    ref = np.asarray(ref).reshape(8, 4, 2, k_heads, h)
    split = np.asarray(split).reshape(8, 4, n, 2, local, h)
    for d in range(n):
      heads = [(d * local + j) * k_heads // tp.kv_heads for j in range(local)]
      np.testing.assert_allclose(split[:, :, d], ref[:, :, :, heads], rtol=2e-5, atol=2e-5)


def check_engine_tokens_equal_single_device(n: int) -> dict:
  """Requests arriving from threads while steps run, more than the lanes and the pages hold
  (preemption), beside a frontend client that submits long requests and cancels them
  mid-step: every finished request's greedy tokens are the single-device engine's, the
  cancelled ones end cancelled, and every page comes back. Returns the split engine's loop
  report."""
  import threading
  import time

  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from blink_jax import Engine, SamplingParams
  from blink_jax.client import mailbox as M
  from blink_jax.client import protocol as PR
  from blink_jax.model.gemma import Gemma

  cfg = tiny_config("gemma3", vocab_size=512)
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
  kw = dict(max_seqs=4, page_size=4, max_context=96, num_slots=16, ring_capacity=16,
            buckets=(4, 16, 32), max_top_logprobs=0, idle_poll_us=100, kv_pages=24)
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(3, 512, k)] for k in (1, 7, 30, 60, 5, 44, 13, 2)]
  sp = SamplingParams(max_tokens=16, ignore_eos=True)
  with Engine(model, None, **kw) as eng:
    want = [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling=sp)]

  with Engine(model, None, tensor_parallel=n, frontend_workers=1, warm_up=True, **kw) as eng:
    client = M.MailboxClient(eng.region, 0, 2)  # a frontend worker beside generate()
    got, cancelled = {}, []

    def caller(i):
      time.sleep(0.05 * i)  # arrivals while earlier requests run
      got[i] = eng.generate(prompt_token_ids=prompts[i], sampling=sp).token_ids

    def frontend():
      for k in range(3):
        slot = client.submit(M.Request(prompt=[int(t) for t in rng.integers(3, 512, 20)],
                                       max_tokens=60, ignore_eos=True))
        time.sleep(0.1 + 0.05 * k)
        client.cancel(slot)
        deadline = time.monotonic() + 60
        while (out := client.poll(slot)).finish_reason == PR.Finish.NONE:
          assert time.monotonic() < deadline, "cancel not finished"
          time.sleep(0.01)
        cancelled.append(out.finish_reason)
        client.release(slot)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=frontend))
    for t in threads:
      t.start()
    for t in threads:
      t.join(300)
      assert not t.is_alive(), "hung"
    stats, report = eng.stats(), eng.loop_report
  assert [got[i] for i in range(len(prompts))] == want
  assert cancelled and all(r in (PR.Finish.CANCELLED, PR.Finish.LENGTH) for r in cancelled)
  assert PR.Finish.CANCELLED in cancelled
  assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0
  return report


def check_donated_model_is_freed_once_split(n: int) -> None:
  """A donated model split n ways: the engine holds only the shards, so the model's arrays
  that were split (every one the fused copies replace among them) are deleted; the tokens
  are the single-device engine's."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from blink_jax import Engine, SamplingParams
  from blink_jax.model.gemma import Block, Gemma

  cfg = tiny_config("gemma3", vocab_size=512)
  kw = dict(max_seqs=2, page_size=4, max_context=48, num_slots=4, buckets=(2, 16),
            max_top_logprobs=0, kv_pages=24)
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  prompt = [7, 300, 41, 9, 122]
  with Engine(Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3)), None, **kw) as eng:
    want = eng.generate(prompt_token_ids=prompt, sampling=sp).token_ids
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
  with Engine(model, None, tensor_parallel=n, donate_model=True, **kw) as eng:
    got = eng.generate(prompt_token_ids=prompt, sampling=sp).token_ids
  assert got == want
  paths = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  for path, a in paths:
    names = tuple(str(getattr(k, "key", k)) for k in path[:-1])
    if names[-2:] in Block.FUSED_AWAY or names[-1] in ("o", "down", "embed"):
      assert a.is_deleted(), names


def check_bundled_gemma_tokens_equal_single_device(n: int, path: str) -> None:
  """The bundled Gemma 3 270M (4 query heads, 1 KV head, 262k vocabulary) split n ways:
  the single-device engine's greedy tokens (those equal transformers', test_engine_gemma)."""
  import jax.numpy as jnp

  from blink_jax import Engine, SamplingParams
  from blink_jax.model.gemma import Gemma
  from blink_jax.weights import checkpoint as ckpt

  cfg, params = ckpt.load_checkpoint(Path(path), dtype=jnp.float32)
  tok = ckpt.load_tokenizer(Path(path))
  model = Gemma.from_params(cfg, params, dtype=jnp.float32)
  prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
  sp = SamplingParams(max_tokens=8, ignore_eos=True)
  outs = []
  for tp in (1, n):
    with Engine(model, tok, tensor_parallel=tp, max_seqs=4, page_size=16, max_context=128,
                num_slots=8, buckets=(4, 32), max_top_logprobs=0) as eng:
      outs.append([o.token_ids for o in eng.generate(prompts, sp)])
  assert outs[0] == outs[1], outs


def _in_interpreter_with_devices(n: int, check: str, *args: str) -> None:
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
         "JAX_PLATFORMS": "cpu"}
  code = f"from tests.test_tensor_parallel import {check} as c; c({n}, *{list(args)!r})"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.parametrize("n", [2, 4])
def test_split_step_equals_single_device(n):
  _in_interpreter_with_devices(n, "check_split_step_equals_single_device")


@pytest.mark.parametrize("n", [2, 4])
def test_engine_tokens_equal_single_device(n):
  _in_interpreter_with_devices(n, "check_engine_tokens_equal_single_device")


def test_donated_model_is_freed_once_split():
  _in_interpreter_with_devices(2, "check_donated_model_is_freed_once_split")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_engine_tokens_equal_single_device_on_gpus(n):
  """The same on n GPUs of one host (NCCL collectives inside the loop), which must still be
  one device WHILE node."""
  from tests.cuda_lowering import gpus
  if len(gpus()) < n:
    pytest.skip(f"{n} CUDA GPUs needed, {len(gpus())} here")
  report = check_engine_tokens_equal_single_device(n)
  assert report["device_while"], report


@pytest.mark.slow
def test_bundled_gemma_tokens_equal_single_device(gemma_dir):
  _in_interpreter_with_devices(2, "check_bundled_gemma_tokens_equal_single_device",
                               str(gemma_dir))


def test_tensor_parallel_needs_the_devices_and_the_persistent_loop():
  from blink_jax.engine_config import EngineConfig
  with pytest.raises(ValueError, match="persistent loop only"):
    EngineConfig(tensor_parallel=2, mode="host")
  with pytest.raises(ValueError, match="tensor_parallel must be an integer >= 1"):
    EngineConfig(tensor_parallel=0)
  import jax
  import jax.numpy as jnp
  from blink_jax import Engine
  from blink_jax.model.gemma import Gemma
  model = Gemma(tiny_config("gemma3"), dtype=jnp.float32)
  n = len(jax.devices("cpu")) + 1
  with pytest.raises(ValueError, match=f"tensor_parallel={n} needs that many cpu devices"):
    Engine(model, None, tensor_parallel=n, max_seqs=2, max_context=32, kv_pages=16,
           device=jax.devices("cpu")[0])


def test_a_shape_that_does_not_split_names_its_sizes():
  with pytest.raises(ValueError, match="num_heads 4.*not divisible by 3"):
    TensorParallel(tiny_config("gemma3"), 3)
  with pytest.raises(ValueError, match="positive integer"):
    TensorParallel(tiny_config("gemma3"), 0)
  assert TensorParallel(tiny_config("gemma3"), 4).local_config().num_kv_heads == 1
