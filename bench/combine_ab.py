"""One result file for an A/B call of bench/gpu_check.sh: its run files (<prefix><side>_<n>.json,
n the call order, each a benchmark's result file), what each side was, and per side and row
the median and spread over its runs of each metric, with the ratio of each side's median to
the first side's.

  python -m bench.combine_ab --dir $OUT --prefix ab_executor_quiet_ \\
    --out bench/results/ab_executor_quiet_h200.json \\
    --side "base=021020b (scripts/bench_executor.py)" --side "new=HEAD" \\
    --command "AB='base=021020b new=HEAD' bash bench/gpu_check.sh ab"

Rows of the runs are matched by their key fields (KEYS, per benchmark; --key names them), and
every other numeric field is a metric (--metric limits the printed table, not the file).
"""
from __future__ import annotations

import json
import pathlib
import re
import statistics

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("dir", None, "folder holding the call's run files", required=True)
  flags.DEFINE_string("prefix", "ab_", "run files are <prefix><side>_<n>.json")
  flags.DEFINE_string("out", None, "combined JSON file", required=True)
  flags.DEFINE_string("revision", None, "the revisions compared, in words (default: each "
                      "side's git_revision from its run files)")
  flags.DEFINE_multi_string("side", [], "name=what this side was (a revision, its command)")
  flags.DEFINE_string("command", None, "the device command", required=True)
  flags.DEFINE_list("key", [], "row fields that identify a row (default: KEYS of the "
                    "benchmark, else its text and boolean fields)")
  flags.DEFINE_list("metric", [], "metrics of the printed table (default: HEADLINE of the "
                    "benchmark, else every metric)")


# A run's key: its file name less the prefix and ".json" (side, call order).
RUN = re.compile(r"(?P<side>.+)_(?P<n>\d+)$")
# Per benchmark: the fields that identify a row, and the metrics the table shows.
KEYS = {
    "executor_latency": ("mode", "batch", "interference"),
    "sched_step": ("mailbox", "lanes", "doorbell_us", "interference"),
    "step": ("kind", "batch", "tokens", "context"),
    "loop_overhead": ("variant", "interference"),
    "hf_reference": ("impl", "compile", "batch"),
    "serving": ("label", "rate"),
    "kernel_profile": ("kind",),
    "sampling": ("rows", "mode", "search_ways"),
}
HEADLINE = {
    "executor_latency": ("tpot_ms_p50", "tpot_ms_p99", "device_tpot_ms_p50",
                         "device_tpot_ms_p99"),
    "sched_step": ("schedule_kernel_us", "commit_kernel_us", "us_per_step_median"),
    "step": ("ms_per_step_median", "tokens_per_s", "energy_per_step_j",
             "energy_above_idle_per_step_j"),
    "loop_overhead": ("us_per_iter_median", "kernel_us_per_iter_median"),
    "hf_reference": ("ms_per_token_median",),
    "serving": ("ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "output_throughput"),
    "kernel_profile": ("us_per_iteration",),
    "sampling": ("us_per_sample_call_median",),
}


def load_runs(folder: pathlib.Path, prefix: str) -> dict[str, dict]:
  """Run key (<side>_<n>) -> the run file's contents, in call order (n, numerically)."""
  found = []
  for path in folder.glob(f"{prefix}*.json"):
    m = RUN.match(path.stem[len(prefix):])
    if m:
      found.append((int(m["n"]), m["side"], path))
  return {f"{side}_{n}": json.loads(path.read_text()) for n, side, path in sorted(found)}


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def key_fields(benchmark: str, rows: list[dict], given=()) -> tuple[str, ...]:
  if given:
    return tuple(given)
  if benchmark in KEYS:
    return KEYS[benchmark]
  return tuple(sorted({k for r in rows for k, v in r.items() if isinstance(v, (str, bool))}))


def row_key(row: dict, keys) -> str:
  return " ".join(f"{k}={row[k]}" for k in keys if k in row)


def combine(runs: dict[str, dict], keys=()) -> dict:
  """Per side, row key -> metric -> {median, min, max, n, all} over the side's runs, and
  per side (the first excepted) the ratio of its medians to the first side's."""
  benchmark = next(iter(runs.values())).get("benchmark", "")
  all_rows = [r for run in runs.values() for r in run.get("results", [])]
  keys = key_fields(benchmark, all_rows, keys)
  values: dict[str, dict[str, dict[str, list[float]]]] = {}
  for run_key, run in runs.items():
    side = RUN.match(run_key)["side"]
    cells = values.setdefault(side, {})
    for row in run.get("results", []):
      metrics = cells.setdefault(row_key(row, keys), {})
      for k, v in row.items():
        if k not in keys and _number(v):
          metrics.setdefault(k, []).append(float(v))
  stats = {side: {rk: {m: {"median": statistics.median(v), "min": min(v), "max": max(v),
                           "n": len(v), "all": v} for m, v in metrics.items()}
                  for rk, metrics in cells.items()}
           for side, cells in values.items()}
  sides = list(stats)
  ratios = {}
  for side in sides[1:]:
    ratios[side] = {}
    for rk, metrics in stats[side].items():
      base = stats[sides[0]].get(rk, {})
      ratios[side][rk] = {m: s["median"] / base[m]["median"] for m, s in metrics.items()
                          if m in base and base[m]["median"]}
  return {"key": list(keys), "side_order": sides, "stats": stats, "ratios": ratios}


def table(combined: dict, metrics) -> list[str]:
  """One line per row key and metric: each side's median [min-max], then the ratios."""
  sides, stats = combined["side_order"], combined["stats"]
  lines = []
  row_keys = list(dict.fromkeys(rk for s in sides for rk in stats[s]))
  for rk in row_keys:
    names = metrics or sorted({m for s in sides for m in stats[s].get(rk, {})})
    for m in names:
      if not any(m in stats[s].get(rk, {}) for s in sides):
        continue
      cells = []
      for s in sides:
        c = stats[s].get(rk, {}).get(m)
        cells.append(f"{s} {c['median']:.4g} [{c['min']:.4g}-{c['max']:.4g}] n={c['n']}"
                     if c else f"{s} -")
      for s in sides[1:]:
        r = combined["ratios"][s].get(rk, {}).get(m)
        if r is not None:
          cells.append(f"{s}/{sides[0]} {r:.3f}")
      lines.append(f"{rk:40} {m:24} " + "  ".join(cells))
  return lines


def main(_):
  folder = pathlib.Path(FLAGS.dir)
  runs = load_runs(folder, FLAGS.prefix)
  if not runs:
    raise app.UsageError(f"no {FLAGS.prefix}<side>_<n>.json in {folder}")
  header = next(iter(runs.values()))
  combined = combine(runs, FLAGS.key)
  revisions = {}
  for run_key, run in runs.items():
    revisions.setdefault(RUN.match(run_key)["side"], run.get("git_revision"))
  out = {
      "benchmark": "ab", "of": header.get("benchmark"), "device": header.get("device"),
      "date": (header.get("date") or "")[:10], "jax": header.get("jax"),
      "command": FLAGS.command,
      "git_revision": FLAGS.revision or " vs ".join(f"{s}={r}" for s, r in revisions.items()),
      "side_revisions": revisions,
      "sides": dict(v.split("=", 1) for v in FLAGS.side),
      **combined,
      "runs": {k: {"command": r.get("command"), "git_revision": r.get("git_revision"),
                   "results": r.get("results")} for k, r in runs.items()},
  }
  pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")
  metrics = FLAGS.metric or HEADLINE.get(out["of"], ())
  print("\n".join(table(combined, metrics)))
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
