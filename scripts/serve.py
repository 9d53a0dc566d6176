"""Serves a model over an OpenAI-compatible HTTP API: the engine plus frontend worker processes.

  python scripts/serve.py --ckpt gemma [--port 8000] [--workers 2] [--transport shm|tcp]

The engine (`blink_jax.engine.Engine`) loads and compiles the model, creates the mailbox in
POSIX shared memory and launches the persistent device loop; `nic_frontend.supervisor.Serving`
runs the frontend workers. After start-up this process only supervises. Every field of
`EngineConfig` and `KernelOptions` is a flag of the same name (`--helpfull` lists them).

SIGINT / SIGTERM: the workers stop accepting, let requests in flight finish for up to
--grace_s seconds and cancel the rest on the device; then the device loop is shut down and the
shared memory released.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time

from absl import app, flags

from blink_jax import engine_config, env

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
flags.DEFINE_integer("workers", 1, "Frontend worker processes.")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer KEY' on /v1 "
                    "(default: $BLINK_API_KEY, none if unset).")
flags.DEFINE_string("shm_name", None, "Name of the mailbox's shared memory (default: random).")
flags.DEFINE_string("relay_host", "127.0.0.1", "Address of the tcp relay (--transport tcp).")
flags.DEFINE_integer("relay_port", 0, "Port of the tcp relay (0: any free port).")
flags.DEFINE_float("grace_s", 30.0, "On shutdown, how long requests in flight may take.")
flags.DEFINE_integer("max_body_bytes", 16 << 20, "Largest accepted request body.")
flags.DEFINE_multi_string("served_model_name", [], "Additional model names to accept.")
engine_config.define_flags()

# Loggers of the libraries under the engine; their INFO lines (orbax's checkpoint reads, JAX's
# backend choice) are shown only with --verbosity=1 or more.
THIRD_PARTY_LOGGERS = ("absl", "jax", "orbax", "etils", "flax", "aiohttp")


def engine_config_from_flags() -> engine_config.EngineConfig:
  """The engine's config: one flag per field; the mailbox shared out among --workers frontend
  workers plus the engine's own client (its generate(), which the warm-up uses), each with
  --num_slots // --workers slots."""
  config = engine_config.from_flags()
  return dataclasses.replace(config, frontend_workers=FLAGS.workers,
                             num_slots=config.num_slots * (FLAGS.workers + 1) // FLAGS.workers)


def make_engine():
  from blink_jax.engine import Engine
  return Engine.from_checkpoint(FLAGS.ckpt, dtype=FLAGS.dtype, tokenizer_path=FLAGS.tokenizer,
                                config=engine_config_from_flags(),
                                shm_name=FLAGS.shm_name or "")


def setup_logging() -> None:
  logging.basicConfig(level=logging.INFO,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
  quiet = FLAGS.verbosity < 1
  for name in THIRD_PARTY_LOGGERS:
    logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv) -> int:
  del argv
  setup_logging()
  if not FLAGS.ckpt:
    raise app.UsageError("--ckpt is required")
  if FLAGS.ckpt.startswith("random:") and not FLAGS.tokenizer:
    raise app.UsageError("--ckpt random:<config> needs --tokenizer (a SentencePiece model)")
  if FLAGS.workers < 1:
    raise app.UsageError("--workers must be at least 1")
  from nic_frontend.supervisor import ServeOptions, Serving

  t0 = time.monotonic()
  engine = make_engine()
  log.info("engine up in %.1fs; mailbox in shared memory %s, transport %s",
           time.monotonic() - t0, engine.shm_name, FLAGS.transport)
  opts = ServeOptions(host=FLAGS.host, port=FLAGS.port, transport=FLAGS.transport,
                      workers=FLAGS.workers, api_key=FLAGS.api_key or env.api_key(),
                      grace_s=FLAGS.grace_s, relay_host=FLAGS.relay_host,
                      relay_port=FLAGS.relay_port, max_body_bytes=FLAGS.max_body_bytes,
                      served_model_names=tuple(FLAGS.served_model_name))
  serving = Serving(engine, opts)
  stop = threading.Event()

  def on_signal(signum, frame):
    log.info("signal %d: shutting down", signum)
    stop.set()

  signal.signal(signal.SIGINT, on_signal)
  signal.signal(signal.SIGTERM, on_signal)
  try:
    serving.start()
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
