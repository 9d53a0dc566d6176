"""A frontend worker process: one aiohttp server over one slot range of the mailbox.

  python -m nic_frontend.worker --shm-name NAME --tokenizer tokenizer.model \
      --model-name gemma --worker 0 --num-workers 1 --host 127.0.0.1 --port 8000

Several workers share a port with --reuse-port (SO_REUSEPORT; the kernel spreads connections);
each owns the slots [w*n/W, (w+1)*n/W) of the mailbox and its own doorbell. Secrets come from
the environment rather than the command line (visible in ps): BLINK_API_KEY (or --api-key) and
BLINK_RELAY_TOKEN for the tcp / rdma transports.

SIGTERM / SIGINT: stop accepting connections, let the requests in flight finish for up to
--grace-s seconds, cancel the rest on the device, exit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
import sys

log = logging.getLogger("nic_frontend.worker")


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
  p.add_argument("--ready-file", default=None,
                 help="written (JSON: host, port, pid, worker) once the server listens")
  p.add_argument("--parent-pid", type=int, default=None,
                 help="shut down when this process (the engine host's supervisor) is gone")
  p.add_argument("--log-level", default="INFO")
  return p.parse_args(argv)


def _write_ready(path: str, info: dict) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(info, f)
  os.replace(tmp, path)


async def serve(args: argparse.Namespace) -> int:
  from blink_jax import env
  from blink_jax.client.tokenizer import Tokenizer
  from nic_frontend import server
  from nic_frontend.transports import open_transport

  token = env.relay_token()
  region = open_transport(args.transport, shm_name=args.shm_name, address=args.relay,
                          token=token)
  tokenizer = Tokenizer(args.tokenizer)
  api_key = args.api_key if args.api_key is not None else env.api_key()
  cfg = server.FrontendConfig(model_name=args.model_name,
                         served_model_names=tuple(args.served_model_name), worker=args.worker,
                         num_workers=args.num_workers, api_key=api_key or None,
                         max_body_bytes=args.max_body_bytes)
  app = server.create_app(region, tokenizer, cfg)
  fe = app[server.FRONTEND_KEY]
  runner, site, port = await server.start_site(app, args.host, args.port,
                                               reuse_port=args.reuse_port)
  log.info("frontend worker %d/%s listening on http://%s:%d (transport %s, model %s%s)",
           args.worker, args.num_workers or "header", args.host, port, args.transport,
           args.model_name, ", api key required" if api_key else "")
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
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, stop.set)
  watchdog = None
  if args.parent_pid:
    watchdog = asyncio.create_task(_watch_parent(args.parent_pid, stop))
  await stop.wait()
  if watchdog is not None:
    watchdog.cancel()
  log.info("worker %d: shutting down (grace %.1fs, %d handlers in flight)", args.worker,
           args.grace_s, fe._handlers_in_flight)
  await site.stop()  # no new connections
  if not await fe.drain(args.grace_s):
    log.warning("worker %d: requests still in flight after %.1fs; cancelling them",
                args.worker, args.grace_s)
  await runner.cleanup()  # cancels leftover handlers; the driver cancels their slots
  if hasattr(region, "close"):
    region.close()
  return 0


async def _watch_parent(pid: int, stop: asyncio.Event, every_s: float = 0.5) -> None:
  """Sets `stop` when the supervising process dies (a SIGKILLed serve.py must not leave
  workers serving a mailbox nobody drives)."""
  while not stop.is_set():
    if os.getppid() != pid:
      log.error("the supervising process %d is gone; shutting down", pid)
      stop.set()
      return
    await asyncio.sleep(every_s)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                      format=f"%(asctime)s worker{args.worker} %(levelname)s %(name)s: "
                             "%(message)s")
  try:
    return asyncio.run(serve(args))
  except KeyboardInterrupt:
    return 0


if __name__ == "__main__":
  sys.exit(main())
