"""Where a serving loop's GPU time goes: GPU kernel time per loop iteration, by kind of kernel,
from a trace `jax.profiler.trace(..., create_perfetto_trace=True)` wrote (for example
`python -m bench.executor --profile DIR`).

  python -m bench.kernel_profile --trace DIR/persistent_b1 \
      --out bench/results/kernel_profile_b1_h200.json

Kernels are grouped by name (KINDS: first match wins); loop iterations are counted by the
scheduler's kernels. `busy_us_per_iteration` against `span_us_per_iteration` says how much of
an iteration the GPU spends running kernels rather than between them.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

from absl import app, flags

from bench import common as C

flags.DEFINE_string("trace", None, "perfetto_trace.json.gz, or a directory holding one")
flags.DEFINE_string("out", None, "JSON result file (default: print only)")
flags.DEFINE_integer("top", 15, "kernels listed by name")
flags.DEFINE_integer("iterations", None, "iterations the trace holds (default: counted by the "
                     "scheduler's kernels; give it for traces of bare steps)")
FLAGS = flags.FLAGS

# (kind, pattern) in order: names of the kernels XLA, Pallas and ffi/ launch.
KINDS = (
    ("scheduler", r"schedule_kernel|commit_kernel|copy_words"),
    ("attention", r"blink_paged_decode_attention|blink_paged_prefill"),
    ("attention merge", r"blink_paged_decode_merge"),
    ("add + norm", r"blink_add_rms_norm"),
    ("q/k prepare", r"blink_prepare_qkv"),
    ("matmul", r"gemm|cublas|cutlass|sm\d+_xmma|triton_gemm|matmul"),
    ("reduction", r"reduce|input_"),
    ("elementwise", r"loop_|wrapped_|fusion"),
    ("memcpy/memset", r"[Mm]emcpy|[Mm]emset"),
)
# The kernel that runs once per loop iteration: the scheduler's first (blink_schedule).
ITERATION_KERNEL = re.compile(r"schedule_kernel")


def kind_of(name: str) -> str:
  for kind, pattern in KINDS:
    if re.search(pattern, name):
      return kind
  return "other"


def gpu_kernels(trace: dict) -> list[tuple[str, float, float]]:
  """(name, start us, duration us) of every event on a GPU device's timelines."""
  gpu_pids = {e["pid"] for e in trace["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and re.search(r"/device:GPU", e.get("args", {}).get("name", ""))}
  return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace["traceEvents"]
          if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def summarize(kernels: list[tuple[str, float, float]], top: int = 15,
              iterations: int | None = None) -> dict:
  """Per kind and per (top) name: launches and microseconds per loop iteration (iterations:
  how many the trace holds; default: counted by the scheduler's kernels)."""
  if not kernels:
    raise ValueError("the trace has no GPU kernels (was it taken on a GPU, with CUPTI?)")
  if iterations is None:
    iterations = sum(1 for name, _, _ in kernels if ITERATION_KERNEL.search(name)) or 1
  by_kind, by_name = collections.defaultdict(list), collections.defaultdict(list)
  for name, _, dur in kernels:
    by_kind[kind_of(name)].append(dur)
    by_name[name].append(dur)

  def row(label, key, durs):
    return {key: label, "launches_per_iteration": len(durs) / iterations,
            "us_per_iteration": sum(durs) / iterations,
            "us_per_launch": sum(durs) / len(durs)}
  kinds = sorted((row(k, "kind", d) for k, d in by_kind.items()),
                 key=lambda r: -r["us_per_iteration"])
  names = sorted((row(n, "kernel", d) for n, d in by_name.items()),
                 key=lambda r: -r["us_per_iteration"])[:top]
  start = min(t for _, t, _ in kernels)
  end = max(t + d for _, t, d in kernels)
  return {"iterations": iterations, "kernels": len(kernels),
          "launches_per_iteration": len(kernels) / iterations,
          "busy_us_per_iteration": sum(d for _, _, d in kernels) / iterations,
          "span_us_per_iteration": (end - start) / iterations,
          "kinds": kinds, "top_kernels": names}


def find_trace(path: str) -> str:
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
      raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
    return found[-1]
  if not os.path.exists(path):
    raise FileNotFoundError(path)
  return path


def main(argv):
  del argv
  path = find_trace(FLAGS.trace)
  with gzip.open(path, "rt") as f:
    summary = summarize(gpu_kernels(json.load(f)), FLAGS.top, FLAGS.iterations)
  print(f"{summary['iterations']} loop iterations, {summary['launches_per_iteration']:.1f} "
        f"kernels and {summary['busy_us_per_iteration']:.1f} us of kernel time per iteration "
        f"in a span of {summary['span_us_per_iteration']:.1f} us")
  cols = ["launches_per_iteration", "us_per_iteration", "us_per_launch"]
  print(C.table(summary["kinds"], ["kind", *cols]))
  print(C.table(summary["top_kernels"], ["kernel", *cols]))
  if FLAGS.out:
    C.write_result(FLAGS.out, "kernel_profile", summary["kinds"],
                   {"trace": FLAGS.trace, **{k: v for k, v in summary.items() if k != "kinds"}})


if __name__ == "__main__":
  flags.mark_flag_as_required("trace")
  app.run(main)
