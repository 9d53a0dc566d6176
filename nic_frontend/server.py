"""The frontend's HTTP server: OpenAI-compatible endpoints over the mailbox (aiohttp).

One frontend worker = one process = one `Frontend`: an aiohttp application and a
`MailboxDriver` (`nic_frontend.driver`), the thread that owns this worker's side of the mailbox
(its slot range and its doorbell). Handlers never touch the region: they hand requests to the
driver and read their slots' output from asyncio queues the driver fills.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web

from blink_jax.client import mailbox
from blink_jax.client import protocol
from blink_jax.client.streaming import ChoiceDecoder, DeviceError

from nic_frontend import openai_api as api
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
    app.on_startup.append(self._on_startup)
    app.on_cleanup.append(self._on_cleanup)
    return app

  async def _on_startup(self, app) -> None:
    self._idle.set()
    self.driver.start(asyncio.get_running_loop())

  async def _on_cleanup(self, app) -> None:
    await asyncio.get_running_loop().run_in_executor(None, self.driver.stop)

  async def drain(self, timeout: float) -> bool:
    """Refuses new requests and waits up to `timeout` for those in flight; True if all ended."""
    self.draining = True
    try:
      await asyncio.wait_for(self._idle.wait(), timeout)
      return True
    except asyncio.TimeoutError:
      return False

  @web.middleware
  async def _middleware(self, request: web.Request, handler):
    endpoint = request.match_info.route.resource.canonical if (
        request.match_info.route.resource is not None) else "other"
    try:
      if request.path.startswith("/v1/") and self.cfg.api_key is not None:
        self._check_key(request)
      resp = await handler(request)
    except api.ApiError as e:
      log.info("%s %s: %d %s", request.method, request.path, e.status,
               e.code or e.type)  # one line per rejected request, no traceback
      resp = _error_response(e)
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
    ok = d.state == protocol.EngineState.READY and d.client is not None and not self.draining
    body = {"status": "ok" if ok else "unavailable",
            "engine_state": STATE_NAMES.get(d.state, "unreachable") if d.state is not None
            else "unreachable",
            "worker": self.cfg.worker, "slots_total": d.slots_total,
            "slots_in_use": d.slots_in_use}
    if body["status"] != "ok":
      body["error"] = api.error_body(self._unavailable_text(), "service_unavailable")["error"]
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

  def _check_ready(self) -> None:
    d = self.driver
    if self.draining or d.state != protocol.EngineState.READY or d.client is None:
      code = ("shutting_down" if self.draining else
              "engine_starting" if d.state == protocol.EngineState.STARTING else
              "engine_stopped" if d.state == protocol.EngineState.STOPPED else "engine_unreachable")
      raise api.ApiError(503, self._unavailable_text(), type="service_unavailable", code=code,
                         headers={"Retry-After": "5"})

  def _limits(self) -> api.Limits:
    h = self.header
    return api.Limits(model_names=self.cfg.names, vocab_size=int(h["vocab_size"]),
                      max_context=int(h["max_context"]), max_prompt=int(h["max_prompt"]),
                      max_top_logprobs=int(h["max_top_logprobs"]))

  async def _read_json(self, request: web.Request) -> Any:
    limit = self.cfg.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
      raise api.ApiError(413, f"request body too large: {request.content_length} bytes, the "
                              f"limit is {limit} bytes", code="request_too_large")
    try:
      raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
      raise api.ApiError(413, f"request body too large: the limit is {limit} bytes",
                         code="request_too_large") from None
    try:
      body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
      raise api.ApiError(400, f"the request body is not valid JSON: {e}",
                         code="invalid_json") from None
    except RecursionError:
      raise api.ApiError(400, "the request body is nested too deeply",
                         code="invalid_json") from None
    api.check_json_values(body)
    return body

  # ---- generation ----
  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "completion")

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, "chat")

  async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
    arrival = time.perf_counter()
    self._check_ready()
    body = await self._read_json(request)
    parse = api.parse_completion if kind == "completion" else api.parse_chat
    gen = parse(body, self._limits(), self.tokenizer)
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
      for i in range(len(gen.prompts)):
        req = gen.slot_request(i, self.driver.new_request_id())
        flights.append(await self.driver.submit(req))
    except BaseException as e:
      for f in flights:
        self.driver.abandon(f, "error")
      if isinstance(e, mailbox.SlotsFullError):
        raise api.ApiError(429, f"The server is busy: all {self.driver.slots_total} request "
                                f"slots of this worker are in use. Retry later.",
                           type="rate_limit_error", code="rate_limit_exceeded",
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
    return api.usage(sum(len(p) for p in self.gen.prompts), completion)

  async def _step(self, c: _Choice):
    """The next piece of choice `c` (waits for the device)."""
    out = await c.flight.next()
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
    return api.ApiError(503, str(e), type="service_unavailable", code="engine_unavailable")

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
    if piece.text or lp is not None:
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


async def start_site(app: web.Application, host: str, port: int, *, reuse_port: bool = False,
                     shutdown_timeout: float = 5.0) -> tuple[web.AppRunner, web.TCPSite, int]:
  """Runs `app` on host:port (handler cancellation on, so a client that goes away cancels its
  request); returns the runner, the site and the bound port."""
  runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
  await runner.setup()
  site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None,
                     shutdown_timeout=shutdown_timeout)
  await site.start()
  bound = port
  server = getattr(site, "_server", None)
  if server is not None and server.sockets:
    bound = server.sockets[0].getsockname()[1]
  return runner, site, bound
