"""The frontend's clock for per-token latency: a separate process (the SmartNIC's role) that
timestamps every new output entry of one mailbox slot, by its own clock and by the GPU's
(`token_ns`), and keeps every slot's ring drained. Used by bench/executor.py.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from blink_jax.client import protocol as P


def _clock_main(shm_name: str, geo: P.Geometry, slot: int, cpu: int | None, ready, stop, conn):
  """The frontend process: timestamps every new output entry of one slot and drains every
  slot's ring. It runs apart from the engine so that it never competes for its GIL."""
  from blink_jax.client import shm
  # Mapped as a frontend maps it: no resource tracker registers (and later warns about) a
  # segment the engine or the benchmark unlinks.
  region = shm.open_region(shm_name)
  if cpu is not None:
    os.sched_setaffinity(0, {cpu})
  buf = region.buf[:geo.total_bytes]
  base = P.HEADER_BYTES
  field = lambda off: np.ndarray((geo.num_slots,), "<u4", buf, base + off, (geo.slot_bytes,))
  counts = field(geo.request_bytes + P.OUTPUT_DTYPE.fields["count"][1])
  token_ns = np.ndarray((geo.num_slots,), "<u8", buf,
                        base + geo.request_bytes + P.OUTPUT_DTYPE.fields["token_ns"][1],
                        (geo.slot_bytes,))
  consumed = field(8)
  stamps, last, n = [], -1, 0
  ready.set()
  while not stop.is_set():
    c = int(counts[slot])
    if c != last:
      t, dev_ns = time.perf_counter(), int(token_ns[slot])
      if int(counts[slot]) == c:  # the device clock read belongs to entry c
        stamps.append((c, t, dev_ns))
        last = c
    n += 1
    if n % 64 == 0:
      consumed[:] = counts
  conn.send(stamps)
  del buf, counts, consumed, field, token_ns
  region.close()


class TokenClock:
  """Per-token latency of one request, seen from a separate frontend process."""

  def __init__(self, shm_name: str, geo: P.Geometry, slot: int, cpu: int | None):
    ctx = mp.get_context("spawn")
    self.stop, ready = ctx.Event(), ctx.Event()
    self.recv, send = ctx.Pipe(duplex=False)
    self.proc = ctx.Process(target=_clock_main,
                            args=(shm_name, geo, slot, cpu, ready, self.stop, send), daemon=True)
    self.proc.start()
    if not ready.wait(120):
      raise TimeoutError("the frontend clock process did not start")
    self.stamps = []

  def finish(self):
    self.stop.set()
    self.stamps = self.recv.recv()
    self.proc.join()

  def _stamps(self) -> list[tuple[int, float, int]]:
    """(count, frontend time, device ns) of this request's entries: the slot may still show
    the count of its previous request (e.g. one of the engine's warm-up requests) until the
    new one starts, so what follows the last reset."""
    st = [x for x in self.stamps if x[0] > 0]
    resets = [i for i in range(1, len(st)) if st[i][0] < st[i - 1][0]]
    return st[resets[-1]:] if resets else st

  def first_count_at(self, from_ns: int) -> int | None:
    """The first entry count seen whose newest entry the GPU wrote at or after `from_ns` (its
    clock), or None."""
    return next((c for c, _, ns in self._stamps() if ns >= from_ns), None)

  def intervals_ms(self, from_ns: int = 0, device: bool = False) -> np.ndarray:
    """Per-token latency: time between consecutive tokens (one new entry each), from the
    first entry the GPU wrote at or after `from_ns` (its clock) on, as the frontend saw them
    or (device=True) by the GPU's clock when each token was written."""
    st = [(c, ns * 1e-9 if device else t) for c, t, ns in self._stamps() if ns >= from_ns]
    out = [(t1 - t0) * 1e3 / (c1 - c0) for (c0, t0), (c1, t1) in zip(st, st[1:]) if c1 > c0]
    return np.asarray(out)
