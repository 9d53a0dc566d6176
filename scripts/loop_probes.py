"""Small device loops for measuring loop and scheduler overheads (no flags: shared by
scripts/diag_loop_overhead.py and scripts/bench_step.py).

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

from scripts import bench_common as C


def _sched_loop(calls: str, top: int = 0):
  """A loop over scheduler calls ('s' schedule, 'c' commit, 'f' the fused blink_step, in
  order) on an empty mailbox
  in GPU memory; `top` columns of top-logprob inputs to commit."""
  from blink_jax import ffi as F
  from blink_jax import protocol as P
  from blink_jax.device_region import DeviceRegion
  from blink_jax.executor import commit_call, schedule_call, step_call
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
      elif k == "f":
        lp = lax.bitcast_convert_type(words[:64], jnp.float32)
        tid = jnp.broadcast_to(words[:64, None], (64, top))
        tlp = lax.bitcast_convert_type(tid, jnp.float32)
        state, hist, pt, words = step_call(cfg, state, hist, pt, words, words[:64], lp, tid,
                                           tlp, lp, tid, tlp)
      else:
        lp = lax.bitcast_convert_type(words[:64], jnp.float32)
        tid = jnp.broadcast_to(words[:64, None], (64, top))
        tlp = lax.bitcast_convert_type(tid, jnp.float32)
        state, hist = commit_call(cfg, state, hist, pt, words, words[:64], lp, tid, tlp,
                                  lp, tid, tlp)  # token_budget == max_seqs == 64 here
    return i + 1, state, hist, pt, words

  args = (jnp.asarray(F.initial_state(cfg)), jnp.zeros((64, 4096), jnp.int32),
          jnp.zeros((64, cfg.max_pages_per_seq), jnp.int32),
          jnp.zeros((F.batch_words(cfg),), jnp.int32))
  return body, args, region


def variant(name: str):
  """(body over (i, *rest), rest, keepalive)."""
  if name == "trivial":
    return (lambda c: (c[0] + 1, c[1] * 1.0001)), (jnp.ones((8,), jnp.float32),), None
  if name == "kernels20":
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) / 8, jnp.float32)

    def body(c):
      i, x = c
      for _ in range(20):  # a matmul and a fusion each: ~40 kernels per iteration
        x = jnp.tanh(x @ w)
      return i + 1, x
    return body, (jnp.ones((8, 64), jnp.float32),), w
  if name == "swap":  # swapping two carried buffers makes XLA copy inside the loop
    return (lambda c: (c[0] + 1, c[2], c[1])), (jnp.ones((1024,), jnp.float32),
                                                 jnp.zeros((1024,), jnp.float32)), None
  if name == "switch":
    def body(c):
      i, x = c
      x = lax.switch(i % 3, [lambda x: x * 1.0001, lambda x: x + 1.0, lambda x: x - 1.0], x)
      return i + 1, x
    return body, (jnp.ones((8,), jnp.float32),), None
  if name.startswith("ffi_"):  # ffi_<calls>[_top<k>], e.g. ffi_sc, ffi_c, ffi_ss, ffi_sc_top1
    parts = name.split("_")
    top = int(parts[2][3:]) if len(parts) > 2 else 0
    return _sched_loop(parts[1], top)
  raise ValueError(f"unknown variant {name!r}")


def measure(name: str, levels: list[int], iters: int, repeats: int,
            dump_hlo: str | None = None) -> list[dict]:
  body, rest, keep = variant(name)
  n = jnp.int32(iters)
  run = jax.jit(lambda rest: lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), *rest)))
  compiled = run.lower(rest).compile()
  hlo = compiled.as_text()
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
    with open(os.path.join(dump_hlo, f"{name}.txt"), "w") as f:
      f.write(hlo)
  copies = sum(1 for l in hlo.splitlines() if re.search(r"= \S+ copy(-start)?\(", l))
  jax.block_until_ready(run(rest))  # warm
  from blink_jax import ffi as F
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
        t = time.perf_counter()
        out = jax.block_until_ready(run(rest))
        per.append((time.perf_counter() - t) / iters * 1e6)
        if name.startswith("ffi_"):  # counters C_SCHEDULE_NS, C_COMMIT_NS of the state
          ns = np.asarray(out[1][:32]).view(np.uint64)[10:12]
          kernel.append(float(ns.sum()) / iters / 1e3)
    finally:
      for p in procs:
        p.kill()
      for p in procs:
        p.wait()
    rows.append({"variant": name, "interference": lvl, "hlo_copies": copies,
                 "unaliased_ffi_calls": unaliased, **C.stats(per, "us_per_iter"),
                 **(C.stats(kernel, "kernel_us_per_iter") if kernel else {})})
  quiet = rows[0]["us_per_iter_median"]
  for r in rows:
    r["ratio"] = r["us_per_iter_median"] / quiet
  if keep is not None and hasattr(keep, "free"):
    keep.free()
  return rows
