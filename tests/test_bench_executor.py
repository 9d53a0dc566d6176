"""bench/executor.py and its per-token clock (bench/diag/token_clock.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.diag.token_clock import TokenClock

ROOT = Path(__file__).resolve().parents[1]


def _clock(stamps):
  clock = TokenClock.__new__(TokenClock)  # no process: stamps given
  clock.stamps = stamps
  return clock


def test_intervals_start_at_the_given_device_time_and_divide_by_the_entries_seen():
  # (count, frontend seconds, device ns); count 5 arrived two entries at once.
  stamps = [(0, 0.0, 0), (1, 1.0, 1_000_000_000), (2, 1.002, 1_002_000_000),
            (3, 1.004, 1_004_000_000), (5, 1.010, 1_010_000_000)]
  np.testing.assert_allclose(_clock(stamps).intervals_ms(), [2.0, 2.0, 3.0])
  # From the GPU's time of the last request's first token (bench.executor's steady window):
  # the first entry written at or after it, however late the frontend saw it.
  np.testing.assert_allclose(_clock(stamps).intervals_ms(1_003_000_000), [3.0])
  assert _clock(stamps).first_count_at(1_003_000_000) == 3
  assert _clock(stamps).first_count_at(1_005_000_000) == 5
  assert _clock(stamps).first_count_at(2_000_000_000) is None
  np.testing.assert_allclose(_clock(stamps).intervals_ms(1_002_000_000, device=True),
                             [2.0, 3.0])


def test_intervals_ignore_the_previous_request_of_the_slot():
  stamps = [(7, 0.5, 0), (8, 0.6, 0), (1, 1.0, 0), (2, 1.001, 0), (3, 1.003, 0)]
  np.testing.assert_allclose(_clock(stamps).intervals_ms(), [1.0, 2.0])


def test_cpu_run_writes_rows_for_every_mode_and_batch(tmp_path):
  # One step size (--buckets 8): one branch per engine to compile, 35 s instead of 59 on 2 cores.
  out = tmp_path / "ex.json"
  subprocess.run([sys.executable, "-m", "bench.executor", "--config", "tiny", "--dtype",
                  "float32", "--batches", "1,2", "--prompt", "16", "--tokens", "48",
                  "--interference", "0", "--modes", "persistent,host", "--gemv", "none",
                  "--decode_rows", "8", "--buckets", "8", "--out", str(out)],
                 cwd=ROOT, check=True, capture_output=True, timeout=600)
  res = json.loads(out.read_text())
  rows = res["results"]
  assert [(r["mode"], r["batch"]) for r in rows] == [
      ("persistent", 1), ("persistent", 2), ("host", 1), ("host", 2)]
  for r in rows:
    assert r["steady_from_token"] >= 1
    assert 0 < r.get("tpot_ms_n", 0) <= 48 - r["steady_from_token"]
    assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
    assert r["iterations_per_token"] > 0.9 and r["steps_per_token"] > 0.9  # header lags a step
  assert res["modes"]["persistent"]["loop_report"]["device_while"] is False  # CPU
  # The kernels are flags (KernelOptions), recorded as asked and as resolved on the CPU; no
  # BLINK_* environment is dumped.
  assert res["kernels"]["asked"] == {"attention": "auto", "prefill": "auto", "norm": "auto",
                                     "gemv": "none", "decode_rows": 8, "decode_head": None,
                                     "split_matmul": False}
  assert res["kernels"]["resolved"]["attention"] == "blocked"
  assert res["modes"]["persistent"]["kernels"]["gemv"] == "none"
  assert "blink_env" not in res
  assert res["command"].startswith("python -m bench.executor --config tiny")


def test_tensor_parallel_run_splits_the_model(tmp_path):
  """--tensor_parallel (EngineConfig's flag): the persistent loop over two XLA host devices,
  as on two GPUs (issue 23's batch-1 latency against one GPU is this recipe there)."""
  import os
  out = tmp_path / "tp.json"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  subprocess.run([sys.executable, "-m", "bench.executor", "--config", "tiny", "--dtype",
                  "float32", "--batches", "1", "--prompt", "16", "--tokens", "24",
                  "--interference", "0", "--modes", "persistent", "--gemv", "none",
                  "--tensor_parallel", "2", "--buckets", "8", "--out", str(out)],
                 cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
  res = json.loads(out.read_text())
  assert res["tensor_parallel"] == 2
  assert res["modes"]["persistent"]["devices"] == ["cpu:0", "cpu:1"]
  [row] = res["results"]
  assert row["batch"] == 1 and row["steady_from_token"] >= 1 and row["last_to_start"] == 0
  assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]


def test_cpu_run_as_served_uses_the_engines_defaults(tmp_path):
  """--as_served_context: the engine at EngineConfig's defaults (4,096 slots, prefix caching,
  its own shared-memory mailbox, which the token clock maps) with that context."""
  from blink_jax.engine_config import EngineConfig
  out = tmp_path / "ex.json"
  run = subprocess.run([sys.executable, "-m", "bench.executor", "--config", "tiny", "--dtype",
                        "float32", "--batches", "1", "--prompt", "16", "--tokens", "48",
                        "--interference", "0", "--modes", "persistent", "--gemv", "none",
                        "--decode_rows", "8", "--as_served_context", "256", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "leaked shared_memory" not in run.stderr
  res = json.loads(out.read_text())
  engine = res["modes"]["persistent"]["engine"]
  assert res["as_served_context"] == 256 and engine["max_context"] == 256
  assert engine["num_slots"] == EngineConfig().num_slots and engine["prefix_caching"]
  (row,) = res["results"]
  # A lone request's window opens at its first token, by the GPU's stamp (a polling loop
  # that first saw all its tokens at once once left no interval: CI's KeyError 'tpot_ms_p50').
  assert row["batch"] == 1 and row["steady_from_token"] >= 1 and row["last_to_start"] == 0
  assert 0 < row["tpot_ms_n"] <= 48 - row["steady_from_token"]
  assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]
