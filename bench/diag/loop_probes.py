"""Small device loops for measuring loop and scheduler overheads (no flags: shared by
bench/diag/loop_overhead.py and bench/step.py).

Each variant is a `lax.while_loop` body over (i, *rest); `measure` runs it a fixed number of
iterations, quiet and under memory-thrashing processes, and reports microseconds per iteration
(and, for the scheduler variants, the device time inside the scheduler kernels).
"""
from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common as C


def _sched_loop(calls: str, top: int = 0):
  """A loop over scheduler calls ('s' schedule, 'c' commit, in order) on an empty mailbox in
  GPU memory; `top` columns of top-logprob inputs to commit."""
  from blink_jax.native import ffi as F
  from blink_jax.client import protocol as P
  from blink_jax.native.device_region import DeviceRegion
  from blink_jax.executor.loop import commit_call, schedule_call
  geo = P.Geometry(64, 16, 64, top)
  region = DeviceRegion(geo.total_bytes)
  cfg = F.SchedConfig.build(
      mailbox=region.address, num_slots=64, max_prompt=16, ring_capacity=64,
      max_top_logprobs=top, vocab_size=32000, max_seqs=64, max_context=4096, page_size=16,
      num_pages=1024, buckets=(64,), eos_ids=(), idle_poll_us=0)
  F.register_targets()

  def body(c):
    i, state, hist, pt, words = c
    for k in calls:
      if k == "s":
        state, hist, pt, words = schedule_call(cfg, state, hist, pt)
      elif k == "c":
        lp = lax.bitcast_convert_type(words[:64], jnp.float32)
        tid = jnp.broadcast_to(words[:64, None], (64, top))
        tlp = lax.bitcast_convert_type(tid, jnp.float32)
        state, hist = commit_call(cfg, state, hist, pt, words, words[:64], lp, tid, tlp,
                                  lp, tid, tlp)  # token_budget == max_seqs == 64 here
      else:
        raise ValueError(f"unknown scheduler call {k!r} (s: schedule, c: commit)")
    return i + 1, state, hist, pt, words

  args = (jnp.asarray(F.initial_state(cfg)), jnp.zeros((64, 4096), jnp.int32),
          jnp.zeros((64, cfg.max_pages_per_seq), jnp.int32),
          jnp.zeros((F.batch_words(cfg),), jnp.int32))
  return body, args, region


def _model_loop(config: str, batch: int, context: int = 1024):
  """A loop of greedy decode steps of a random-weight model (bf16): `batch` sequences at
  `context` tokens each; the sampled tokens feed the next step."""
  from flax import nnx

  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.model.gemma import Gemma, init_kv_cache
  cfg = tiny_config("gemma3") if config == "tiny" else get_config(config)
  model = Gemma(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  page = 16
  pages = -(-(context + 1) // page)
  kv = init_kv_cache(cfg, batch * pages + 1, page, jnp.bfloat16)
  pt = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  positions = jnp.full((batch,), context - 1, jnp.int32)
  seq_ids = jnp.arange(batch, dtype=jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, batch), jnp.int32)

  def body(c):
    i, params, kv, tokens = c
    m = nnx.merge(graphdef, params)
    hidden, kv = m.forward(tokens, positions, seq_ids, pt, kv)
    return i + 1, params, kv, jnp.argmax(m.logits(hidden), axis=-1).astype(jnp.int32)
  return body, (params, kv, tokens), None


class _Mailbox:
  """A mailbox holding `batch` submitted requests, in GPU memory or host-mapped; `reset()`
  restores it before every timed run (each run starts from the same initial carry)."""

  def __init__(self, geo, vocab: int, max_context: int, batch: int, prompt: int, where: str):
    from blink_jax.client import mailbox as M, mapping
    image = M.LocalRegion(mapping.map_memory(geo.total_bytes))
    M.init_header(image, geo, vocab_size=vocab, max_context=max_context, num_workers=1, eos_id=1)
    client = M.MailboxClient(image)
    rng = np.random.default_rng(0)
    for _ in range(batch):
      client.submit(M.Request(prompt=[int(t) for t in rng.integers(3, vocab, prompt)],
                              max_tokens=1 << 20, ignore_eos=True))
    self.image = np.array(image.buf[:geo.total_bytes])
    if where == "device":
      from blink_jax.native.device_region import DeviceRegion
      self.region = DeviceRegion(geo.total_bytes)
      self.address, self.free = self.region.address, self.region.free
    else:
      self.host = M.LocalRegion(mapping.map_memory(geo.total_bytes))
      self.address, self.free = C.device_mailbox(self.host, geo.total_bytes)
    self.reset()

  def reset(self):
    if hasattr(self, "region"):
      self.region.upload(self.image)
    else:
      self.host.buf[:self.image.size] = self.image


def _engine_loop(config: str, batch: int, where: str, prompt: int = 1024, ring: int = 512):
  """The engine's own step (schedule -> bucket switch with the model and sampling -> commit)
  over `batch` requests decoding after a `prompt`-token prefill; nobody drains the rings
  (they hold a run), the mailbox is in GPU memory (`device`) or host-mapped (`host`)."""
  from flax import nnx

  from blink_jax.native import ffi as F
  from blink_jax.client import protocol as P
  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.executor.loop import Executor
  from blink_jax.model.gemma import Gemma
  cfg = tiny_config("gemma3") if config == "tiny" else get_config(config)
  model = Gemma(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  ctx = prompt + ring + 16
  geo = P.Geometry(max(2 * batch, 8), prompt, ring, 0)
  box = _Mailbox(geo, cfg.vocab_size, ctx, batch, prompt, where)
  sched = F.SchedConfig.build(
      mailbox=box.address, num_slots=geo.num_slots, max_prompt=prompt, ring_capacity=ring,
      max_top_logprobs=0, vocab_size=cfg.vocab_size, max_seqs=batch, max_context=ctx,
      page_size=16, num_pages=batch * (-(-ctx // 16)) + 8, buckets=(1, 8, 64, 256),
      eos_ids=(), idle_poll_us=0)
  ex = Executor(model, sched, max_top_logprobs=0)

  def body(c):
    i, inputs, carry = c
    return i + 1, inputs, ex._step_fn(inputs, carry)
  return body, (ex.inputs, ex.initial_carry()), box


def variant(name: str):
  """(body over (i, *rest), rest, keepalive, index in rest of the scheduler state or None).

  Names: trivial, kernels20, swap, switch; ffi_<calls>[_top<k>] (scheduler calls, e.g.
  ffi_sc, ffi_c); model-<config>-b<batch> (decode steps); and `a+b` for a loop whose
  body runs both (e.g. model-gemma3-1b-b1+ffi_sc: which of the two interference reaches)."""
  if name.startswith("cond-"):  # the probe's body inside a two-way branch (as the engine's
    return _in_cond(variant(name[len("cond-"):]))  # model sits inside its bucket switch)
  if "+" in name:
    return _compose([variant(p) for p in name.split("+")])
  if name == "trivial":
    return (lambda c: (c[0] + 1, c[1] * 1.0001)), (jnp.ones((8,), jnp.float32),), None, None
  if name == "kernels20":
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) / 8, jnp.float32)

    def body(c):
      i, x = c
      for _ in range(20):  # a matmul and a fusion each: ~40 kernels per iteration
        x = jnp.tanh(x @ w)
      return i + 1, x
    return body, (jnp.ones((8, 64), jnp.float32),), w, None
  if name == "swap":  # swapping two carried buffers makes XLA copy inside the loop
    return (lambda c: (c[0] + 1, c[2], c[1])), (jnp.ones((1024,), jnp.float32),
                                                 jnp.zeros((1024,), jnp.float32)), None, None
  if name == "switch":
    def body(c):
      i, x = c
      x = lax.switch(i % 3, [lambda x: x * 1.0001, lambda x: x + 1.0, lambda x: x - 1.0], x)
      return i + 1, x
    return body, (jnp.ones((8,), jnp.float32),), None, None
  if name == "nested":  # a cond inside a switch branch, as the engine's prompt-logprob cond
    def branch(k):
      return lambda x: lax.cond(x[0] > 1e30, lambda x: x * 2.0, lambda x: x + k, x)

    def body(c):
      i, x = c
      return i + 1, lax.switch(i % 3, [branch(1.0), branch(-1.0), branch(0.5)], x)
    return body, (jnp.ones((8,), jnp.float32),), None, None
  if name.startswith("ffi_"):  # ffi_<calls>[_top<k>], e.g. ffi_sc, ffi_c, ffi_ss, ffi_sc_top1
    parts = name.split("_")
    top = int(parts[2][3:]) if len(parts) > 2 else 0
    return (*_sched_loop(parts[1], top), 0)
  if name.startswith("model-"):
    config, batch = name[len("model-"):].rsplit("-b", 1)
    return (*_model_loop(config, int(batch)), None)
  if name.startswith("engine"):  # engine-<config>-b<batch> (GPU-memory mailbox), enginehost-..
    kind, rest = name.split("-", 1)
    config, batch = rest.rsplit("-b", 1)
    return (*_engine_loop(config, int(batch), "host" if kind == "enginehost" else "device"),
            None)
  raise ValueError(f"unknown variant {name!r}")


def _in_cond(probe):
  """Runs the body in the taken branch of a lax.cond whose predicate XLA cannot fold."""
  fn, rest, keep, state = probe

  def body(c):
    i = c[0]
    return lax.cond(i % 7919 >= 0, fn, lambda c: (c[0] + 1, *c[1:]), c)
  return body, rest, keep, state


def _compose(probes):
  """One loop body that runs each probe's body on its own part of the carry, in order."""
  sizes = [len(rest) for _, rest, _, _ in probes]
  state = next((sum(sizes[:k]) + s for k, (_, _, _, s) in enumerate(probes) if s is not None),
               None)

  def body(c):
    i, rest, out, k = c[0], c[1:], [], 0
    for (fn, _, _, _), n in zip(probes, sizes):
      out += list(fn((i, *rest[k:k + n]))[1:])
      k += n
    return (i + 1, *out)
  rest = tuple(x for _, r, _, _ in probes for x in r)
  return body, rest, [keep for _, _, keep, _ in probes], state


def measure(name: str, levels: list[int], iters: int, repeats: int,
            dump_hlo: str | None = None) -> list[dict]:
  from blink_jax.executor.loop_report import capture_stderr, command_buffer_report
  body, rest, keep, state_at = variant(name)
  if "model-" in name or name.startswith("engine"):  # a model step takes milliseconds
    iters = max(iters // 100, 20)
  n = jnp.int32(iters)
  run = jax.jit(lambda rest: lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), *rest)))
  with capture_stderr() as compile_log:
    compiled = run.lower(rest).compile()
  # Whether this loop became a device-side WHILE: a loop the host drives is slowed by a busy
  # CPU for an unrelated reason, so every row says which kind it measured.
  loop = command_buffer_report(compiled, compile_log(), jax.devices()[0], "persistent")
  hlo = compiled.as_text()
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    with open(os.path.join(dump_hlo, f"{name}.txt"), "w") as f:
      f.write(hlo)
  copies = sum(1 for l in hlo.splitlines() if re.search(r"= \S+ copy(-start)?\(", l))
  jax.block_until_ready(run(rest))  # XLA's op-by-op first execution, then the CUDA graph
  from blink_jax.native import ffi as F
  cuda = F.cuda_library()
  unaliased = int(cuda.blink_cuda_unaliased_calls()) if cuda is not None else None
  rows = []
  for lvl in levels:
    procs = C.start_interference(lvl, set(os.sched_getaffinity(0)), 120) if lvl else []
    try:
      if procs:
        time.sleep(1.0)
      per, kernel = [], []
      for _ in range(repeats):
        for k in keep if isinstance(keep, list) else [keep]:
          if hasattr(k, "reset"):
            k.reset()
        t = time.perf_counter()
        out = jax.block_until_ready(run(rest))
        per.append((time.perf_counter() - t) / iters * 1e6)
        if state_at is not None:  # counters C_SCHEDULE_NS, C_COMMIT_NS of the state
          ns = np.asarray(out[1 + state_at][:32]).view(np.uint64)[10:12]
          kernel.append(float(ns.sum()) / iters / 1e3)
    finally:
      for p in procs:
        p.kill()
      for p in procs:
        p.wait()
    rows.append({"variant": name, "interference": lvl, "hlo_copies": copies,
                 "device_while": loop.get("device_while"),
                 "unaliased_ffi_calls": unaliased, **C.stats(per, "us_per_iter"),
                 **(C.stats(kernel, "kernel_us_per_iter") if kernel else {})})
  quiet = rows[0]["us_per_iter_median"]
  for r in rows:
    r["ratio"] = r["us_per_iter_median"] / quiet
  for k in keep if isinstance(keep, list) else [keep]:
    if hasattr(k, "free"):
      k.free()
  return rows
