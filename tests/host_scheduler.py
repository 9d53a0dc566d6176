"""The scheduler driven directly through the C API on numpy buffers (no XLA): exactly the code
of the CPU FFI handlers, for the property tests and the fake device."""
from __future__ import annotations

import numpy as np

from blink_jax.native import ffi


GUARD_WORD = -0x21524111  # 0xDEADBEEF as int32: negative, so no token, page or lane id


class HostScheduler:
  """Drives the scheduler directly through the C API on numpy buffers (no XLA).

  The property tests use it: it runs exactly the code of the CPU FFI handlers.
  With `guard` > 0 every buffer lies between two runs of `guard` words of GUARD_WORD, so a
  test can tell a write past a buffer's end (`broken_guards`) instead of corrupting the heap.
  """

  def __init__(self, cfg: ffi.SchedConfig, guard: int = 0):
    self.cfg = cfg
    self._words = cfg.words()
    self._cfg_ptr = self._words.ctypes.data_as(ffi._i64p)
    self.guard = guard
    self._backing: dict[str, np.ndarray] = {}
    self.state = self._guarded("state", ffi.initial_state(cfg))
    self.history = self._guarded("history",
                                 np.zeros((cfg.max_seqs, cfg.max_context), np.int32))
    self.page_table = self._guarded(
        "page_table", np.zeros((cfg.max_seqs, cfg.max_pages_per_seq), np.int32))
    self.batch = self._guarded("batch", np.zeros(ffi.batch_words(cfg), np.int32))

  def _guarded(self, name: str, a: np.ndarray) -> np.ndarray:
    if not self.guard:
      return a
    g = self.guard
    backing = np.full(a.size + 2 * g, GUARD_WORD, np.int32)
    backing[g:g + a.size] = a.ravel()
    self._backing[name] = backing
    return backing[g:g + a.size].reshape(a.shape)

  def broken_guards(self) -> list[str]:
    """The buffers whose guard words changed (always [] without guards)."""
    g = self.guard
    return [name for name, b in self._backing.items()
            if (b[:g] != GUARD_WORD).any() or (b[-g:] != GUARD_WORD).any()]

  def schedule(self) -> np.ndarray:
    ffi.library().blink_host_schedule(self._cfg_ptr, self.state.ctypes.data_as(ffi._i32p),
                                  self.history.ctypes.data_as(ffi._i32p),
                                  self.page_table.ctypes.data_as(ffi._i32p),
                                  self.batch.ctypes.data_as(ffi._i32p))
    return self.batch

  def commit(self, sampled, logprobs, top_ids, top_lps, row_lps=None, row_top_ids=None,
             row_top_lps=None) -> None:
    """Per sample: token, logprob, top-n; per batch row (prompt logprobs; zeros if omitted):
    the target's logprob and top-n."""
    sampled = np.ascontiguousarray(sampled, np.int32)
    logprobs = np.ascontiguousarray(logprobs, np.float32)
    top_ids = np.ascontiguousarray(top_ids, np.int32)
    top_lps = np.ascontiguousarray(top_lps, np.float32)
    rows, k = self.cfg.token_budget, top_ids.shape[1] if top_ids.ndim == 2 else 0
    row_lps = np.ascontiguousarray(np.zeros(rows) if row_lps is None else row_lps, np.float32)
    row_top_ids = np.ascontiguousarray(
        np.zeros((rows, k)) if row_top_ids is None else row_top_ids, np.int32)
    row_top_lps = np.ascontiguousarray(
        np.zeros((rows, k)) if row_top_lps is None else row_top_lps, np.float32)
    ffi.library().blink_host_commit(self._cfg_ptr, self.state.ctypes.data_as(ffi._i32p),
                                self.history.ctypes.data_as(ffi._i32p),
                                self.page_table.ctypes.data_as(ffi._i32p),
                                self.batch.ctypes.data_as(ffi._i32p),
                                sampled.ctypes.data_as(ffi._i32p), logprobs.ctypes.data_as(ffi._f32p),
                                top_ids.ctypes.data_as(ffi._i32p), top_lps.ctypes.data_as(ffi._f32p),
                                row_lps.ctypes.data_as(ffi._f32p), row_top_ids.ctypes.data_as(ffi._i32p),
                                row_top_lps.ctypes.data_as(ffi._f32p), k)

  def check(self) -> str:
    return ffi.library().blink_state_check(self._cfg_ptr, self.state.ctypes.data_as(ffi._i32p),
                                       self.page_table.ctypes.data_as(ffi._i32p)).decode()

  def summary(self) -> dict[str, int]:
    return ffi.summarize(self.cfg, self.state)
