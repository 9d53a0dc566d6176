"""The frontend side of a running engine: the tcp relay and the frontend worker processes.

`scripts/serve.py` starts an engine with its mailbox in POSIX shared memory, then a `Serving`:
one `nic_frontend.worker` process per --workers (no JAX; all on one port through
SO_REUSEPORT; worker w owns its own slot range and doorbell), reaching the mailbox directly
(shm) or through a relay this process runs (tcp: what a frontend on another host, without
RDMA, would use). `supervise` restarts a worker that died and returns when the engine failed
(`EngineWatch`: its device loop ended, or it made no progress for `engine_stall_s` with
requests pending); `stop` lets the workers drain for up to `grace_s`, then shuts the engine
down.

The engine and this supervisor are one process: if it is killed (SIGKILL) or stopped (SIGSTOP),
the workers are what is left. Each watches this process (--parent-pid): on its death they end
every request with an error at once and remove the shared memory and the run folder
(--orphan-unlink-shm, --orphan-remove-dir); a stopped engine is a stalled one for their
mailbox drivers (503 until it moves again).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from blink_jax import env
from blink_jax.client import mailbox, protocol
from nic_frontend.driver import PROGRESS_COUNTERS

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("blink.serve")


@dataclasses.dataclass
class ServeOptions:
  host: str = "127.0.0.1"
  port: int = 8000
  transport: str = "shm"
  workers: int = 1
  api_key: str | None = None
  grace_s: float = 30.0
  relay_host: str = "127.0.0.1"
  relay_port: int = 0
  max_body_bytes: int = 16 << 20
  served_model_names: tuple[str, ...] = ()
  run_dir: str | None = None      # ready files, metrics of several workers (default: temp)
  start_timeout_s: float = 120.0
  engine_stall_s: float = 10.0    # no progress this long with requests pending: failed (0: off)
  # Per worker: requests waiting (FIFO) for one of its slots (its connection cap, 4096, bounds
  # them too), each at most queue_timeout_s (0: no limit); the rest get 503 + Retry-After.
  max_queued_requests: int = 4096
  queue_timeout_s: float = 0.0
  # The CPUs every worker (all its threads) runs on, as taskset writes them ("0,1"): the
  # SmartNIC's cores, out of reach of the host's other work (None: this process's CPUs).
  frontend_cpus: str | None = None
  metrics_require_key: bool = False  # /metrics needs the API key too


_SEQ = protocol.REQUEST_DTYPE.fields["seq"][1]
_FINISHED_SEQ = protocol.OUTPUT_DTYPE.fields["finished_seq"][1]


class EngineWatch:
  """Whether the engine has failed: its device loop ended on its own (`engine.running` is
  false), or requests are pending in the mailbox (a slot whose request the device has not
  finished) and none of the counters the device publishes after every schedule and commit
  moved for `stall_s`. `check()` is called every fraction of a second; a long gap between two
  calls (this process was stopped) restarts the stall clock instead of counting as a stall."""

  def __init__(self, engine, stall_s: float, clock=time.monotonic):
    self.engine, self.stall_s, self.clock = engine, stall_s, clock
    self.region = engine.region
    self.geo = mailbox.geometry_of(mailbox.read_header(self.region))
    self._sig: tuple | None = None
    self._since = 0.0
    self._last: float | None = None

  def pending(self) -> int:
    """Slots holding a request the device has not finished."""
    n = 0
    for s in range(self.geo.num_slots):
      seq = int.from_bytes(self.region.read(self.geo.request_offset(s) + _SEQ, 4), "little")
      done = self.region.read(self.geo.output_offset(s) + _FINISHED_SEQ, 4)
      n += bool(seq) and int.from_bytes(done, "little") != seq
    return n

  def check(self) -> str | None:
    """None, or what failed."""
    if not getattr(self.engine, "running", True):
      return "the engine's device loop stopped"
    if self.stall_s <= 0:
      return None
    now = self.clock()
    h = mailbox.read_header(self.region)
    sig = tuple(int(h[k]) for k in PROGRESS_COUNTERS)
    last, self._last = self._last, now
    if (sig != self._sig or last is None or now - last > max(1.0, self.stall_s / 2)
        or not self.pending()):
      self._sig, self._since = sig, now
      return None
    if now - self._since >= self.stall_s:
      return (f"the engine's device loop made no progress for {now - self._since:.1f}s with "
              f"{self.pending()} requests pending (stalled)")
    return None


class Serving:
  """The frontend side of a running engine: the relay (tcp) and the worker processes.

  `engine` is a `blink_jax.engine.Engine` whose mailbox is in named shared memory
  (`Engine(..., shm_name=...)`); what this class uses of it: `region`, `shm_name`,
  `mailbox_workers` (the frontend workers plus the engine's own client), `tokenizer_path`,
  `model_name`, `running` (its device loop is alive), `stats()` and `shutdown(timeout=)`,
  which also removes the shared memory.
  """

  def __init__(self, engine, opts: ServeOptions):
    if opts.workers < 1:
      raise ValueError("--workers must be at least 1")
    self.engine, self.opts = engine, opts
    self.region, self.shm_name = engine.region, engine.shm_name
    if opts.transport == "shm" and not self.shm_name:
      raise ValueError("the engine's mailbox is not in named shared memory")
    self.procs: list[subprocess.Popen] = []
    self.relay = None
    self._relay_token = secrets.token_urlsafe(32)
    self._own_run_dir = opts.run_dir is None
    self.run_dir = Path(opts.run_dir or tempfile.mkdtemp(prefix="blink-serve-"))
    self._metrics_dir: Path | None = None
    self._stopping = False
    self._lock = threading.Lock()
    self.failure: str | None = None  # what supervise() saw fail
    idle_us = getattr(getattr(engine, "config", None), "idle_poll_us", None)
    if opts.engine_stall_s and idle_us and opts.engine_stall_s < 4 * idle_us / 1e6:
      log.warning("engine_stall_s %.3g s is close to the idle loop's round (idle_poll_us %d): "
                  "an idle engine may look stalled", opts.engine_stall_s, idle_us)

  # ---- start ----
  def start(self) -> None:
    o = self.opts
    if o.transport == "tcp":
      from nic_frontend.transports.tcp import TcpRelayServer
      self.relay = TcpRelayServer(self.region, token=self._relay_token,
                                  host=o.relay_host, port=o.relay_port).start()
      log.info("tcp relay for the mailbox on %s", self.relay.address)
    elif o.transport != "shm":
      raise ValueError(f"unknown transport {o.transport!r}")
    if o.workers > 1:
      self._metrics_dir = self.run_dir / "prometheus"
      shutil.rmtree(self._metrics_dir, ignore_errors=True)
      self._metrics_dir.mkdir(parents=True)
    self.procs = [self._spawn(w) for w in range(o.workers)]
    deadline = time.monotonic() + o.start_timeout_s
    for w in range(o.workers):
      self._wait_ready(w, deadline)
    log.info("serving %s on http://%s:%d/v1 with %d frontend worker(s) (transport %s, CPUs %s)",
             self.engine.model_name, o.host, o.port, o.workers, o.transport,
             o.frontend_cpus or "inherited")

  def _ready_file(self, w: int) -> Path:
    return self.run_dir / f"worker{w}.ready.json"

  def _spawn(self, w: int) -> subprocess.Popen:
    o = self.opts
    ready = self._ready_file(w)
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "nic_frontend.worker", "--transport", o.transport,
           "--tokenizer", str(self.engine.tokenizer_path), "--model-name",
           self.engine.model_name, "--worker", str(w), "--num-workers",
           # The engine keeps the last slot range for its own generate() client.
           str(self.engine.mailbox_workers),
           "--host", o.host, "--port", str(o.port), "--grace-s", str(o.grace_s),
           "--max-body-bytes", str(o.max_body_bytes), "--ready-file", str(ready),
           "--engine-stall-s", str(o.engine_stall_s), "--max-queued-requests",
           str(o.max_queued_requests),
           "--queue-timeout-s", str(o.queue_timeout_s), "--parent-pid", str(os.getpid())]
    # What this process removes at its shutdown, for the workers to remove if it is killed.
    if self.shm_name:
      cmd += ["--orphan-unlink-shm", self.shm_name]
    own_dir = self.run_dir if self._own_run_dir else self._metrics_dir
    if own_dir is not None:
      cmd += ["--orphan-remove-dir", str(own_dir)]
    if o.metrics_require_key:
      cmd.append("--metrics-require-key")
    if o.workers > 1:
      cmd.append("--reuse-port")
    if o.frontend_cpus:
      cmd += ["--cpus", o.frontend_cpus]
    for name in o.served_model_names:
      cmd += ["--served-model-name", name]
    secrets_and_dirs = {}
    if o.transport == "shm":
      cmd += ["--shm-name", self.shm_name]
    else:
      cmd += ["--relay", self.relay.address]
      secrets_and_dirs[env.RELAY_TOKEN] = self._relay_token
    if o.api_key:
      secrets_and_dirs[env.API_KEY] = o.api_key
    if self._metrics_dir is not None:
      secrets_and_dirs[env.PROMETHEUS_MULTIPROC_DIR] = str(self._metrics_dir)
    child_env = env.child_environment(
        secrets_and_dirs, drop=(env.PROMETHEUS_MULTIPROC_DIR, env.API_KEY))
    # The workers must not inherit our signal dispositions' effects on the terminal group:
    # they get SIGTERM from us (start_new_session keeps a Ctrl-C aimed at us from reaching them
    # before we decide how to stop them).
    return subprocess.Popen(cmd, cwd=REPO, env=child_env, start_new_session=True)

  def _wait_ready(self, w: int, deadline: float) -> None:
    ready = self._ready_file(w)
    while not ready.exists():
      if self.procs[w].poll() is not None:
        raise RuntimeError(f"frontend worker {w} exited with {self.procs[w].returncode} "
                           "during start-up")
      if time.monotonic() > deadline:
        raise TimeoutError(f"frontend worker {w} did not start in {self.opts.start_timeout_s}s")
      time.sleep(0.02)
    info = json.loads(ready.read_text())
    log.info("frontend worker %d (pid %d) ready on port %d", w, info["pid"], info["port"])

  # ---- run ----
  def supervise(self, stop: threading.Event, poll_s: float | None = None) -> str | None:
    """Restarts a worker that died on its own, until `stop` is set (returns None) or the
    engine failed (returns what failed, also kept in `failure`; `stop` then shuts down)."""
    stall_s = self.opts.engine_stall_s
    if poll_s is None:
      poll_s = min(0.5, max(0.05, stall_s / 5)) if stall_s > 0 else 0.5
    watch = EngineWatch(self.engine, stall_s)
    while not stop.wait(poll_s):
      with self._lock:
        if self._stopping:
          return None
        failure = watch.check()
        if failure is not None:
          log.error("engine failure: %s; shutting down", failure)
          self.failure = failure
          return failure
        for w, p in enumerate(self.procs):
          if p.poll() is not None:
            log.error("frontend worker %d exited with %s; restarting it", w, p.returncode)
            if self._metrics_dir is not None:
              from prometheus_client import multiprocess
              multiprocess.mark_process_dead(p.pid, str(self._metrics_dir))
            self.procs[w] = self._spawn(w)
    return None

  # ---- stop ----
  def stop(self) -> None:
    """Workers drain and exit, then the engine shuts down and the shared memory goes."""
    with self._lock:
      if self._stopping:
        return
      self._stopping = True
    if self.failure is not None:
      # The workers end what they still have at once rather than after the grace period.
      mailbox.write_header_word(self.region, "engine_state", protocol.EngineState.STOPPED)
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    # A worker ends within about half a second past the grace period; this is the backstop.
    deadline = time.monotonic() + self.opts.grace_s + 5
    for w, p in enumerate(self.procs):
      try:
        p.wait(max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        log.error("frontend worker %d did not stop; killing it", w)
        p.kill()
        p.wait()
    if self.relay is not None:
      self.relay.stop()
    try:
      stats = self.engine.stats()
      log.info("engine stats at shutdown: %s", stats)
    except Exception:  # the stats are informational
      pass
    if self.failure is not None:  # a stalled loop may never end: do not wait a minute for it
      self.engine.shutdown(timeout=2.0)
    else:
      self.engine.shutdown()  # the engine removes its shared memory
    if self._own_run_dir:
      shutil.rmtree(self.run_dir, ignore_errors=True)
    elif self._metrics_dir is not None:
      shutil.rmtree(self._metrics_dir, ignore_errors=True)
    log.info("stopped")
