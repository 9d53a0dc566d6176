"""bench/vllm_step.py: vLLM's decode step from two generates, its kernels from two traces (the
parts that need no GPU and no vLLM; the benchmark itself runs on the device machine)."""
import gzip
import json
import threading

import pytest

from bench import vllm_step as V


def test_a_step_is_the_difference_of_the_two_generates_over_the_tokens():
  short = {"seconds": 0.050, "joules": 15.0}      # prefill + first token
  long = {"seconds": 0.050 + 128 * 0.002, "joules": 15.0 + 128 * 0.6}
  step = V.per_step(short, long, 128, idle_w=120.0)
  assert step["ms_per_step"] == pytest.approx(2.0)
  assert step["energy_per_step_j"] == pytest.approx(0.6)
  assert step["avg_power_w"] == pytest.approx(300.0)
  assert step["energy_above_idle_per_step_j"] == pytest.approx(0.6 - 120.0 * 0.002)


def test_without_an_energy_counter_only_time_is_reported():
  step = V.per_step({"seconds": 1.0, "joules": None}, {"seconds": 2.0, "joules": None}, 100,
                    idle_w=None)
  assert step == {"ms_per_step": pytest.approx(10.0)}


def _trace(kernels):
  """A torch profiler trace: CPU ops, CUDA runtime calls and GPU kernels."""
  events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 9.0}]
  events += [{"ph": "X", "cat": cat, "name": n, "ts": 10 + i, "dur": d}
             for i, (cat, n, d) in enumerate(kernels)]
  return {"traceEvents": events}


def test_trace_kernels_are_the_gpu_events_only():
  trace = _trace([("kernel", "gemv_kernel", 4.0), ("gpu_memcpy", "Memcpy HtoD", 1.5),
                  ("gpu_memset", "Memset", 0.5)])
  assert V.trace_kernels(trace) == [("gemv_kernel", 4.0), ("Memcpy HtoD", 1.5),
                                    ("Memset", 0.5)]


def test_kernel_table_takes_the_prefill_out():
  prefill = [("flash_fwd_prefill", 300.0), ("gemm_big", 500.0), ("sample", 5.0)]
  step = [("gemv", 10.0), ("gemv", 12.0), ("flash_decode", 6.0), ("sample", 5.0)]
  short = prefill
  long = prefill + step * 4  # 4 decode steps after the same prefill
  table = V.kernel_table(short, long, tokens=4, top=2)
  assert table["busy_us_per_step"] == pytest.approx(33.0)
  assert table["launches_per_step"] == pytest.approx(4.0)
  assert [r["kernel"] for r in table["top_kernels"]] == ["gemv", "flash_decode"]
  assert table["top_kernels"][0]["us_per_step"] == pytest.approx(22.0)
  assert table["top_kernels"][0]["launches_per_step"] == pytest.approx(2.0)


def test_the_new_trace_is_waited_for_until_written(tmp_path):
  old = tmp_path / "old.pt.trace.json.gz"
  old.write_bytes(b"x")
  before = {str(old)}
  path = tmp_path / "worker" / "b1_n33_dp0_pp0_tp0.pt.trace.json.gz"

  def write():
    path.parent.mkdir()
    with gzip.open(path, "wt") as f:
      json.dump(_trace([("kernel", "k", 1.0)]), f)
  threading.Timer(0.3, write).start()
  found = V._new_traces(str(tmp_path), before, timeout_s=10)
  assert found == [str(path)]
  assert V.trace_kernels(V._load_trace(found[0])) == [("k", 1.0)]


def test_no_trace_is_a_clear_timeout(tmp_path):
  with pytest.raises(TimeoutError, match="no new trace"):
    V._new_traces(str(tmp_path), set(), timeout_s=0.5)


def test_a_result_written_without_jax_does_not_start_jax(tmp_path):
  """A load generator or a torch benchmark (this one, beside vLLM) names its device without
  starting a JAX client on the GPU a server holds."""
  import subprocess
  import sys
  code = ("import sys, json; from bench import common as C; "
          f"p = C.write_result({str(tmp_path / 'r.json')!r}, 'x', []); "
          "print('jax' in sys.modules, json.load(open(p))['device'])")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=V.C.ROOT).stdout.split("\n")[-2]
  assert out.startswith("False "), out
  assert out.split(" ", 1)[1].startswith(("gpu:", "cpu:")), out


def test_prefill_per_prompt_from_the_one_token_generate():
  # 4 prompts prefilled in 20 ms for 10 J, idle 100 W: 5 ms and 2.5 J a prompt, 2 J above idle.
  row = V.prefill({"seconds": 0.02, "joules": 10.0}, 4, 100.0)
  assert row["prefill_ms_per_prompt"] == pytest.approx(5.0)
  assert row["prefill_energy_per_prompt_j"] == pytest.approx(2.5)
  assert row["prefill_energy_above_idle_per_prompt_j"] == pytest.approx(2.0)
  assert set(V.prefill({"seconds": 0.02, "joules": None}, 4, 100.0)) == {"prefill_ms_per_prompt"}
