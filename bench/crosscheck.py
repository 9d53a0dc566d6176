"""Cross-check of the load generator (issue 27): `vllm bench serve` and bench.serving against
one server, the same workload (fixed input and output lengths, the same number of requests,
Poisson arrivals at the same rate, greedy, ignore_eos), one after the other; the figures
side by side with their ratio. The two tools should agree within run-to-run noise.
--rounds alternates them (vLLM's then ours, ours then vLLM's, ...; round k with seed + k, so
no round finds another's prompts in the prefix cache) and compares the medians: a server that
speeds up or slows down during the check then shows in each tool's runs rather than as a
difference between the tools.

  python -m bench.crosscheck --base_url http://127.0.0.1:8000/v1 \\
      --tokenizer .carry/peer/tokenizer --rate 16 --label blink \\
      --vllm_path /tmp/vllm/site

`--tokenizer` is the Hugging Face tokenizer folder `vllm bench serve` draws its random prompts
with (`python -m bench.peer model_dir`); `--vllm_path` the PYTHONPATH of a vLLM install
(bench/vllm_install.sh). The two tools differ in one way: vLLM's sends text (random token ids
decoded), ours token ids, so the server tokenizes only vLLM's.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from bench import common as C  # noqa: E402
from bench import serving as BS  # noqa: E402

FLAGS = flags.FLAGS

# What both tools report (vllm bench serve's names; bench.serving's rows carry them too).
METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
           "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration")


def define_flags():
  flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "the server's OpenAI base URL")
  flags.DEFINE_string("model", None, "model name (default: the first of GET /models)")
  flags.DEFINE_string("tokenizer", None, "Hugging Face tokenizer folder for vllm bench serve")
  flags.DEFINE_string("vllm_path", "", "PYTHONPATH entries (':'-joined) of the vLLM install")
  flags.DEFINE_integer("num_prompts", 200, "requests per tool")
  flags.DEFINE_float("rate", 16.0, "request rate (requests/s)")
  flags.DEFINE_integer("input_len", 512, "tokens per prompt")
  flags.DEFINE_integer("output_len", 256, "tokens per answer")
  flags.DEFINE_integer("seed", 0, "seed of both tools' prompts and arrivals (round k: seed + k)")
  flags.DEFINE_integer("rounds", 2, "runs of each tool, alternated: round k runs vLLM's tool "
                       "first when k is even, ours first when odd")
  flags.DEFINE_string("label", "default", "name of the server in the result")
  flags.DEFINE_string("out", None, "JSON result (default: bench/results/crosscheck_<label>.json)")


def vllm_command(base_url: str, model: str, tokenizer: str, num_prompts: int, rate: float,
                 input_len: int, output_len: int, seed: int, result_dir: str) -> list[str]:
  root = base_url.rstrip("/").removesuffix("/v1")
  return [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
          "--backend", "openai", "--base-url", root, "--endpoint", "/v1/completions",
          "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
          "--random-input-len", str(input_len), "--random-output-len", str(output_len),
          "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
          "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
          "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
          "--metric-percentiles", "50,99", "--save-result", "--result-dir", result_dir,
          "--result-filename", "vllm_bench_serve.json"]


def run_vllm_bench(cmd: list[str], vllm_path: str, result_dir: str) -> dict:
  env = {**os.environ, "HF_HUB_OFFLINE": "1",
         "PYTHONPATH": ":".join(p for p in (vllm_path, os.environ.get("PYTHONPATH")) if p)}
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
  tail = (done.stdout + done.stderr)[-3000:]
  path = pathlib.Path(result_dir) / "vllm_bench_serve.json"
  if done.returncode != 0 or not path.exists():
    raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}):\n{tail}")
  print("\n".join(ln for ln in done.stdout.splitlines() if ":" in ln and "INFO" not in ln)[-2500:])
  return json.loads(path.read_text())


def run_ours(base_url: str, model: str, num_prompts: int, rate: float, input_len: int,
             output_len: int, seed: int, max_context: int) -> dict:
  reqs = BS.synthetic_requests(num_prompts, seed, max_context=max_context, input_len=input_len,
                               output_len=output_len)
  recs, duration = asyncio.run(BS.run_rate(base_url, {}, model, reqs, rate, seed + 1000,
                                           None, 1800.0))
  return BS.compute_metrics(recs, duration)


def median_run(runs: list[dict]) -> dict:
  """Per metric, the median over a tool's runs (the metrics both tools report)."""
  import numpy as np
  out = {}
  for k in METRICS + COUNTS:
    vals = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
    out[k] = float(np.median(vals)) if vals else None
  return out


def round_order(k: int) -> tuple[str, str]:
  """Which tool runs first in round k: vLLM's in even rounds, ours in odd ones."""
  return ("vllm", "ours") if k % 2 == 0 else ("ours", "vllm")


def compare(vllm: dict, ours: dict) -> dict:
  """{metric: {"vllm_bench_serve", "bench_serving", "ratio" (ours / vLLM's)}}."""
  out = {}
  for k in METRICS + COUNTS:
    a, b = vllm.get(k), ours.get(k)
    out[k] = {"vllm_bench_serve": a, "bench_serving": b,
              "ratio": (b / a) if isinstance(a, (int, float)) and a and b is not None else None}
  return out


def main(argv):
  del argv
  if not FLAGS.tokenizer:
    raise app.UsageError("--tokenizer (a Hugging Face tokenizer folder) is required")
  info = asyncio.run(BS.server_info(FLAGS.base_url, {}))
  model = FLAGS.model or info.get("id")
  if not model:
    raise app.UsageError("--model is required (GET /models gave none)")
  max_context = info.get("max_model_len") or 4096
  if FLAGS.rounds < 1:
    raise app.UsageError(f"--rounds must be >= 1, got {FLAGS.rounds}")
  runs = {"vllm": [], "ours": []}
  for k in range(FLAGS.rounds):
    seed = FLAGS.seed + k
    for tool in round_order(k):
      if tool == "vllm":
        with tempfile.TemporaryDirectory() as tmp:
          cmd = vllm_command(FLAGS.base_url, model, FLAGS.tokenizer, FLAGS.num_prompts,
                             FLAGS.rate, FLAGS.input_len, FLAGS.output_len, seed, tmp)
          runs["vllm"].append(run_vllm_bench(cmd, FLAGS.vllm_path, tmp))
      else:
        runs["ours"].append(run_ours(FLAGS.base_url, model, FLAGS.num_prompts, FLAGS.rate,
                                     FLAGS.input_len, FLAGS.output_len, seed, max_context))
      print(f"round {k}: {tool} done", flush=True)
  vllm = runs["vllm"][-1]
  cmp = compare(median_run(runs["vllm"]), median_run(runs["ours"]))
  rows = [{"metric": k, **v,
           "vllm_bench_serve_runs": [r.get(k) for r in runs["vllm"]],
           "bench_serving_runs": [r.get(k) for r in runs["ours"]]} for k, v in cmp.items()]
  extra = {"label": FLAGS.label, "base_url": FLAGS.base_url, "model": model,
           "rate": FLAGS.rate, "num_prompts": FLAGS.num_prompts, "input_len": FLAGS.input_len,
           "output_len": FLAGS.output_len, "seed": FLAGS.seed, "rounds": FLAGS.rounds,
           "vllm_bench_serve_command": " ".join(cmd[1:]),
           "vllm_bench_serve_version": vllm.get("vllm_version") or vllm.get("version"),
           "vllm_bench_serve_result": {k: v for k, v in vllm.items()
                                       if not isinstance(v, list)},
           "bench_serving_result": runs["ours"][-1]}
  C.write_result(FLAGS.out or f"bench/results/crosscheck_{FLAGS.label}.json", "crosscheck",
                 rows, extra)
  print(C.table(rows, ["metric", "vllm_bench_serve", "bench_serving", "ratio",
                       "vllm_bench_serve_runs", "bench_serving_runs"]))


if __name__ == "__main__":
  define_flags()
  app.run(main)
