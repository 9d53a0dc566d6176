"""The mailbox driver of a frontend worker: the one thread that touches the mailbox region.

It submits and cancels on behalf of the HTTP handlers (`nic_frontend.server`), polls the output
rings of the slots in flight and posts what it reads to each request's asyncio queue, and keeps
a snapshot of the header (engine state, GPU counters). Handlers never touch the region, so a
blocking transport (TCP relay, RDMA) never stalls the event loop.

Two things besides: a request that finds every slot of this worker in use waits in a FIFO
queue (`DriverOptions.max_queued_requests`, `queue_timeout_s`) for the next slot this worker
frees; and
the engine's liveness: the device publishes its counters (loop_iterations, steps, tokens, ...)
after every schedule and every commit, and an idle loop still goes round every idle_poll_us,
so a READY engine whose counters stay unchanged for `engine_stall_s` is stalled (the engine
process stopped or hung): what is in flight or queued ends with an error, new requests are
refused, until the counters move again.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

from blink_jax.client import mailbox
from blink_jax.client import protocol

from nic_frontend.metrics import FrontendMetrics

log = logging.getLogger("nic_frontend")

STATE_NAMES = {protocol.EngineState.STARTING: "starting", protocol.EngineState.READY: "ready",
               protocol.EngineState.STOPPED: "stopped"}


class EngineUnavailable(Exception):
  """The engine is not ready (starting, stopped, stalled, gone), the transport to it is down,
  or the frontend is shutting down. `code`: the OpenAI-style error code clients get."""

  def __init__(self, message: str, code: str = "engine_unavailable"):
    super().__init__(message)
    self.code = code


class Flight:
  """One request in a slot, as the asyncio side sees it."""

  __slots__ = ("loop", "queue", "submitted", "slot", "abandoned", "device_done", "request_id",
               "created", "placed")

  def __init__(self, loop: asyncio.AbstractEventLoop, request_id: int):
    self.loop = loop
    self.queue: asyncio.Queue = asyncio.Queue()
    self.submitted: asyncio.Future = loop.create_future()
    self.slot: int | None = None
    self.abandoned = False
    self.device_done = False  # the device finished it (set on the asyncio side on delivery)
    self.request_id = request_id
    self.created = time.monotonic()  # its time in the queue counts from here
    self.placed: float | None = None  # when its slot's write began, until its first output

  async def next(self) -> mailbox.Output:
    item = await self.queue.get()
    if isinstance(item, BaseException):
      raise item
    if item.finished:
      self.device_done = True
    return item


def _resolve(fut: asyncio.Future, value: Any = None, exc: BaseException | None = None) -> None:
  if fut.done():
    return
  if exc is not None:
    fut.set_exception(exc)
  else:
    fut.set_result(value)


@dataclasses.dataclass
class DriverOptions:
  poll_min_s: float = 50e-6   # poll interval right after output arrived
  poll_max_s: float = 500e-6  # ... backing off to this while requests wait for output
  idle_s: float = 20e-3       # nothing in flight
  header_s: float = 50e-3     # header (engine state, GPU counters) refresh
  full_sweep_s: float = 10e-3  # poll every slot in flight at least this often (see _poll_active)
  reconnect_max_s: float = 1.0  # back-off limit while the engine is unreachable
  # READY but none of the device's counters moved for this long: the engine is stalled (0:
  # never). It must exceed the longest step (one schedule -> model -> commit; a long prompt is
  # prefilled in steps of at most the token budget, each of which moves the counters).
  engine_stall_s: float = 10.0
  # With every slot of this worker in use, up to max_queued_requests requests wait (FIFO) for
  # the next slot it frees, each at most queue_timeout_s (0: no limit); beyond either:
  # SlotsFullError (503 + Retry-After, as vLLM past --max-num-queued-reqs).
  max_queued_requests: int = 0
  queue_timeout_s: float = 0.0


# Header counters that move whenever the device loop goes round (every schedule and commit;
# an idle loop still iterates every idle_poll_us).
PROGRESS_COUNTERS = ("loop_iterations", "steps", "tokens_generated", "prompt_tokens",
                     "requests_admitted", "requests_finished", "requests_cancelled")


# The GPU publishes these counters after every commit, once the ring entries and finishes of
# the step are written: while they do not change there is no new output in any slot, and one
# 32-byte read replaces a read per slot in flight (a round trip each on a remote transport).


class MailboxDriver:
  """The thread that owns this worker's side of the mailbox.

  It is the only user of the region in this process: it submits and cancels on behalf of the
  handlers, polls the output rings of the slots in flight and posts what it reads to each
  request's asyncio queue, and keeps a snapshot of the header (engine state, GPU counters).
  """

  def __init__(self, region: mailbox.Region, *, worker: int = 0, num_workers: int | None = None,
               metrics: FrontendMetrics | None = None, options: DriverOptions | None = None):
    self.region = region
    self.worker = worker
    self.num_workers = num_workers
    self.metrics = metrics
    self.opt = options or DriverOptions()
    self.client: mailbox.MailboxClient | None = None
    self.header: dict | None = None
    self.state: protocol.EngineState | None = None  # None: no valid header / transport down
    self.last_error: str | None = None
    self.loop: asyncio.AbstractEventLoop | None = None
    self._cmds: collections.deque = collections.deque()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._active: dict[int, Flight] = {}
    self._thread: threading.Thread | None = None
    self._last_header = 0.0
    self._last_hint = b""
    self._last_sweep = 0.0
    self._failures = 0
    self._ids = itertools.count(1)
    self.slots_total = 0
    self.slots_in_use = 0
    self.stalled = False  # READY, but no progress for engine_stall_s
    self.failed: EngineUnavailable | None = None  # fail_all(): every request is refused so
    self._waiting: collections.deque = collections.deque()  # (flight, request, deadline)
    self._last_waiting = 0  # the queue length the metrics show
    self._progress_sig: tuple | None = None
    self._progress_at = 0.0
    self._progress_check: float | None = None
    self._closed = False

  # ---- lifecycle ----
  def start(self, loop: asyncio.AbstractEventLoop) -> None:
    self.loop = loop
    self._thread = threading.Thread(target=self._run, name=f"blink-mailbox-{self.worker}",
                                    daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 5.0) -> None:
    """Cancels what is still in flight on the device, waits (up to `timeout`) for the device to
    finish those requests so their pages are freed, and stops the thread."""
    if self._thread is None:
      return
    self._cmds.append(("drain", time.monotonic() + timeout))
    self._wake.set()
    self._thread.join(timeout + 1.0)
    self._thread = None

  def fail_all(self, exc: EngineUnavailable) -> None:
    """Ends every request in flight (an error event, or a 503 if nothing was sent yet) and every
    queued one with `exc`, cancels them on the device, and refuses new requests with it from
    now on (shutdown past its grace period, the engine process gone)."""
    self._cmds.append(("fail", exc))
    self._wake.set()

  @property
  def in_flight(self) -> int:
    return len(self._active)

  @property
  def queued(self) -> int:
    return len(self._waiting)

  def new_request_id(self) -> int:
    return (self.worker << 48) | (next(self._ids) & ((1 << 48) - 1))

  # ---- asyncio side ----
  async def submit(self, req: mailbox.Request) -> Flight:
    """Places `req` in a free slot of this worker, waiting in the FIFO queue if they are all in
    use (`max_queued_requests`, `queue_timeout_s`). Raises SlotsFullError, EngineUnavailable."""
    if self._closed:
      raise EngineUnavailable("the frontend is shutting down", code="shutting_down")
    flight = Flight(asyncio.get_running_loop(), req.request_id)
    self._cmds.append(("submit", flight, req))
    self._wake.set()
    try:
      flight.slot = await flight.submitted
    except asyncio.CancelledError:
      self.abandon(flight, "disconnect")
      raise
    return flight

  def abandon(self, flight: Flight, reason: str) -> None:
    """Stops caring about `flight`: cancels it on the device unless it already finished; the
    slot returns to the free list once the device has finished it."""
    if flight.abandoned or flight.device_done:
      return
    flight.abandoned = True
    self._cmds.append(("abandon", flight, reason))
    self._wake.set()

  # ---- the thread ----
  def _post(self, fn, *args) -> None:
    loop = self.loop
    if loop is not None and not loop.is_closed():
      try:
        loop.call_soon_threadsafe(fn, *args)
      except RuntimeError:  # loop closed meanwhile
        pass

  def _run(self) -> None:
    interval = self.opt.poll_min_s
    drain_deadline = None
    while True:
      self._wake.clear()
      progressed = False
      try:
        if self.client is None:
          self._connect()
        if self.client is not None:
          now = time.monotonic()
          if now - self._last_header >= self.opt.header_s:
            self._refresh_header(now)
          drain_deadline = self._run_commands(drain_deadline)
          progressed = self._poll_active()
          if self._waiting:
            self._admit_waiting(time.monotonic())
        else:
          drain_deadline = self._run_commands(drain_deadline)
      except Exception as e:  # transport failure: fail what is in flight, reconnect later
        self._transport_failed(e)
      if self.metrics is not None and len(self._waiting) != self._last_waiting:
        self._last_waiting = len(self._waiting)
        self.metrics.set_waiting(self._last_waiting)
      if drain_deadline is not None and (not self._active or time.monotonic() > drain_deadline
                                         or self.client is None):
        break
      if self.client is None:
        interval = min(self.opt.header_s * 2 ** min(self._failures, 10),
                       self.opt.reconnect_max_s)
      elif progressed:
        interval = self.opt.poll_min_s
      elif self._active:
        interval = min(interval * 2, self.opt.poll_max_s)
      else:
        interval = self.opt.idle_s
      self._wake.wait(interval)
    self._closed = True
    self._fail_all(EngineUnavailable("the frontend is shutting down", code="shutting_down"))
    while self._cmds:  # submits that came in meanwhile
      cmd = self._cmds.popleft()
      if cmd[0] == "submit":
        self._post(_resolve, cmd[1].submitted, None,
                   EngineUnavailable("the frontend is shutting down", code="shutting_down"))

  def _connect(self) -> None:
    try:
      h = mailbox.read_header(self.region)
    except ValueError as e:  # no valid header yet: the engine is still creating it
      self.state, self.header, self.last_error = None, None, str(e)
      return
    nw = self.num_workers or int(h["num_workers"]) or 1
    if self.num_workers and int(h["num_workers"]) and self.num_workers > int(h["num_workers"]):
      log.warning("worker %d: %d frontend workers but the mailbox header says %d; the "
                  "device may be slow to see the extra workers' doorbells", self.worker,
                  self.num_workers, int(h["num_workers"]))
    if not 0 <= self.worker < nw:
      raise ValueError(f"worker {self.worker} is outside 0..{nw - 1}")
    self.client = mailbox.MailboxClient(self.region, self.worker, nw)
    self.slots_total = len(self.client.slots)
    if self.client.stale_slots:
      log.warning("worker %d: cancelled %d requests a previous worker left in flight",
                  self.worker, self.client.stale_slots)
    self._refresh_header(time.monotonic())
    log.info("worker %d owns slots %d..%d of the mailbox's %d", self.worker,
             self.client.slots.start, self.client.slots.stop - 1, self.client.geo.num_slots)
    if self._failures:
      log.info("worker %d: connected to the mailbox again", self.worker)
    self.last_error = None
    self._failures = 0

  def _refresh_header(self, now: float) -> None:
    h = mailbox.read_header(self.region)
    self.header = {name: (h[name].tolist()) for name in protocol.HEADER_DTYPE.names}
    self._last_header = now
    try:
      self.state = protocol.EngineState(int(h["engine_state"]))
    except ValueError:
      self.state = None
    if self.client is not None and self.client.stale_slots:
      self.client.reclaim()
    if self.state == protocol.EngineState.STOPPED and (
        self._waiting or any(not f.abandoned for f in self._active.values())):
      self._fail_all(EngineUnavailable("the engine stopped"), keep_slots=True)
    self._check_progress(now)
    self._update_slots()

  def _check_progress(self, now: float) -> None:
    """The stall detector: READY and none of PROGRESS_COUNTERS moved for engine_stall_s."""
    stall_s = self.opt.engine_stall_s
    if self.state != protocol.EngineState.READY or stall_s <= 0 or self.header is None:
      self._progress_sig, self._progress_check = None, None
      self.stalled = False
      return
    sig = tuple(self.header[k] for k in PROGRESS_COUNTERS)
    last, self._progress_check = self._progress_check, now
    # A long gap since our own last look means this process did not run (it was stopped):
    # then nothing can be said about the engine, and the clock restarts.
    if sig != self._progress_sig or last is None or now - last > max(1.0, stall_s / 2):
      self._progress_sig, self._progress_at = sig, now
      if self.stalled:
        self.stalled = False
        log.warning("worker %d: the engine is making progress again", self.worker)
      return
    if not self.stalled and now - self._progress_at >= stall_s:
      self.stalled = True
      log.error("worker %d: the engine made no progress for %.1fs (its loop counters did not "
                "move): failing %d requests in flight and %d queued", self.worker,
                now - self._progress_at, sum(not f.abandoned for f in self._active.values()),
                len(self._waiting))
      self._fail_all(self._stall_error(), keep_slots=True)

  def _stall_error(self) -> EngineUnavailable:
    return EngineUnavailable(f"the engine made no progress for {self.opt.engine_stall_s:g}s "
                             "(stalled)", code="engine_stalled")

  def _refusal(self, drain_deadline) -> EngineUnavailable | None:
    """Why a new request cannot be submitted now, or None."""
    if drain_deadline is not None or self._closed:
      return EngineUnavailable("the frontend is shutting down", code="shutting_down")
    if self.failed is not None:
      return self.failed
    if self.client is None or self.state != protocol.EngineState.READY:
      return EngineUnavailable(self.state_text())
    if self.stalled:
      return self._stall_error()
    return None

  def _update_slots(self) -> None:
    if self.client is not None:
      self.slots_in_use = self.slots_total - self.client.free_slots
    if self.metrics is not None:
      self.metrics.set_slots(self.slots_in_use, self.slots_total)

  def _run_commands(self, drain_deadline):
    while self._cmds:
      cmd = self._cmds.popleft()
      if cmd[0] == "submit":
        _, flight, req = cmd
        refusal = self._refusal(drain_deadline)
        if refusal is not None:
          self._post(_resolve, flight.submitted, None, refusal)
        elif flight.abandoned:  # its client left before we got to it
          pass
        elif self._waiting:  # FIFO: behind those already waiting
          self._enqueue(flight, req)
        else:
          try:
            writing = time.monotonic()
            slot = self.client.submit(req)
          except mailbox.SlotsFullError as e:
            self._enqueue(flight, req, e)
          except ValueError as e:
            self._post(_resolve, flight.submitted, None, e)
          else:
            self._place(flight, slot, writing)
      elif cmd[0] == "abandon":
        _, flight, reason = cmd
        if flight.slot is not None and self._active.get(flight.slot) is flight:
          self.client.cancel(flight.slot)
          if self.metrics is not None:
            self.metrics.cancelled.labels(reason).inc()
        elif flight.slot is None and self._waiting:  # it leaves the queue
          self._waiting = collections.deque(w for w in self._waiting if w[0] is not flight)
      elif cmd[0] == "fail":
        self.failed = cmd[1]
        self._fail_all(cmd[1], keep_slots=self.client is not None)
      elif cmd[0] == "drain":
        drain_deadline = cmd[1]
        exc = EngineUnavailable("the frontend is shutting down", code="shutting_down")
        self._fail_waiting(exc)
        for flight in list(self._active.values()):
          if not flight.abandoned:
            flight.abandoned = True
            if self.metrics is not None:
              self.metrics.cancelled.labels("shutdown").inc()
            self._post(flight.queue.put_nowait, exc)
          if self.client is not None:
            self.client.cancel(flight.slot)
    return drain_deadline

  # ---- the queue of requests waiting for a slot ----
  def _place(self, flight: Flight, slot: int, writing: float) -> None:
    """`flight` holds `slot`, whose write began at `writing` (a remote transport's writes take
    round trips, and the device may take the request before the last one returns)."""
    flight.slot = slot
    self._active[slot] = flight
    flight.placed = writing
    if self.metrics is not None:
      self.metrics.queue_time.observe(flight.placed - flight.created)
    self._post(_resolve, flight.submitted, slot)
    self._update_slots()

  def _enqueue(self, flight: Flight, req: mailbox.Request,
               full: mailbox.SlotsFullError | None = None) -> None:
    if len(self._waiting) >= self.opt.max_queued_requests:
      why = (f"all {self.slots_total} slots of worker {self.worker} are busy" +
             (f" and {len(self._waiting)} requests are queued"
              if self.opt.max_queued_requests else ""))
      self._post(_resolve, flight.submitted, None, full or mailbox.SlotsFullError(why))
      return
    timeout = self.opt.queue_timeout_s
    self._waiting.append((flight, req, flight.created + timeout if timeout > 0 else None))

  def _admit_waiting(self, now: float) -> None:
    """Gives freed slots to the queue's head, in order; ends those waiting past the timeout."""
    while self._waiting:
      flight, req, deadline = self._waiting[0]
      if flight.abandoned:
        self._waiting.popleft()
        continue
      if not self.client.free_slots and not self.client.stale_slots:
        break
      try:
        writing = time.monotonic()
        slot = self.client.submit(req)
      except mailbox.SlotsFullError:
        break
      except ValueError as e:
        self._waiting.popleft()
        self._post(_resolve, flight.submitted, None, e)
        continue
      self._waiting.popleft()
      self._place(flight, slot, writing)
    while self._waiting and self._waiting[0][2] is not None and self._waiting[0][2] <= now:
      # One timeout for all: the deadlines are in queue order.
      flight, _, _ = self._waiting.popleft()
      self._post(_resolve, flight.submitted, None, mailbox.SlotsFullError(
          f"no slot of worker {self.worker} came free in {self.opt.queue_timeout_s:g}s "
          "(queue_timeout_s)"))

  def _fail_waiting(self, exc: Exception) -> None:
    while self._waiting:
      flight, _, _ = self._waiting.popleft()
      self._post(_resolve, flight.submitted, None, exc)

  def _poll_active(self) -> bool:
    if not self._active:
      return False
    client = self.client
    now = time.monotonic()
    hint = client.progress()
    if hint == self._last_hint and now - self._last_sweep < self.opt.full_sweep_s:
      return False
    self._last_hint, self._last_sweep = hint, now
    delivered = []
    finished = False
    ring = client.geo.ring_capacity
    polled = client.poll_many(list(self._active))
    # When the reads returned, not when the sweep began: over TCP a slot's first output can
    # be written during the sweep's round trips, after `now`.
    seen = time.monotonic()
    for slot, out in polled:
      flight = self._active[slot]
      if out.tokens and self.metrics is not None:
        self.metrics.output_fill.observe(len(out.tokens) / ring)
        if flight.placed is not None:
          self.metrics.slot_to_first_output.observe(seen - flight.placed)
          flight.placed = None
          if out.first_ns >= out.taken_ns > 0:  # the same request's stamps, device clock
            self.metrics.device_first_output.observe((out.first_ns - out.taken_ns) / 1e9)
      if (out.finished and out.produced > 1 and out.token_ns > out.first_ns > 0
          and self.metrics is not None):
        self.metrics.device_tpot.observe(
            (out.token_ns - out.first_ns) / (out.produced - 1) / 1e9)
      if not flight.abandoned:
        delivered.append((flight, out))
      if out.finished:
        client.release(slot)
        del self._active[slot]
        finished = True
    if delivered:
      self._post(_deliver, delivered)
    if finished:
      self._update_slots()
    return bool(delivered) or finished

  def _fail_all(self, exc: Exception, keep_slots: bool = False) -> None:
    """Ends every request in flight with `exc`. keep_slots: the mailbox is still there (the
    engine stopped): cancel them and keep polling, so a slot the device still finishes comes
    back; otherwise (transport lost, shutdown) forget them."""
    for flight in self._active.values():
      if not flight.abandoned:
        flight.abandoned = True
        self._post(flight.queue.put_nowait, exc)
        if keep_slots:
          self.client.cancel(flight.slot)
    if not keep_slots:
      self._active.clear()
    self._fail_waiting(exc)

  def _transport_failed(self, e: Exception) -> None:
    if self._failures == 0:
      log.error("worker %d: mailbox transport failed: %s (reconnecting)", self.worker, e)
    self._failures += 1
    self.last_error = f"{type(e).__name__}: {e}"
    self.state, self.client = None, None
    self._fail_all(EngineUnavailable(f"lost the connection to the engine ({e})"))
    self.slots_in_use = 0
    self._update_slots()

  def state_text(self) -> str:
    if self.failed is not None:
      return str(self.failed)
    if self.state is None:
      why = f": {self.last_error}" if self.last_error else ""
      return f"the engine is unreachable or not initialized{why}"
    if self.stalled and self.state == protocol.EngineState.READY:
      return str(self._stall_error())
    return f"the engine is {STATE_NAMES.get(self.state, str(self.state))}"


def _deliver(items) -> None:
  for flight, out in items:
    flight.queue.put_nowait(out)

