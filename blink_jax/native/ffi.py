"""Loads the scheduler library (ffi/), registers its XLA FFI targets and wraps its C API.

`SchedConfig` mirrors `BlinkSchedConfig` (ffi/sched_state.h); its fields are passed by name
as FFI attributes and as an int64 array to the C API (tests/test_protocol.py checks the
order against the library).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import pathlib

import numpy as np

from blink_jax.client import protocol
from blink_jax.engine_config import MAX_BUCKETS

_LIB_DIR = pathlib.Path(__file__).resolve().parents[1] / "_lib"  # CMakeLists.txt installs there

_i64p = ctypes.POINTER(ctypes.c_int64)
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)


@dataclasses.dataclass(frozen=True)
class SchedConfig:
  mailbox: int
  num_slots: int
  max_prompt: int
  ring_capacity: int
  max_top_logprobs: int
  vocab_size: int
  max_seqs: int
  max_context: int
  page_size: int
  num_pages: int
  token_budget: int
  num_buckets: int
  bucket0: int
  bucket1: int = 0
  bucket2: int = 0
  bucket3: int = 0
  bucket4: int = 0
  bucket5: int = 0
  bucket6: int = 0
  bucket7: int = 0
  bucket8: int = 0
  bucket9: int = 0
  bucket10: int = 0
  bucket11: int = 0
  bucket12: int = 0
  bucket13: int = 0
  bucket14: int = 0
  bucket15: int = 0
  eos0: int = -1
  eos1: int = -1
  eos2: int = -1
  eos3: int = -1
  idle_poll_us: int = 0
  arena_tokens: int = 0  # build(): the mailbox Geometry's default
  min_step_interval_us: int = 0  # step pacing, off
  prefix_caching: int = 0  # automatic prefix caching, off
  window: int = 0  # windowed pages: the sliding window in tokens (0: off)
  window_pages: int = 0  # windowed pages: ring pages per lane
  step_interval_permille: int = 0  # step pacing relative to the step's length, off

  @classmethod
  def build(cls, *, buckets: tuple[int, ...], eos_ids: tuple[int, ...] = (), **kw) -> "SchedConfig":
    if not kw.get("arena_tokens"):
      kw["arena_tokens"] = protocol.default_arena_tokens(kw["num_slots"], kw["max_prompt"])
    if not 1 <= len(buckets) <= MAX_BUCKETS:
      raise ValueError(f"between 1 and {MAX_BUCKETS} token buckets, got {buckets}")
    if len(eos_ids) > 4:
      raise ValueError(f"at most 4 EOS ids, got {eos_ids}")
    b = {f"bucket{i}": v for i, v in enumerate(buckets)}
    e = {f"eos{i}": v for i, v in enumerate(eos_ids)}
    cfg = cls(num_buckets=len(buckets), token_budget=buckets[-1], **b, **e, **kw)
    msg = library().blink_config_check(cfg.words_ptr()).decode()
    if msg:
      raise ValueError(f"bad scheduler config: {msg}")
    return cfg

  @property
  def buckets(self) -> tuple[int, ...]:
    return tuple(getattr(self, f"bucket{i}") for i in range(self.num_buckets))

  @property
  def max_pages_per_seq(self) -> int:
    return -(-self.max_context // self.page_size)

  def words(self) -> np.ndarray:
    return np.array(dataclasses.astuple(self), dtype=np.int64)

  def words_ptr(self):
    arr = self.words()
    # Keep the array alive with the pointer.
    return arr.ctypes.data_as(_i64p), arr

  def attrs(self) -> dict[str, np.int64]:
    return {k: np.int64(v) for k, v in dataclasses.asdict(self).items()}

  def replace(self, **kw) -> "SchedConfig":
    return dataclasses.replace(self, **kw)


class _Lib:
  """ctypes view of libblink_ffi with argument types set."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    lib = self.lib = ctypes.CDLL(str(path))
    lib.blink_sched_config_fields.restype = ctypes.c_char_p
    lib.blink_state_words.restype = ctypes.c_int64
    lib.blink_state_words.argtypes = [_i64p]
    lib.blink_batch_words_c.restype = ctypes.c_int64
    lib.blink_batch_words_c.argtypes = [_i64p]
    lib.blink_state_init.argtypes = [_i64p, _i32p]
    lib.blink_config_check.restype = ctypes.c_char_p
    lib.blink_config_check.argtypes = [_i64p]
    lib.blink_mailbox_layout.restype = ctypes.c_char_p
    lib.blink_batch_layout.restype = ctypes.c_char_p
    lib.blink_counter_layout.restype = ctypes.c_char_p
    lib.blink_geometry_offsets.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32,
                                           ctypes.POINTER(ctypes.c_uint64)]
    lib.blink_host_schedule.argtypes = [_i64p, _i32p, _i32p, _i32p, _i32p]
    lib.blink_host_commit.argtypes = [_i64p, _i32p, _i32p, _i32p, _i32p, _i32p, _f32p, _i32p,
                                      _f32p, _f32p, _i32p, _f32p, ctypes.c_int64]
    lib.blink_state_check.restype = ctypes.c_char_p
    lib.blink_state_check.argtypes = [_i64p, _i32p, _i32p]
    lib.blink_state_summary.argtypes = [_i64p, _i32p, _i64p]

  def __getattr__(self, name):
    return getattr(self.lib, name)

  def blink_config_check(self, ptr_and_arr) -> bytes:
    return self.lib.blink_config_check(ptr_and_arr[0])


def _find(name: str) -> pathlib.Path:
  path = _LIB_DIR / name
  if not path.exists():
    raise FileNotFoundError(
        f"{path} is missing: build the FFI library with `pip install -e .` from the repository")
  return path


@functools.cache
def library() -> _Lib:
  return _Lib(_find("libblink_ffi.so"))


@functools.cache
def cuda_library() -> ctypes.CDLL | None:
  """The CUDA handlers, or None when they were not built (no nvcc at install time)."""
  path = _LIB_DIR / "libblink_ffi_cuda.so"
  if not path.exists():
    return None
  lib = ctypes.CDLL(str(path))
  lib.blink_cuda_register_host.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                           ctypes.POINTER(ctypes.c_uint64)]
  lib.blink_cuda_unregister_host.argtypes = [ctypes.c_void_p]
  lib.blink_cuda_error_string.restype = ctypes.c_char_p
  lib.blink_cuda_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
  lib.blink_cuda_alloc.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]
  lib.blink_cuda_free.argtypes = [ctypes.c_void_p]
  lib.blink_cuda_unaliased_calls.restype = ctypes.c_int64
  return lib


def config_field_names() -> list[str]:
  return library().blink_sched_config_fields().decode().split(",")


def state_words(cfg: SchedConfig) -> int:
  ptr, _keep = cfg.words_ptr()
  return int(library().blink_state_words(ptr))


def batch_words(cfg: SchedConfig) -> int:
  ptr, _keep = cfg.words_ptr()
  return int(library().blink_batch_words_c(ptr))


def initial_state(cfg: SchedConfig) -> np.ndarray:
  ptr, _keep = cfg.words_ptr()
  st = np.zeros(library().blink_state_words(ptr), np.int32)
  library().blink_state_init(ptr, st.ctypes.data_as(_i32p))
  return st


def _layout(text: bytes) -> dict[str, int]:
  """The library's "name=value;..." layout strings as a dict."""
  return {k: int(v) for k, v in (item.split("=") for item in text.decode().split(";") if item)}


def mailbox_layout() -> dict[str, int]:
  return _layout(library().blink_mailbox_layout())


def batch_layout() -> dict[str, int]:
  return _layout(library().blink_batch_layout())


def counters(state: np.ndarray) -> dict[str, int]:
  """The named 64-bit counters at the start of a scheduler state (ffi/sched_state.h,
  BlinkCounter): loop iterations, steps, and the device time in the scheduler's kernels and
  in schedule's phases (CUDA handlers only; zero on the host)."""
  index = _layout(library().blink_counter_layout())
  values = np.asarray(state[:2 * index.pop("num_counters")]).view(np.uint64)
  return {name: int(values[i]) for name, i in index.items()}


def geometry_offsets(geo, slot: int) -> list[int]:
  g = (ctypes.c_uint32 * 5)(geo.num_slots, geo.max_prompt, geo.ring_capacity,
                            geo.max_top_logprobs, geo.arena_tokens)
  out = (ctypes.c_uint64 * 8)()
  library().blink_geometry_offsets(g, slot, out)
  return list(out)


@functools.cache
def register_targets() -> tuple[str, ...]:
  """Registers blink_schedule / blink_commit with XLA for every platform we have
  handlers for, and on CUDA blink_gemv (`cuda_gemv`) and blink_sample_thresholds
  (`cuda_sampler`)."""
  import jax  # the protocol and the C API above need no JAX; the FFI targets do

  platforms = ["cpu"]
  lib = library().lib
  jax.ffi.register_ffi_target("blink_schedule", jax.ffi.pycapsule(lib.BlinkScheduleCpu),
                              platform="cpu")
  jax.ffi.register_ffi_target("blink_commit", jax.ffi.pycapsule(lib.BlinkCommitCpu),
                              platform="cpu")
  cuda = cuda_library()
  if cuda is not None:
    try:
      jax.ffi.register_ffi_target("blink_schedule", jax.ffi.pycapsule(cuda.BlinkScheduleCuda),
                                  platform="CUDA")
      jax.ffi.register_ffi_target("blink_commit", jax.ffi.pycapsule(cuda.BlinkCommitCuda),
                                  platform="CUDA")
      jax.ffi.register_ffi_target("blink_gemv", jax.ffi.pycapsule(cuda.BlinkGemvCuda),
                                  platform="CUDA")  # blink_jax/kernels/cuda_gemv.py
      jax.ffi.register_ffi_target(  # blink_jax/kernels/cuda_sampler.py
          "blink_sample_thresholds", jax.ffi.pycapsule(cuda.BlinkSampleThresholdsCuda),
          platform="CUDA")
      platforms.append("cuda")
    except Exception:  # no CUDA plugin in this jax: CPU only
      pass
  return tuple(platforms)


def cuda_targets_available() -> bool:
  """Whether the CUDA FFI targets are registered (a CUDA build of ffi/ and a GPU jax)."""
  return "cuda" in register_targets()


def use_cuda_kernel(use_kernel: bool | None) -> bool:
  """Whether a kernel module (`cuda_gemv`, `cuda_sampler`) calls its CUDA target: as asked,
  or by default when the targets are registered and the default device is a GPU. Asking
  registers them where it can (XLA names a target that could not be)."""
  import jax

  if use_kernel is None:
    return jax.devices()[0].platform == "gpu" and cuda_targets_available()
  if use_kernel:
    cuda_targets_available()
  return use_kernel


SUMMARY_FIELDS = ("free_pages", "running", "waiting", "free_lanes", "steps", "tokens_generated",
                  "prompt_tokens", "admitted", "finished", "errored", "cancelled", "preemptions",
                  "loop_iterations", "prefix_queries", "prefix_hits", "cached_pages")


def summarize(cfg: SchedConfig, state: np.ndarray) -> dict[str, int]:
  ptr, _keep = cfg.words_ptr()
  st = np.ascontiguousarray(state, np.int32)
  out = np.zeros(16, np.int64)
  library().blink_state_summary(ptr, st.ctypes.data_as(_i32p), out.ctypes.data_as(_i64p))
  return {k: int(v) for k, v in zip(SUMMARY_FIELDS, out)}
