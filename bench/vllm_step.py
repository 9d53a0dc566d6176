"""vLLM's decode step, for the energy comparison of issue 25: milliseconds and joules (NVML's
energy counter, total and above idle) per decode step of vLLM 0.26 at a few batch sizes, and
optionally the GPU kernels of its step by name (its torch profiler), beside `bench.step`'s
figures for ours (docs/PERFORMANCE.md, "Pacing relative to the step against vLLM (revision
51be640)": at the same tokens per step our step costs 1.05-1.13x vLLM's energy above idle;
this says whether vLLM's is cheaper by time or by power, and in which kernels).

  VLLM_SITE=/tmp/vllm/site python -m bench.vllm_step --peer_dir .carry/peer \
      --config gemma3-1b --batches 1,8 --profile_dir /tmp/vllm_profile \
      --out bench/results/vllm_step_h100.json

The model: the peer's folder `<peer_dir>/<config>` (bench/peer.py; random weights, vLLM's
`load_format="dummy"`), as the serving runs have it. A point is B prompts of --context random
tokens, generated greedily with `ignore_eos` twice: 1 token (the prefill and the first token)
and 1 + --tokens; the difference over --tokens is one decode step of B sequences at about
--context, the whole engine's (scheduler, sampler, its CPU time between steps on the GPU's
clock too), as it serves, against the bare model step `bench.step` times for ours. Repeats
alternate the two lengths; medians and spreads reported (bench.common.stats). The kernel
table is the same difference, per kernel name, of two profiled generates.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

from bench import common as C

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("vllm_path", os.environ.get("VLLM_SITE", "/tmp/vllm/site"),
                      "vLLM's site-packages (bench/vllm_install.sh unpacks them there)")
  flags.DEFINE_string("peer_dir", ".carry/peer", "the peer's model folders (bench/peer.py)")
  flags.DEFINE_string("config", "gemma3-1b", "model shape: <peer_dir>/<config>")
  flags.DEFINE_list("batches", ["1", "8"], "decode batch sizes")
  flags.DEFINE_integer("context", 1024, "prompt tokens of every sequence")
  flags.DEFINE_integer("tokens", 512, "decode steps timed per point (NVML's energy counter "
                       "moves in steps of tens of ms: most of a second at batch 1)")
  flags.DEFINE_integer("repeats", 3, "timed pairs (1 and 1 + --tokens) per point")
  flags.DEFINE_float("gpu_memory_utilization", 0.9, "vLLM's --gpu-memory-utilization")
  flags.DEFINE_float("idle_s", 3.0, "seconds of idle power measured after vLLM's start")
  flags.DEFINE_string("profile_dir", None, "folder for vLLM's torch profiler traces: "
                      "adds the kernel table of the first batch size (none when unset)")
  flags.DEFINE_integer("profile_tokens", 32, "decode steps of the profiled generate")
  flags.DEFINE_integer("top", 30, "kernels listed by name")
  flags.DEFINE_integer("seed", 0, "prompt tokens")
  flags.DEFINE_string("out", "bench/results/vllm_step.json", "result file")


def per_step(short: dict, long: dict, tokens: int, idle_w: float | None) -> dict:
  """One decode step from two generates of the same prompts ({"seconds", "joules"}: 1 and
  1 + tokens output tokens each): ms, J, J above idle, watts over the extra steps."""
  seconds = long["seconds"] - short["seconds"]
  out = {"ms_per_step": 1e3 * seconds / tokens}
  if short.get("joules") is not None and long.get("joules") is not None and seconds > 0:
    out.update(C.energy_per("step", long["joules"] - short["joules"], seconds, tokens, idle_w))
    out.pop("idle_power_w", None)  # the run's, in the result's header
  return out


def prefill(short: dict, batch: int, idle_w: float | None) -> dict:
  """The 1-token generate of `batch` prompts ({"seconds", "joules"}) per prompt: its prefill
  (and first token, the engine's overheads), ms and J, beside bench.step's mixed steps."""
  out = {"ms_per_prompt": 1e3 * short["seconds"] / batch}
  if short.get("joules") is not None:
    out.update(C.energy_per("prompt", short["joules"], short["seconds"], batch, idle_w))
    out.pop("idle_power_w", None)
  return {f"prefill_{k}": v for k, v in out.items()}


def trace_kernels(trace: dict) -> list[tuple[str, float]]:
  """(name, duration us) of every GPU kernel, memcpy and memset of a torch profiler trace."""
  return [(e["name"], float(e["dur"])) for e in trace.get("traceEvents", [])
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
          and "dur" in e]


def kernel_table(short: list[tuple[str, float]], long: list[tuple[str, float]], tokens: int,
                 top: int) -> dict:
  """Per kernel name, launches and microseconds per decode step: the profiled generate of 1 +
  tokens output tokens less the one of 1 (the same prefill), over tokens."""
  sums = {}
  for sign, kernels in ((-1, short), (1, long)):
    for name, dur in kernels:
      n, us = sums.get(name, (0, 0.0))
      sums[name] = (n + sign, us + sign * dur)
  rows = [{"kernel": name, "launches_per_step": n / tokens, "us_per_step": us / tokens}
          for name, (n, us) in sums.items() if us > 0 and n > 0]
  rows.sort(key=lambda r: -r["us_per_step"])
  return {"busy_us_per_step": sum(r["us_per_step"] for r in rows),
          "launches_per_step": sum(r["launches_per_step"] for r in rows),
          "top_kernels": rows[:top]}


def _traces(directory: str) -> set[str]:
  """The trace files under `directory` (vLLM's worker names them <prefix>...pt.trace.json.gz)."""
  return set(glob.glob(os.path.join(directory, "**", "*.json*"), recursive=True))


def _new_traces(directory: str, before: set[str], timeout_s: float = 180.0) -> list[str]:
  """The trace files vLLM wrote into `directory` since `before` (by its worker process, after
  stop_profile returns: waited for until their sizes hold still between two looks)."""
  deadline, last = time.monotonic() + timeout_s, None
  while time.monotonic() < deadline:
    new = sorted(_traces(directory) - before)
    sizes = [os.path.getsize(p) for p in new]
    if new and all(sizes) and sizes == last:
      return new
    last = sizes
    time.sleep(1.0)
  raise TimeoutError(f"no new trace in {directory} after {timeout_s:.0f} s")


def _load_trace(path: str) -> dict:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return json.load(f)


def main(argv):
  del argv
  sys.path.insert(0, FLAGS.vllm_path)
  # vLLM inspects the model's architecture in a subprocess, which sees PYTHONPATH, not this
  # sys.path ("Model architectures ['Gemma3ForCausalLM'] failed to be inspected" otherwise);
  # no FlashInfer sampler, as bench/serving_suite.sh runs it (no cubins offline).
  os.environ["PYTHONPATH"] = os.pathsep.join(
      p for p in (FLAGS.vllm_path, os.environ.get("PYTHONPATH")) if p)
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
  import vllm
  from vllm import LLM, SamplingParams

  profile_dir = os.path.abspath(FLAGS.profile_dir) if FLAGS.profile_dir else None
  batches = [int(b) for b in FLAGS.batches]
  kwargs = dict(model=os.path.join(FLAGS.peer_dir, FLAGS.config),
                tokenizer=os.path.join(FLAGS.peer_dir, "tokenizer"), load_format="dummy",
                dtype="bfloat16", seed=FLAGS.seed, max_num_seqs=max(batches),
                max_model_len=FLAGS.context + FLAGS.tokens + 16,
                gpu_memory_utilization=FLAGS.gpu_memory_utilization,
                enable_prefix_caching=False)
  if profile_dir:
    os.makedirs(profile_dir, exist_ok=True)
    kwargs["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir,
                                 "torch_profiler_with_stack": False}
  llm = LLM(**kwargs)
  vocab = llm.llm_engine.model_config.get_vocab_size()

  time.sleep(1.0)
  idle_w = C.idle_power(seconds=FLAGS.idle_s)
  print(f"vllm {vllm.__version__}, {C.describe_device()}, idle "
        + (f"{idle_w:.1f} W" if idle_w is not None else
           f"power unknown ({C.EnergyCounter().reason})"))

  rng = np.random.default_rng(FLAGS.seed)

  def prompts(batch):
    return [{"prompt_token_ids": rng.integers(10, vocab - 1, FLAGS.context).tolist()}
            for _ in range(batch)]

  def generate(batch_prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    with C.EnergyCounter() as meter:
      t0 = time.monotonic()
      outs = llm.generate(batch_prompts, params, use_tqdm=False)
      seconds = time.monotonic() - t0
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {n}:
      raise RuntimeError(f"asked for {n} tokens a sequence, vLLM gave {sorted(lengths)}")
    return {"seconds": seconds, "joules": meter.joules}

  rows = []
  for batch in batches:
    generate(prompts(batch), 2)  # warm-up: this batch size's graphs and buffers
    pairs = []
    for _ in range(FLAGS.repeats):
      # Fresh prompts each time (no prefix caching anyway), the same ones for both lengths.
      p = prompts(batch)
      short, long = generate(p, 1), generate(p, 1 + FLAGS.tokens)
      pairs.append({**per_step(short, long, FLAGS.tokens, idle_w),
                    **prefill(short, batch, idle_w)})
    row = {"batch": batch, "context": FLAGS.context, "tokens": FLAGS.tokens}
    for key in pairs[0]:  # median, min, max and every repeat, named as bench.step's
      values = [p[key] for p in pairs if p.get(key) is not None]
      if values:
        row.update(C.stats(values, key))
    rows.append(row)
    print(C.table([row], ["batch", "ms_per_step_median", "energy_per_step_j_median",
                          "energy_above_idle_per_step_j_median", "avg_power_w_median"]))

  profile = None
  if profile_dir:
    batch, n = batches[0], FLAGS.profile_tokens
    p = prompts(batch)
    traces = []
    for tokens in (1, 1 + n):
      before = _traces(profile_dir)
      llm.start_profile(f"b{batch}_n{tokens}")
      generate(p, tokens)
      llm.stop_profile()
      traces.append(_new_traces(profile_dir, before))
    # Every file a profiled generate left (a CPU-only one adds no kernels).
    short, long = ([k for path in paths for k in trace_kernels(_load_trace(path))]
                   for paths in traces)
    profile = {"batch": batch, "tokens": n, "traces": traces,
               **kernel_table(short, long, n, FLAGS.top)}
    print(f"batch {batch}: {profile['launches_per_step']:.0f} launches and "
          f"{profile['busy_us_per_step']:.0f} us of kernel time per decode step")
    print(C.table(profile["top_kernels"], ["kernel", "launches_per_step", "us_per_step"]))

  C.write_result(FLAGS.out, "vllm_step", rows,
                 {"vllm": vllm.__version__, "config": FLAGS.config, "idle_power_w": idle_w,
                  "engine_args": {k: v for k, v in kwargs.items() if k != "profiler_config"},
                  "kernel_profile": profile})


if __name__ == "__main__":
  define_flags()
  app.run(main)
