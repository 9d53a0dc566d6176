"""Serves a model over an OpenAI-compatible HTTP API: the engine plus frontend worker processes.

  python scripts/serve.py --ckpt gemma [--port 8000] [--workers 2] [--transport shm|tcp]

The engine (`blink_jax.engine.Engine`) loads and compiles the model, creates the mailbox in
POSIX shared memory and launches the persistent device loop; `nic_frontend.supervisor.Serving`
runs the frontend workers. After start-up this process only supervises. Every field of
`EngineConfig` and `KernelOptions` is a flag of the same name (`--helpfull` lists them).

SIGINT / SIGTERM: the workers stop accepting, let requests in flight finish for up to
--grace_s seconds, end the rest with an error (streams: an error event, then [DONE]) and cancel
them on the device; then the device loop is shut down and the shared memory released.

Engine failure: if the device loop dies, or makes no progress for --engine_stall_s while
requests are pending, the requests end with an error, everything is cleaned up and this exits
with status 1. If this process is killed, its frontend workers end every request with an error
and remove the shared memory and the run folder; if it is stopped (SIGSTOP), they answer 503
(engine_stalled) until it runs again.

The API key: --api_key_file or $BLINK_API_KEY (--api_key works too, but every user of the
machine sees it in ps).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from absl import app, flags

from blink_jax import engine_config, env
from blink_jax.client import protocol

log = logging.getLogger("blink.serve")

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint name from checkpoints/catalog.json, a path, or "
                    "random:<config> (random weights in that shape, for benchmarks).")
flags.DEFINE_string("tokenizer", None, "SentencePiece model (default: the checkpoint's).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype of the weights.")
flags.DEFINE_string("host", "127.0.0.1", "Address the HTTP server binds (0.0.0.0: all).")
flags.DEFINE_integer("port", 8000, "HTTP port, shared by every worker.")
flags.DEFINE_enum("transport", "shm", ["shm", "tcp"],
                  "How the frontend workers reach the mailbox.")
flags.DEFINE_integer("workers", None, "Frontend worker processes (default: 2, which keep up "
                     "with the 1B shape's saturation on an H200 where one does not, "
                     "docs/PERFORMANCE.md \"Frontend workers\"; 1 with --port 0, since the "
                     "workers share one port).")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on /v1 (visible "
                    "to every user in ps: prefer --api_key_file or $BLINK_API_KEY).")
flags.DEFINE_string("api_key_file", None, "A file holding the API key (default: "
                    "$BLINK_API_KEY; no key if neither is set).")
flags.DEFINE_bool("metrics_require_key", False, "/metrics requires the API key too.")
flags.DEFINE_string("shm_name", None, "Name of the mailbox's shared memory (default: random).")
flags.DEFINE_string("relay_host", "127.0.0.1", "Address of the tcp relay (--transport tcp).")
flags.DEFINE_integer("relay_port", 0, "Port of the tcp relay (0: any free port).")
flags.DEFINE_float("grace_s", 30.0, "On shutdown, how long requests in flight may take.")
flags.DEFINE_float("engine_stall_s", 10.0, "The engine has failed when its loop makes no "
                   "progress for this long (0: never); it must exceed the longest step.")
flags.DEFINE_integer("max_queued_requests", 4096, "Requests per worker that wait (FIFO) for "
                     "one of its slots when all are in use; the rest get 503 + Retry-After.")
flags.DEFINE_float("queue_timeout_s", 0.0, "How long a queued request waits for a slot before "
                   "its 503 (0: no limit).")
flags.DEFINE_integer("max_body_bytes", 16 << 20, "Largest accepted request body.")
flags.DEFINE_multi_string("served_model_name", [], "Additional model names to accept.")
flags.DEFINE_string("frontend_cpus", None, "CPUs the frontend workers run on, every thread of "
                    "them, as taskset lists them (0,1 or 0-3): the SmartNIC's cores, kept from "
                    "the host's other work (default: this process's CPUs; docs/PERFORMANCE.md "
                    "\"Frontend cores\").")
engine_config.define_flags()

# Loggers of the libraries under the engine; their INFO lines (orbax's checkpoint reads, JAX's
# backend choice) are shown only with --verbosity=1 or more.
THIRD_PARTY_LOGGERS = ("absl", "jax", "orbax", "etils", "flax", "aiohttp")


# The mailbox header has one doorbell per client: the frontend workers and the engine's own.
MAX_FRONTEND_WORKERS = protocol.MAX_WORKERS - 1


DEFAULT_WORKERS = 2


def workers() -> int:
  """--workers, or its default: 2, or 1 with --port 0 (any free port: workers share one)."""
  if FLAGS.workers is not None:
    return FLAGS.workers
  return 1 if FLAGS.port == 0 else DEFAULT_WORKERS


def engine_config_from_flags() -> engine_config.EngineConfig:
  """The engine's config: one flag per field; the mailbox shared out among --workers frontend
  workers plus the engine's own client (its generate(), which the warm-up uses), each with
  --num_slots // --workers slots."""
  config = engine_config.from_flags()
  return dataclasses.replace(config, frontend_workers=workers(),
                             num_slots=config.num_slots * (workers() + 1) // workers())


def make_engine(config: engine_config.EngineConfig):
  from blink_jax.engine import Engine
  return Engine.from_checkpoint(FLAGS.ckpt, dtype=FLAGS.dtype, tokenizer_path=FLAGS.tokenizer,
                                config=config, shm_name=FLAGS.shm_name or "")


def check_flags() -> engine_config.EngineConfig:
  """Raises app.UsageError for a bad flag; returns the engine's config."""
  usage = app.UsageError
  if not FLAGS.ckpt:
    raise usage("--ckpt is required")
  if FLAGS.ckpt.startswith("random:") and not FLAGS.tokenizer:
    raise usage("--ckpt random:<config> needs --tokenizer (a SentencePiece model)")
  if not 1 <= workers() <= MAX_FRONTEND_WORKERS:
    raise usage(f"--workers must be in 1..{MAX_FRONTEND_WORKERS}, got {workers()}")
  for name in ("port", "relay_port"):
    if not 0 <= FLAGS[name].value <= 65535:
      raise usage(f"--{name} must be in 0..65535, got {FLAGS[name].value}")
  if FLAGS.port == 0 and workers() > 1:
    raise usage("--port 0 (any free port) works with one worker only: the workers share a port")
  for name in ("grace_s", "engine_stall_s", "max_queued_requests", "queue_timeout_s"):
    if FLAGS[name].value < 0:
      raise usage(f"--{name} must be >= 0, got {FLAGS[name].value}")
  for name in ("max_body_bytes",):
    if FLAGS[name].value <= 0:
      raise usage(f"--{name} must be > 0, got {FLAGS[name].value}")
  if FLAGS.frontend_cpus is not None:
    from nic_frontend.worker import parse_cpus
    try:
      parse_cpus(FLAGS.frontend_cpus)
    except ValueError as e:
      raise usage(f"--frontend_cpus: {e}") from None
  for b in FLAGS.buckets or ():
    if not b.strip().isdigit():
      raise usage(f"--buckets must be integers separated by commas, got {b!r}")
  try:
    config = engine_config_from_flags()
  except (ValueError, TypeError) as e:
    raise usage(str(e)) from None
  if config.num_slots < workers() + 1:
    raise usage(f"--num_slots must be at least --workers ({workers()}): every worker needs "
                "a slot")
  if (config.idle_poll_us and FLAGS.engine_stall_s
      and FLAGS.engine_stall_s < 4 * config.idle_poll_us / 1e6):
    raise usage(f"--engine_stall_s {FLAGS.engine_stall_s} is too close to --idle_poll_us "
                f"{config.idle_poll_us}: an idle engine goes round only that often")
  return config


def api_key_from_flags() -> str | None:
  """--api_key_file, --api_key (warned: visible in ps) or $BLINK_API_KEY; raises UsageError."""
  if FLAGS.api_key and FLAGS.api_key_file:
    raise app.UsageError("give --api_key or --api_key_file, not both")
  key = None
  if FLAGS.api_key_file:
    path = Path(FLAGS.api_key_file)
    try:
      key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
      raise app.UsageError(f"--api_key_file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not key:
      raise app.UsageError(f"--api_key_file {path} is empty")
  elif FLAGS.api_key:
    log.warning("--api_key is visible to every user of this machine (ps, /proc/PID/cmdline); "
                "use --api_key_file or $%s instead", env.API_KEY)
    key = FLAGS.api_key
  else:
    key = env.api_key()
  if FLAGS.metrics_require_key and not key:
    raise app.UsageError("--metrics_require_key needs an API key (--api_key_file or "
                         f"${env.API_KEY})")
  return key


def setup_logging() -> None:
  logging.basicConfig(level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
  quiet = FLAGS.verbosity < 1
  for name in THIRD_PARTY_LOGGERS:
    logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  setup_logging()
  config = check_flags()
  api_key = api_key_from_flags()
  from nic_frontend.supervisor import ServeOptions, Serving

  from blink_jax.executor.loop_report import filtered_stderr

  t0 = time.monotonic()
  try:
    with filtered_stderr():  # XLA's INFO lines only with --verbosity=1
      engine = make_engine(config)
  except ValueError as e:  # a checkpoint, model config or size that does not fit
    if FLAGS.verbosity >= 1:
      log.exception("the engine did not start")
    raise app.UsageError(str(e)) from None
  log.info("engine up in %.1fs; mailbox in shared memory %s, transport %s",
           time.monotonic() - t0, engine.shm_name, FLAGS.transport)
  opts = ServeOptions(host=FLAGS.host, port=FLAGS.port, transport=FLAGS.transport,
                      workers=workers(), api_key=api_key, grace_s=FLAGS.grace_s,
                      relay_host=FLAGS.relay_host, relay_port=FLAGS.relay_port,
                      max_body_bytes=FLAGS.max_body_bytes,
                      served_model_names=tuple(FLAGS.served_model_name),
                      engine_stall_s=FLAGS.engine_stall_s,
                      max_queued_requests=FLAGS.max_queued_requests,
                      queue_timeout_s=FLAGS.queue_timeout_s,
                      metrics_require_key=FLAGS.metrics_require_key,
                      frontend_cpus=FLAGS.frontend_cpus)
  serving = Serving(engine, opts)
  stop = threading.Event()

  def on_signal(signum, frame):
    log.info("signal %d: shutting down", signum)
    stop.set()

  signal.signal(signal.SIGINT, on_signal)
  signal.signal(signal.SIGTERM, on_signal)
  failure = None
  try:
    serving.start()
    failure = serving.supervise(stop)
  finally:
    serving.stop()
  if failure is not None:
    log.error("exiting after an engine failure: %s", failure)
    # A stalled device loop may still hold its thread (and XLA's) inside a step: leave
    # without the interpreter's shutdown, which could wait for them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
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
