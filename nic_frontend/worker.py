"""A frontend worker process: one aiohttp server over one slot range of the mailbox.

  python -m nic_frontend.worker --shm-name NAME --tokenizer tokenizer.model \
      --model-name gemma --worker 0 --num-workers 1 --host 127.0.0.1 --port 8000

Several workers share a port with --reuse-port (SO_REUSEPORT; the kernel spreads connections);
each owns the slots [w*n/W, (w+1)*n/W) of the mailbox and its own doorbell. Secrets come from
the environment rather than the command line (visible in ps): BLINK_API_KEY (or --api-key) and
BLINK_RELAY_TOKEN for the tcp / rdma transports.

SIGTERM / SIGINT: stop accepting connections, let the requests in flight finish for up to
--grace-s seconds, then end the rest with an error (streams: an error event and [DONE]; others
503), cancel them on the device and exit 0, within about half a second past the grace period.

With --parent-pid (the engine's process, serve.py), the worker watches it: when it is gone
(killed: the engine died with it) every request ends with an error at once, the worker removes
what that process can no longer remove (--orphan-unlink-shm, --orphan-remove-dir) and exits
with status 3. An engine that stops making progress (stopped, hung) is noticed by the mailbox
driver after --engine-stall-s: /health answers 503, requests end with an error, until it moves
again.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import time
import sys

log = logging.getLogger("nic_frontend.worker")

EXIT_ORPHANED = 3  # the supervising (engine) process went away


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m nic_frontend.worker", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--transport", choices=("shm", "tcp", "rdma"), default="shm")
  p.add_argument("--shm-name", help="POSIX shared memory name of the mailbox (shm)")
  p.add_argument("--relay", help="host:port of the engine host's relay (tcp, rdma)")
  p.add_argument("--tokenizer", required=True, help="SentencePiece model file")
  p.add_argument("--model-name", required=True, help="the model name clients send")
  p.add_argument("--served-model-name", action="append", default=[],
                 help="additional accepted model names")
  p.add_argument("--worker", type=int, default=0)
  p.add_argument("--num-workers", type=int, default=None,
                 help="frontend workers sharing the mailbox (default: the header's)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000, help="0: any free port (single worker)")
  p.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT (several workers)")
  p.add_argument("--api-key", default=None,
                 help="require 'Authorization: Bearer KEY' on /v1 (default: $BLINK_API_KEY)")
  p.add_argument("--max-body-bytes", type=int, default=16 << 20)
  p.add_argument("--grace-s", type=float, default=30.0,
                 help="on SIGTERM, how long requests in flight may take to finish")
  p.add_argument("--engine-stall-s", type=float, default=10.0,
                 help="the engine is stalled when none of its loop counters moved for this "
                      "long (0: never); must exceed its longest step")
  p.add_argument("--max-queued-requests", type=int, default=0,
                 help="requests that may wait (FIFO) for a slot of this worker when all are "
                      "in use (0: none; the rest get 503 + Retry-After)")
  p.add_argument("--queue-timeout-s", type=float, default=0.0,
                 help="how long a queued request waits for a slot before its 503 (0: no "
                      "limit)")
  p.add_argument("--metrics-require-key", action="store_true",
                 help="/metrics requires the API key too")
  p.add_argument("--ready-file", default=None,
                 help="written (JSON: host, port, pid, worker) once the server listens")
  p.add_argument("--parent-pid", type=int, default=None,
                 help="shut down when this process (the engine host's supervisor) is gone")
  p.add_argument("--orphan-unlink-shm", default=None,
                 help="when --parent-pid is gone: remove this shared memory segment")
  p.add_argument("--orphan-remove-dir", default=None,
                 help="when --parent-pid is gone: remove this folder")
  p.add_argument("--cpus", type=parse_cpus, default=None,
                 help="CPUs this worker and all its threads run on, as taskset lists them "
                      "(0,1 or 0-3,8; default: the parent's)")
  p.add_argument("--log-level", default="INFO")
  return p.parse_args(argv)


def parse_cpus(text: str) -> frozenset[int]:
  """A CPU list as taskset writes it ("0,1", "0-3,8") -> the CPU ids; ValueError naming the
  bad part for anything else, or for a CPU this machine does not have."""
  cpus: set[int] = set()
  for part in text.split(","):
    lo, dash, hi = part.strip().partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
      raise ValueError(f"bad CPU list {text!r}: {part!r} is not N or N-M (M >= N)")
    cpus.update(range(int(lo), int(hi if dash else lo) + 1))
  count = os.cpu_count() or 1
  missing = sorted(c for c in cpus if c >= count)
  if missing:
    raise ValueError(f"CPU list {text!r}: this machine has CPUs 0-{count - 1}, not {missing}")
  return frozenset(cpus)


def pin(cpus: frozenset[int]) -> None:
  """Runs this process on `cpus` from now on. Called before any thread starts, so that the
  mailbox driver's thread is pinned too: an outside `taskset -p` pins the main thread only,
  and left the driver on cores shared with the host's other work (docs/PERFORMANCE.md,
  "Frontend cores")."""
  try:
    os.sched_setaffinity(0, cpus)
  except OSError as e:  # a CPU outside this process's cpuset (a container's limit)
    raise SystemExit(f"worker: --cpus {sorted(cpus)}: {e.strerror}; this process may use "
                     f"{sorted(os.sched_getaffinity(0))}") from None


def _write_ready(path: str, info: dict) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(info, f)
  os.replace(tmp, path)


async def serve(args: argparse.Namespace) -> int:
  from blink_jax import env
  from blink_jax.client.tokenizer import Tokenizer
  from nic_frontend import server
  from nic_frontend.driver import DriverOptions, EngineUnavailable
  from nic_frontend.transports import open_transport

  token = env.relay_token()
  region = open_transport(args.transport, shm_name=args.shm_name, address=args.relay,
                          token=token)
  tokenizer = Tokenizer(args.tokenizer)
  api_key = args.api_key if args.api_key is not None else env.api_key()
  driver_opts = DriverOptions(engine_stall_s=args.engine_stall_s,
                              max_queued_requests=args.max_queued_requests,
                              queue_timeout_s=args.queue_timeout_s)
  if args.metrics_require_key and not api_key:
    raise SystemExit("--metrics-require-key needs an API key")
  cfg = server.FrontendConfig(model_name=args.model_name,
                         served_model_names=tuple(args.served_model_name), worker=args.worker,
                         num_workers=args.num_workers, api_key=api_key or None,
                         max_body_bytes=args.max_body_bytes, driver=driver_opts,
                         metrics_require_key=args.metrics_require_key)
  app = server.create_app(region, tokenizer, cfg)
  fe = app[server.FRONTEND_KEY]
  runner, site, port = await server.start_site(app, args.host, args.port,
                                               reuse_port=args.reuse_port,
                                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
  log.info("frontend worker %d listening on http://%s:%d (transport %s, model %s%s)",
           args.worker, args.host, port, args.transport, args.model_name,
           ", api key required" if api_key else "")
  # Ready means reachable *and* attached: with SO_REUSEPORT a request may land on this worker
  # as soon as it listens, so wait (bounded) until the driver has read the engine's header.
  deadline = time.monotonic() + 30.0
  while fe.driver.state is None and time.monotonic() < deadline:
    await asyncio.sleep(0.01)
  if fe.driver.state is None:
    log.warning("worker %d: not attached to the engine yet: %s", args.worker,
                fe.driver.state_text())
  if args.ready_file:
    _write_ready(args.ready_file, {"host": args.host, "port": port, "pid": os.getpid(),
                                   "worker": args.worker})
  print(f"BLINK_FRONTEND_READY worker={args.worker} port={port}", flush=True)

  stop = asyncio.Event()
  orphaned = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, stop.set)
  watchdog = None
  if args.parent_pid:
    watchdog = asyncio.create_task(_watch_parent(args.parent_pid, stop, orphaned))
  await stop.wait()
  if watchdog is not None:
    watchdog.cancel()
  if orphaned.is_set():
    # The engine died with its process: no token will come. End everything now.
    fe.driver.fail_all(EngineUnavailable("the engine process is gone", code="engine_gone"))
    await site.stop()
    await fe.drain(0.5)  # the handlers send the error; all of them end at once
    _orphan_cleanup(args)
    await _close(runner, fe, region, driver_timeout=0.0)
    return EXIT_ORPHANED
  log.info("worker %d: shutting down (grace %.1fs, %d handlers in flight)", args.worker,
           args.grace_s, fe._handlers_in_flight)
  await site.stop()  # no new connections
  if not await fe.drain(args.grace_s):
    log.warning("worker %d: requests still in flight after %.1fs were ended with an error",
                args.worker, args.grace_s)
  await _close(runner, fe, region, driver_timeout=DRIVER_STOP_S)
  return 0


# Past the grace period: how long the device may take to finish the cancelled requests (their
# pages come back) and the HTTP server to close what is left.
DRIVER_STOP_S = 0.3
SHUTDOWN_TIMEOUT_S = 0.3


async def _close(runner, fe, region, driver_timeout: float) -> None:
  """Stops the driver (cancelling what it still has on the device), then the HTTP server."""
  await asyncio.get_running_loop().run_in_executor(None, fe.driver.stop, driver_timeout)
  await runner.cleanup()  # the app's cleanup finds the driver stopped
  if hasattr(region, "close"):
    region.close()


def _orphan_cleanup(args: argparse.Namespace) -> None:
  """What the dead supervisor would have removed at its shutdown."""
  if args.orphan_unlink_shm:
    from blink_jax.client import shm
    try:
      seg = shm.open_region(args.orphan_unlink_shm)
    except (FileNotFoundError, ValueError):
      pass
    else:
      seg.unlink()
      seg.close()
      log.info("removed the shared memory %s", args.orphan_unlink_shm)
  if args.orphan_remove_dir:
    shutil.rmtree(args.orphan_remove_dir, ignore_errors=True)


async def _watch_parent(pid: int, stop: asyncio.Event, orphaned: asyncio.Event | None = None,
                        every_s: float = 0.2) -> None:
  """Sets `orphaned` and `stop` when the supervising process dies (a SIGKILLed serve.py must
  not leave workers serving a mailbox nobody drives)."""
  while not stop.is_set():
    if os.getppid() != pid:
      log.error("the supervising process %d is gone (the engine with it): ending every "
                "request and shutting down", pid)
      if orphaned is not None:
        orphaned.set()
      stop.set()
      return
    await asyncio.sleep(every_s)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.cpus:
    pin(args.cpus)
  logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                      format=f"%(asctime)s worker{args.worker} %(levelname)s %(name)s: "
                             "%(message)s")
  try:
    return asyncio.run(serve(args))
  except KeyboardInterrupt:
    return 0


if __name__ == "__main__":
  code = main()
  # Everything is closed: the interpreter's own teardown (module and object finalization, a
  # few tenths of a second) would only delay the supervisor's shutdown.
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
