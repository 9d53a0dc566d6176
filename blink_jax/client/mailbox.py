"""Frontend-side access to the mailbox: submit requests, cancel, read output rings (no JAX).

`Region` is the transport seam: a flat byte region with loads and stores at offsets. The
shared-memory and in-process transports hand a numpy view (stores are plain CPU stores, which
x86 keeps in program order, so "payload first, sequence word last" holds); remote transports
(TCP relay, RDMA) implement the same two calls.
"""
from __future__ import annotations

import bisect
import dataclasses
import threading
import time
from typing import Protocol, Sequence

import numpy as np

from blink_jax.client import protocol


class Region(Protocol):
  """A flat byte region: the one thing a transport provides."""

  def read(self, offset: int, nbytes: int) -> bytes: ...

  def write(self, offset: int, data: bytes) -> None: ...


class LocalRegion:
  """Memory of this process (POSIX shm mapping or a plain buffer)."""

  def __init__(self, buf: np.ndarray):
    self.buf = buf.view(np.uint8).reshape(-1)

  @property
  def address(self) -> int:
    return self.buf.ctypes.data

  def read(self, offset: int, nbytes: int) -> bytes:
    return self.buf[offset:offset + nbytes].tobytes()

  def write(self, offset: int, data: bytes) -> None:
    n = len(data)
    if n in (4, 8) and offset % n == 0:
      # A sequence / cancel / doorbell word: one aligned store, never torn.
      self.buf[offset:offset + n].view("<u4" if n == 4 else "<u8")[0] = (
          int.from_bytes(data, "little"))
    else:
      self.buf[offset:offset + n] = np.frombuffer(data, np.uint8)


def init_header(region: Region, geo: protocol.Geometry, *, vocab_size: int, max_context: int,
                num_workers: int, eos_id: int) -> None:
  """Writes a fresh header (engine side, before READY)."""
  h = np.zeros((), protocol.HEADER_DTYPE)
  h["magic"], h["version"] = protocol.MAGIC, protocol.VERSION
  h["header_bytes"] = protocol.HEADER_BYTES
  h["num_slots"], h["max_prompt"] = geo.num_slots, geo.max_prompt
  h["ring_capacity"], h["max_top_logprobs"] = geo.ring_capacity, geo.max_top_logprobs
  h["request_bytes"], h["output_bytes"] = geo.request_bytes, geo.output_bytes
  h["total_bytes"], h["vocab_size"], h["max_context"] = geo.total_bytes, vocab_size, max_context
  h["num_workers"], h["eos_id"] = num_workers, eos_id
  h["arena_tokens"] = geo.arena_tokens
  h["engine_state"] = protocol.EngineState.STARTING
  region.write(0, h.tobytes())


def read_header(region: Region) -> np.ndarray:
  h = np.frombuffer(region.read(0, protocol.HEADER_BYTES), protocol.HEADER_DTYPE)[0]
  if int(h["magic"]) != protocol.MAGIC or int(h["version"]) != protocol.VERSION:
    raise ValueError(f"not a blink mailbox (magic {int(h['magic']):#x}, version "
                     f"{int(h['version'])}); expected version {protocol.VERSION}")
  return h


def geometry_of(h: np.ndarray) -> protocol.Geometry:
  return protocol.Geometry(int(h["num_slots"]), int(h["max_prompt"]), int(h["ring_capacity"]),
                           int(h["max_top_logprobs"]), int(h["arena_tokens"]))


def _u32(x: int) -> bytes:
  return int(x).to_bytes(4, "little")


def _field_offset(dtype: np.dtype, name: str) -> int:
  return dtype.fields[name][1]


_CANCEL = _field_offset(protocol.REQUEST_DTYPE, "cancel")
_CONSUMED = _field_offset(protocol.REQUEST_DTYPE, "consumed")
_DOORBELLS = _field_offset(protocol.HEADER_DTYPE, "doorbell")
# Header counters the device bumps whenever an output ring gains entries or a request ends
# (tokens_generated .. requests_finished): one read says whether any slot needs polling.
_PROGRESS = _field_offset(protocol.HEADER_DTYPE, "tokens_generated")
_PROGRESS_LEN = _field_offset(protocol.HEADER_DTYPE, "requests_finished") + 8 - _PROGRESS


def write_header_word(region: Region, field: str, value: int) -> None:
  """One 32-bit word of the header, written alone (engine host side: engine_state, shutdown,
  num_workers; ffi/mailbox.h says who owns which)."""
  if protocol.HEADER_DTYPE.fields[field][0].itemsize != 4:
    raise ValueError(f"header field {field!r} is not one 32-bit word")
  region.write(_field_offset(protocol.HEADER_DTYPE, field), _u32(value))


@dataclasses.dataclass
class Request:
  """What the frontend writes into a slot (validated again on the device)."""
  prompt: Sequence[int]
  max_tokens: int
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_ids: Sequence[int] = ()
  num_logprobs: int = 0
  logprobs: bool = False
  prompt_logprobs: bool = False  # entries start with the prompt's tokens 1.. and logprobs
  ignore_eos: bool = False
  request_id: int = 0


@dataclasses.dataclass
class Output:
  """New entries of a slot since the last poll, and its finish if it has finished."""
  tokens: list[int]
  logprobs: list[float]
  top: list[list[tuple[int, float]]]
  finished: bool
  finish_reason: protocol.Finish = protocol.Finish.NONE
  error: protocol.Error = protocol.Error.NONE
  admit_ticket: int = 0
  preemptions: int = 0
  cached_tokens: int = 0  # prompt tokens that came from the prefix cache
  # Entries the slot holds (read so far, these included) and the device's clock (ns) when it
  # took the request, wrote entry 0 and wrote its newest entry (ffi/mailbox.h; token_ns is
  # read with the count, so before the finish it may already be the next entry's).
  produced: int = 0
  taken_ns: int = 0
  first_ns: int = 0
  token_ns: int = 0


class SlotsFullError(RuntimeError):
  """Every slot of this worker holds a request, or its prompt arena has no room for the
  prompt until some request finishes: either way the request can wait for one to finish."""


class PromptArena:
  """First-fit allocator of one worker's range of the mailbox's prompt arena (ffi/mailbox.h).

  A request's prompt tokens stay where they were written until the request finishes (the
  device reads them when it admits the request, which may be long after the submit), so
  allocations end in any order; free ranges are kept sorted and merged with their neighbours.
  """

  def __init__(self, tokens: range):
    self.tokens = tokens
    self._starts = [tokens.start] if len(tokens) else []  # free ranges, sorted by start
    self._ends = [tokens.stop] if len(tokens) else []

  @property
  def capacity(self) -> int:
    return len(self.tokens)

  @property
  def free_tokens(self) -> int:
    return sum(e - s for s, e in zip(self._starts, self._ends))

  def alloc(self, n: int) -> int | None:
    """The start of `n` (>= 1) free tokens, now taken; None when no free range is that long."""
    for i, (s, e) in enumerate(zip(self._starts, self._ends)):
      if e - s >= n:
        if e - s == n:
          del self._starts[i], self._ends[i]
        else:
          self._starts[i] = s + n
        return s
    return None

  def free(self, start: int, n: int) -> None:
    end = start + n
    i = bisect.bisect_left(self._starts, start)
    if (i > 0 and self._ends[i - 1] > start) or (i < len(self._starts) and self._starts[i] < end):
      raise ValueError(f"arena tokens [{start}, {end}) are already free")
    if i > 0 and self._ends[i - 1] == start:  # merge with the range before
      i -= 1
      start = self._starts[i]
      del self._starts[i], self._ends[i]
    if i < len(self._starts) and self._starts[i] == end:  # and with the one after
      end = self._ends[i]
      del self._starts[i], self._ends[i]
    self._starts.insert(i, start)
    self._ends.insert(i, end)


class MailboxClient:
  """One frontend worker's view: it alone writes the request side of its slot range."""

  def __init__(self, region: Region, worker: int = 0, num_workers: int = 1):
    self.region = region
    self.header = read_header(region)
    self.geo = geometry_of(self.header)
    self.worker = worker
    self.slots = self.geo.worker_slots(worker, num_workers)
    self.arena = PromptArena(self.geo.worker_arena(worker, num_workers))
    self._prompts: dict[int, tuple[int, int]] = {}  # slot -> its request's arena tokens
    self._lock = threading.Lock()
    self._free = list(reversed(self.slots))
    self._seq: dict[int, int] = {}
    self._read: dict[int, int] = {}
    self._wants: dict[int, tuple[bool, int]] = {}  # slot -> (logprobs, top-n) it asked for
    self._doorbell = int(self.header["doorbell"][worker])
    # Every slot's output `count` and `finished_seq` as strided views, when the region is
    # this process's memory (poll_many's vectorized pick).
    self._counts = self._finished = None
    if isinstance(region, LocalRegion) and self.geo.slot_bytes % 4 == 0:
      words = region.buf[:self.geo.arena_offset].view("<u4")
      def field(name: str) -> np.ndarray:
        at = (self.geo.output_offset(0) + protocol.OUTPUT_DTYPE.fields[name][1]) // 4
        return words[at::self.geo.slot_bytes // 4][:self.geo.num_slots]
      self._counts, self._finished = field("count"), field("finished_seq")
    # Continue the sequence numbers a previous client of these slots left behind. A slot whose
    # request is still unfinished (its client died) is cancelled and kept out of the free list
    # until the device finishes it: see reclaim().
    self._stale: set[int] = set()
    for s in self.slots:
      req = self._request(s)
      self._seq[s] = int(req["seq"])
      if self._seq[s] != 0 and self._output(s).finished_seq != self._seq[s]:
        self._stale.add(s)
        self._free.remove(s)
    if self._stale:
      for s in sorted(self._stale):
        self.region.write(self.geo.request_offset(s) + _CANCEL, _u32(self._seq[s]))
      self._ring_doorbell()

  # ---- low level ----
  def _request(self, slot: int) -> np.ndarray:
    raw = self.region.read(self.geo.request_offset(slot), protocol.REQUEST_FIXED_BYTES)
    return np.frombuffer(raw, protocol.REQUEST_DTYPE)[0]

  def _output(self, slot: int) -> protocol.OutputHeader:
    h = protocol.OUTPUT_HEADER
    return protocol.OutputHeader._make(h.unpack(self.region.read(self.geo.output_offset(slot),
                                                                 h.size)))

  def _ring_doorbell(self) -> None:
    self._doorbell += 1
    off = _DOORBELLS + protocol.HEADER_DTYPE.fields["doorbell"][0].base.itemsize * self.worker
    self.region.write(off, self._doorbell.to_bytes(8, "little"))

  def ring_doorbell(self) -> None:
    """Rings this worker's doorbell with nothing new: the device's next schedule scans the
    slots as after a submit (bench.sched measures that scan's cost this way)."""
    with self._lock:
      self._ring_doorbell()

  def header_now(self) -> np.ndarray:
    return read_header(self.region)

  @property
  def free_slots(self) -> int:
    return len(self._free)

  @property
  def stale_slots(self) -> int:
    return len(self._stale)

  def reclaim(self) -> int:
    """Frees the stale slots (left unfinished by a previous client) that have finished since;
    returns how many are still pending."""
    with self._lock:
      for s in sorted(self._stale):
        if self._output(s).finished_seq == self._seq[s]:
          self._stale.discard(s)
          self._free.append(s)
      return len(self._stale)

  # ---- requests ----
  def submit(self, r: Request, overrides: dict | None = None) -> int:
    """Writes `r` into a free slot and publishes it; returns the slot.

    `overrides` are request fields written verbatim after the normal encoding (tests use it to
    forge requests the device must reject).
    """
    g = self.geo
    if len(r.stop_ids) > protocol.MAX_STOP_IDS:
      raise ValueError(f"at most {protocol.MAX_STOP_IDS} stop token ids, got {len(r.stop_ids)}")
    n, longest = len(r.prompt), min(g.max_prompt, self.arena.capacity)
    if n > longest:
      raise ValueError(f"prompt of {n} tokens exceeds the slot capacity {longest}")
    if not self._free and self._stale:
      self.reclaim()
    with self._lock:
      if not self._free:
        raise SlotsFullError(f"all {len(self.slots)} slots of worker {self.worker} are busy")
      size = max(n, 1)  # an empty prompt (refused by the device) still takes a token
      at = self.arena.alloc(size)
      if at is None:
        raise SlotsFullError(f"the prompt arena of worker {self.worker} has no room for "
                             f"{n} tokens until a request finishes "
                             f"({self.arena.free_tokens} of {self.arena.capacity} free)")
      slot = self._free.pop()
      self._prompts[slot] = (at, size)
      # Next sequence number after the one in the slot: normally ours; if another writer used
      # the slot meanwhile (a misconfigured second client), still never a seq whose output
      # is already there (ABA).
      current = int(self._request(slot)["seq"])
      seq = (max(self._seq[slot], current) + 1) & 0xFFFFFFFF or 1
      self._seq[slot] = seq
      self._read[slot] = 0
      req = np.zeros((), protocol.REQUEST_DTYPE)
      req["cancel"], req["consumed"], req["prompt_len"] = 0, 0, len(r.prompt)
      req["request_id"], req["seed"] = r.request_id, r.seed & 0xFFFFFFFFFFFFFFFF
      req["max_tokens"] = r.max_tokens
      req["temperature"], req["top_p"], req["top_k"] = r.temperature, r.top_p, r.top_k
      req["num_logprobs"] = r.num_logprobs
      req["flags"] = ((protocol.FLAG_LOGPROBS if r.logprobs else 0)
                      | (protocol.FLAG_PROMPT_LOGPROBS if r.prompt_logprobs else 0)
                      | (protocol.FLAG_IGNORE_EOS if r.ignore_eos else 0))
      req["num_stop_ids"] = len(r.stop_ids)
      req["prompt_offset"] = at
      req["arrival_ns"] = time.monotonic_ns()
      req["stop_ids"][:len(r.stop_ids)] = list(r.stop_ids)
      for k, v in (overrides or {}).items():
        req[k] = v
      req["seq"] = current  # unchanged until the payload is in place
      # Payload first (prompt, then the fixed fields), the sequence word last.
      flags = int(req["flags"])
      logprobs = bool(flags & (protocol.FLAG_LOGPROBS | protocol.FLAG_PROMPT_LOGPROBS))
      self._wants[slot] = (logprobs, int(req["num_logprobs"]) if logprobs else 0)
      self.region.write(g.arena_offset + 4 * at,
                        np.asarray(r.prompt, dtype=np.int64).astype("<i4").tobytes())
      self.region.write(g.request_offset(slot), req.tobytes())
      self.region.write(g.request_offset(slot), _u32(seq))
      self._ring_doorbell()
      return slot

  def cancel(self, slot: int) -> None:
    with self._lock:
      self.region.write(self.geo.request_offset(slot) + _CANCEL, _u32(self._seq[slot]))
      self._ring_doorbell()

  def poll(self, slot: int) -> Output:
    """Reads the entries produced since the last poll (and marks them consumed)."""
    g, seq = self.geo, self._seq[slot]
    out = self._output(slot)
    if out.started_seq != seq:
      return Output([], [], [], False)
    finished = out.finished_seq == seq
    count = out.count  # read after finished_seq: includes every entry if finished
    if finished:
      out = self._output(slot)
      count = out.count
    start = self._read[slot]
    n = count - start
    tokens, lps, top = [], [], []
    if n > 0:
      # One load of the arrays the request asked for (tokens | logprobs | top ids | top
      # logprobs are contiguous): one round trip on a remote transport, and a request without
      # logprobs (most) copies 4 bytes an entry of its ring, not 8 + 8 x max_top_logprobs.
      ring, k = g.ring_capacity, g.max_top_logprobs
      logprobs, n_top = self._wants.get(slot, (True, k))
      base = g.out_tokens_offset(slot)
      end = (g.out_top_logprobs_offset(slot) + 4 * ring * k if n_top and k else
             g.out_top_ids_offset(slot) if logprobs else g.out_logprobs_offset(slot))
      raw = memoryview(self.region.read(base, end - base))
      idx = [(start + i) % ring for i in range(n)]
      ids = raw[:4 * ring].cast("i")  # native order: little-endian like the protocol
      tokens = [ids[i] for i in idx]
      if logprobs:
        values = raw[4 * ring:8 * ring].cast("f")
        lps = [values[i] for i in idx]
      if n_top and k:
        top_ids = raw[8 * ring:(8 + 4 * k) * ring].cast("i")
        top_lps = raw[(8 + 4 * k) * ring:].cast("f")
        top = [list(zip(top_ids[i * k:(i + 1) * k], top_lps[i * k:(i + 1) * k])) for i in idx]
      self._read[slot] = count
      self.region.write(g.request_offset(slot) + _CONSUMED, _u32(count))
    return Output(tokens, lps, top, finished,
                  protocol.Finish(out.finish_reason) if finished else protocol.Finish.NONE,
                  protocol.Error(out.error_code) if finished else protocol.Error.NONE,
                  out.admit_ticket, out.preemptions, out.cached_tokens, count, out.taken_ns,
                  out.first_ns, out.token_ns)

  def progress(self) -> bytes:
    """The device's progress counters: unchanged since the last call means no output ring of
    any slot has gained an entry and no request has finished (one read instead of a poll of
    every slot in flight)."""
    return self.region.read(_PROGRESS, _PROGRESS_LEN)

  def poll_many(self, slots) -> list[tuple[int, Output]]:
    """`poll` of each slot; the (slot, output) pairs with new entries or a finish.

    In local memory (shm) one vectorized read of every slot's `count` and `finished_seq`
    first picks the slots that may have something: a worker holds up to thousands of
    requests in flight, most of them queued on the device or between tokens, and a `poll`
    of one with nothing new costs a few microseconds of Python (with 1,024 streams on 256
    lanes the sweeps took half the worker's busy time, docs/PERFORMANCE.md, "Frontend
    workers"). The pick is a hint like the progress counters: `poll` itself reads in the
    protocol's order, and a slot passed over has its news at the next sweep."""
    slots = list(slots)
    if self._counts is not None and len(slots) > 8:  # a handful: polling them costs as little
      idx = np.fromiter(slots, np.int64, len(slots))
      read = np.fromiter((self._read[s] for s in slots), np.uint32, len(slots))
      seq = np.fromiter((self._seq[s] for s in slots), np.uint32, len(slots))
      news = (self._counts[idx] != read) | (self._finished[idx] == seq)
      slots = idx[news].tolist()
    out = []
    for slot in slots:
      o = self.poll(slot)
      if o.tokens or o.finished:
        out.append((slot, o))
    return out

  def release(self, slot: int) -> None:
    """Returns a finished (and fully read) slot, and its prompt's arena tokens, to this
    worker's free lists."""
    with self._lock:
      self.arena.free(*self._prompts.pop(slot))
      self._wants.pop(slot, None)
      self._free.append(slot)
