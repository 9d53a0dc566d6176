"""bench/combine_ab.py: one file, medians and ratios from an A/B call's run files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import combine_ab as CA

ROOT = Path(__file__).resolve().parents[1]


def _run_file(folder: Path, stem: str, rows: list[dict], benchmark="executor_latency",
              revision="rev"):
  (folder / f"ab_executor_quiet_{stem}.json").write_text(json.dumps({
      "benchmark": benchmark, "device": "gpu:test", "date": "2026-12-01T06:00:00+00:00",
      "jax": "0.0", "command": f"bench ({stem})", "git_revision": revision, "results": rows}))


def _rows(b1: float, b64: float) -> list[dict]:
  return [{"mode": "persistent", "batch": 1, "interference": 0, "tpot_ms_p50": b1,
           "retried": False, "steady_from_token": 3},
          {"mode": "persistent", "batch": 64, "interference": 0, "tpot_ms_p50": b64}]


def _combine(folder: Path, *extra) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "bench.combine_ab", f"--dir={folder}",
       "--prefix=ab_executor_quiet_", f"--out={folder}/combined.json", "--side=base=021020b",
       "--side=new=HEAD (x=y)", "--command=gpu_check.sh ab", *extra],
      cwd=ROOT, capture_output=True, text=True)


def test_runs_in_call_order_with_median_spread_and_ratio(tmp_path):
  _run_file(tmp_path, "base_1", _rows(2.0, 3.0), revision="aaa")
  _run_file(tmp_path, "new_2", _rows(1.0, 3.3), revision="bbb")
  _run_file(tmp_path, "base_3", _rows(4.0, 3.0), revision="aaa")
  _run_file(tmp_path, "new_10", _rows(1.2, 3.3), revision="bbb")
  _run_file(tmp_path, "base_11", _rows(3.0, 3.6), revision="aaa")
  (tmp_path / "unrelated.json").write_text("{}")
  proc = _combine(tmp_path)
  assert proc.returncode == 0, proc.stderr
  data = json.loads((tmp_path / "combined.json").read_text())
  # Numeric call order (10 after 3), not the names' order.
  assert list(data["runs"]) == ["base_1", "new_2", "base_3", "new_10", "base_11"]
  assert data["sides"] == {"base": "021020b", "new": "HEAD (x=y)"}
  assert data["side_order"] == ["base", "new"]
  assert data["side_revisions"] == {"base": "aaa", "new": "bbb"}
  assert data["of"] == "executor_latency" and data["date"] == "2026-12-01"
  assert data["key"] == ["mode", "batch", "interference"]
  b1 = "mode=persistent batch=1 interference=0"
  base = data["stats"]["base"][b1]["tpot_ms_p50"]
  assert (base["median"], base["min"], base["max"], base["n"]) == (3.0, 2.0, 4.0, 3)
  assert data["stats"]["new"][b1]["tpot_ms_p50"]["median"] == 1.1
  # Booleans are not metrics; other numeric fields are.
  assert "retried" not in data["stats"]["base"][b1]
  assert data["stats"]["base"][b1]["steady_from_token"]["median"] == 3
  assert abs(data["ratios"]["new"][b1]["tpot_ms_p50"] - 1.1 / 3.0) < 1e-9
  b64 = "mode=persistent batch=64 interference=0"
  assert abs(data["ratios"]["new"][b64]["tpot_ms_p50"] - 1.1) < 1e-9
  # The printed table: the headline metrics of the benchmark, a line per row and metric.
  lines = [l for l in proc.stdout.splitlines() if "tpot_ms_p50" in l]
  assert len(lines) == 2 and lines[0].startswith(b1) and "new/base 0.367" in lines[0]
  assert "steady_from_token" not in proc.stdout


def test_unknown_benchmark_keys_on_text_fields():
  runs = {"a_1": {"benchmark": "other", "results": [{"name": "x", "v": 1.0}]},
          "b_2": {"benchmark": "other", "results": [{"name": "x", "v": 3.0}]}}
  out = CA.combine(runs)
  assert out["key"] == ["name"] and out["side_order"] == ["a", "b"]
  assert out["ratios"]["b"]["name=x"]["v"] == 3.0


def test_an_empty_folder_is_a_usage_error(tmp_path):
  proc = _combine(tmp_path)
  assert proc.returncode != 0 and "no ab_executor_quiet_<side>_<n>.json" in proc.stderr
  assert not (tmp_path / "combined.json").exists()
