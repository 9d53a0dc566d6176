"""The Python mirrors (protocol.py, batch.py, ffi.SchedConfig) against the compiled library."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from blink_jax.native import batch as B
from blink_jax.native import ffi as F
from blink_jax.client import protocol as P


def check_mailbox_layout(layout: dict) -> None:
  """`layout` (a native library's `blink_mailbox_layout`, parsed) is the protocol mirror's:
  every field at the same offset, none missing on either side, the same constants. Also
  tests/test_bazel_build.py's check of the Bazel-built library."""
  dtypes = {"header": P.HEADER_DTYPE, "request": P.REQUEST_DTYPE, "output": P.OUTPUT_DTYPE}
  seen = 0
  for key, off in layout.items():
    struct, field = key.split(".")
    if struct == "const":
      continue
    assert dtypes[struct].fields[field][1] == off, key
    seen += 1
  # Every mirrored field exists in C and vice versa.
  assert seen == sum(len(d.names) for d in dtypes.values())
  assert layout["const.header_bytes"] == P.HEADER_BYTES == P.HEADER_DTYPE.itemsize
  assert layout["const.request_fixed_bytes"] == P.REQUEST_FIXED_BYTES
  assert layout["const.output_fixed_bytes"] == P.OUTPUT_FIXED_BYTES
  assert layout["const.max_workers"] == P.MAX_WORKERS
  assert layout["const.max_stop_ids"] == P.MAX_STOP_IDS
  assert layout["const.version"] == P.VERSION


def geometry_offsets_of(geo: P.Geometry, slot: int) -> list[int]:
  """What a native library's `blink_geometry_offsets` must give for `slot` of `geo`."""
  return [geo.request_offset(slot), geo.arena_offset, geo.output_offset(slot),
          geo.out_tokens_offset(slot), geo.out_logprobs_offset(slot),
          geo.out_top_ids_offset(slot), geo.out_top_logprobs_offset(slot), geo.total_bytes]


def test_fixed_struct_offsets_match_the_header():
  check_mailbox_layout(F.mailbox_layout())


@pytest.mark.parametrize("geo", [P.Geometry(1, 1, 1, 0), P.Geometry(4096, 8191, 64, 20),
                                 P.Geometry(4096, 32767, 64, 8, 1 << 23),
                                 P.Geometry(7, 13, 5, 3, 29)])
def test_geometry_offsets_match(geo):
  for slot in (0, 1, geo.num_slots - 1):
    assert F.geometry_offsets(geo, slot) == geometry_offsets_of(geo, slot)


def test_batch_layout_matches():
  c = F.batch_layout()
  assert c["header_words"] == B.HEADER_WORDS
  assert [c[n] for n in ("num_rows", "bucket", "bucket_size", "num_samples", "shutdown",
                         "num_decode")] == [B.NUM_ROWS, B.BUCKET, B.BUCKET_SIZE, B.NUM_SAMPLES,
                                            B.SHUTDOWN, B.NUM_DECODE]
  assert [c[n] for n in B.TOKEN_ARRAYS] == list(range(len(B.TOKEN_ARRAYS)))
  assert [c[n] for n in B.SAMPLE_ARRAYS] == list(range(len(B.SAMPLE_ARRAYS)))
  assert c["token_arrays"] == len(B.TOKEN_ARRAYS) and c["sample_arrays"] == len(B.SAMPLE_ARRAYS)


def test_sched_config_fields_match():
  assert [f.name for f in dataclasses.fields(F.SchedConfig)] == F.config_field_names()
  cfg = F.SchedConfig.build(mailbox=1, num_slots=4, max_prompt=8, ring_capacity=4,
                            max_top_logprobs=0, vocab_size=10, max_seqs=2, max_context=16,
                            page_size=4, num_pages=8, buckets=(2, 4))
  assert F.batch_words(cfg) == B.batch_words(cfg.token_budget, cfg.max_seqs)


def test_protocol_modules_import_without_jax():
  code = ("import sys, blink_jax.client.protocol, blink_jax.client.mailbox, blink_jax.native.batch, "
          "blink_jax.client.tokenizer; assert 'jax' not in sys.modules, 'jax was imported'")
  subprocess.run([sys.executable, "-c", code], check=True)
