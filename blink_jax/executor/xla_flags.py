"""XLA flags that let the serving loop run as a CUDA graph with device-side control flow.

They must be set before JAX creates its GPU client (measured on an H200: a host-driven
while_loop iteration costs 18.6 us, a command-buffer WHILE node iteration 6.4 us).
"""
from __future__ import annotations

import importlib.util
import logging

from blink_jax import env

log = logging.getLogger("blink_jax")

COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION"
# DYNAMIC_SLICE_FUSION: XLA wraps a custom call whose operands are slices (e.g. a scheduler
# call fed `words[:n]`) in a dynamic-slice fusion; without this type the whole enclosing while
# loop stays host-driven.
# Host mode compiles its step with these instead: no WHILE, CONDITIONAL or
# DYNAMIC_SLICE_FUSION, so each bucket branch of the step is its own CUDA graph, run op by op
# the first time it is taken (the warm-up workload takes every branch) and launched as a
# graph afterwards, like the per-batch-size graphs of vLLM. (With DYNAMIC_SLICE_FUSION the
# whole step was one graph and a 1B-shape token took 8.6 ms at batch 1 instead of 4.4 ms.)
HOST_COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"
# Smallest run of commands host mode puts into a CUDA graph. XLA re-records ~26 small graphs
# (1-3 commands, the pieces between the step's host-run conditionals) at every host-mode
# step (docs/NOTES.md, "Host mode re-records small graphs"); with a larger minimum they would
# launch as plain kernels. 1: XLA's setting for the persistent loop.
HOST_MIN_GRAPH_SIZE = 1
# XLA log lines the executor reads: which thunks became command buffers, and the op-by-op
# warm-up execution of a command buffer.
VMODULES = ("command_buffer_conversion_pass=2", "command_buffer_thunk=2")


def command_types() -> str:
  """The persistent loop's command types (BLINK_COMMAND_BUFFER_TYPES overrides them)."""
  return env.get(env.COMMAND_BUFFER_TYPES) or COMMAND_TYPES


def host_options() -> dict:
  """Compiler options of host mode's step (env.py declares the overrides)."""
  return {"xla_gpu_enable_command_buffer": env.get(env.HOST_COMMAND_BUFFER_TYPES)
          or HOST_COMMAND_TYPES,
          "xla_gpu_graph_min_graph_size": env.host_min_graph_size(HOST_MIN_GRAPH_SIZE)}


def command_buffer_flags() -> tuple[str, ...]:
  return (f"--xla_gpu_enable_command_buffer={command_types()}",
          "--xla_gpu_graph_min_graph_size=1")
# XLA's dot-strength-reduction pass rewrites every vector x matrix dot under 10M elements
# (each projection of a decode step at one row) as a multiply plus a reduce, some of which
# write a weight-sized product. Off, they stay GEMM fusions: the 1B-shape bucket-1 branch
# drops from 753 to 649 kernels and a batch-1 token from 2.14 to 1.84 ms (H200; docs/NOTES.md,
# "Dot-strength reduction off").
DECODE_FLAGS = ("--xla_disable_hlo_passes=dot-strength-reduction",)


def cuda_plugin_installed() -> bool:
  def found(name: str) -> bool:
    try:
      return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # parent package absent
      return False
  return any(found(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin",
                                "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"))


def backend_started() -> bool:
  try:
    from jax._src import xla_bridge
    return bool(getattr(xla_bridge, "_backends", {}))
  except Exception:  # pragma: no cover - private API moved
    return False


# The share of each GPU JAX's allocator pool takes when XLA_PYTHON_CLIENT_MEM_FRACTION is not
# set (JAX's documented default).
JAX_POOL_FRACTION = 0.75


def pool_fraction() -> float:
  """The share of the GPU that XLA's allocator pool is (`memory_stats()["bytes_limit"]`)."""
  value = env.get(env.MEM_FRACTION)
  try:
    f = float(value) if value else JAX_POOL_FRACTION
  except ValueError:
    return JAX_POOL_FRACTION
  return f if f > 0 else JAX_POOL_FRACTION  # past 1: unified memory oversubscribed


def configure_memory_pool(fraction: float) -> float:
  """Makes XLA's allocator pool `fraction` of each GPU (XLA_PYTHON_CLIENT_MEM_FRACTION), as
  vLLM's --gpu-memory-utilization takes that share of the device for the weights, the step
  and the KV cache; JAX's own default pool is 0.75 of it, which left the cache 0.675 of the
  device at a 0.9 fraction (docs/ARCHITECTURE.md, "The engine around the loop"). Left alone
  when the variable is set already (the user's choice) or JAX's backend has started. Returns
  the pool's share of the device as JAX will use it."""
  if (cuda_plugin_installed() and env.get(env.MEM_FRACTION) is None
      and not backend_started()):
    env.set(env.MEM_FRACTION, f"{fraction:g}")
  return pool_fraction()


def configure_command_buffers() -> bool:
  """Adds the command-buffer flags to XLA_FLAGS; returns whether they will take effect."""
  if not cuda_plugin_installed() or env.command_buffers_disabled():
    return False
  current = env.get(env.XLA_FLAGS, "")
  unset = lambda flags: [f for f in flags if f.split("=")[0] not in current]  # noqa: E731
  missing_cb, missing_decode = unset(command_buffer_flags()), unset(DECODE_FLAGS)
  missing = missing_cb + missing_decode
  if backend_started():
    if missing_decode:
      log.warning("JAX's backend is already running without %s: batch-1 decode steps will be "
                  "slower", " ".join(missing_decode))
    if not missing_cb:
      return True
    log.warning("JAX's backend is already running: the command-buffer flags cannot take "
                "effect and the loop will be driven by the host. Create the Engine before "
                "any other JAX work, or set XLA_FLAGS=%s", " ".join(missing))
    return False
  if missing:
    env.set(env.XLA_FLAGS, " ".join([current, *missing]).strip())
  # XLA logs which thunks it puts into command buffers at this verbosity; the executor reads
  # those lines while compiling to report whether the serving loop became a device WHILE.
  # (Only effective when set before jaxlib loads, i.e. before `import jax`.)
  # command_buffer_thunk=2 logs XLA's op-by-op warm-up execution (Executor.warm_up).
  vmodule = env.get(env.TF_CPP_VMODULE, "")
  wanted = [m for m in VMODULES if m.split("=")[0] not in vmodule]
  if wanted:
    env.set(env.TF_CPP_VMODULE, ",".join([m for m in (vmodule, *wanted) if m]))
  if env.get(env.TF_CPP_MIN_LOG_LEVEL) is None:
    env.set(env.TF_CPP_MIN_LOG_LEVEL, "0")
  return True
