"""Python mirror of the mailbox protocol defined in ffi/mailbox.h (no JAX import).

The frontend (nic_frontend, the SmartNIC's role) and the in-process engine client both use
this module to place requests in slots and read their output rings. tests/test_protocol.py
checks every offset here against the compiled library.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import struct
from typing import NamedTuple

import numpy as np

MAGIC = 0x31424D4B4E494C42
VERSION = 5
MAX_WORKERS = 64
MAX_STOP_IDS = 16
HEADER_BYTES = 1024
REQUEST_FIXED_BYTES = 192
OUTPUT_FIXED_BYTES = 64

FLAG_IGNORE_EOS = 1
FLAG_LOGPROBS = 2
FLAG_PROMPT_LOGPROBS = 4  # first prompt_len - 1 entries: prompt tokens 1.. and their logprobs


class EngineState(enum.IntEnum):
  STARTING = 0
  READY = 1
  STOPPED = 2


class Finish(enum.IntEnum):
  NONE = 0
  STOP = 1
  LENGTH = 2
  CANCELLED = 3
  ERROR = 4


class Error(enum.IntEnum):
  NONE = 0
  PROMPT_LENGTH = 1
  TOKEN_ID = 2
  MAX_TOKENS = 3
  TEMPERATURE = 4
  TOP_P = 5
  TOP_K = 6
  STOP_IDS = 7
  LOGPROBS = 8
  FLAGS = 9
  PROMPT_OFFSET = 10


ERROR_MESSAGES = {
    Error.PROMPT_LENGTH: "prompt length is zero or exceeds the context",
    Error.TOKEN_ID: "a prompt token id is outside the vocabulary",
    Error.MAX_TOKENS: "max_tokens must be at least 1",
    Error.TEMPERATURE: "temperature must be finite and >= 0",
    Error.TOP_P: "top_p must be in (0, 1]",
    Error.TOP_K: "top_k must be >= 0",
    Error.STOP_IDS: "too many stop token ids or an id outside the vocabulary",
    Error.LOGPROBS: "too many logprobs requested",
    Error.FLAGS: "unknown request flags",
    Error.PROMPT_OFFSET: "the prompt lies outside the mailbox's prompt arena",
}

# The schedule kernel's phases, each timed in the header as sched_<phase>_ns (ffi/sched_state.h,
# BlinkCounter): doorbells and slot scan, lane checks and releases, decode rows, prefill and
# admission, the batch's arrays and idle polling.
SCHEDULE_PHASES = ("scan", "poll", "decode", "admit", "batch")

HEADER_DTYPE = np.dtype({
    "names": [
        "magic", "version", "header_bytes", "num_slots", "max_prompt", "ring_capacity",
        "max_top_logprobs", "request_bytes", "output_bytes", "total_bytes", "vocab_size",
        "max_context", "num_workers", "eos_id", "engine_state", "shutdown", "arena_tokens",
        "doorbell",
        "loop_iterations", "steps", "tokens_generated", "prompt_tokens", "requests_admitted",
        "requests_finished", "requests_errored", "requests_cancelled", "preemptions",
        "pages_in_use", "pages_total", "running", "waiting", "last_step_tokens",
        "schedule_ns", "commit_ns", "prefix_cache_queries", "prefix_cache_hits",
        "slot_scans", *(f"sched_{phase}_ns" for phase in SCHEDULE_PHASES), "step_rows",
    ],
    "formats": ["<u8"] + ["<u4"] * 8 + ["<u8"] + ["<u4"] * 7 + [("<u8", (MAX_WORKERS,))]
               + ["<u8"] * 25,
    "offsets": [0, 8, 12, 16, 20, 24, 28, 32, 36, 40, 48, 52, 56, 60, 64, 68, 72, 128]
               + [640 + 8 * i for i in range(25)],
    "itemsize": HEADER_BYTES,
})

REQUEST_DTYPE = np.dtype({
    "names": [
        "seq", "cancel", "consumed", "prompt_len", "request_id", "seed", "max_tokens",
        "temperature", "top_p", "top_k", "num_logprobs", "flags", "num_stop_ids",
        "prompt_offset", "arrival_ns", "stop_ids",
    ],
    "formats": ["<u4"] * 4 + ["<u8", "<u8", "<u4", "<f4", "<f4", "<i4", "<u4", "<u4", "<u4",
                              "<u4", "<i8", ("<i4", (MAX_STOP_IDS,))],
    "offsets": [0, 4, 8, 12, 16, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64, 72],
    "itemsize": REQUEST_FIXED_BYTES,
})

OUTPUT_DTYPE = np.dtype({
    "names": ["started_seq", "finished_seq", "count", "finish_reason", "error_code",
              "prompt_len", "preemptions", "admit_ticket", "token_ns", "cached_tokens",
              "taken_ns", "first_ns"],
    "formats": ["<u4"] * 8 + ["<u8", "<u4", "<u8", "<u8"],
    "offsets": [4 * i for i in range(8)] + [32, 40, 48, 56],
    "itemsize": OUTPUT_FIXED_BYTES,
})


def _packed(dtype: np.dtype) -> struct.Struct:
  """A struct.Struct of `dtype`'s fields in order (gaps between them skipped as padding):
  unpacking one is a few times faster than reading a numpy structured scalar's fields, and
  the frontend's driver does it for every slot in flight at every step."""
  codes, at = "<", 0
  for name in dtype.names:
    field, offset = dtype.fields[name][:2]
    if offset < at or field.byteorder == ">":
      raise ValueError(f"{name} is not little-endian at or after {at}")
    codes += f"{offset - at}x" if offset > at else ""
    at = offset
    codes += {"u4": "I", "u8": "Q", "i4": "i", "i8": "q"}[field.str[1:]]
    at += field.itemsize
  return struct.Struct(codes)


OUTPUT_HEADER = _packed(OUTPUT_DTYPE)
# OUTPUT_DTYPE's fields as a tuple: what a poll reads of a slot's output on every round.
OutputHeader = NamedTuple("OutputHeader", [(name, int) for name in OUTPUT_DTYPE.names])


def default_arena_tokens(num_slots: int, max_prompt: int) -> int:
  """A prompt arena with room for every slot's longest prompt at once: the size of a
  Geometry, and of a scheduler config (native.ffi.SchedConfig.build), given none."""
  return num_slots * max_prompt


def _align64(x: int) -> int:
  return (x + 63) & ~63


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Sizes of the mailbox; every offset derives from these five numbers. `arena_tokens`, the
  prompt arena's size, defaults to `default_arena_tokens`."""
  num_slots: int
  max_prompt: int
  ring_capacity: int
  max_top_logprobs: int
  arena_tokens: int | None = None

  def __post_init__(self):
    if self.arena_tokens is None:
      object.__setattr__(self, "arena_tokens",
                         default_arena_tokens(self.num_slots, self.max_prompt))

  request_bytes = REQUEST_FIXED_BYTES  # prompts live in the arena, not in the slot

  @functools.cached_property  # read on every offset computation
  def output_bytes(self) -> int:
    return _align64(OUTPUT_FIXED_BYTES + self.ring_capacity * (8 + 8 * self.max_top_logprobs))

  @functools.cached_property  # read on every offset computation
  def slot_bytes(self) -> int:
    return self.request_bytes + self.output_bytes

  @functools.cached_property
  def arena_offset(self) -> int:
    """Byte offset of the prompt arena (int32 token ids), after the last slot."""
    return HEADER_BYTES + self.num_slots * self.slot_bytes

  @property
  def total_bytes(self) -> int:
    return self.arena_offset + _align64(4 * self.arena_tokens)

  def request_offset(self, slot: int) -> int:
    return HEADER_BYTES + slot * self.slot_bytes

  def output_offset(self, slot: int) -> int:
    return self.request_offset(slot) + self.request_bytes

  def out_tokens_offset(self, slot: int) -> int:
    return self.output_offset(slot) + OUTPUT_FIXED_BYTES

  def out_logprobs_offset(self, slot: int) -> int:
    return self.out_tokens_offset(slot) + 4 * self.ring_capacity

  def out_top_ids_offset(self, slot: int) -> int:
    return self.out_logprobs_offset(slot) + 4 * self.ring_capacity

  def out_top_logprobs_offset(self, slot: int) -> int:
    return self.out_top_ids_offset(slot) + 4 * self.ring_capacity * self.max_top_logprobs

  def worker_slots(self, worker: int, num_workers: int) -> range:
    """The slots frontend worker `worker` of `num_workers` owns (one writer per slot)."""
    lo = worker * self.num_slots // num_workers
    hi = (worker + 1) * self.num_slots // num_workers
    return range(lo, hi)

  def worker_arena(self, worker: int, num_workers: int) -> range:
    """The arena tokens frontend worker `worker` of `num_workers` owns for its prompts."""
    lo = worker * self.arena_tokens // num_workers
    hi = (worker + 1) * self.arena_tokens // num_workers
    return range(lo, hi)
