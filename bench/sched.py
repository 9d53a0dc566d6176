"""Cost of blink_schedule + blink_commit per step, inside the device loop, with no model.

Keeps `lanes` requests decoding (one token each per step) over a mailbox of `slots` slots and
measures the loop's per-iteration time: schedule (doorbell check, cancel/consumed reads of
every running request, decode rows, page growth) + a stub sampler + commit (ring writes,
stop checks). A consumer thread keeps every ring drained, as a frontend would.

  python -m bench.sched --lanes 1,64,256 --slots 4096 --seconds 2
"""
from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

from blink_jax.native import batch as B
from blink_jax.native import ffi as F
from blink_jax.client import mailbox as M
from blink_jax.client import mapping
from blink_jax.client import protocol as P
from blink_jax.executor import xla_flags
from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_list("lanes", ["1", "64", "256"], "running requests (= max_seqs)")
  flags.DEFINE_integer("slots", 4096, "mailbox slots")
  flags.DEFINE_float("seconds", 2.0, "measurement window per configuration")
  flags.DEFINE_integer("repeats", 3, "windows per configuration (median and spread reported)")
  flags.DEFINE_string("out", "bench/results/sched_step.json", "JSON result file")
  flags.DEFINE_integer("interference", 0, "also measure with N memory-thrashing processes")
  flags.DEFINE_list("mailbox", ["host"], "where the mailbox lives: host (host-mapped shared "
                    "memory, the shm transport) and/or device (GPU memory, as an RDMA NIC "
                    "writes it)")
  flags.DEFINE_list("doorbell_us", ["0"], "also ring the doorbell every N us (host mailbox; 0: "
                    "only on resubmits): the next schedule then scans every slot's sequence word, "
                    "as after a new request, so the scan's cost shows in schedule_scan_us")


def _loop(cfg: F.SchedConfig):
  from blink_jax.executor.loop import commit_call, schedule_call

  def outputs(words):
    """A stub sampler: token = (position * 7 + 3) % vocab for each sample (no EOS:
    ignore_eos); no request asks for logprobs. The logprob inputs are the sampled positions
    reinterpreted (a zero-fill would be a memset, which XLA cannot capture in a CUDA
    graph)."""
    pos = words[B.HEADER_WORDS + 3 * cfg.token_budget + 7 * cfg.max_seqs:][:cfg.max_seqs]
    tok = (pos * 7 + 3) % cfg.vocab_size
    lp = lax.bitcast_convert_type(pos, jnp.float32)
    rows = words[B.HEADER_WORDS:B.HEADER_WORDS + cfg.token_budget]  # no prompt logprobs asked
    rlp = lax.bitcast_convert_type(rows, jnp.float32)
    return (tok.astype(jnp.int32), lp, pos[:, None][:, :0], lp[:, None][:, :0], rlp,
            rows[:, None][:, :0], rlp[:, None][:, :0])

  def body(c):
    state, hist, pt, _ = c
    state, hist, pt, words = schedule_call(cfg, state, hist, pt)
    state, hist = commit_call(cfg, state, hist, pt, words, *outputs(words))
    return state, hist, pt, words[B.SHUTDOWN]

  def run(s, h, p):
    return lax.while_loop(lambda c: c[3] == 0, body, (s, h, p, jnp.zeros((), jnp.int32)))
  return jax.jit(run, donate_argnums=(0, 1, 2))


REQUEST = M.Request(prompt=[5, 6, 7, 8], max_tokens=1 << 30, ignore_eos=True)


def _drain(client: M.MailboxClient, region: M.LocalRegion, geo: P.Geometry,
           stop: threading.Event, doorbell_us: int = 0):
  """A fast frontend: marks every output entry consumed (vectorised over all slots) and
  resubmits requests that reached the end of their context, keeping every lane busy; rings
  the doorbell every `doorbell_us` (0: never) with nothing new to find."""
  buf, base = region.buf, P.HEADER_BYTES
  field = lambda name, off: np.ndarray((geo.num_slots,), "<u4", buf, base + off,
                                       (geo.slot_bytes,))
  counts = field("count", geo.request_bytes + P.OUTPUT_DTYPE.fields["count"][1])
  finished = field("finished", geo.request_bytes + P.OUTPUT_DTYPE.fields["finished_seq"][1])
  seqs = field("seq", 0)
  consumed = field("consumed", 8)
  rung = time.perf_counter()
  while not stop.is_set():
    consumed[:] = counts
    for slot in np.flatnonzero((finished == seqs) & (seqs > 0)):
      client.release(int(slot))
      client.submit(REQUEST)
    if doorbell_us and time.perf_counter() - rung >= doorbell_us * 1e-6:
      client.ring_doorbell()
      rung = time.perf_counter()
    time.sleep(50e-6)


def measure(lanes: int, slots: int, seconds: float, repeats: int, interference: int = 0,
            mailbox: str = "host", doorbell_us: int = 0) -> dict:
  on_device = mailbox == "device"
  if on_device:
    # Nobody drains a GPU-memory mailbox here: rings and contexts hold the whole run.
    ctx, ps, ring, slots = 1 << 19, 64, 1 << 18, max(2 * lanes, 8)
  else:
    ctx, ps, ring = 1 << 16, 64, 64  # long contexts: requests rarely finish (resubmitted)
  geo = P.Geometry(slots, 16, ring, 0)
  engine_region = M.LocalRegion(mapping.map_memory(geo.total_bytes))
  M.init_header(engine_region, geo, vocab_size=32000, max_context=ctx, num_workers=1, eos_id=1)
  if on_device:
    from blink_jax.native.device_region import DeviceRegion
    dev_region = DeviceRegion(geo.total_bytes)
    addr, release, header_region = dev_region.address, dev_region.free, dev_region
  else:
    addr, release = C.device_mailbox(engine_region, geo.total_bytes)
    header_region = engine_region
  budget = max(lanes, 8)
  cfg = F.SchedConfig.build(
      mailbox=addr, num_slots=slots, max_prompt=16, ring_capacity=ring, max_top_logprobs=0,
      vocab_size=32000, max_seqs=lanes, max_context=ctx, page_size=ps,
      num_pages=lanes * (ctx // ps), buckets=(budget,), eos_ids=(), idle_poll_us=0)
  client = M.MailboxClient(engine_region)
  for i in range(lanes):
    client.submit(REQUEST)
  if on_device:
    dev_region.upload(engine_region.buf[:geo.total_bytes])
  F.register_targets()
  loop = _loop(cfg)
  dev = jax.devices()[0]
  state = jax.device_put(F.initial_state(cfg), dev)
  hist = jax.device_put(np.zeros((lanes, ctx), np.int32), dev)
  pt = jax.device_put(np.zeros((lanes, cfg.max_pages_per_seq), np.int32), dev)
  from blink_jax.executor.loop_report import capture_stderr, command_buffer_report
  with capture_stderr() as log_text:
    compiled = loop.lower(state, hist, pt).compile()
  driver = command_buffer_report(compiled, log_text(), dev, "persistent")
  # XLA runs a command buffer op by op the first time (the host drives that loop): run it
  # once with the shutdown word set (Executor.warm_up does the same for the engine).
  shutdown_at = P.HEADER_DTYPE.fields["shutdown"][1]
  header_region.write(shutdown_at, (1).to_bytes(4, "little"))
  state, hist, pt, _ = jax.block_until_ready(compiled(state, hist, pt))
  header_region.write(shutdown_at, (0).to_bytes(4, "little"))
  stop = threading.Event()
  if not on_device:
    threading.Thread(target=_drain, args=(client, engine_region, geo, stop, doorbell_us),
                     daemon=True).start()
  result = {}
  done = threading.Event()
  out = {}

  def run():
    out["tid"] = threading.get_native_id()
    out["carry"] = jax.block_until_ready(compiled(state, hist, pt))
    done.set()

  th = threading.Thread(target=run, daemon=True)
  th.start()
  time.sleep(0.5)  # admission and warm-up
  procs = []
  if interference:
    procs = C.start_interference(interference, set(os.sched_getaffinity(0)), 300)
    time.sleep(1.0)
  per_iter = []
  for _ in range(repeats):
    h0, t0 = M.read_header(header_region), time.perf_counter()
    time.sleep(seconds)
    h1, t1 = M.read_header(header_region), time.perf_counter()
    it = int(h1["loop_iterations"]) - int(h0["loop_iterations"])
    toks = int(h1["tokens_generated"]) - int(h0["tokens_generated"])
    per_iter.append((t1 - t0) / max(it, 1) * 1e6)
    result.setdefault("tokens_per_iteration", []).append(toks / max(it, 1))
  for p in procs:
    p.kill()
  header_region.write(shutdown_at, (1).to_bytes(4, "little"))
  th.join(60)
  stop.set()
  release()
  if "carry" in out:  # device time inside the kernels and schedule's phases (CUDA only)
    ctr = F.counters(np.asarray(out["carry"][0]))
    iters = max(ctr["loop_iterations"], 1)
    result.update(schedule_kernel_us=ctr["schedule_ns"] / iters / 1e3,
                  commit_kernel_us=ctr["commit_ns"] / iters / 1e3,
                  **{f"schedule_{p}_us": ctr[f"sched_{p}_ns"] / iters / 1e3
                     for p in P.SCHEDULE_PHASES},
                  slot_scans_per_iteration=ctr["slot_scans"] / iters)
  result.update(C.stats(per_iter, "us_per_step"))
  result.update(lanes=lanes, slots=slots, mailbox=mailbox, interference=interference,
                doorbell_us=doorbell_us,
                running=int(h1["running"]),
                errored=int(h1["requests_errored"]), admitted=int(h1["requests_admitted"]),
                finished=int(h1["requests_finished"]), cancelled=int(h1["requests_cancelled"]),
                **driver)
  return result


def main(argv):
  del argv
  xla_flags.configure_command_buffers()
  rows = [measure(int(n), FLAGS.slots, FLAGS.seconds, FLAGS.repeats, lvl, mb, int(d))
          for mb in FLAGS.mailbox for n in FLAGS.lanes
          for d in (FLAGS.doorbell_us if mb == "host" else ["0"])
          for lvl in ([0, FLAGS.interference] if FLAGS.interference else [0])]
  print(C.table(rows, ["mailbox", "lanes", "slots", "doorbell_us", "interference", "running",
                       "us_per_step_median", "schedule_kernel_us", "commit_kernel_us",
                       "schedule_scan_us", "schedule_poll_us", "schedule_decode_us",
                       "schedule_admit_us", "schedule_batch_us", "slot_scans_per_iteration",
                       "tokens_per_iteration", "device_while"]))
  C.write_result(FLAGS.out, "sched_step", rows)


if __name__ == "__main__":
  define_flags()
  app.run(main)
