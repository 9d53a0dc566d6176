"""One result file for a `gpu_check.sh schedab` call: its run files (sched_ab_<name>[_fused]_<n>.json)
with what each variant was, and a table of the median kernel times per variant.

  python scripts/combine_ab.py --dir /tmp/results --out bench/results/sched_ab_poll_h200.json \
    --revision "0b363ef (base) vs 478e55c (new)" --variant "base=ffi/ of 0b363ef" \
    --variant "new=ffi/ of 478e55c: ..." --command "SCHED_AB='base=ab_base new=.' gpu_check.sh schedab"
"""
from __future__ import annotations

import json
import pathlib
import re
import statistics

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("dir", None, "folder holding the call's sched_ab_*.json files", required=True)
flags.DEFINE_string("out", None, "combined JSON file", required=True)
flags.DEFINE_string("revision", None, "the revisions compared, in words", required=True)
flags.DEFINE_multi_string("variant", [], "name=what this variant's ffi/ tree was")
flags.DEFINE_string("command", None, "the device command", required=True)

# A run's key: its file name less "sched_ab_" and ".json" (variant, fused or not, call order).
KEY = re.compile(r"(?P<name>.+?)(?P<fused>_fused)?_(?P<n>\d+)$")
# Kernel-time columns of a run file: the fused step's kernel time is in commit_kernel_us.
COLUMNS = {False: ("schedule_kernel_us", "commit_kernel_us"), True: ("commit_kernel_us",)}


def load_runs(folder: pathlib.Path) -> tuple[dict[str, dict], dict]:
  """(key -> the run's command and results, in call order; the first run file's header)."""
  runs, header = {}, {}
  paths = [(p, p.stem.removeprefix("sched_ab_")) for p in folder.glob("sched_ab_*.json")]
  for path, key in sorted((pk for pk in paths if KEY.match(pk[1])),
                          key=lambda pk: int(KEY.match(pk[1])["n"])):
    data = json.loads(path.read_text())
    runs[key] = {"command": data["command"], "results": data["results"]}
    header = header or data
  return runs, header


def medians(runs: dict[str, dict]) -> dict[str, dict[str, float]]:
  """Per variant, 'lanes kind' -> the median over its runs of the kernel time (us): kind is
  schedule, commit or fused (the fused step kernel)."""
  table: dict[str, dict[str, list[float]]] = {}
  for key, run in runs.items():
    m = KEY.match(key)
    fused = m["fused"] is not None
    cells = table.setdefault(m["name"], {})
    for row in run["results"]:
      for col in COLUMNS[fused]:
        kind = "fused" if fused else col.split("_")[0]
        cells.setdefault(f"{row['lanes']} {kind}", []).append(row[col])
  return {name: {k: round(statistics.median(v), 3) for k, v in cells.items()}
          for name, cells in table.items()}


def main(_):
  folder = pathlib.Path(FLAGS.dir)
  runs, header = load_runs(folder)
  if not runs:
    raise app.UsageError(f"no sched_ab_*.json in {folder}")
  out = {
      "benchmark": "sched_ab", "device": header["device"], "date": header["date"][:10],
      "jax": header["jax"], "command": FLAGS.command, "git_revision": FLAGS.revision,
      "variants": dict(v.split("=", 1) for v in FLAGS.variant),
      "median_kernel_us": medians(runs), "runs": runs,
  }
  pathlib.Path(FLAGS.out).write_text(json.dumps(out, indent=1) + "\n")
  for name, cells in out["median_kernel_us"].items():
    by_lanes = sorted(cells.items(), key=lambda kv: (int(kv[0].split()[0]), kv[0]))
    print(name.ljust(10), "  ".join(f"{k}={v}" for k, v in by_lanes))


if __name__ == "__main__":
  app.run(main)
