"""bench/step.py's step shapes (CPU): the rows of decode, prefill and a burst's mixed steps,
and one small run of each through the real model."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import step as bench_step

REPO = Path(__file__).resolve().parents[1]


def test_mixed_step_rows_put_decode_rows_first_then_prompt_chunks():
  pos, seq, logit_rows, seqs, longest = bench_step.step_rows(
      "mixed", 3, 100, tokens=16, prompt=5, logit_rows=8)
  assert pos.tolist() == [99, 99, 99, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
  assert seq.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 5, 5, 5]
  assert logit_rows.tolist() == list(range(8)) and seqs == 6 and longest == 100
  # all prompt rows (no decode rows), and a step of decode rows only
  pos, seq, _, seqs, longest = bench_step.step_rows("mixed", 0, 100, tokens=8, prompt=8,
                                                    logit_rows=256)
  assert pos.tolist() == list(range(8)) and set(seq.tolist()) == {0} and seqs == 1
  assert longest == 100
  pos, seq, _, seqs, _ = bench_step.step_rows("mixed", 4, 50, tokens=4, prompt=8, logit_rows=2)
  assert pos.tolist() == [49] * 4 and seq.tolist() == [0, 1, 2, 3] and seqs == 4


def test_decode_and_prefill_rows():
  pos, seq, rows, seqs, _ = bench_step.step_rows("decode", 4, 64)
  assert (pos == 63).all() and seq.tolist() == [0, 1, 2, 3] and rows.tolist() == [0, 1, 2, 3]
  pos, seq, rows, seqs, _ = bench_step.step_rows("prefill", 1, 10)
  assert pos.tolist() == list(range(10)) and (seq == 0).all() and rows.tolist() == [9]
  assert seqs == 1


def test_bench_step_runs_mixed_steps(tmp_path):
  out = tmp_path / "step.json"
  run = subprocess.run(
      [sys.executable, "-m", "bench.step", "--config", "tiny", "--batches", "",
       "--prefill_lengths", "", "--mixed", "32:4", "--mixed_prompt", "10", "--context", "40",
       "--steps", "5", "--repeats", "1", "--noscheduler", "--copy_elems", "1024",
       "--matmul_n", "64", "--out", str(out)],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  rows = json.loads(out.read_text())["results"]
  assert len(rows) == 1
  r = rows[0]
  assert (r["kind"], r["batch"], r["tokens"], r["prompt_chunk"], r["logit_rows"]) == (
      "mixed", 4, 32, 10, 32)
  assert np.isfinite(r["ms_per_step_median"]) and r["ms_per_step_median"] > 0


def test_energy_counter_measures_a_block_or_says_why_not():
  # NVML's energy counter where there is one (a GPU host); a reason and no figure elsewhere.
  from bench import common as C
  with C.EnergyCounter() as counter:
    sum(range(1000))
  if counter.reason:
    assert counter.joules is None
    assert "NVML" in counter.reason or "pynvml" in counter.reason
  else:
    assert counter.joules >= 0 and counter.seconds > 0


def test_energy_per_unit_above_the_idle_power():
  from bench import common as C
  # 300 J over 2 s and 1,000 steps with the GPUs idling at 100 W: 100 J above idle.
  row = C.energy_per("step", 300.0, 2.0, 1000, 100.0)
  assert row["avg_power_w"] == 150.0 and row["idle_power_w"] == 100.0
  assert row["energy_per_step_j"] == pytest.approx(0.3)
  assert row["energy_above_idle_per_step_j"] == pytest.approx(0.1)
  assert set(C.energy_per("product", 3.0, 2.0, 10, None)) == {"energy_per_product_j",
                                                                "avg_power_w"}
  assert C.energy_per("step", 3.0, 2.0, 0, 100.0) == {}


def test_idle_power_is_measured_once_per_key(monkeypatch):
  from bench import common as C
  calls = []
  monkeypatch.setattr(C, "_IDLE_POWER", {})
  monkeypatch.setattr(C.time, "sleep", lambda s: calls.append(s))
  first = C.idle_power(key="engine-a", seconds=0.01)
  assert C.idle_power(key="engine-a", seconds=0.01) == first and len(calls) == 1
  C.idle_power(key="engine-b", seconds=0.01)
  assert len(calls) == 2
