"""Shared pieces of the benchmarks: result files, statistics, tables, mailboxes, and the
kernel flags (one per KernelOptions field) of the benchmarks that build an engine or executor."""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def device_mailbox(region, nbytes: int):
  """(address the device uses, release function): host-mapped on a GPU, plain on CPU."""
  import jax

  from blink_jax.native import host_memory
  if jax.devices()[0].platform != "gpu":
    return region.address, lambda: None
  registration = host_memory.Registration(region.address, nbytes)
  return registration.device_address, registration.release


THRASH_C = ROOT / "bench" / "thrash.c"


def _thrash_binary() -> str | None:
  cc = shutil.which("gcc") or shutil.which("cc")
  if cc is None:
    return None
  out = os.path.join(tempfile.gettempdir(), "blink_thrash")
  subprocess.run([cc, "-O2", "-o", out, str(THRASH_C)], check=True)
  return out


def start_interference(n: int, cpus: set[int], seconds: int) -> list[subprocess.Popen]:
  """n memory-thrashing processes on `cpus` (random read-modify-write over 256 MB each)."""
  exe = _thrash_binary()
  cmd = [exe, str(seconds)] if exe else [
      "python3", "-c", "import numpy as np,time\nb=np.zeros(1<<25,np.int64);r=np.random.default_rng()"
      f"\nt=time.time()+{seconds}\nwhile time.time()<t:\n i=r.integers(0,b.size,1<<16);b[i]+=1"]
  procs = []
  for _ in range(n):
    p = subprocess.Popen(cmd)
    os.sched_setaffinity(p.pid, cpus)
    procs.append(p)
  return procs



def stats(values, name: str) -> dict:
  v = np.asarray(values, float)
  return {f"{name}_median": float(np.median(v)), f"{name}_min": float(v.min()),
          f"{name}_max": float(v.max()), f"{name}_all": [float(x) for x in v]}


def percentile_stats(values, name: str) -> dict:
  v = np.asarray(values, float)
  if v.size == 0:
    return {}
  return {f"{name}_p50": float(np.percentile(v, 50)), f"{name}_p90": float(np.percentile(v, 90)),
          f"{name}_p99": float(np.percentile(v, 99)), f"{name}_mean": float(v.mean()),
          f"{name}_n": int(v.size)}


def table(rows: list[dict], cols: list[str]) -> str:
  def fmt(x):
    if isinstance(x, float):
      return f"{x:.3f}"
    if isinstance(x, list):
      return "[" + ", ".join(fmt(y) for y in x[:4]) + "]"
    return str(x)
  cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
  lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)),
           "-+-".join("-" * w for w in widths)]
  lines += [" | ".join(x.ljust(w) for x, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def describe_device() -> str:
  """JAX's first device, where this process runs JAX; else (a load generator, a torch
  benchmark) the GPUs NVML sees, or the host CPU: such a process must not start a JAX client
  on a GPU that a server beside it holds."""
  jax = sys.modules.get("jax")
  if jax is not None:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')} ({len(jax.devices())} devices)"
  meter = EnergyCounter()
  if not meter.reason:
    names = [meter.nvml.nvmlDeviceGetName(h) for h in meter.handles]
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    return f"gpu:{names[0]} ({len(names)} devices)"
  return f"cpu:{cpu_model()} ({platform.node()})"


def cpu_model() -> str:
  """The host CPU's model name (Linux), for results measured on the CPU."""
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
  except OSError:
    pass
  return f"{platform.processor() or platform.machine()} x {os.cpu_count()}"


def git_revision() -> str:
  """BLINK_GIT_REVISION when set (the device copy of the tree may carry a stale .git), else
  the checkout's HEAD."""
  if os.environ.get("BLINK_GIT_REVISION"):
    return os.environ["BLINK_GIT_REVISION"]
  try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return rev + ("-dirty" if dirty else "")
  except Exception:
    return "unknown"


def _jax_version() -> str | None:
  """The installed JAX's version, without importing it (see describe_device)."""
  from importlib import metadata
  try:
    return metadata.version("jax")
  except metadata.PackageNotFoundError:
    return None


# The environment overrides blink_jax.env declares that change what a benchmark measures
# (XLA's command buffers); recorded in every result. (Kernels are chosen by flags, recorded
# as "kernels"; the secrets BLINK_API_KEY / BLINK_RELAY_TOKEN are never written.)
XLA_OVERRIDES = ("BLINK_NO_COMMAND_BUFFERS", "BLINK_COMMAND_BUFFER_TYPES",
                 "BLINK_HOST_COMMAND_BUFFER_TYPES", "BLINK_HOST_MIN_GRAPH_SIZE")


def command_line() -> str:
  """How this benchmark was started, from the repository root: `python -m bench.executor
  ...` for a module, the script's path otherwise."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  head = (f"python -m {spec.name}" if spec is not None and spec.name
          else os.path.relpath(sys.argv[0], ROOT))
  return " ".join([head] + sys.argv[1:])


# ---- kernel flags (benchmarks that build an engine or an executor) ----

def define_kernel_flags(flag_values=None) -> None:
  """One absl flag per KernelOptions field (--attention --prefill --norm --gemv
  --decode_rows --decode_head --split_matmul), the same names and help as scripts/serve.py's, defaulting to the
  dataclass's defaults."""
  import dataclasses

  from absl import flags

  from blink_jax.engine import KernelOptions
  from blink_jax.engine_config import define_field_flag
  fv = flag_values or flags.FLAGS
  for f in dataclasses.fields(KernelOptions):
    define_field_flag(f, f.default, f.metadata.get("help", f.name), fv)


def define_engine_flag(name: str, flag_values=None) -> None:
  """The flag of EngineConfig field `name`, with scripts/serve.py's name and help and the
  dataclass's default."""
  import dataclasses

  from absl import flags

  from blink_jax.engine_config import EngineConfig, define_field_flag
  f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
  define_field_flag(f, f.default, f.metadata.get("help", name), flag_values or flags.FLAGS)


def kernel_options(flag_values=None):
  """The KernelOptions the kernel flags ask for (`define_kernel_flags`: one per field)."""
  import dataclasses

  from absl import flags

  from blink_jax.engine import KernelOptions
  fv = flag_values or flags.FLAGS
  return KernelOptions(**{f.name: fv[f.name].value for f in dataclasses.fields(KernelOptions)})


def kernels_record(options, platform: str | None = None) -> dict:
  """A result's "kernels": the KernelOptions asked for and, given the platform, what their
  "auto" resolved to there."""
  import dataclasses
  out = {"asked": dataclasses.asdict(options)}
  if platform is not None:
    out["resolved"] = dataclasses.asdict(options.resolved(platform))
  return out


def write_result(path: str, name: str, rows, extra: dict | None = None) -> pathlib.Path:
  """Writes a result file (relative paths: under the repository root, e.g.
  bench/results/...): the device (describe_device), date, command, git revision, versions,
  XLA flags and overrides, then `rows` under "results" and `extra` (a benchmark that builds an
  engine puts its KernelOptions there, as "kernels")."""
  out = pathlib.Path(path)
  if not out.is_absolute():
    out = ROOT / out
  out.parent.mkdir(parents=True, exist_ok=True)
  doc = {"benchmark": name, "device": describe_device(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "command": command_line(),
         "git_revision": git_revision(), "jax": _jax_version(), "python": platform.python_version(),
         "host_cpus": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "xla_overrides": {k: os.environ[k] for k in XLA_OVERRIDES if k in os.environ},
         "results": rows, **(extra or {})}
  out.write_text(json.dumps(doc, indent=2))
  print(f"wrote {out}")
  return out


def _total_energy_j(nvml, handles) -> float:
  """The GPUs' total-energy counters (nvmlDeviceGetTotalEnergyConsumption, mJ) summed, in J."""
  return sum(nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles) / 1e3


class _NvmlMeter:
  """NVML and this host's GPUs for a meter whose `_read` sums one figure over them: `nvml`
  and `handles` where it works (a first `_read` included), else no handles and `reason`."""

  def __init__(self):
    self.reason: str | None = None
    self.handles = []
    try:
      import pynvml
      pynvml.nvmlInit()
      self.nvml = pynvml
      self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                      for i in range(pynvml.nvmlDeviceGetCount())]
      if not self.handles:
        self.reason = "NVML reports no GPU"
      else:
        self._read()
    except ImportError:
      self.reason = "pynvml (nvidia-ml-py) is not installed"
    except Exception as e:  # NVML library missing, no driver, not supported, ...
      self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
    if self.reason:
      self.handles = []

  def _read(self) -> float:
    raise NotImplementedError


class PowerSampler(_NvmlMeter):
  """Sums the power of this host's GPUs every `interval_s` (NVML) in a thread; integrates it.
  Also samples the hottest GPU's temperature and the GPUs' mean SM clock: a GPU's power at
  the same work grows with its temperature (leakage), so two servers' joules compare only
  with the temperatures they ran at (docs/PERFORMANCE.md, "vLLM's step beside ours")."""

  def __init__(self, interval_s: float = 0.05):
    self.interval_s = interval_s
    self.samples: list[tuple[float, float]] = []  # (monotonic s, watts over all GPUs)
    # (monotonic s, hottest GPU's °C, mean SM clock MHz)
    self.thermal: list[tuple[float, float, float]] = []
    # (monotonic s, J of the GPUs' total-energy counters): exact per window, where the
    # sampled power is an average over NVML's own window (`split`)
    self.energy: list[tuple[float, float]] = []
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    super().__init__()

  def _read(self) -> float:
    return sum(self.nvml.nvmlDeviceGetPowerUsage(h) for h in self.handles) / 1e3

  def _read_thermal(self) -> tuple[float, float] | None:
    """(hottest GPU's temperature °C, mean SM clock MHz), None where NVML lacks them."""
    nv = self.nvml
    try:
      temps = [nv.nvmlDeviceGetTemperature(h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
               for h in self.handles]
      clocks = [nv.nvmlDeviceGetClockInfo(h, getattr(nv, "NVML_CLOCK_SM", 1))
                for h in self.handles]
    except Exception:  # an old driver, a stand-in NVML without them
      return None
    return float(max(temps)), float(np.mean(clocks))

  def _read_energy(self) -> float | None:
    try:
      return _total_energy_j(self.nvml, self.handles)
    except Exception:  # before Volta, a stand-in NVML without it
      return None

  def _run(self):
    while not self._stop.is_set():
      try:
        now = time.monotonic()
        self.samples.append((now, self._read()))
      except Exception as e:
        self.reason = f"NVML read failed: {e}"
        return
      if (thermal := self._read_thermal()) is not None:
        self.thermal.append((now, *thermal))
      if (joules := self._read_energy()) is not None:
        self.energy.append((time.monotonic(), joules))  # the read's own instant
      self._stop.wait(self.interval_s)

  def __enter__(self):
    self.samples, self.thermal, self.energy = [], [], []
    if self.handles:
      self._stop.clear()
      self._thread = threading.Thread(target=self._run, daemon=True, name="nvml-power")
      self._thread.start()
    return self

  def __exit__(self, *exc):
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
      try:
        self.samples.append((time.monotonic(), self._read()))
      except Exception:
        pass

  def result(self, output_tokens: int) -> dict:
    if self.reason or len(self.samples) < 2:
      return {"energy_j": None, "avg_power_w": None, "energy_per_token_j": None,
              "energy_note": self.reason or "too few power samples"}
    t, w = np.array(self.samples).T
    joules = float(np.sum((w[1:] + w[:-1]) / 2 * np.diff(t)))
    out = {"energy_j": joules, "avg_power_w": joules / float(t[-1] - t[0]),
           "energy_per_token_j": joules / output_tokens if output_tokens else None,
           "energy_note": f"NVML power of {len(self.handles)} GPU(s), "
                          f"{len(self.samples)} samples every {1e3 * self.interval_s:.0f} ms",
           "gpus": len(self.handles)}
    if self.thermal:
      _, temps, clocks = np.array(self.thermal).T
      out.update(gpu_temp_c_mean=float(temps.mean()), gpu_temp_c_max=float(temps.max()),
                 sm_clock_mhz_mean=float(clocks.mean()))
    if len(self.energy) >= 2:  # exact, where the sampled power averages over NVML's window
      (t0, j0), (t1, j1) = self.energy[0], self.energy[-1]
      out.update(counter_energy_j=j1 - j0, counter_avg_power_w=(j1 - j0) / (t1 - t0))
    return out

  def split(self, busy: list[tuple[float, float]]) -> dict:
    """The run's energy split between its gaps (counter windows that overlap no `busy`
    interval: (start, end) on time.monotonic(), e.g. requests from sent to last byte) and
    the rest: seconds, average power, SM clock and temperature of each. What an idle
    server draws between requests after it has run warm, against its cold idle power
    (docs/PERFORMANCE.md, "Where a served step's energy goes (revision faba37c)"). {}
    without the energy counter."""
    if len(self.energy) < 2:
      return {}
    t, j = np.array(self.energy).T
    lo, hi = t[:-1], t[1:]
    gap = np.ones(len(lo), bool)
    for s, e in busy:
      gap &= (hi <= s) | (lo >= e)
    if self.thermal:  # each thermal sample's counter window
      tt, temps, clocks = np.array(self.thermal).T
      k = np.clip(np.searchsorted(lo, tt, side="right") - 1, 0, len(lo) - 1)
      within = (tt >= lo[0]) & (tt <= hi[-1])
    out = {}
    for name, sel in (("gap", gap), ("busy", ~gap)):
      secs = float(np.sum((hi - lo)[sel]))
      out[f"{name}_s"] = secs
      out[f"{name}_power_w"] = float(np.sum(np.diff(j)[sel]) / secs) if secs > 0 else None
      if self.thermal:
        inside = sel[k] & within
        out[f"{name}_sm_clock_mhz"] = float(clocks[inside].mean()) if inside.any() else None
        out[f"{name}_gpu_temp_c"] = float(temps[inside].mean()) if inside.any() else None
    return out


class EnergyCounter(_NvmlMeter):
  """Joules the GPUs of this host used over a `with` block, from NVML's total-energy counter
  (nvmlDeviceGetTotalEnergyConsumption, Volta and later): exact over short runs, where
  sampled power (PowerSampler) lags by its averaging window. `joules` None, `reason` set,
  where there is no counter."""

  def __init__(self):
    self.joules: float | None = None
    self.seconds: float | None = None
    super().__init__()

  def _read(self) -> float:
    return _total_energy_j(self.nvml, self.handles)

  def __enter__(self):
    if not self.reason:
      self._t, self._j = time.monotonic(), self._read()
    return self

  def __exit__(self, *exc):
    if not self.reason:
      self.joules, self.seconds = self._read() - self._j, time.monotonic() - self._t


_IDLE_POWER: dict = {}  # key -> the GPUs' idle power, W (None without the counter)


def idle_power(key=None, seconds: float = 2.0) -> float | None:
  """The GPUs' power over `seconds` with nothing of this process running on them (or, for an
  engine, its loop idle: a key naming the engine), from NVML's energy counter; measured once
  per key. None without the counter."""
  if key not in _IDLE_POWER:
    with EnergyCounter() as meter:
      time.sleep(seconds)
    _IDLE_POWER[key] = meter.joules / meter.seconds if meter.joules is not None else None
  return _IDLE_POWER[key]


def copies_holding(mib: int, nbytes: int) -> int:
  """Distinct copies of an array of `nbytes` that together hold at least `mib` MiB (a loop
  cycling through them reads from HBM, not from the L2 cache)."""
  return max(1, math.ceil(mib * 2**20 / nbytes))


def torch_graph(chain):
  """`chain` (torch work on the GPU) captured in a CUDA graph after one run on a side
  stream (so libraries' workspaces and heuristics are set up before the capture): a call
  that replays it and waits. Off a GPU, `chain` itself."""
  import torch
  if not torch.cuda.is_available():
    return chain
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    chain()
  torch.cuda.current_stream().wait_stream(stream)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    chain()

  def call():
    graph.replay()
    torch.cuda.synchronize()
  return call


def per_unit_us(call, repeats: int, units: int) -> list[float]:
  """Microseconds per unit of `call` (which runs `units` of them and waits), over
  `repeats` calls after a first one."""
  call()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    call()
    times.append((time.perf_counter() - t) / units * 1e6)
  return times


def repeated_energy(call, seconds: float, units_per_call: int, unit: str) -> dict:
  """J per `unit` of `call` (runs units_per_call of them and waits for them) run again and
  again for `seconds` under NVML's energy counter, above the idle power (`idle_power`); {}
  when seconds <= 0 or without the counter."""
  counter = EnergyCounter()
  if seconds <= 0 or counter.reason:
    return {}
  idle_w = idle_power()
  t = time.perf_counter()
  call()
  calls = max(1, round(seconds / max(time.perf_counter() - t, 1e-6)))
  with counter:
    for _ in range(calls):
      call()
  return energy_per(unit, counter.joules, counter.seconds, calls * units_per_call, idle_w)


def energy_per(unit: str, joules: float, seconds: float, n: int,
               idle_w: float | None) -> dict:
  """`joules` over `seconds` spent on `n` units (steps, products): J per unit, the average
  power and, given the idle power, J per unit above it ({} for no units)."""
  if n <= 0:
    return {}
  out = {f"energy_per_{unit}_j": joules / n, "avg_power_w": joules / seconds}
  if idle_w is not None:
    out["idle_power_w"] = idle_w
    out[f"energy_above_idle_per_{unit}_j"] = (joules - idle_w * seconds) / n
  return out
