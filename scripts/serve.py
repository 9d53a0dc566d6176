"""Serves a model over an OpenAI-compatible HTTP API: the engine plus frontend worker processes.

  python scripts/serve.py --ckpt gemma [--port 8000] [--workers 2] [--transport shm|tcp]

The engine (blink_jax.engine.Engine) loads and compiles the model and launches the persistent
device loop; it creates the mailbox in POSIX shared memory. The frontend runs as separate
processes (`python -m nic_frontend.worker`, no JAX), one per --workers, all on one port through
SO_REUSEPORT; worker w owns its own slot range and doorbell. With --transport tcp the workers
reach the mailbox through a relay this process runs (what a frontend on another host, without
RDMA, would use); with shm they map it directly. After start-up this process only supervises.

SIGINT / SIGTERM: the workers stop accepting, let requests in flight finish for up to
--grace_s seconds and cancel the rest on the device; then the device loop is shut down and the
shared memory released.
"""
from __future__ import annotations

import dataclasses
import inspect
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

from absl import app, flags

from blink_jax import config

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("blink.serve")

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint name from checkpoints/catalog.json, a path, or "
                    "random:<config> (random weights in that shape, for benchmarks).")
flags.DEFINE_string("tokenizer", None, "SentencePiece model (default: the checkpoint's).")
flags.DEFINE_string("dtype", "bfloat16", "Compute dtype of the weights.")
flags.DEFINE_string("host", "127.0.0.1", "Address the HTTP server binds (0.0.0.0: all).")
flags.DEFINE_integer("port", 8000, "HTTP port, shared by every worker.")
flags.DEFINE_enum("transport", "shm", ["shm", "tcp"],
                  "How the frontend workers reach the mailbox.")
flags.DEFINE_integer("workers", 1, "Frontend worker processes.")
flags.DEFINE_integer("max_seqs", None, "Sequences decoded together (engine default if unset).")
flags.DEFINE_integer("kv_pages", None, "KV cache pages (engine default if unset).")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on /v1 "
                    "(default: $BLINK_API_KEY, none if unset).")
flags.DEFINE_enum("mode", "persistent", ["persistent", "host"],
                  "persistent: the serving loop runs on the device; host: the host drives "
                  "each step (for comparison).")
flags.DEFINE_bool("fused_step", False,
                  "One scheduler call per step (blink_step: the commit of a step and the "
                  "schedule of the next in one kernel) instead of a schedule and a commit.")
flags.DEFINE_enum("attention", "auto", config.KERNEL_KINDS,
                  "Paged attention of decode-sized steps: the jnp reference, the Pallas "
                  "kernel that reads KV pages in place (fewer kernels per step), or auto: "
                  "the kernel on a GPU, the reference elsewhere.")
flags.DEFINE_enum("norm", "auto", config.KERNEL_KINDS,
                  "Residual add + RMSNorm pairs and the q/k norm + RoPE: the jnp reference "
                  "or one Pallas kernel each (auto: the kernels on a GPU).")
flags.DEFINE_string("shm_name", None, "Name of the mailbox's shared memory (default: random).")
flags.DEFINE_string("relay_host", "127.0.0.1", "Address of the tcp relay (--transport tcp).")
flags.DEFINE_integer("relay_port", 0, "Port of the tcp relay (0: any free port).")
flags.DEFINE_float("grace_s", 30.0, "On shutdown, how long requests in flight may take.")
flags.DEFINE_integer("max_body_bytes", 16 << 20, "Largest accepted request body.")
flags.DEFINE_multi_string("served_model_name", [], "Additional model names to accept.")
flags.DEFINE_integer("max_context", None, "Context length served (engine default if unset).")
flags.DEFINE_integer("num_slots", 64, "Mailbox request slots, shared out among the workers.")


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


class Serving:
  """The frontend side of a running engine: the relay (tcp) and the worker processes.

  `engine` provides tokenizer_path, model_name, stats() and shutdown(), and its mailbox as
  `region` (a ShmRegion) and `shm_name` unless they are given here (blink_jax.engine.Engine,
  or the tests' FakeEngine).
  """

  def __init__(self, engine, opts: ServeOptions, *, region=None, shm_name: str | None = None):
    if opts.workers < 1:
      raise ValueError("--workers must be at least 1")
    self.engine, self.opts = engine, opts
    self.region = region if region is not None else engine.region
    self.shm_name = shm_name or getattr(engine, "shm_name", None) or getattr(
        self.region, "name", None)
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
    log.info("serving %s on http://%s:%d/v1 with %d frontend worker(s) (transport %s)",
             self.engine.model_name, o.host, o.port, o.workers, o.transport)

  def _ready_file(self, w: int) -> Path:
    return self.run_dir / f"worker{w}.ready.json"

  def _spawn(self, w: int) -> subprocess.Popen:
    o = self.opts
    ready = self._ready_file(w)
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "nic_frontend.worker", "--transport", o.transport,
           "--tokenizer", str(self.engine.tokenizer_path), "--model-name",
           self.engine.model_name, "--worker", str(w), "--num-workers",
           # The engine may keep the last slot range for its own generate() client.
           str(getattr(self.engine, "mailbox_workers", o.workers)),
           "--host", o.host, "--port", str(o.port), "--grace-s", str(o.grace_s),
           "--max-body-bytes", str(o.max_body_bytes), "--ready-file", str(ready),
           "--parent-pid", str(os.getpid())]
    if o.workers > 1:
      cmd.append("--reuse-port")
    for name in o.served_model_names:
      cmd += ["--served-model-name", name]
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if o.transport == "shm":
      cmd += ["--shm-name", self.shm_name]
    else:
      cmd += ["--relay", self.relay.address]
      env["BLINK_RELAY_TOKEN"] = self._relay_token
    if o.api_key:
      env["BLINK_API_KEY"] = o.api_key
    else:
      env.pop("BLINK_API_KEY", None)
    if self._metrics_dir is not None:
      env["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir)
    # The workers must not inherit our signal dispositions' effects on the terminal group:
    # they get SIGTERM from us (start_new_session keeps a Ctrl-C aimed at us from reaching them
    # before we decide how to stop them).
    return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)

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
  def supervise(self, stop: threading.Event, poll_s: float = 1.0) -> None:
    """Restarts a worker that died on its own, until `stop` is set."""
    while not stop.wait(poll_s):
      with self._lock:
        if self._stopping:
          return
        for w, p in enumerate(self.procs):
          if p.poll() is not None:
            log.error("frontend worker %d exited with %s; restarting it", w, p.returncode)
            if self._metrics_dir is not None:
              from prometheus_client import multiprocess
              multiprocess.mark_process_dead(p.pid, str(self._metrics_dir))
            self.procs[w] = self._spawn(w)

  # ---- stop ----
  def stop(self) -> None:
    """Workers drain and exit, then the engine shuts down and the shared memory goes."""
    with self._lock:
      if self._stopping:
        return
      self._stopping = True
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + self.opts.grace_s + 15
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
    self.engine.shutdown()
    if hasattr(self.region, "unlink"):  # the shared memory goes (idempotent)
      if hasattr(self.region, "close"):
        self.region.close()
      self.region.unlink()
    if self._own_run_dir:
      shutil.rmtree(self.run_dir, ignore_errors=True)
    elif self._metrics_dir is not None:
      shutil.rmtree(self._metrics_dir, ignore_errors=True)
    log.info("stopped")


def _describe(engine, shm_name: str | None) -> str:
  devices = getattr(engine, "devices", None)
  if devices is None:
    device = getattr(engine, "device", None)
    if device is None:
      import jax  # the engine host has JAX; only the frontend must not import it
      devices = jax.devices()
    else:
      devices = [device]
  loop = getattr(engine, "loop_on_device", None)
  report = getattr(engine, "loop_report", None)
  if loop is None and isinstance(report, dict):
    loop = report.get("device_while")
  dtype = getattr(engine, "dtype", None) or FLAGS.dtype
  why = f" ({report.get('reason')})" if isinstance(report, dict) and report.get("reason") else ""
  return (f"model {engine.model_name}, dtype {dtype}, devices {list(devices)}, "
          f"max context {engine.max_context}, mailbox shm {shm_name}, transport "
          f"{FLAGS.transport}, mode {FLAGS.mode}{' (fused step)' if FLAGS.fused_step else ''}, "
          f"loop on device: "
          f"{'unknown' if loop is None else bool(loop)}{why}")


def _accepts(fn, name: str) -> bool:
  return name in inspect.signature(fn).parameters


def _set_header_workers(region, workers: int) -> None:
  """The header announces every frontend worker (the device polls their doorbells). Engine
  host code owns the header; the device rereads num_workers at each idle poll."""
  from blink_jax import protocol as P
  off = P.HEADER_DTYPE.fields["num_workers"][1]
  region.write(off, int(workers).to_bytes(4, "little"))


def make_engine(Engine):
  """(engine, region, shm_name): the engine over a mailbox in named shared memory.

  With an Engine.from_checkpoint that creates the shared memory itself (transport="shm",
  shm_name=...), that is used; otherwise this creates the segment, sized for the geometry the
  engine will use, and hands it to the engine as its region.
  """
  from blink_jax import protocol as P
  from nic_frontend.transports import shm

  kw = dict(dtype=FLAGS.dtype, mode=FLAGS.mode, attention=FLAGS.attention, norm=FLAGS.norm)
  if FLAGS.tokenizer:
    kw["tokenizer_path"] = FLAGS.tokenizer
  if FLAGS.fused_step:
    kw["fused_step"] = True
  for name in ("max_seqs", "kv_pages", "max_context"):
    if getattr(FLAGS, name) is not None:
      kw[name] = getattr(FLAGS, name)
  if _accepts(Engine.from_checkpoint, "shm_name"):
    kw.update(transport="shm", shm_name=FLAGS.shm_name, num_slots=FLAGS.num_slots)
    if _accepts(Engine.from_checkpoint, "num_workers"):
      kw["num_workers"] = FLAGS.workers
    engine = Engine.from_checkpoint(FLAGS.ckpt, **kw)
    region, name = engine.region, engine.shm_name
  else:
    from blink_jax.checkpoint import load_config, resolve_checkpoint
    from blink_jax.config import get_config
    cfg = (get_config(FLAGS.ckpt.split(":", 1)[1]) if FLAGS.ckpt.startswith("random:")
           else load_config(resolve_checkpoint(FLAGS.ckpt)))
    max_context = FLAGS.max_context or min(cfg.max_context, 4096)
    ring, top = 64, 8
    reserve = _accepts(Engine.__init__, "frontend_workers")
    # With a slot range reserved for the engine's own client, grow the ring of slots so the
    # frontend workers still share --num_slots among themselves.
    num_slots = FLAGS.num_slots * (FLAGS.workers + 1) // FLAGS.workers if reserve else FLAGS.num_slots
    geo = P.Geometry(num_slots, max_context - 1, ring, top)
    region = shm.create_region(FLAGS.shm_name, geo.total_bytes)
    kw.update(max_context=max_context, num_slots=num_slots, ring_capacity=ring,
              max_top_logprobs=top, region=region)
    if reserve:
      kw["frontend_workers"] = FLAGS.workers
    try:
      engine = Engine.from_checkpoint(FLAGS.ckpt, **kw)
    except BaseException:
      region.close()
      region.unlink()
      raise
    name = region.name
  if not hasattr(engine, "mailbox_workers"):
    _set_header_workers(region, FLAGS.workers)
  return engine, region, name


def main(argv) -> int:
  del argv
  logging.basicConfig(level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if not FLAGS.ckpt:
    raise app.UsageError("--ckpt is required")
  if FLAGS.ckpt.startswith("random:") and not FLAGS.tokenizer:
    raise app.UsageError("--ckpt random:<config> needs --tokenizer (a SentencePiece model)")
  from blink_jax.engine import Engine

  t0 = time.monotonic()
  engine, region, shm_name = make_engine(Engine)
  log.info("engine up in %.1fs: %s", time.monotonic() - t0, _describe(engine, shm_name))
  opts = ServeOptions(host=FLAGS.host, port=FLAGS.port, transport=FLAGS.transport,
                      workers=FLAGS.workers,
                      api_key=FLAGS.api_key or os.environ.get("BLINK_API_KEY") or None,
                      grace_s=FLAGS.grace_s, relay_host=FLAGS.relay_host,
                      relay_port=FLAGS.relay_port, max_body_bytes=FLAGS.max_body_bytes,
                      served_model_names=tuple(FLAGS.served_model_name))
  serving = Serving(engine, opts, region=region, shm_name=shm_name)
  stop = threading.Event()

  def on_signal(signum, frame):
    log.info("signal %d: shutting down", signum)
    stop.set()

  signal.signal(signal.SIGINT, on_signal)
  signal.signal(signal.SIGTERM, on_signal)
  try:
    start = getattr(engine, "start", None)
    serving.start()
    if callable(start):  # an engine that launches its loop separately
      start()
    serving.supervise(stop)
  finally:
    serving.stop()
  return 0


def _normalize_argv(argv: list[str]) -> list[str]:
  """Accepts --max-seqs as well as absl's --max_seqs."""
  out = []
  for a in argv:
    if a.startswith("--") and not a.startswith("---"):
      name, eq, value = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + value
    out.append(a)
  return out


if __name__ == "__main__":
  app.run(main, argv=_normalize_argv(sys.argv))
