"""Per-token decode latency of the engine: persistent (device loop) vs host-driven mode, quiet
and under CPU interference, at several batch sizes.

The measuring thread plays the SmartNIC frontend: pinned to its own core (the NIC's cores are
not the host's), it watches one request's output count in the mailbox and timestamps every new
token, and keeps all rings drained. The engine's threads and the interference processes share
the other cores, as a colocated host workload would.

  python -m bench.executor --config gemma3-1b --batches 1,64 --prompt 1024
  python -m bench.executor --modes persistent --interference 0 --gemv none
  python -m bench.executor --config gemma3-27b --modes persistent --batches 1,64 --tensor_parallel 2

Kernels: --attention --prefill --norm --gemv --decode_rows --decode_head (KernelOptions, as scripts/serve.py's
flags); the result records them ("kernels": asked and resolved) beside each mode's report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
from absl import app, flags

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P
from blink_jax.executor import xla_flags
from bench import common as C
from bench.diag.token_clock import TokenClock

FLAGS = flags.FLAGS


def define_flags():
  """Defined when run as a program only (tests import modules of bench/ side by side)."""
  flags.DEFINE_string("config", "gemma3-1b", "model config name, or 'tiny'")
  flags.DEFINE_string("dtype", "bfloat16", "bfloat16 | float32")
  flags.DEFINE_list("batches", ["1", "64"], "concurrent requests")
  flags.DEFINE_list("modes", ["persistent", "host"], "executor modes")
  flags.DEFINE_integer("prompt", 1024, "prompt tokens per request")
  flags.DEFINE_integer("tokens", 128, "decode tokens measured per request")
  flags.DEFINE_integer("interference", -1, "thrashing processes (-1: 2 x nproc; 0: quiet only)")
  flags.DEFINE_integer("page_size", 16, "KV page size")
  flags.DEFINE_list("buckets", ["1", "8", "64", "256"], "token buckets")
  flags.DEFINE_string("out", "bench/results/executor_latency.json", "JSON result file")
  C.define_kernel_flags()  # --attention --prefill --norm --gemv --decode_rows
  C.define_engine_flag("tensor_parallel")
  flags.DEFINE_integer("as_served_context", 0, "when > 0: the engine at serve.py's defaults "
                       "(EngineConfig's max_seqs, num_slots, buckets, prefix caching, the KV "
                       "cache sized from device memory) with this --max_context (2048: as "
                       "bench/serving_suite.sh serves) instead of one sized for the batches, "
                       "so a step's cost in the served configuration is measured apart from "
                       "the load's")
  flags.DEFINE_string("profile", None, "write a jax.profiler trace of each mode's engine, from "
                      "before its start to after its shutdown (the trace's stop waits for the "
                      "device), under this directory (<mode>_b<first batch>; "
                      "python -m bench.kernel_profile reads it); its rows are marked profiled: "
                      "the tracer's overhead is in them")
  flags.DEFINE_enum("warm_up", "workload", ["workload", "shutdown"],
                    "before serving, run every bucket branch once (workload) or only one "
                    "schedule (shutdown) in XLA's op-by-op first execution (docs/NOTES.md, 16)")


def build_engine(mode: str, max_seqs: int):
  import jax.numpy as jnp
  from flax import nnx

  from blink_jax import Engine
  from blink_jax.model.config import get_config, tiny_config
  from blink_jax.model.gemma import Gemma
  cfg = tiny_config("gemma3") if FLAGS.config == "tiny" else get_config(FLAGS.config)
  dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[FLAGS.dtype]
  model = Gemma(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  ctx = FLAGS.prompt + FLAGS.tokens + 64
  if FLAGS.as_served_context > 0:
    if FLAGS.as_served_context < ctx:
      raise app.UsageError(f"--as_served_context {FLAGS.as_served_context} < prompt + tokens + "
                           f"64 = {ctx}")
    # The engine makes and owns its shared-memory mailbox (shm_name "": a fresh name).
    eng = Engine(model, None, mode=mode, shm_name="", max_context=FLAGS.as_served_context,
                 kernels=C.kernel_options(), warm_up=FLAGS.warm_up == "workload",
                 tensor_parallel=FLAGS.tensor_parallel)
    if eng.config.max_seqs < max_seqs:
      raise app.UsageError(f"the served default max_seqs {eng.config.max_seqs} < batch "
                           f"{max_seqs}")
    eng.shm = None
    return eng, cfg
  buckets = tuple(sorted({min(int(b), 256) for b in FLAGS.buckets} | {max(max_seqs, 8)}))
  buckets = tuple(b for b in buckets if b >= 1)
  from multiprocessing import shared_memory
  geo_bytes = P.Geometry(max(2 * max_seqs, 8), ctx - 1, 64, 0).total_bytes
  shm = shared_memory.SharedMemory(create=True, size=geo_bytes)
  region = M.LocalRegion(np.ndarray((geo_bytes,), np.uint8, shm.buf))
  eng = Engine(model, None, region=region, mode=mode, max_seqs=max_seqs,
               page_size=FLAGS.page_size, max_context=ctx, num_slots=max(2 * max_seqs, 8),
               ring_capacity=64, max_top_logprobs=0, buckets=buckets, idle_poll_us=50,
               kernels=C.kernel_options(),
               warm_up=FLAGS.warm_up == "workload", tensor_parallel=FLAGS.tensor_parallel,
               kv_pages=max_seqs * (-(-ctx // FLAGS.page_size)) + 8)
  eng.shm = shm
  return eng, cfg


def mailbox_name(eng) -> str:
  """The shared-memory name of the engine's mailbox (the token clock maps it): ours, or the
  engine's own (--as_served_context)."""
  return eng.shm.name if eng.shm is not None else eng.shm_name


def executor_kernels(eng) -> dict | None:
  """The KernelOptions the engine's executor runs, as a dict."""
  kernels = getattr(eng.executor, "kernels", None)
  return dataclasses.asdict(kernels) if dataclasses.is_dataclass(kernels) else None


def run_case(eng, cfg, batch: int, interference: int, cpus: list[int]) -> dict:
  rng = np.random.default_rng(batch)
  C.idle_power(key=mailbox_name(eng))  # before the first case's requests: its loop idles
  slots = []
  clock_cpu = cpus[0] if len(cpus) > 1 else None
  others = set(cpus[1:]) or set(cpus)
  procs = C.start_interference(interference, others, 600) if interference else []
  try:
    time.sleep(1.0 if procs else 0.1)
    watched = eng.client._free[-batch]  # the slot the last request will take (admitted last)
    clock = TokenClock(mailbox_name(eng), eng.geo, watched, clock_cpu)
    for _ in range(batch):
      prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, FLAGS.prompt)]
      slots.append(eng.client.submit(M.Request(prompt=prompt, max_tokens=FLAGS.tokens,
                                               ignore_eos=True)))
    assert slots[-1] == watched
    h0 = M.read_header(eng.region)
    t0 = time.perf_counter()
    # Per-token latency at batch b is measured once all b requests decode: until then some
    # steps also carry another request's prompt chunk (requests that arrive between two
    # scans queue in slot order, so the watched one may decode before the last prefill).
    # That moment is the GPU's: the latest of the requests' first-token stamps (first_ns),
    # whatever this polling loop's lag on a busy CPU.
    got, first_ns = dict.fromkeys(slots, 0), dict.fromkeys(slots, 0)
    # The GPU's energy over the steady window (all b requests decoding, to the end): J per
    # step of the whole loop (schedule, step, sampler, commit), beside bench.step's bare step.
    meter, metering, h_steady = C.EnergyCounter(), contextlib.ExitStack(), None
    while True:
      outs = {s: eng.client.poll(s) for s in slots}
      for s, o in outs.items():
        got[s] += len(o.tokens)
        if got[s] and not first_ns[s]:  # this request's stamp (it has written an entry)
          first_ns[s] = o.first_ns
      if h_steady is None and all(n > 0 for n in got.values()):
        metering.enter_context(meter)
        h_steady = M.read_header(eng.region)
      if all(o.finished for o in outs.values()):
        break
      time.sleep(0.001)
      if time.perf_counter() - t0 > 300:
        raise TimeoutError("requests did not finish")
    h1 = M.read_header(eng.region)
    metering.close()
    clock.finish()
  finally:
    for p in procs:
      p.kill()
    for p in procs:
      p.wait()
  for s in slots:
    eng.client.release(s)
  # Loop iterations and model steps per generated token: more iterations than steps means
  # the loop idled (nothing runnable) between steps.
  delta = {k: int(h1[k]) - int(h0[k]) for k in ("loop_iterations", "steps", "tokens_generated",
                                                 "schedule_ns", "commit_ns")}
  per_tok = max(delta["tokens_generated"], 1) / batch
  iters = max(delta["loop_iterations"], 1)
  steady_ns = max(first_ns.values())
  # the request that produced its first token last (expected: the last one submitted)
  last_to_start = slots.index(max(slots, key=lambda s: first_ns[s]))
  energy = {}
  if h_steady is not None and meter.joules is not None:
    steps = int(h1["steps"]) - int(h_steady["steps"])
    idle_w = C.idle_power(key=mailbox_name(eng))
    energy = {"energy_steps": steps,
              **C.energy_per("step", meter.joules, meter.seconds, steps, idle_w)}
  return {"batch": batch, "interference": interference, **energy,
          "sched_kernel_us_per_iteration": (delta["schedule_ns"] + delta["commit_ns"]) / iters / 1e3,
          "iterations_per_token": delta["loop_iterations"] / per_tok,
          "steps_per_token": delta["steps"] / per_tok,
          # the watched request's entry count where the steady window starts (1 at batch 1)
          "steady_from_token": clock.first_count_at(steady_ns),
          # submission index of the request that produced its first token last (expected:
          # the last one, batch - 1)
          "last_to_start": last_to_start,
          **C.percentile_stats(clock.intervals_ms(steady_ns), "tpot_ms"),
          **C.percentile_stats(clock.intervals_ms(steady_ns, device=True), "device_tpot_ms")}


def main(argv):
  del argv
  xla_flags.configure_command_buffers()
  cpus = sorted(os.sched_getaffinity(0))
  # The engine's own threads run on the shared cores (not the frontend's core).
  if len(cpus) > 1:
    os.sched_setaffinity(0, set(cpus[1:]))
  n_int = 2 * len(cpus) if FLAGS.interference < 0 else FLAGS.interference
  levels = [0] + ([n_int] if n_int else [])
  rows, reports = [], {}
  max_seqs = max(int(b) for b in FLAGS.batches)
  for mode in FLAGS.modes:
    tracing = None
    if FLAGS.profile:  # started before the engine, so no device loop runs yet
      tracing = os.path.join(FLAGS.profile, f"{mode}_b{FLAGS.batches[0]}")
      jax.profiler.start_trace(tracing, create_perfetto_trace=True)
    t = time.perf_counter()
    eng, cfg = build_engine(mode, max_seqs)
    blockers = sorted({l.split("] ")[-1] for l in eng.executor.compile_log.splitlines()
                       if "Unsupported thunk kind" in l or "not enabled by the user" in l})
    reports[mode] = {"loop_report": eng.loop_report, "command_buffer_blockers": blockers[:12],
                     # what the executor runs ("auto" resolved, after any fallback)
                     "kernels": executor_kernels(eng),
                     "devices": [str(d) for d in eng.executor.devices],
                     "engine": {k: getattr(eng.config, k) for k in (
                         "max_seqs", "num_slots", "max_context", "kv_pages", "buckets",
                         "prefix_caching", "idle_poll_us")},
                     "startup_s": round(time.perf_counter() - t, 1)}
    print(mode, reports[mode], flush=True)
    try:
      for b in (int(x) for x in FLAGS.batches):
        for lvl in levels:
          row = {"mode": mode, **run_case(eng, cfg, b, lvl, cpus)}
          if tracing:
            row["profiled"] = True
          if "tpot_ms_p50" not in row:
            # No interval had all b requests decoding (seen once, host mode at batch 64,
            # c9de529): run the case again rather than leave the row empty.
            print("no steady window, running the case again:", row, flush=True)
            row = {"mode": mode, **run_case(eng, cfg, b, lvl, cpus), "retried": True}
          print(row, flush=True)
          rows.append(row)
    finally:
      eng.shutdown()
      # The profiler collects the GPU's activity when it stops, which waits for the device:
      # stopped while the serving loop still ran, it never returned (on the H200, 885ea50).
      if tracing:
        jax.profiler.stop_trace()
      if eng.shm is not None:  # ours (the engine unlinks its own)
        eng.region = None
        eng.shm.close()
        eng.shm.unlink()
  # Interference / quiet ratios per mode and batch.
  for r in rows:
    quiet = next(q for q in rows if q["mode"] == r["mode"] and q["batch"] == r["batch"]
                 and q["interference"] == 0)
    for k in ("tpot_ms_p50", "tpot_ms_p99", "device_tpot_ms_p99"):
      if k in r and k in quiet:
        r[k.replace("tpot_ms", "ratio")] = r[k] / quiet[k]
  print(C.table(rows, ["mode", "batch", "interference", "tpot_ms_p50", "tpot_ms_p90",
                       "tpot_ms_p99", "device_tpot_ms_p50", "device_tpot_ms_p99", "ratio_p50",
                       "ratio_p99", "iterations_per_token", "sched_kernel_us_per_iteration",
                       "energy_above_idle_per_step_j"]))
  C.write_result(FLAGS.out, "executor_latency", rows,
                 {"config": FLAGS.config, "dtype": FLAGS.dtype, "prompt": FLAGS.prompt,
                  "as_served_context": FLAGS.as_served_context or None,
                  "tokens": FLAGS.tokens, "modes": reports, "cpus": len(cpus),
                  "warm_up": FLAGS.warm_up, "tensor_parallel": FLAGS.tensor_parallel,
                  "kernels": C.kernels_record(C.kernel_options(), jax.devices()[0].platform),
                  "host_min_graph_size": xla_flags.host_options()["xla_gpu_graph_min_graph_size"]})


if __name__ == "__main__":
  define_flags()
  app.run(main)
