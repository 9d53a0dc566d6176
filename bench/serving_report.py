"""Tables and plots of one serving lease (bench/serving_suite.sh): per model shape, every server
(blink-jax persistent and host, vLLM) side by side at each rate, quiet and under thrashers,
with the ratios against vLLM that Blink's paper reports; the single-stream runs; the
cross-check of the load generator. Markdown on stdout, one PNG per shape.

  python -m bench.serving_report --results bench/results --prefix serving_h200_ \\
      --plot_dir bench/results
  python -m bench.serving_report --prefix serving_h100_ --vllm_run e1k_quiet  # variants
"""
from __future__ import annotations

import json
import math
import pathlib
import re
import sys

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from bench import serving as BS  # noqa: E402

FLAGS = flags.FLAGS

SERVERS = ("persistent", "host", "vllm")
NAMES = {"persistent": "blink persistent", "host": "blink host mode", "vllm": "vLLM"}
# Blink (arXiv 2604.07609), its best ratios against vLLM, SGLang and TensorRT-LLM on one GPU.
BLINK_HEADLINE = {"p99_ttft": "up to 8.47x lower", "p99_tpot": "up to 3.40x lower",
                  "throughput": "up to 2.1x higher", "energy": "up to 48.6 % lower"}


def define_flags():
  flags.DEFINE_string("results", "bench/results", "folder of the result files")
  flags.DEFINE_string("prefix", "serving_h200_",
                      "result files: <prefix><shape>_<server>_<run>.json")
  flags.DEFINE_string("crosscheck_prefix", "crosscheck_h200_", "cross-check result files")
  flags.DEFINE_string("plot_dir", None, "write <prefix><shape without gemma3->_p99.png here")
  flags.DEFINE_string("vllm_run", None, "compare every blink-jax run with this vLLM run "
                      "(e.g. p600_quiet: the variants of one lease, TAG=p600f25, TAG=p600f20, "
                      "against its one vLLM run); default: each run with vLLM's of its name")


def load(folder: pathlib.Path, prefix: str) -> dict:
  """{(shape, server, run): document}; run is quiet, int<N>, single, or int<N>_unpinned."""
  pat = re.compile(rf"{re.escape(prefix)}(.+?)_({'|'.join(SERVERS)})_(.+)\.json$")
  out = {}
  for p in sorted(folder.glob(f"{prefix}*.json")):
    if m := pat.match(p.name):
      out[m.groups()] = BS.load_result(p)
  return out


def _f(x, digits=0) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return f"{x:,.{digits}f}"


def _row_at(doc: dict | None, rate) -> dict | None:
  if doc is None:
    return None
  return next((r for r in doc["results"] if str(r["rate"]) == str(rate)), None)


def tail_s(doc: dict, row: dict) -> float | None:
  """The rate's tail (bench.serving's `tail_s`: the last request's send to the last answer's
  end), from its saved requests for a file older than the field."""
  if row.get("tail_s") is not None:
    return row["tail_s"]
  reqs = (doc.get("requests") or {}).get(str(row["rate"]))
  return BS.tail_s(BS.records_of(reqs)) if reqs else None


def quiet_of(run: str) -> str | None:
  """The quiet run a thrasher run is compared with: int32 -> quiet, s49_int32 -> s49_quiet
  (a TAG's runs), int32_unpinned -> quiet; None for a quiet or single run."""
  m = re.fullmatch(r"(.+_)?int\d+(_unpinned)?", run)
  return f"{m.group(1) or ''}quiet" if m else None


def serving_table(docs: dict, shape: str) -> list[str]:
  runs = sorted({run for (s, _, run) in docs if s == shape and run != "single"},
                key=lambda r: (r != "quiet", r))
  rates = []
  for (s, _, run), d in docs.items():
    if s == shape and run in runs:
      rates += [r["rate"] for r in d["results"] if r["rate"] not in rates]
  rates.sort(key=lambda r: math.inf if r == "inf" else float(r))
  out = ["| rate | run | server | out tok/s | P50 / P99 TTFT ms | P50 / P99 TPOT ms | J / token "
         "| tail s | host CPU s / 1k tok (engine) | int/quiet P99 TTFT, TPOT |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for rate in rates:
    for run in runs:
      for server in SERVERS:
        doc = docs.get((shape, server, run))
        r = _row_at(doc, rate)
        if r is None:
          continue
        q = _row_at(docs.get((shape, server, quiet_of(run) or "")), rate)
        ratio = "-"
        if q:
          ratio = (f"{r['ttft_ms_p99'] / q['ttft_ms_p99']:.2f}, "
                   f"{r['tpot_ms_p99'] / q['tpot_ms_p99']:.2f}")
        label = "all at once" if rate == "inf" else f"{float(rate):g}"
        out.append(
            f"| {label} | {run} | {NAMES[server]} | {_f(r['output_throughput'])} "
            f"| {_f(r.get('ttft_ms_p50'))} / {_f(r.get('ttft_ms_p99'))} "
            f"| {_f(r.get('tpot_ms_p50'), 2)} / {_f(r.get('tpot_ms_p99'), 2)} "
            f"| {_f(r.get('energy_per_token_j'), 3)} | {_f(tail_s(doc, r), 1)} "
            f"| {_f(r.get('host_cpu_s_per_1k_tokens'), 3)} "
            f"({_f(r.get('engine_cpu_s_per_1k_tokens'), 4)}) | {ratio} |")
  return out


def _ratio(ours: dict, theirs: dict, key: str) -> str:
  """ours[key] / theirs[key] as '1.23x', '-' where either lacks it."""
  if not ours.get(key) or not theirs.get(key):
    return "-"
  return f"{ours[key] / theirs[key]:.2f}x"


def vs_vllm(docs: dict, shape: str, server: str = "persistent",
            vllm_run: str | None = None) -> list[str]:
  """vLLM's figure over ours (>1: ours better) at each rate and run, beside Blink's best;
  each run against vLLM's run of the same name, or against `vllm_run`. The energy per token
  above idle is the steps per output token times the energy of a busy step above idle: the
  last two columns are those two, ours over vLLM's (docs/PERFORMANCE.md, "Where a served
  step's energy goes (revision faba37c)")."""
  out = [f"| rate | run | P99 TTFT (vLLM / {NAMES[server]}) | P99 TPOT | out tok/s "
         f"({NAMES[server]} / vLLM) | J / token saved (1 - ours / vLLM's) "
         f"| steps / token (ours / vLLM's) | J per busy step above idle (ours / vLLM's) |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for (s, srv, run), doc in sorted(docs.items()):
    if s != shape or srv != server or run == "single":
      continue
    for r in doc["results"]:
      v = _row_at(docs.get((shape, "vllm", vllm_run or run)), r["rate"])
      if v is None:
        continue
      label = "all at once" if r["rate"] == "inf" else f"{float(r['rate']):g}"
      energy = (f"{100 * (1 - r['energy_per_token_j'] / v['energy_per_token_j']):+.0f} %"
                if r.get("energy_per_token_j") and v.get("energy_per_token_j") else "-")
      out.append(f"| {label} | {run} | {v['ttft_ms_p99'] / r['ttft_ms_p99']:.2f}x "
                 f"| {v['tpot_ms_p99'] / r['tpot_ms_p99']:.2f}x "
                 f"| {r['output_throughput'] / v['output_throughput']:.2f}x | {energy} "
                 f"| {_ratio(r, v, 'device_steps_per_output_token')} "
                 f"| {_ratio(r, v, 'busy_energy_above_idle_per_step_j')} |")
  out.append(f"| Blink's paper | best | {BLINK_HEADLINE['p99_ttft']} | "
             f"{BLINK_HEADLINE['p99_tpot']} | {BLINK_HEADLINE['throughput']} | "
             f"{BLINK_HEADLINE['energy']} | - | - |")
  return out


def single_table(docs: dict) -> list[str]:
  out = ["| shape | server | P50 / P99 TPOT ms | P50 TTFT ms | J / token | host CPU s / 1k tok |",
         "| --- | --- | --- | --- | --- | --- |"]
  for (shape, server, run), doc in sorted(docs.items()):
    if run == "single":
      r = doc["results"][0]
      out.append(f"| {shape} | {NAMES[server]} | {_f(r['tpot_ms_p50'], 2)} / "
                 f"{_f(r['tpot_ms_p99'], 2)} | {_f(r['ttft_ms_p50'], 1)} "
                 f"| {_f(r.get('energy_per_token_j'), 3)} "
                 f"| {_f(r.get('host_cpu_s_per_1k_tokens'), 3)} |")
  return out


def crosscheck_table(folder: pathlib.Path, prefix: str) -> list[str]:
  keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
          "p99_tpot_ms", "median_itl_ms", "completed")
  out = ["| server | tool | " + " | ".join(keys) + " |", "| --- | --- |" + " --- |" * len(keys)]
  for p in sorted(folder.glob(f"{prefix}*.json")):
    d = json.loads(p.read_text())
    rows = {r["metric"]: r for r in d["results"]}
    for tool in ("vllm_bench_serve", "bench_serving", "ratio"):
      cells = [_f(rows[k][tool], 2 if tool == "ratio" or "tpot" in k or "itl" in k else 0)
               for k in keys]
      out.append(f"| {d['label']} | {tool} | " + " | ".join(cells) + " |")
  return out


def plot(docs: dict, shape: str, path: pathlib.Path) -> None:
  picked = [(f"{NAMES[srv]} {run}", doc["results"]) for (s, srv, run), doc in sorted(docs.items())
            if s == shape and re.fullmatch(r"(.+_)?(quiet|int\d+)", run)]  # tagged runs too
  BS.plot_results(picked, path, ("p99",))


def main(argv):
  del argv
  folder = pathlib.Path(FLAGS.results)
  docs = load(folder, FLAGS.prefix)
  if not docs:
    raise app.UsageError(f"no {FLAGS.prefix}<shape>_<server>_<run>.json in {folder}")
  for shape in sorted({s for s, _, _ in docs}):
    print(f"\n### {shape}\n")
    print("\n".join(serving_table(docs, shape)))
    if any(s == shape and srv == "vllm" for s, srv, _ in docs):
      print()
      print("\n".join(vs_vllm(docs, shape, vllm_run=FLAGS.vllm_run)))
    if FLAGS.plot_dir:
      plot(docs, shape, pathlib.Path(FLAGS.plot_dir) /
           f"{FLAGS.prefix}{shape.removeprefix('gemma3-')}_p99.png")
  print("\n### single stream\n")
  print("\n".join(single_table(docs)))
  cross = crosscheck_table(folder, FLAGS.crosscheck_prefix)
  if len(cross) > 2:
    print("\n### load generator cross-check\n")
    print("\n".join(cross))


if __name__ == "__main__":
  define_flags()
  app.run(main)
