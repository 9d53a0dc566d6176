"""bench/kernel_profile.py: GPU kernel time per loop iteration from a perfetto trace."""
import gzip
import json

import pytest

from bench import kernel_profile as K


def _trace(kernels, host_events=()):
  """A perfetto trace as jax.profiler writes it: a host process and a GPU process."""
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name",
             "args": {"name": "/device:GPU:0 (NVIDIA H200)"}}]
  events += [{"ph": "X", "pid": 1, "tid": 1, "ts": t, "dur": d, "name": n}
             for n, t, d in host_events]
  events += [{"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": d, "name": n} for n, t, d in kernels]
  return {"displayTimeUnit": "ns", "traceEvents": events}


def test_groups_gpu_kernels_by_kind_per_iteration():
  kernels = []
  for i in range(2):  # two loop iterations, 100 us apart
    base = 100.0 * i
    kernels += [("schedule_kernel", base, 7.0), ("gemm_fusion_dot_343", base + 10, 5.0),
                ("gemm_fusion_dot_344", base + 16, 3.0), ("blink_add_rms_norm", base + 20, 2.0),
                ("loop_multiply_fusion_1", base + 23, 1.0), ("commit_kernel", base + 30, 3.0)]
  summary = K.summarize(K.gpu_kernels(_trace(kernels, [("PjitFunction(step)", 0, 500.0)])))
  assert summary["iterations"] == 2
  assert summary["launches_per_iteration"] == 6
  assert summary["busy_us_per_iteration"] == pytest.approx(21.0)
  assert summary["span_us_per_iteration"] == pytest.approx(133.0 / 2)
  kinds = {r["kind"]: r for r in summary["kinds"]}
  assert kinds["scheduler"]["us_per_iteration"] == pytest.approx(10.0)
  assert kinds["matmul"]["launches_per_iteration"] == 2
  assert kinds["matmul"]["us_per_launch"] == pytest.approx(4.0)
  assert kinds["add + norm"]["us_per_iteration"] == pytest.approx(2.0)
  assert kinds["elementwise"]["us_per_iteration"] == pytest.approx(1.0)
  assert summary["kinds"][0]["kind"] == "scheduler"  # largest first
  assert summary["top_kernels"][0]["kernel"] == "schedule_kernel"


def test_a_trace_without_gpu_kernels_is_an_error(tmp_path):
  path = tmp_path / "perfetto_trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump(_trace([], [("PjitFunction(step)", 0, 5.0)]), f)
  assert K.find_trace(str(tmp_path)) == str(path)
  with gzip.open(K.find_trace(str(tmp_path)), "rt") as f:
    with pytest.raises(ValueError, match="no GPU kernels"):
      K.summarize(K.gpu_kernels(json.load(f)))
  with pytest.raises(FileNotFoundError):
    K.find_trace(str(tmp_path / "missing"))


def test_iterations_given_for_traces_of_bare_steps():
  # A bare model step has no scheduler kernel to count iterations by.
  kernels = [("gemm_fusion_dot", 10.0 * i, 4.0) for i in range(6)]
  summary = K.summarize(K.gpu_kernels(_trace(kernels)), iterations=3)
  assert summary["iterations"] == 3
  assert summary["launches_per_iteration"] == 2
  assert summary["busy_us_per_iteration"] == pytest.approx(8.0)
