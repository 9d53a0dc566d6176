"""bench/frontend.py: serve.py over the fake device with one and two frontend workers, a few
streams each (CPU, seconds)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_frontend_bench_compares_worker_counts(tmp_path):
  out = tmp_path / "frontend.json"
  r = subprocess.run([sys.executable, "-m", "bench.frontend", "--workers", "1,2", "--streams",
                      "12", "--output_len", "24", "--repeats", "1", "--out", str(out)],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert doc["benchmark"] == "frontend" and doc["streams"] == 12
  assert [row["workers"] for row in doc["results"]] == [1, 2]
  for row in doc["results"]:
    (run,) = row["runs"]
    assert run["completed"] == 12 and run["failed"] == 0 and row["failed"] == 0
    assert run["output_throughput"] > 0 and row["output_throughput_median"] == \
        run["output_throughput"]
    # Every token reached the client, in at most one chunk each, and one chunk ends each
    # stream (its finish_reason).
    assert 0 < run["chunks_per_token"] <= 1 + 1 / 24
    # The workers' CPU is counted as the frontend's (the fake engine's few steps may stay
    # under one clock tick).
    assert run["frontend_cpu_s_per_1k_tokens"] > 0 and run["engine_cpu_s_per_1k_tokens"] >= 0
