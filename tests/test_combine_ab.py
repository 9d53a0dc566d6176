"""scripts/combine_ab.py: one file and median table from a schedab call's run files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_file(folder: Path, stem: str, kernel_us: dict[int, tuple[float, float]]):
  results = [{"lanes": lanes, "schedule_kernel_us": s, "commit_kernel_us": c}
             for lanes, (s, c) in kernel_us.items()]
  (folder / f"sched_ab_{stem}.json").write_text(json.dumps({
      "benchmark": "sched_step", "device": "gpu:test", "date": "2026-12-01T06:00:00+00:00",
      "jax": "0.0", "command": f"bench_sched.py ({stem})", "results": results}))


def test_runs_are_kept_in_call_order_and_medians_split_by_kernel(tmp_path):
  _run_file(tmp_path, "base_1", {1: (7.0, 2.0), 256: (9.0, 4.0)})
  _run_file(tmp_path, "base_fused_2", {1: (0.0, 9.0), 256: (0.0, 11.0)})
  _run_file(tmp_path, "new_3", {1: (6.0, 2.5), 256: (8.0, 4.5)})
  _run_file(tmp_path, "base_10", {1: (8.0, 3.0), 256: (10.0, 5.0)})
  _run_file(tmp_path, "base_11", {1: (9.0, 1.0), 256: (11.0, 3.0)})
  out = tmp_path / "combined.json"
  proc = subprocess.run(
      [sys.executable, "scripts/combine_ab.py", f"--dir={tmp_path}", f"--out={out}",
       "--revision=a vs b", "--variant=base=the old tree", "--variant=new=x=y, the new one",
       "--command=gpu_check.sh schedab"],
      cwd=ROOT, capture_output=True, text=True, check=True)
  data = json.loads(out.read_text())
  # Numeric order of the call (10 after 3), not the names' order.
  assert list(data["runs"]) == ["base_1", "base_fused_2", "new_3", "base_10", "base_11"]
  assert data["variants"] == {"base": "the old tree", "new": "x=y, the new one"}
  assert data["date"] == "2026-12-01" and data["device"] == "gpu:test"
  base = data["median_kernel_us"]["base"]
  assert base["1 schedule"] == 8.0 and base["1 commit"] == 2.0
  assert base["256 schedule"] == 10.0 and base["256 commit"] == 4.0
  # A fused run's step kernel is its own column, not schedule or commit.
  assert base["1 fused"] == 9.0 and base["256 fused"] == 11.0
  assert data["median_kernel_us"]["new"] == {"1 schedule": 6.0, "1 commit": 2.5,
                                             "256 schedule": 8.0, "256 commit": 4.5}
  # The printed table: one line per variant, lane counts in numeric order.
  first = proc.stdout.splitlines()[0]
  assert first.startswith("base") and first.index("1 commit=2.0") < first.index("256 commit=4.0")


def test_an_empty_folder_is_a_usage_error(tmp_path):
  proc = subprocess.run(
      [sys.executable, "scripts/combine_ab.py", f"--dir={tmp_path}", f"--out={tmp_path}/o.json",
       "--revision=r", "--command=c"], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode != 0 and "no sched_ab_*.json" in proc.stderr
  assert not (tmp_path / "o.json").exists()
