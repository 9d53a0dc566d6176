"""Python mirror of the step's batch descriptor written by blink_schedule (ffi/sched_state.h).

One int32 vector: a header, then token arrays of `token_budget` rows, then per-sample arrays
of `max_seqs` entries. The executor slices it (jnp or numpy alike) into a `Batch`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

HEADER_WORDS = 16
NUM_ROWS, BUCKET, BUCKET_SIZE, NUM_SAMPLES, SHUTDOWN, NUM_DECODE = range(6)
TOKEN_ARRAYS = ("tokens", "positions", "seq_ids", "targets", "local_only")
SAMPLE_ARRAYS = ("rows", "lanes", "temperature", "top_p", "top_k", "seed_lo", "seed_hi",
                 "position", "num_logprobs")


def batch_words(token_budget: int, max_seqs: int) -> int:
  return HEADER_WORDS + len(TOKEN_ARRAYS) * token_budget + len(SAMPLE_ARRAYS) * max_seqs


@dataclasses.dataclass
class Batch:
  """Views of one step's rows (first `rows` of them) and samples (first `samples`)."""
  tokens: Any
  positions: Any
  seq_ids: Any
  targets: Any      # next prompt token whose logprob the row reports, or -1
  local_only: Any   # 1: only the sliding-window layers write the row's K/V (windowed pages)
  rows: Any
  lanes: Any
  temperature: Any  # float32 bits
  top_p: Any        # float32 bits
  top_k: Any
  seed_lo: Any
  seed_hi: Any
  position: Any
  num_logprobs: Any


def split(words, token_budget: int, max_seqs: int, rows: int, samples: int) -> Batch:
  """Slices a batch vector; `rows` and `samples` are static sizes (a bucket)."""
  out = {}
  base = HEADER_WORDS
  for name in TOKEN_ARRAYS:
    out[name] = words[base:base + rows]
    base += token_budget
  for name in SAMPLE_ARRAYS:
    out[name] = words[base:base + samples]
    base += max_seqs
  return Batch(**out)
