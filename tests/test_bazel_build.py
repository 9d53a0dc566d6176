"""The Bazel-built native library (WORKSPACE, ffi/BUILD.bazel) against the Python mirrors, as
tests/test_protocol.py checks the CMake-built one, and against the CMake-built one itself.

`.ci/run` builds it (`bazel build //...`) before pytest and names it in BLINK_BAZEL_LIB;
elsewhere these tests take bazel-bin/ffi/libblink_ffi.so and skip when it is missing or older
than the sources (`bazel build //ffi:libblink_ffi.so` makes it).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import shutil

import pytest

from blink_jax.client import protocol as P
from blink_jax.native import batch as B
from blink_jax.native import ffi as F
from tests.test_protocol import check_mailbox_layout, geometry_offsets_of

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [*sorted((REPO / "ffi").glob("*.h")), REPO / "ffi" / "capi.cc",
           REPO / "ffi" / "cpu_handlers.cc"]


@pytest.fixture(scope="module")
def bazel_lib() -> F._Lib:
  if os.environ.get("BLINK_BAZEL_LIB"):
    # Named (as .ci/run does right after building it): it must be there, and it is current.
    path = pathlib.Path(os.environ["BLINK_BAZEL_LIB"])
    assert path.is_file(), f"BLINK_BAZEL_LIB={path} does not exist"
    return F._Lib(path.resolve())
  path = REPO / "bazel-bin" / "ffi" / "libblink_ffi.so"
  if not path.exists():
    why = ("bazel is not installed (.ci/run installs Debian's bazel-bootstrap)"
           if shutil.which("bazel") is None else "run `bazel build //ffi:libblink_ffi.so` first")
    pytest.skip(f"no Bazel-built library at {path}: {why}")
  newest = max(SOURCES, key=lambda p: p.stat().st_mtime)
  if newest.stat().st_mtime > path.stat().st_mtime:
    pytest.skip(f"the Bazel-built {path.name} is older than {newest.relative_to(REPO)}: "
                "rerun `bazel build //ffi:libblink_ffi.so`")
  return F._Lib(path.resolve())


def test_bazel_library_mailbox_layout_matches_the_protocol_mirror(bazel_lib):
  check_mailbox_layout(F._layout(bazel_lib.blink_mailbox_layout()))


@pytest.mark.parametrize("geo", [P.Geometry(1, 1, 1, 0), P.Geometry(7, 13, 5, 3, 29)])
def test_bazel_library_geometry_offsets_match(bazel_lib, geo):
  for slot in (0, geo.num_slots - 1):
    g = (ctypes.c_uint32 * 5)(geo.num_slots, geo.max_prompt, geo.ring_capacity,
                              geo.max_top_logprobs, geo.arena_tokens)
    out = (ctypes.c_uint64 * 8)()
    bazel_lib.blink_geometry_offsets(g, slot, out)
    assert list(out) == geometry_offsets_of(geo, slot)


def test_bazel_library_batch_layout_and_config_fields_match(bazel_lib):
  c = F._layout(bazel_lib.blink_batch_layout())
  assert c["header_words"] == B.HEADER_WORDS
  assert [c[n] for n in B.TOKEN_ARRAYS] == list(range(len(B.TOKEN_ARRAYS)))
  assert [c[n] for n in B.SAMPLE_ARRAYS] == list(range(len(B.SAMPLE_ARRAYS)))
  names = bazel_lib.blink_sched_config_fields().decode().split(",")
  assert names == [f.name for f in dataclasses.fields(F.SchedConfig)]


def test_bazel_library_exports_the_cpu_ffi_handlers(bazel_lib):
  for name in ("BlinkScheduleCpu", "BlinkCommitCpu"):
    assert ctypes.cast(getattr(bazel_lib.lib, name), ctypes.c_void_p).value, name


def test_bazel_and_cmake_libraries_agree(bazel_lib):
  try:
    cmake = F.library()
  except FileNotFoundError as e:
    pytest.skip(f"no CMake-built library to compare with: {e}")
  assert pathlib.Path(cmake.path).resolve() != pathlib.Path(bazel_lib.path).resolve()
  for fn in ("blink_mailbox_layout", "blink_batch_layout", "blink_counter_layout",
             "blink_sched_config_fields"):
    assert getattr(bazel_lib, fn)() == getattr(cmake, fn)(), fn
  cfg = F.SchedConfig.build(mailbox=1, num_slots=4, max_prompt=8, ring_capacity=4,
                            max_top_logprobs=0, vocab_size=10, max_seqs=2, max_context=16,
                            page_size=4, num_pages=8, buckets=(2, 4))
  ptr, _keep = cfg.words_ptr()
  assert bazel_lib.blink_state_words(ptr) == cmake.blink_state_words(ptr)
  assert bazel_lib.blink_batch_words_c(ptr) == cmake.blink_batch_words_c(ptr)
