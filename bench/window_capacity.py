"""How many long sequences run at once in one KV memory, with windowed pages and without.

For each mode the engine's own sizing (`kv_pages_for_memory`, the rings first) gives the most
sequences of --context tokens that --kv_gib holds; then the engine serves that many requests
of --context tokens at once (random weights, random prompts, all submitted together) and the
run confirms it: every request ran at the same time (peak `running`), none was preempted.

  python -m bench.window_capacity --config gemma3-1b --context 32768 --kv_gib 8 \
      --out bench/results/window_capacity_h200.json
"""
from __future__ import annotations

import threading
import time

import numpy as np
from absl import app, flags

from bench import common as C
from blink_jax.engine_config import EngineConfig, kv_pages_for_memory
from blink_jax.model.config import ModelConfig, get_config
from blink_jax.model.gemma import kv_page_bytes, ring_bytes

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defined when run as a script only: tests import this module beside other absl scripts."""
  flags.DEFINE_string("config", "gemma3-1b", "model shape (random weights)")
  flags.DEFINE_integer("context", 32768, "tokens per sequence (prompt + output)")
  flags.DEFINE_float("kv_gib", 8.0, "KV memory both modes get (GiB)")
  flags.DEFINE_integer("page_size", 16, "KV page size")
  flags.DEFINE_integer("window_chunk", 512, "windowed pages: prompt tokens a sequence computes "
                       "per step")
  flags.DEFINE_integer("output_len", 1024, "tokens generated per request: long enough that the "
                       "first request still decodes when the last one finished its prefill")
  flags.DEFINE_list("modes", ["full", "windowed"], "full: every layer paged; windowed pages")
  flags.DEFINE_bool("run", True, "serve the requests (--norun: the arithmetic alone)")
  flags.DEFINE_string("out", "bench/results/window_capacity.json", "JSON result file")


def sequences_for_memory(cfg: ModelConfig, *, context: int, page_size: int, kv_bytes: int,
                         windowed: bool, window_chunk: int = 512) -> tuple[int, int]:
  """(sequences, window_pages): the most sequences of `context` tokens whose KV fits in
  kv_bytes as the engine sizes it (kv_pages_for_memory, the rings of every lane first)."""
  per_seq = -(-context // page_size)
  window_pages = EngineConfig(windowed_pages=True, window_chunk=window_chunk,
                              page_size=page_size).window_pages(cfg.sliding_window) \
      if windowed else 0

  def fits(seqs: int) -> bool:
    try:
      pages = kv_pages_for_memory(
          bytes_limit=kv_bytes, bytes_in_use=0, workspace_bytes=0, fraction=1.0,
          max_seqs=seqs, max_context=context, page_size=page_size, prefix_caching=False,
          page_bytes=kv_page_bytes(cfg, page_size, windowed=windowed),
          ring_bytes=ring_bytes(cfg, page_size, seqs * window_pages))
    except ValueError:  # not one sequence fits
      return False
    return pages >= seqs * per_seq
  n = 0
  while fits(n + 1):
    n += 1
  return n, window_pages


def serve(cfg_name: str, n: int, *, context: int, page_size: int, windowed: bool,
          window_chunk: int, output_len: int) -> dict:
  """Serves n requests of `context` tokens at once; the peak of concurrently running requests
  and the preemptions, from the mailbox header polled every 20 ms."""
  from blink_jax import Engine, SamplingParams
  per_seq = -(-context // page_size)
  t0 = time.perf_counter()
  eng = Engine.from_checkpoint(
      f"random:{cfg_name}", dtype="bfloat16", max_seqs=n, kv_pages=n * per_seq,
      max_context=context, page_size=page_size, windowed_pages=windowed,
      window_chunk=window_chunk if windowed else None, num_slots=max(64, n))
  started = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, 32000, context - output_len - 1)]
             for _ in range(n)]
  peak, done = {"running": 0, "pages_in_use": 0}, threading.Event()

  def poll():
    while not done.is_set():
      s = eng.stats()
      for k in peak:
        peak[k] = max(peak[k], s[k])
      time.sleep(0.02)
  with eng:
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    outs = eng.generate(prompt_token_ids=prompts,
                        sampling=SamplingParams(max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    stats = eng.stats()
    kv_bytes = eng.sched.num_pages * eng.executor.page_bytes + eng.executor.ring_bytes
  return {"requests": n, "engine_start_s": round(started, 1), "wall_s": round(wall, 2),
          "peak_running": peak["running"], "peak_pages_in_use": peak["pages_in_use"],
          "all_ran_at_once": peak["running"] == n, "preemptions": stats["preemptions"], "finished": stats["requests_finished"],
          "all_full_length": all(len(o.token_ids) == output_len for o in outs),
          "prompt_tokens": stats["prompt_tokens"], "kv_bytes": kv_bytes,
          "prompt_tokens_per_s": round(stats["prompt_tokens"] / wall)}


def main(argv):
  del argv
  cfg = get_config(FLAGS.config)
  kv_bytes = int(FLAGS.kv_gib * 2**30)
  rows = []
  for mode in FLAGS.modes:
    windowed = mode == "windowed"
    n, window_pages = sequences_for_memory(cfg, context=FLAGS.context,
                                           page_size=FLAGS.page_size, kv_bytes=kv_bytes,
                                           windowed=windowed, window_chunk=FLAGS.window_chunk)
    row = {"mode": mode, "context": FLAGS.context, "kv_gib": FLAGS.kv_gib,
           "computed_sequences": n, "window_pages": window_pages}
    print(f"{mode}: {n} sequences of {FLAGS.context} tokens in {FLAGS.kv_gib} GiB", flush=True)
    if FLAGS.run:
      row.update(serve(FLAGS.config, n, context=FLAGS.context, page_size=FLAGS.page_size,
                       windowed=windowed, window_chunk=FLAGS.window_chunk,
                       output_len=FLAGS.output_len))
      print(row, flush=True)
    rows.append(row)
  if len(rows) == 2:
    print(f"windowed / full: {rows[1]['computed_sequences'] / rows[0]['computed_sequences']:.2f}x")
  C.write_result(FLAGS.out, "window_capacity", rows, {"config": FLAGS.config})


if __name__ == "__main__":
  define_flags()
  app.run(main)
