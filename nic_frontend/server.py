"""The frontend's HTTP server: OpenAI-compatible endpoints over the mailbox (aiohttp).

One frontend worker = one process = one `Frontend`: an aiohttp application and a
`MailboxDriver` (`nic_frontend.driver`), the thread that owns this worker's side of the mailbox
(its slot range and its doorbell). Handlers never touch the region: they hand requests to the
driver and read their slots' output from asyncio queues the driver fills.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics, GET /openapi.json (the API as
an OpenAPI document, `nic_frontend.openapi`).

No client input gets a 5xx: the middleware answers every error in OpenAI's schema, and so does
the HTTP protocol (`_Protocol`) for what aiohttp itself rejects (a malformed request line or
header, a broken chunked body). The protocol also caps the connections of a worker (503 over
the cap, before reading anything), closes a connection whose request headers take longer than
header_timeout_s and (aiohttp) one idle for keepalive_timeout_s; a body must arrive within
body_timeout_s. Bodies over INLINE_PARSE_BYTES are parsed and tokenized in a process pool
(`_ParserPool`), never on the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import hmac
import json
import logging
import multiprocessing
import os
import time
from http import HTTPStatus
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from blink_jax.client import mailbox
from blink_jax.client import protocol
from blink_jax.client.streaming import ChoiceDecoder, DeviceError

from nic_frontend import openai_api as api
from nic_frontend import openapi
from nic_frontend.driver import STATE_NAMES, DriverOptions, EngineUnavailable, Flight, MailboxDriver
from nic_frontend.metrics import FrontendMetrics

log = logging.getLogger("nic_frontend")

DEFAULT_MAX_BODY_BYTES = 16 << 20




@dataclasses.dataclass
class FrontendConfig:
  model_name: str
  served_model_names: tuple[str, ...] = ()
  worker: int = 0
  num_workers: int | None = None
  api_key: str | None = None
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
  retry_after_s: int = 1
  driver: DriverOptions = dataclasses.field(default_factory=DriverOptions)
  # Connections (see `_Protocol`): a request's headers must be complete this long after the
  # connection opened or its first byte arrived (slowloris); its body must arrive within
  # body_timeout_s (408); an idle keep-alive connection is closed after keepalive_timeout_s
  # (0: after each response). Header and body timeouts None or 0: none. A streamed response is
  # never cut by any of them.
  header_timeout_s: float | None = 10.0
  body_timeout_s: float | None = 60.0
  keepalive_timeout_s: float = 75.0
  # Open connections of this worker at most (fewer if the file descriptor limit is lower);
  # over it a connection is answered 503 at once and closed.
  max_connections: int = 4096
  accept_error_log_s: float = 5.0  # accept() failures (EMFILE): one log line per period at most
  # Processes that parse and tokenize bodies over INLINE_PARSE_BYTES (0: a thread instead).
  parse_processes: int = 1
  metrics_require_key: bool = False  # /metrics needs the API key too (when one is set)

  @property
  def names(self) -> tuple[str, ...]:
    return (self.model_name, *[n for n in self.served_model_names if n != self.model_name])


def _json(data: Any, status: int = 200, headers: dict | None = None) -> web.Response:
  try:
    raw = json.dumps(data, ensure_ascii=False).encode()
  except UnicodeEncodeError:  # a lone surrogate (echoed from a URL, say): escaped instead
    raw = json.dumps(data).encode()
  return web.Response(body=raw, status=status, content_type="application/json",
                      headers=headers)


def _error_response(e: api.ApiError) -> web.Response:
  return _json(e.body(), e.status, e.headers)


_HTTP_ERRORS = {404: ("Not found", "not_found"), 405: ("Method not allowed", "method_not_allowed"),
                413: ("Request body too large", "request_too_large")}


def _printable(text: Any, most: int = 200) -> str:
  """`text` for one log line: escaped (no newlines or control characters from a client) and
  clipped."""
  out = ascii(str(text))[1:-1]
  return out if len(out) <= most else out[:most] + "..."


class RateLimitedLog:
  """Logs at most one line per `every_s` seconds; the calls in between are counted into the
  next line that is logged."""

  def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
               every_s: float = 5.0, clock=time.monotonic):
    self.logger, self.level, self.every_s, self.clock = logger, level, every_s, clock
    self._last: float | None = None
    self._held = 0

  def __call__(self, msg: str, *args) -> bool:
    """Logs `msg % args` unless a line was logged less than every_s ago; True if logged."""
    now = self.clock()
    if self._last is not None and now - self._last < self.every_s:
      self._held += 1
      return False
    held, self._held, self._last = self._held, 0, now
    if held:
      msg = f"{msg} (and {held} more like it since the last such line)"
    self.logger.log(self.level, msg, *args)
    return True


class _LoopErrors:
  """The event loop's exception handler while the app runs: a failed accept() is logged at
  most once per `every_s` seconds, with a count and without a traceback. (Out of file
  descriptors, asyncio reports every accept it retries, up to the listen backlog per wake-up
  and with a traceback each: megabytes of log a second.) Everything else goes to the handler
  that was there before."""

  def __init__(self, every_s: float):
    self.accept_failed = RateLimitedLog(log, logging.ERROR, every_s)
    self._previous = None

  def install(self, loop: asyncio.AbstractEventLoop) -> None:
    self._previous = loop.get_exception_handler()
    loop.set_exception_handler(self)

  @staticmethod
  def is_accept_error(context: dict) -> bool:
    exc = context.get("exception")
    if str(context.get("message", "")).startswith("socket.accept()"):
      return True
    return isinstance(exc, OSError) and exc.errno in (
        errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and "accept" in repr(
            context.get("handle", ""))

  def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if self.is_accept_error(context):
      exc = context.get("exception")
      self.accept_failed("accepting a connection failed: %s", exc or context.get("message"))
      return
    if self._previous is not None:
      self._previous(loop, context)
    else:
      loop.default_exception_handler(context)


# Bodies up to this size are parsed on the event loop (a few ms at worst: JSON of nested
# arrays, the slowest, parses and validates at ~0.5 us a byte); larger ones in the pool.
INLINE_PARSE_BYTES = 32 << 10
# The listen backlog, at most (the kernel caps it at net.core.somaxconn, 4096 by default).
MAX_BACKLOG = 1024


class _ParserPool:
  """`api.parse_body` (JSON, validation, tokenization) of large bodies, in a small pool of
  processes, so that no body holds the event loop: json.loads and the validation keep the GIL
  for as long as they run (a 5 MB body of nested arrays: 2.4 s), and SentencePiece, which
  mostly releases it, converts its ids to a list under it. A pool that breaks is replaced and
  the body tried once more; without a pool (parse_processes=0, or a tokenizer that cannot be
  sent to one) large bodies are parsed in a thread (docs/NOTES.md, "What holds a frontend
  worker's event loop")."""

  def __init__(self, tokenizer, processes: int):
    self.tokenizer = tokenizer
    self.processes = max(0, int(processes))
    sp = getattr(tokenizer, "sp", None)
    self._model = sp.serialized_model_proto() if self.processes and sp is not None else None
    self._pool: concurrent.futures.ProcessPoolExecutor | None = None

  def start(self) -> None:
    if self._model is None or self._pool is not None:
      return
    # spawn, not fork: this process has threads (the driver's); the children never see the
    # listening socket or the mailbox.
    try:
      self._pool = concurrent.futures.ProcessPoolExecutor(
          self.processes, mp_context=multiprocessing.get_context("spawn"),
          initializer=api.init_parser_process, initargs=(self._model, os.getpid()))
      for _ in range(self.processes):  # start them now, not on the first large body
        self._pool.submit(api.parser_process_ready)
    except OSError as e:  # no processes to be had (out of memory, of pids): parse in a thread
      log.warning("no parser processes (%s): large bodies are parsed in a thread", e)
      self.stop()

  def stop(self) -> None:
    pool, self._pool = self._pool, None
    if pool is None:
      return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:  # one parsing a large body would hold the worker's exit until it is done
      p.terminate()

  async def parse(self, raw: bytes, kind: str, limits: api.Limits) -> api.GenRequest:
    loop = asyncio.get_running_loop()
    for _ in range(2):
      if self._pool is None:
        break
      try:
        return await loop.run_in_executor(self._pool, api.parse_in_process, raw, kind, limits)
      except (concurrent.futures.process.BrokenProcessPool, OSError):
        log.warning("the parser process pool broke; starting a new one")
        self.stop()
        self.start()
    else:
      raise api.ApiError(400, "the request body could not be parsed", code="invalid_body")
    return await loop.run_in_executor(None, api.parse_body, raw, kind, limits, self.tokenizer)


class Frontend:
  """Routes, handlers and the driver of one worker."""

  def __init__(self, region: mailbox.Region, tokenizer, config: FrontendConfig,
               metrics: FrontendMetrics | None = None):
    self.tokenizer = tokenizer
    self.cfg = config
    self.metrics = metrics or FrontendMetrics(config.worker, header_source=lambda: self.header)
    self.driver = MailboxDriver(region, worker=config.worker, num_workers=config.num_workers,
                                metrics=self.metrics, options=config.driver)
    self.created = int(time.time())
    self.draining = False
    self._handlers_in_flight = 0
    self._idle = asyncio.Event()
    if hasattr(tokenizer, "warm_up"):
      tokenizer.warm_up()  # now, not while the first requests wait
    self._parser = _ParserPool(tokenizer, config.parse_processes)
    self._loop_errors = _LoopErrors(config.accept_error_log_s)

  @property
  def header(self) -> dict | None:
    return self.driver.header

  # ---- app ----
  def app(self) -> web.Application:
    app = web.Application(client_max_size=self.cfg.max_body_bytes,
                          middlewares=[self._middleware])
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_post("/v1/chat/completions", self.chat_completions)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/v1/models/{model}", self.model)
    app.router.add_get("/health", self.health)
    app.router.add_get("/metrics", self.metrics_endpoint)
    app.router.add_get("/openapi.json", self.openapi_endpoint)
    app.on_startup.append(self._on_startup)
    app.on_cleanup.append(self._on_cleanup)
    return app

  async def _on_startup(self, app) -> None:
    self._idle.set()
    loop = asyncio.get_running_loop()
    self._loop_errors.install(loop)
    self._parser.start()
    self.driver.start(loop)

  async def _on_cleanup(self, app) -> None:
    self._parser.stop()
    await asyncio.get_running_loop().run_in_executor(None, self.driver.stop)

  async def drain(self, timeout: float, fail_wait_s: float = 0.5) -> bool:
    """Refuses new requests and waits up to `timeout` for those in flight; True if all ended.
    Past `timeout` every request still open ends with an error (streams: an error event, then
    [DONE]; the rest 503) and this waits up to `fail_wait_s` more for their handlers to send
    it, so nothing is left for the server's shutdown to cut off."""
    self.draining = True
    try:
      await asyncio.wait_for(self._idle.wait(), timeout)
      return True
    except asyncio.TimeoutError:
      pass
    self.driver.fail_all(EngineUnavailable("the server is shutting down", code="shutting_down"))
    try:
      await asyncio.wait_for(self._idle.wait(), fail_wait_s)
    except asyncio.TimeoutError:
      log.warning("%d handlers did not end after their error was posted",
                  self._handlers_in_flight)
    return False

  @web.middleware
  async def _middleware(self, request: web.Request, handler):
    endpoint = request.match_info.route.resource.canonical if (
        request.match_info.route.resource is not None) else "other"
    try:
      if self.cfg.api_key is not None and (
          request.path.startswith("/v1/")
          or (self.cfg.metrics_require_key and endpoint == "/metrics")):
        self._check_key(request)
      resp = await handler(request)
    except api.ApiError as e:
      log.info("%s %s: %d %s", _printable(request.method), _printable(request.path), e.status,
               e.code or e.type)  # one line per rejected request, no traceback
      resp = _error_response(e)
      if e.status == 408 or e.code == "invalid_body":  # the body is lost: so is the connection
        resp.force_close()
    except web.HTTPException as e:
      if e.status < 400:
        raise
      msg, code = _HTTP_ERRORS.get(e.status, (e.reason, None))
      if e.status == 413:
        msg = (f"request body too large: the limit is {self.cfg.max_body_bytes} bytes")
      resp = _error_response(api.ApiError(e.status, msg, code=code))
    except asyncio.CancelledError:
      self.metrics.request_done(endpoint, 499)
      raise
    except ConnectionError:  # the client went away while its request was read
      log.debug("%s %s: the client went away", _printable(request.method),
                _printable(request.path))
      request["blink_status"] = 499
      resp = web.Response(status=499)
    except Exception:
      log.exception("unhandled error in %s", request.path)
      resp = _error_response(api.ApiError(500, "internal server error", code="internal_error"))
    self.metrics.request_done(endpoint, request.get("blink_status", resp.status))
    if not resp.prepared:
      resp.headers["x-blink-worker"] = str(self.cfg.worker)
    return resp

  def _check_key(self, request: web.Request) -> None:
    auth = request.headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    # Header bytes that are not UTF-8 arrive as surrogate escapes: compare them as the bytes
    # they were, so an odd header is a wrong key, not an encoding error.
    given = key.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.cfg.api_key.encode()):
      raise api.ApiError(401, "Incorrect API key provided.", type="invalid_request_error",
                         code="invalid_api_key")

  # ---- simple endpoints ----
  async def health(self, request: web.Request) -> web.Response:
    d = self.driver
    ok = (d.state == protocol.EngineState.READY and d.client is not None and not self.draining
          and not d.stalled and d.failed is None)
    state = (STATE_NAMES.get(d.state, "unreachable") if d.state is not None else "unreachable")
    if d.failed is not None:
      state = "gone" if d.failed.code == "engine_gone" else state
    elif d.stalled and d.state == protocol.EngineState.READY:
      state = "stalled"
    body = {"status": "ok" if ok else "unavailable", "engine_state": state,
            "worker": self.cfg.worker, "slots_total": d.slots_total,
            "slots_in_use": d.slots_in_use, "queued": d.queued}
    if body["status"] != "ok":
      body["error"] = api.error_body(self._unavailable_text(), "service_unavailable",
                                     code=self._unavailable_code())["error"]
      return _json(body, 503)
    return _json(body)

  async def models(self, request: web.Request) -> web.Response:
    return _json(api.models_list(self.cfg.names, self._max_context(), self.created))

  async def model(self, request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name not in self.cfg.names:
      raise api.ApiError(404, f"The model `{name}` does not exist.", param="model",
                         code="model_not_found")
    return _json(api.model_card(name, self._max_context(), self.created))

  async def metrics_endpoint(self, request: web.Request) -> web.Response:
    self.metrics.set_slots(self.driver.slots_in_use, self.driver.slots_total)
    body, ctype = self.metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp

  def _max_context(self) -> int | None:
    return None if self.header is None else int(self.header["max_context"])

  def _unavailable_text(self) -> str:
    if self.draining:
      return "the server is shutting down"
    return self.driver.state_text()

  def _unavailable_code(self) -> str:
    d = self.driver
    return ("shutting_down" if self.draining else
            d.failed.code if d.failed is not None else
            "engine_starting" if d.state == protocol.EngineState.STARTING else
            "engine_stopped" if d.state == protocol.EngineState.STOPPED else
            "engine_unreachable" if d.state is None or d.client is None else
            "engine_stalled" if d.stalled else "service_unavailable")

  def _check_ready(self) -> None:
    d = self.driver
    if (self.draining or d.state != protocol.EngineState.READY or d.client is None
        or d.stalled or d.failed is not None):
      raise api.ApiError(503, self._unavailable_text(), type="service_unavailable",
                         code=self._unavailable_code(), headers={"Retry-After": "5"})

  def _limits(self) -> api.Limits:
    h = self.header
    return api.Limits(model_names=self.cfg.names, vocab_size=int(h["vocab_size"]),
                      max_context=int(h["max_context"]), max_prompt=int(h["max_prompt"]),
                      max_top_logprobs=int(h["max_top_logprobs"]))

  async def _read_body(self, request: web.Request) -> bytes:
    limit = self.cfg.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
      raise api.ApiError(413, f"request body too large: {request.content_length} bytes, the "
                              f"limit is {limit} bytes", code="request_too_large")
    timeout = self.cfg.body_timeout_s or None
    try:
      return await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
      raise api.ApiError(413, f"request body too large: the limit is {limit} bytes",
                         code="request_too_large") from None
    except asyncio.TimeoutError:
      raise api.ApiError(408, f"the request body did not arrive within {timeout:g} s",
                         code="request_timeout") from None
    except (ConnectionError, asyncio.CancelledError):
      raise
    except Exception as e:  # aiohttp's payload errors: a body cut short, a bad chunk, ...
      raise api.ApiError(400, f"the request body could not be read: "
                              f"{api._clip(str(e) or type(e).__name__)}",
                         code="invalid_body") from None

  async def _parse(self, raw: bytes, kind: str) -> api.GenRequest:
    """JSON, validation and tokenization of a body: on the event loop for a small one, in the
    parser pool for a large one (any body the loop would spend more than a few ms on)."""
    if len(raw) <= INLINE_PARSE_BYTES:
      return api.parse_body(raw, kind, self._limits(), self.tokenizer)
    return await self._parser.parse(raw, kind, self._limits())

  async def openapi_endpoint(self, request: web.Request) -> web.Response:
    try:
      limits = self._limits() if self.header is not None else None
    except (KeyError, TypeError, ValueError):
      limits = None
    return _json(openapi.document(self.cfg.names, limits, api_key=self.cfg.api_key is not None,
                                  metrics_require_key=self.cfg.metrics_require_key))

  # ---- generation ----
  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "completion")

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "chat")

  async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
    arrival = time.perf_counter()
    self._check_ready()
    gen = await self._parse(await self._read_body(request), kind)
    self.metrics.prepare_time.observe(time.perf_counter() - arrival)
    self._handlers_in_flight += 1
    self._idle.clear()
    flights: list[Flight] = []
    reason = "disconnect"
    try:
      flights = await self._submit_all(gen)
      self.metrics.prompt_tokens.inc(sum(len(p) for p in gen.prompts))
      run = _Run(self, gen, flights, arrival)
      if gen.stream:
        resp = await run.stream(request)
      else:
        resp = await run.collect()
      reason = run.abandon_reason
      return resp
    except api.ApiError:
      reason = "error"
      raise
    finally:
      for f in flights:
        self.driver.abandon(f, reason)
      self._handlers_in_flight -= 1
      if self._handlers_in_flight == 0:
        self._idle.set()

  async def _submit_all(self, gen: api.GenRequest) -> list[Flight]:
    flights: list[Flight] = []
    try:
      for i in range(gen.num_choices):
        req = gen.slot_request(i, self.driver.new_request_id())
        flights.append(await self.driver.submit(req))
    except BaseException as e:
      for f in flights:
        self.driver.abandon(f, "error")
      if isinstance(e, mailbox.SlotsFullError):
        # As vLLM past --max-num-queued-reqs: 503, the client may come back.
        raise api.ApiError(503, f"The server is busy ({e or 'every request slot is in use'})."
                                " Retry later.",
                           type="service_unavailable", code="queue_full",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
      if isinstance(e, EngineUnavailable):
        raise api.ApiError(503, str(e), type="service_unavailable", code="engine_unavailable",
                           headers={"Retry-After": "5"}) from None
      if isinstance(e, ValueError):
        raise api.ApiError(400, str(e), param="prompt") from None
      raise
    return flights


class _Choice:
  """One choice's state while it runs."""

  def __init__(self, run: "_Run", index: int, flight: Flight):
    self.index = index
    self.flight = flight
    self.decoder = ChoiceDecoder(run.fe.tokenizer, run.gen.stop)
    self.lp = (api.LogprobsBuilder(run.gen.kind, run.fe.tokenizer, run.gen.top_logprobs)
               if run.gen.logprobs else None)
    self.first_token_at: float | None = None
    self.last_token_at: float | None = None
    self.cached_tokens = 0  # the device's count, once admitted


class _Run:
  """A request's choices from their first token to the response (JSON or SSE)."""

  def __init__(self, fe: Frontend, gen: api.GenRequest, flights: list[Flight], arrival: float):
    self.fe, self.gen, self.arrival = fe, gen, arrival
    self.choices = [_Choice(self, i, f) for i, f in enumerate(flights)]
    self.rid = api.new_id(gen.kind)
    self.created = int(time.time())
    self.abandon_reason = "disconnect"
    self._first = True

  def _note_tokens(self, c: _Choice, n: int) -> None:
    if n <= 0:
      return
    now = time.perf_counter()
    if c.first_token_at is None:
      c.first_token_at = now
      if self._first:
        self._first = False
        self.fe.metrics.ttft.observe(now - self.arrival)
    c.last_token_at = now

  def _finish_metrics(self) -> dict:
    m = self.fe.metrics
    completion = sum(len(c.decoder.tokens) for c in self.choices)
    m.generation_tokens.inc(completion)
    for c in self.choices:
      n = len(c.decoder.tokens)
      if n > 1 and c.first_token_at is not None:
        m.tpot.observe((c.last_token_at - c.first_token_at) / (n - 1))
    m.e2e.observe(time.perf_counter() - self.arrival)
    if any(c.decoder.stopped_by_string for c in self.choices):
      self.abandon_reason = "stop_string"
    prompt = sum(len(p) for p in self.gen.prompts)
    # Each prompt runs once per choice (n): its cached tokens are the mean over its choices.
    cached = sum(c.cached_tokens for c in self.choices) // self.gen.n
    return api.usage(prompt, completion, min(cached, prompt))

  async def _step(self, c: _Choice):
    """The next piece of choice `c` (waits for the device)."""
    out = await c.flight.next()
    c.cached_tokens = max(c.cached_tokens, out.cached_tokens)
    piece = c.decoder.feed(out.tokens, out.logprobs, out.top, out.finished, out.finish_reason,
                           out.error)
    self._note_tokens(c, len(piece.tokens))
    lp = c.lp.add(piece.tokens, piece.logprobs, piece.top) if c.lp is not None else None
    return piece, lp

  @staticmethod
  def _api_error(e: Exception) -> api.ApiError:
    if isinstance(e, DeviceError):
      if e.finish == protocol.Finish.ERROR:
        return api.ApiError(400, f"the engine rejected the request: {e}", code="invalid_value")
      return api.ApiError(500, str(e), code="engine_cancelled")
    return api.ApiError(503, str(e), type="service_unavailable",
                        code=getattr(e, "code", "engine_unavailable"), headers={"Retry-After": "5"})

  # ---- non-streaming ----
  async def collect(self) -> web.Response:
    async def run_choice(c: _Choice):
      while not c.decoder.done:
        await self._step(c)

    try:
      await asyncio.gather(*(run_choice(c) for c in self.choices))
    except (DeviceError, EngineUnavailable) as e:
      self.abandon_reason = "error"
      raise self._api_error(e) from None
    usage = self._finish_metrics()
    g = self.gen
    make = api.chat_choice if g.kind == "chat" else api.completion_choice
    choices = [make(c.index, c.decoder.text, c.lp.result() if c.lp else None,
                    c.decoder.finish_reason) for c in self.choices]
    build = api.chat_response if g.kind == "chat" else api.completion_response
    return _json(build(self.rid, self.created, g.model, choices, usage))

  # ---- streaming ----
  async def stream(self, request: web.Request) -> web.StreamResponse:
    g = self.gen
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice):
      try:
        while not c.decoder.done:
          piece, lp = await self._step(c)
          queue.put_nowait((c, piece, lp, None))
      except (DeviceError, EngineUnavailable) as e:
        queue.put_nowait((c, None, None, e))

    tasks = [asyncio.create_task(pump(c)) for c in self.choices]
    resp: web.StreamResponse | None = None
    try:
      remaining = len(self.choices)
      failed = False
      while remaining:
        c, piece, lp, err = await queue.get()
        if err is not None:
          self.abandon_reason = "error"
          if resp is None:  # nothing sent yet: a plain HTTP error
            raise self._api_error(err)
          # Mid-stream: an error event in OpenAI's schema, then the end of the stream.
          await self._send(resp, self._api_error(err).body())
          failed = True
          break
        if resp is None:
          resp = await self._open(request)
        await self._send_piece(resp, c, piece, lp)
        if piece.finish_reason is not None:
          remaining -= 1
      if resp is None:
        resp = await self._open(request)
      if not failed:
        usage = self._finish_metrics()
        if g.include_usage:
          await self._send(resp, api.chunk(g.kind, self.rid, self.created, g.model, [], True,
                                           usage))
      await resp.write(b"data: [DONE]\n\n")
      await resp.write_eof()
      return resp
    except ConnectionResetError:
      self.abandon_reason = "disconnect"
      request["blink_status"] = 499  # nginx's "client closed request"
      return resp if resp is not None else web.Response(status=499)
    finally:
      for t in tasks:
        t.cancel()

  async def _open(self, request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", "x-blink-worker": str(self.fe.cfg.worker)})
    await resp.prepare(request)
    if self.gen.kind == "chat":
      for c in self.choices:
        await self._send(resp, self._chunk([api.chat_delta_choice(
            c.index, {"role": "assistant", "content": ""}, None, None)]))
    return resp

  def _chunk(self, choices: list[dict]) -> dict:
    g = self.gen
    return api.chunk(g.kind, self.rid, self.created, g.model, choices, g.include_usage)

  async def _send(self, resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

  async def _send_piece(self, resp, c: _Choice, piece, lp) -> None:
    chat = self.gen.kind == "chat"
    # A chunk for every batch of new tokens, also when its text is empty (a control token, an
    # incomplete character, text a stop string may still claim), as vLLM streams: the client
    # sees the tokens arrive, so its TTFT and inter-token times are the engine's, not those of
    # the first visible character (docs/PERFORMANCE.md, "Serving suite").
    if piece.tokens or piece.text or lp is not None:
      if chat:
        ch = api.chat_delta_choice(c.index, {"content": piece.text}, lp, None)
      else:
        ch = api.completion_choice(c.index, piece.text, lp, None)
      await self._send(resp, self._chunk([ch]))
    if piece.finish_reason is not None:
      if chat:
        ch = api.chat_delta_choice(c.index, {}, None, piece.finish_reason)
      else:
        ch = api.completion_choice(c.index, "", None, piece.finish_reason)
      await self._send(resp, self._chunk([ch]))


def create_app(region: mailbox.Region, tokenizer, config: FrontendConfig,
               metrics: FrontendMetrics | None = None) -> web.Application:
  """The aiohttp application of one frontend worker (its driver starts with the app)."""
  fe = Frontend(region, tokenizer, config, metrics)
  app = fe.app()
  app[FRONTEND_KEY] = fe
  return app


FRONTEND_KEY = web.AppKey("frontend", Frontend)


# ---- the HTTP protocol: connection cap, header timeout, aiohttp's own errors ----------------

def _raw_response(status: int, err: dict, headers: dict[str, str] | None = None) -> bytes:
  """A complete HTTP/1.1 response (JSON body, Connection: close), for the protocol to write
  outside aiohttp's request handling."""
  body = json.dumps(err).encode()
  lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
           f"Content-Length: {len(body)}", "Connection: close",
           *(f"{k}: {v}" for k, v in (headers or {}).items()), "", ""]
  return "\r\n".join(lines).encode("latin-1") + body


_OVER_CAP = _raw_response(503, api.error_body(
    "The server has too many open connections. Retry later.", "service_unavailable",
    code="too_many_connections"), {"Retry-After": "1"})
_HEADER_TIMEOUT = _raw_response(408, api.error_body(
    "The request headers did not arrive in time.", code="request_timeout"))
_REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its 503 at the latest


def _connection_limits(wanted: int) -> tuple[int, int]:
  """(the connection cap, the listen backlog): `wanted` connections and aiohttp's backlog of
  128, or fewer when the file descriptor limit would not leave room for them."""
  try:
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  except (ImportError, OSError, ValueError):
    return wanted, 128
  if soft == resource.RLIM_INFINITY or soft <= 0:
    return wanted, MAX_BACKLOG
  # Besides the connections served: asyncio accepts up to the backlog at each wake-up and a
  # refused connection's descriptor is closed on the next one (two backlogs' worth in flight
  # under a flood), up to 64 refused ones linger, and the process has its own (~20: the
  # mailbox, pipes, the parser pool). A burst of connections past the backlog is refused by the
  # kernel: 149 of 2,000 streams opened at once failed to connect with aiohttp's 128.
  backlog = min(MAX_BACKLOG, max(16, soft // 8))
  return max(1, min(wanted, soft - (2 * backlog + 128))), backlog


class _Guard:
  """The connection limits of one server (all its connections' `_Protocol`s share it)."""

  def __init__(self, cfg: FrontendConfig):
    self.max_connections, self.backlog = _connection_limits(cfg.max_connections)
    self.header_timeout_s = cfg.header_timeout_s or None
    self.open = 0        # connections served
    self.lingering = 0   # refused connections not closed yet
    self.max_lingering = max(1, min(64, self.max_connections // 8))
    self.refused = RateLimitedLog(log, logging.WARNING, 5.0)
    self.timed_out = RateLimitedLog(log, logging.INFO, 5.0)


class _Protocol(web_protocol.RequestHandler):
  """aiohttp's HTTP/1 protocol plus what it lacks here:

  - a connection cap: over `max_connections` a connection is answered 503 (OpenAI JSON,
    Connection: close) as soon as it is accepted and closed, without reading a request;
  - a header timeout: the headers of a request must be complete `header_timeout_s` after the
    connection opened, or after the first byte of a later request on it (else 408 and close);
    it is never armed while a request is being handled, so a stream is never cut;
  - aiohttp's own errors in OpenAI's schema: the 400 of its parser (malformed request line or
    header, bad chunked encoding, a line too long, ...) and any HTTP error or exception that
    escapes the application, as JSON, with one log line and no traceback for a client's.
  """

  def __init__(self, manager, *, guard: _Guard, **kwargs):
    super().__init__(manager, **kwargs)
    self._guard = guard
    self._hloop: asyncio.AbstractEventLoop = kwargs["loop"]
    self._state = "new"  # -> "open" (served) or "refused" -> "closed"
    self._header_timer: asyncio.TimerHandle | None = None
    self._partial = False  # bytes of a request whose headers are not complete yet
    self._refused_close: asyncio.TimerHandle | None = None
    self._lingers = False

  # -- connection cap --
  def connection_made(self, transport) -> None:
    g = self._guard
    if g.open >= g.max_connections:
      self._state = "refused"
      g.refused("%d connections open, the most this worker takes: refusing new ones (503)",
                g.open)
      try:
        transport.write(_OVER_CAP)
        if g.lingering < g.max_lingering and transport.can_write_eof():
          # Half-close and drop what the client sends, so that it reads the 503 rather than
          # a reset; closed when it closes, or after _REFUSED_LINGER_S.
          transport.write_eof()
          g.lingering += 1
          self._lingers = True
          self._refused_close = self._hloop.call_later(_REFUSED_LINGER_S, transport.close)
        else:
          transport.close()
      except Exception:  # the peer is gone already
        transport.abort()
      return
    g.open += 1
    self._state = "open"
    super().connection_made(transport)
    self._arm_header_timer()

  def connection_lost(self, exc: BaseException | None) -> None:
    state, self._state = self._state, "closed"
    if state == "refused":
      if self._refused_close is not None:
        self._refused_close.cancel()
      if self._lingers:
        self._guard.lingering -= 1
      return
    if state != "open":
      return
    self._guard.open -= 1
    self._cancel_header_timer()
    super().connection_lost(exc)

  def eof_received(self):
    if self._state == "refused":
      return None  # the client is done: close
    return super().eof_received()

  # -- header timeout --
  def data_received(self, data: bytes) -> None:
    if self._state != "open":
      return  # refused: dropped
    if data and self._header_timer is None and self._waiting():
      self._arm_header_timer()
    if data and self._header_timer is not None:
      self._partial = True
    super().data_received(data)
    if self._messages:  # headers complete (or rejected)
      self._cancel_header_timer()
      self._fail_body_on_parse_error()

  def _fail_body_on_parse_error(self) -> None:
    """The parser failed in the middle of a body being read (a broken chunk): the handler's
    read fails now (400) instead of waiting for a body that cannot come."""
    msg = self._messages[-1][0]
    req = getattr(self, "_current_request", None)
    err_info = getattr(web_protocol, "_ErrInfo", None)
    if req is None or err_info is None or not isinstance(msg, err_info):
      return
    content = req.content
    if not content.is_eof() and content.exception() is None:
      content.set_exception(web_protocol.RequestPayloadError(msg.message))

  def _waiting(self) -> bool:
    """True while the connection waits for a request: none is handled or queued."""
    w = self._waiter
    return w is not None and not w.done() and not self._messages

  def _arm_header_timer(self) -> None:
    t = self._guard.header_timeout_s
    if t and self._header_timer is None:
      self._partial = False
      self._header_timer = self._hloop.call_later(t, self._header_timeout)

  def _cancel_header_timer(self) -> None:
    if self._header_timer is not None:
      self._header_timer.cancel()
      self._header_timer = None
    self._partial = False

  def _header_timeout(self) -> None:
    self._header_timer = None
    if self._state != "open" or self.transport is None or not self._waiting():
      return  # a request is being handled: the keep-alive logic takes over after it
    self._guard.timed_out("closing a connection: no complete request headers within %g s",
                          self._guard.header_timeout_s)
    if self._partial:
      self.transport.write(_HEADER_TIMEOUT)
    self.force_close()

  def log_exception(self, *args, **kwargs) -> None:
    exc = kwargs.get("exc_info")
    if isinstance(exc, (web_protocol.RequestPayloadError, HttpProcessingError, ConnectionError)):
      # A client's broken body met while aiohttp drained it after the response (the request
      # was answered and logged already): the connection is closed, without a traceback.
      log.debug("closing a connection: %s", _printable(exc))
      return
    super().log_exception(*args, **kwargs)

  # -- errors in OpenAI's schema --
  def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                   message: str | None = None) -> web.StreamResponse:
    if status >= 500:  # an exception escaped the application: a bug, with its traceback
      log.error("error handling %s %s", _printable(request.method), _printable(request.path),
                exc_info=exc)
      err = api.ApiError(status, "internal server error" if status == 500 else
                         HTTPStatus(status).phrase, code="internal_error")
    else:  # aiohttp's parser rejected the request: the client's, one line
      text = message or getattr(exc, "message", None) or str(exc or "") or \
          HTTPStatus(status).phrase
      log.info("malformed request: %d %s", status, _printable(text))
      err = api.ApiError(status, f"malformed HTTP request: {api._clip(str(text))}",
                         code="invalid_http_request")
    if request.writer.output_size > 0:
      raise ConnectionError("Response is sent already, cannot send another response "
                            "with the error message")
    resp = _error_response(err)
    resp.force_close()
    return resp

  async def finish_response(self, request, resp, start_time):
    if isinstance(resp, web.HTTPException) and resp.status >= 400:
      # An HTTP error aiohttp raised outside the middleware (an unknown Expect header, ...).
      msg, code = _HTTP_ERRORS.get(resp.status, (resp.text or resp.reason, None))
      log.info("%s %s: %d %s", _printable(request.method), _printable(request.path),
               resp.status, _printable(msg))
      json_resp = _error_response(api.ApiError(resp.status, msg, code=code))
      if not resp.keep_alive:
        json_resp.force_close()
      resp = json_resp
    return await super().finish_response(request, resp, start_time)


class _GuardedServer(web.Server):
  """aiohttp's low-level server, making `_Protocol`s."""
  _blink_guard: _Guard

  def __call__(self) -> web_protocol.RequestHandler:
    return _Protocol(self, loop=self._loop, guard=self._blink_guard, **self._kwargs)


def _install_protocol(server: web.Server, guard: _Guard) -> bool:
  """Makes `server` (an AppRunner's) create `_Protocol`s; False (and aiohttp's own protocol)
  where this aiohttp lacks what `_Protocol` relies on."""
  needs = ("_messages", "_waiter", "handle_error", "finish_response")
  if (type(server) is not web.Server or not hasattr(server, "_kwargs")
      or not hasattr(server, "_loop")
      or not all(hasattr(web_protocol.RequestHandler, n) for n in needs)):
    log.warning("this aiohttp (%s) is not the one the frontend's HTTP protocol was written "
                "for: no connection cap, header timeout or JSON parser errors",
                getattr(web, "__version__", "?"))
    return False
  server.__class__ = _GuardedServer
  server._blink_guard = guard
  return True


async def start_site(app: web.Application, host: str, port: int, *, reuse_port: bool = False,
                     shutdown_timeout: float = 5.0) -> tuple[web.AppRunner, web.TCPSite, int]:
  """Runs `app` on host:port (handler cancellation on, so a client that goes away cancels its
  request; the connection limits and timeouts of its FrontendConfig, see `_Protocol`);
  returns the runner, the site and the bound port."""
  fe = app.get(FRONTEND_KEY)
  kwargs = {}
  guard = _Guard(fe.cfg) if fe is not None else None
  if fe is not None:
    kwargs["keepalive_timeout"] = fe.cfg.keepalive_timeout_s or 0
  runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **kwargs)
  await runner.setup()
  if guard is not None:
    _install_protocol(runner.server, guard)
  site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None,
                     backlog=guard.backlog if guard is not None else MAX_BACKLOG,
                     shutdown_timeout=shutdown_timeout)
  await site.start()
  bound = port
  server = getattr(site, "_server", None)
  if server is not None and server.sockets:
    bound = server.sockets[0].getsockname()[1]
  return runner, site, bound
