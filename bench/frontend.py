"""What the frontend alone delivers (issue 25, item 5): scripts/serve.py over the fake device
(tests/fake_device.py: the real scheduler, a model that costs nothing), so the engine is never
the limit, with 1..N frontend workers; all streams at once through real HTTP. Per worker
count: output tokens/s, SSE chunks per token, and the CPU seconds per 1k tokens of the
frontend processes and of the fake engine (`bench.serving.ServerCPU`). Worker counts
alternate over the repeats; the result is the median with its spread.

  python -m bench.frontend --workers 1,2,4 --streams 256 --output_len 200 --step_ms 3 --repeats 3

The load generator runs in this process (pin it with taskset to keep it off the workers'
cores); on a machine of few cores the load generator, the fake device and the workers share
them, so the figure that carries over is the frontend's CPU per 1k tokens.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402
from bench import serving as BS  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_list("workers", ["1", "2"], "frontend worker counts to compare")
  flags.DEFINE_integer("streams", 256, "concurrent streaming requests (all sent at once)")
  flags.DEFINE_integer("lanes", 0, "the fake device's max_seqs (0: --streams): fewer lanes "
                       "than streams queue the rest on the device, as in a burst")
  flags.DEFINE_integer("output_len", 200, "tokens per request (the fake device's context is "
                       "256)")
  flags.DEFINE_integer("input_len", 16, "prompt tokens per request")
  flags.DEFINE_float("step_ms", 3.0, "the fake device's pace: one token per stream per step "
                     "(the 1B shape's step at a few hundred rows on the H200 is 3-10 ms); 0: "
                     "as fast as it goes, tokens then arrive many per chunk")
  flags.DEFINE_integer("repeats", 2, "runs per worker count (alternated)")
  flags.DEFINE_integer("client_procs", 1, "load-generator processes (bench.serving's "
                       "--client_procs; docs/PERFORMANCE.md, \"A frontend worker's "
                       "ceiling (revision edcad9c)\")")
  flags.DEFINE_string("tokenizer", "", "SentencePiece model the workers detokenize with (e.g. "
                      "Gemma's, checkpoints/gemma/tokenizer.model); default: the tests' tiny one, "
                      "whose pieces are cheaper to decode")
  flags.DEFINE_string("out", "bench/results/frontend_fake.json", "JSON result")


@contextlib.contextmanager
def fake_server(workers: int, streams: int, step_ms: float, tmp: pathlib.Path,
                lanes: int = 0):
  """serve.py over the fake device with `workers` frontend workers; yields (port, pid)."""
  from tests import fake_device as FD
  tok = pathlib.Path(FLAGS.tokenizer) if FLAGS.tokenizer else FD.tiny_tokenizer(tmp / "tok")
  port, info = FD.free_port(), tmp / f"info_{workers}.json"
  info.unlink(missing_ok=True)
  cmd = [sys.executable, "-c", "import sys; from tests.fake_device import fake_serve; "
         "fake_serve(sys.argv)", "--ckpt", "fake", "--tokenizer", str(tok), "--port", str(port),
         "--fake_info_file", str(info), "--workers", str(workers),
         "--max_seqs", str(lanes or streams),
         "--num_slots", str(2 * streams), "--engine_stall_s", "0",
         "--fake_step_delay_s", str(step_ms / 1e3)]
  env = {k: v for k, v in os.environ.items() if k != "BLINK_API_KEY"}
  log = tmp / f"serve_{workers}.log"
  proc = FD.spawn_until_ready(cmd, info, log, env)
  try:
    yield port, proc.pid
  finally:
    FD.terminate(proc, 30)


def one_run(port: int, pid: int, streams: int, input_len: int, output_len: int,
            seed: int, procs: int = 1) -> dict:
  reqs = BS.synthetic_requests(streams, seed, vocab_size=320, max_context=256,
                               input_len=input_len, output_len=output_len)
  cpu = BS.ServerCPU(pid)
  with cpu:
    recs, duration = BS.run_rate_procs(f"http://127.0.0.1:{port}/v1", {}, "tiny", reqs,
                                       float("inf"), seed, None, 600.0, procs,
                                       progress=False)
  m = BS.compute_metrics(recs, duration)
  chunks = sum(len(r.chunk_times) for r in recs if r.ok)
  m.update(cpu.result(m["output_tokens"]))
  roles = m.get("host_cpu_s_by_role", {})
  per_1k = 1e3 / max(m["output_tokens"], 1)
  return {"output_throughput": m["output_throughput"], "completed": m["completed"],
          "failed": m["failed"], "chunks_per_token": chunks / max(m["output_tokens"], 1),
          "frontend_cpu_s_per_1k_tokens": roles.get("frontend", 0.0) * per_1k,
          "engine_cpu_s_per_1k_tokens": roles.get("engine", 0.0) * per_1k,
          "ttft_ms_p50": m.get("ttft_ms_p50"), "tpot_ms_p50": m.get("tpot_ms_p50")}


def main(argv):
  del argv
  counts = [int(w) for w in FLAGS.workers]
  runs: dict[int, list[dict]] = {w: [] for w in counts}
  with tempfile.TemporaryDirectory() as tmp:
    for rep in range(FLAGS.repeats):
      for w in counts:  # alternated: 1 2 1 2 ...
        with fake_server(w, FLAGS.streams, FLAGS.step_ms, pathlib.Path(tmp),
                         FLAGS.lanes) as (port, pid):
          one_run(port, pid, 8, FLAGS.input_len, 8, 99)  # connections and caches warm
          r = one_run(port, pid, FLAGS.streams, FLAGS.input_len, FLAGS.output_len, rep,
                      FLAGS.client_procs)
        runs[w].append(r)
        print(f"workers {w} run {rep + 1}: {r['output_throughput']:,.0f} tokens/s, "
              f"{r['chunks_per_token']:.2f} chunks/token, frontend "
              f"{r['frontend_cpu_s_per_1k_tokens']:.3f} CPU s / 1k tokens", flush=True)
  rows = []
  for w in counts:
    row = {"workers": w, "streams": FLAGS.streams, "runs": runs[w]}
    for k in ("output_throughput", "chunks_per_token", "frontend_cpu_s_per_1k_tokens",
              "engine_cpu_s_per_1k_tokens"):
      row.update(C.stats([r[k] for r in runs[w]], k))
    row["failed"] = sum(r["failed"] for r in runs[w])
    rows.append(row)
  C.write_result(FLAGS.out, "frontend", rows, {
      "host_cpu": C.cpu_model(), "streams": FLAGS.streams, "lanes": FLAGS.lanes or FLAGS.streams,
      "step_ms": FLAGS.step_ms,
      "input_len": FLAGS.input_len,
      "output_len": FLAGS.output_len, "load_generator_cpus": sorted(os.sched_getaffinity(0)),
      "client_procs": FLAGS.client_procs,
      "tokenizer": FLAGS.tokenizer or "tiny (tests/fake_device.py)"})
  print(C.table(rows, ["workers", "output_throughput_median", "output_throughput_min",
                       "output_throughput_max", "chunks_per_token_median",
                       "frontend_cpu_s_per_1k_tokens_median", "failed"]))


if __name__ == "__main__":
  define_flags()
  app.run(main)
