"""The engine API: `Engine.from_checkpoint(...)`, `engine.generate(...)`, `engine.stats()`.

The engine owns the mailbox, the executor thread (which runs the serving loop until shutdown)
and a poller thread that reads output rings. `generate` submits through the same mailbox
protocol as the HTTP frontend, so the device cannot tell the two apart.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from typing import Any, Iterator, Sequence

import numpy as np

from blink_jax import config
from blink_jax import mailbox as M
from blink_jax import protocol as P
from blink_jax.xla_flags import configure_command_buffers
from nic_frontend.streaming import StopMatcher

log = logging.getLogger("blink_jax.engine")

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
  # A device loop still running when the interpreter exits would abort the process.
  for eng in list(_LIVE_ENGINES):
    eng.shutdown(timeout=5.0)


class EngineStoppedError(RuntimeError):
  """The engine was shut down."""


@dataclasses.dataclass
class SamplingParams:
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] = ()
  logprobs: int | None = None  # top-n alternatives per token (0: only the sampled token's)
  prompt_logprobs: int | None = None  # the same for every prompt token after the first
  ignore_eos: bool = False

  def stop_strings(self) -> list[str]:
    if self.stop is None:
      return []
    return [self.stop] if isinstance(self.stop, str) else list(self.stop)

  def validate(self, vocab_size: int, max_top_logprobs: int) -> None:
    """Raises ValueError naming the first bad value."""
    import math
    if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
    if not math.isfinite(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
    if not (0 < self.top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
    if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
      raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
    if len(self.stop_token_ids) > P.MAX_STOP_IDS:
      raise ValueError(f"at most {P.MAX_STOP_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
    for t in self.stop_token_ids:
      if not isinstance(t, int) or not 0 <= t < vocab_size:
        raise ValueError(f"stop_token_ids: {t!r} is not a token id of this model")
    if any(not isinstance(s, str) or not s for s in self.stop_strings()):
      raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
    for name in ("logprobs", "prompt_logprobs"):
      v = getattr(self, name)
      if v is not None and not (isinstance(v, int) and 0 <= v <= max_top_logprobs):
        raise ValueError(f"{name} must be an integer in [0, {max_top_logprobs}], got {v!r}")


@dataclasses.dataclass
class RequestOutput:
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  finish_reason: str  # "stop" | "length" | "cancelled" | "error: ..."
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
  ttft_s: float = 0.0
  e2e_s: float = 0.0
  preemptions: int = 0


@dataclasses.dataclass
class StreamDelta:
  text: str
  token_ids: list[int]
  finish_reason: str | None = None


class _Tracked:
  """A request in flight: its slot, its outputs so far, and who waits for them."""

  def __init__(self, slot: int, prompt: list[int], params: SamplingParams, tokenizer):
    self.slot, self.prompt, self.params = slot, prompt, params
    self.tokens: list[int] = []
    self.lps: list[float] = []
    self.top: list = []
    # Prompt-logprob entries come first in the output (prompt tokens 1..).
    self.prompt_entries_left = len(prompt) - 1 if params.prompt_logprobs is not None else 0
    self.prompt_lps: list = [None]
    self.prompt_top: list = [None]
    self.events: queue.Queue = queue.Queue()
    self.t_submit = time.perf_counter()
    self.t_first = 0.0
    self.t_done = 0.0
    # Stop strings are matched on text with the frontend's matcher: it holds back any tail
    # that could still become a stop string, so streamed deltas never leak one.
    self.stop = StopMatcher(params.stop_strings())
    self.detok = tokenizer.detokenizer() if tokenizer is not None else None
    self.text = ""
    self.stopped_by_string = False
    self.cancel_sent = False
    self.preemptions = 0


def _finish_name(reason: P.Finish, error: P.Error) -> str:
  if reason == P.Finish.ERROR:
    return f"error: {P.ERROR_MESSAGES.get(error, error.name)}"
  return {P.Finish.STOP: "stop", P.Finish.LENGTH: "length",
          P.Finish.CANCELLED: "cancelled"}[reason]


def _host_mapped_buffer(nbytes: int) -> np.ndarray:
  """Page-aligned anonymous memory the GPU can map (cudaHostRegister needs whole pages)."""
  size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
  return np.frombuffer(mmap.mmap(-1, size), np.uint8)


class Engine:
  """Serves one model from one device; thread-safe `generate` for many callers."""

  def __init__(self, model, tokenizer=None, *, max_seqs: int = 8, kv_pages: int | None = None,
               page_size: int = 16, max_context: int | None = None, num_slots: int = 64,
               ring_capacity: int = 64, max_top_logprobs: int = 8,
               buckets: Sequence[int] | None = None, mode: str = "persistent",
               idle_poll_us: int = 200, region: Any = None, model_name: str = "model",
               tokenizer_path: str | None = None, eos_ids: Sequence[int] | None = None,
               device: Any = None, frontend_workers: int = 0, fused_step: bool = False,
               warm_up: bool | None = None, attention: str = "auto", norm: str = "auto"):
    import jax

    from blink_jax import executor as X
    from blink_jax import ffi as F
    from blink_jax import cuda_gemv, kernels

    if mode not in ("persistent", "host"):
      raise ValueError(f"mode must be 'persistent' or 'host', got {mode!r}")
    # Names checked before the mailbox is allocated and registered.
    config.resolve_kernel(attention, "", "attention")
    config.resolve_kernel(norm, "", "norm")
    cfg = model.cfg
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
      raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces but the model only "
                       f"{cfg.vocab_size} embeddings")
    self.model_cfg, self.tokenizer, self.mode = cfg, tokenizer, mode
    self.model_name, self.tokenizer_path = model_name, tokenizer_path
    self.max_context = max_context or min(cfg.max_context, 4096)
    if buckets is None:
      budget = max(256, max_seqs)
      buckets = tuple(sorted({min(b, budget) for b in (1, 8, 64, budget) if b >= 1}
                             | {budget}))
      buckets = tuple(b for b in buckets if b >= 1)
    max_pages = -(-self.max_context // page_size)
    kv_pages = kv_pages or max_pages * max_seqs
    self.max_top_logprobs = max_top_logprobs
    self.geo = P.Geometry(num_slots, self.max_context - 1, ring_capacity, max_top_logprobs)
    self.eos_ids = tuple(eos_ids if eos_ids is not None else
                         (tokenizer.eos_ids if tokenizer is not None else ()))[:4]
    self.device = device or jax.devices()[0]
    on_gpu = self.device.platform == "gpu"

    # The mailbox: host memory the device reads in place.
    self.region = region or M.LocalRegion(_host_mapped_buffer(self.geo.total_bytes))
    # Frontend workers 0..N-1 own the first slot ranges; this engine's own client (generate())
    # is worker N, so the two never write the same slot or doorbell.
    self.mailbox_workers = frontend_workers + 1
    M.init_header(self.region, self.geo, vocab_size=cfg.vocab_size,
                  max_context=self.max_context, num_workers=self.mailbox_workers,
                  eos_id=self.eos_ids[0] if self.eos_ids else 0)
    self._registered = None
    mailbox_addr = self.region.address
    if on_gpu:
      cuda = F.cuda_library()
      if cuda is None:
        raise RuntimeError("running on a GPU but the CUDA handlers were not built "
                           "(reinstall with nvcc on PATH)")
      import ctypes
      dev = ctypes.c_uint64()
      rc = cuda.blink_cuda_register_host(self.region.address, self.geo.total_bytes,
                                         ctypes.byref(dev))
      if rc:
        raise RuntimeError(f"cudaHostRegister failed: {cuda.blink_cuda_error_string(rc)}")
      self._registered = self.region.address
      mailbox_addr = dev.value
    # From here on a failed start (e.g. a kernel that does not compile) unregisters the
    # mailbox: nothing leaks.
    try:
      self.sched = F.SchedConfig.build(
          mailbox=mailbox_addr, num_slots=num_slots, max_prompt=self.geo.max_prompt,
          ring_capacity=ring_capacity, max_top_logprobs=max_top_logprobs,
          vocab_size=cfg.vocab_size, max_seqs=max_seqs, max_context=self.max_context,
          page_size=page_size, num_pages=kv_pages, buckets=tuple(buckets),
          eos_ids=self.eos_ids, idle_poll_us=idle_poll_us)
      self.executor = X.Executor(model, self.sched, max_top_logprobs=max_top_logprobs,
                                 device=self.device, fused_step=fused_step, attention=attention,
                                 norm=norm)
      log.info("engine: model %s (%s, %d layers), dtype %s, device %s, mode %s (%s), "
               "max_seqs %d, kv pages %d x %d, buckets %s, attention %s, norm %s, CUDA GEMV for "
               "%s, experimental kernels %s",
               model_name, cfg.name, cfg.num_layers, model.dtype, self.device, mode,
               "one scheduler kernel per step" if fused_step else "schedule + commit kernels",
               max_seqs,
               kv_pages, page_size, list(buckets), self.executor.attention, self.executor.norm,
               sorted(cuda_gemv.active(interpret=not on_gpu)) or "none",
               kernels.experimental_kernels() or "off")
      carry = self.executor.initial_carry()
      self.compiled = self.executor.compile(carry, mode)
      self.client = M.MailboxClient(self.region, frontend_workers, self.mailbox_workers)
      # Before READY (no frontend submits yet): XLA's first execution of the loop runs op by op;
      # on a GPU it serves a warm-up workload that takes every bucket branch (see warm_up).
      workload = self._warm_up_workload if (on_gpu if warm_up is None else warm_up) else None
      if workload or mode == "persistent":
        log.info("warm-up: %s in XLA's op-by-op first execution",
                 f"every bucket branch {list(self.sched.buckets)} once" if workload else
                 "one empty step")
        t0 = time.perf_counter()
        carry = self.executor.warm_up(carry, self.compiled, mode, self._write_shutdown, workload)
        log.info("warm-up done in %.1f s", time.perf_counter() - t0)
      self._lock = threading.Lock()
      self._slot_free = threading.Condition(self._lock)
      self._active: dict[int, _Tracked] = {}
      self._stopping = False
      self._error: BaseException | None = None
      self._final_carry = None
      self._loop_thread = threading.Thread(target=self._run_loop, args=(carry,),
                                           name="blink-loop", daemon=True)
      self._poll_thread = threading.Thread(target=self._poll, name="blink-poll", daemon=True)
      self._set_engine_state(P.EngineState.READY)
      _LIVE_ENGINES.add(self)
      if on_gpu and mode == "persistent":
        self._start_loop_checked()
      else:
        self._loop_thread.start()
      self._poll_thread.start()
      self.loop_report = self.executor.loop_report
      log.info("serving loop on the device: %s", self.loop_report)
      if on_gpu and mode == "persistent" and not self.loop_report.get("device_while"):
        log.warning("the serving loop is NOT a device-side WHILE node, the host CPU drives every "
                    "iteration (latency will suffer under CPU load): %s", self.loop_report)
    except BaseException:
      self._unregister()
      raise

  # ---- construction from a checkpoint ----
  @classmethod
  def from_checkpoint(cls, name_or_path: str, *, dtype: str = "bfloat16",
                      tokenizer_path: str | None = None, **kw) -> "Engine":
    """A checkpoint by catalog name or path, or `random:<config>` (random weights in a known
    shape, for benchmarks; the tokenizer comes from `tokenizer_path` if given)."""
    configure_command_buffers()
    import jax.numpy as jnp

    from blink_jax.checkpoint import load_checkpoint, load_tokenizer, resolve_checkpoint
    from blink_jax.model import Gemma

    dtypes = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
    if dtype not in dtypes:
      raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if str(name_or_path).startswith("random:"):
      from flax import nnx

      from blink_jax.config import get_config
      from blink_jax.tokenizer import Tokenizer
      cfg = get_config(str(name_or_path).split(":", 1)[1])
      log.info("random weights in the %s shape", cfg.name)
      model = Gemma(cfg, dtype=dtypes[dtype], rngs=nnx.Rngs(0))
      tok = Tokenizer(tokenizer_path) if tokenizer_path else None
      return cls(model, tok, model_name=str(name_or_path), tokenizer_path=tokenizer_path, **kw)
    path = resolve_checkpoint(name_or_path)
    cfg, params = load_checkpoint(path, dtype=dtypes[dtype])
    model = Gemma.from_params(cfg, params, dtype=dtypes[dtype])
    tok = load_tokenizer(path)
    return cls(model, tok, model_name=str(name_or_path),
               tokenizer_path=tokenizer_path or str(path / "tokenizer.model"), **kw)

  # ---- lifecycle ----
  def _write_header_word(self, field: str, value: int) -> None:
    off = P.HEADER_DTYPE.fields[field][1]
    self.region.write(off, int(value).to_bytes(4, "little"))

  def _set_engine_state(self, s: P.EngineState) -> None:
    self._write_header_word("engine_state", s)

  def _warm_up_workload(self, loop_alive) -> None:
    """Requests that make the loop take every bucket branch once: `b` one-token prompts
    decoding together for each bucket b <= max_seqs, one b-token prompt (a prefill step of b
    rows) for each larger bucket. Runs during the warm-up execution, in the engine's slots."""
    s, client = self.sched, self.client
    rng = np.random.default_rng(0)
    vocab = self.model_cfg.vocab_size
    longest = min(self.geo.max_prompt, self.max_context - 2, (s.num_pages - 1) * s.page_size - 2)
    for b in s.buckets:
      if b <= min(s.max_seqs, len(client.slots)):
        waves = [M.Request(prompt=[int(rng.integers(3, vocab))], max_tokens=4, ignore_eos=True)
                 for _ in range(b)]
      elif b <= longest:
        waves = [M.Request(prompt=[int(t) for t in rng.integers(3, vocab, b)], max_tokens=1,
                           ignore_eos=True)]
      else:
        log.warning("warm-up cannot reach bucket %d (longest prompt %d)", b, longest)
        continue
      slots = [client.submit(r) for r in waves]
      deadline = time.monotonic() + 600
      while not all(client.poll(sl).finished for sl in slots):
        if not loop_alive():
          raise RuntimeError("the serving loop stopped during its warm-up")
        if time.monotonic() > deadline:
          raise TimeoutError(f"warm-up requests for bucket {b} did not finish in 600 s")
        time.sleep(0.002)
      for sl in slots:
        client.release(sl)

  def _start_loop_checked(self, timeout: float = 2.0) -> None:
    """Starts the serving run and records whether XLA launched it as a CUDA graph: XLA logs
    its op-by-op execution when the run starts (it then drives every iteration from the
    host); that happens if a new XLA executable was created after the warm-up, since XLA
    then evicts every CUDA graph of the process."""
    from blink_jax import executor as X
    with X.capture_stderr() as log_text:
      start = int(M.read_header(self.region)["loop_iterations"])
      self._loop_thread.start()
      deadline = time.monotonic() + timeout
      while (int(M.read_header(self.region)["loop_iterations"]) < start + 2
             and time.monotonic() < deadline and self._loop_thread.is_alive()):
        time.sleep(0.005)
    op_by_op = X.XLA_OP_BY_OP_LINE in log_text()
    self.executor.loop_report = dict(
        self.executor.loop_report,
        serving_run="op by op, driven by the host (XLA re-ran its warm-up execution)"
        if op_by_op else "CUDA graph")
    if op_by_op:
      log.warning("XLA runs the serving loop op by op, driven by the host: a JAX program was "
                  "compiled after the warm-up (XLA then evicts its CUDA graphs). Compile other "
                  "programs before creating the Engine.")

  def _write_shutdown(self, on: bool) -> None:
    self._write_header_word("shutdown", on)

  def _run_loop(self, carry) -> None:
    try:
      if self.mode == "persistent":
        self._final_carry = self.executor.run_persistent(carry, self.compiled)
      else:
        self._final_carry = self.executor.run_host(carry, self.compiled)
    except BaseException as e:  # surfaced to callers
      log.exception("serving loop failed")
      self._error = e
    finally:
      self._set_engine_state(P.EngineState.STOPPED)

  def shutdown(self, timeout: float = 60.0) -> None:
    """Cancels what is in flight, stops the loop and joins the threads."""
    with self._lock:
      if self._stopping:
        return
      self._stopping = True
      for t in self._active.values():
        self.client.cancel(t.slot)
    deadline = time.monotonic() + timeout
    while self._active and time.monotonic() < deadline and self._loop_thread.is_alive():
      time.sleep(0.005)
    self._write_shutdown(True)
    self._loop_thread.join(max(0.0, deadline - time.monotonic()))
    self._poll_thread.join(1.0)
    self._unregister()
    self._final_carry = None
    with self._lock:
      for t in self._active.values():
        t.events.put(None)
      self._slot_free.notify_all()

  def _unregister(self) -> None:
    if self._registered is not None:
      from blink_jax import ffi as F
      F.cuda_library().blink_cuda_unregister_host(self._registered)
      self._registered = None

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  @property
  def running(self) -> bool:
    return self._loop_thread.is_alive() and not self._stopping

  # ---- requests ----
  def _encode(self, prompt) -> list[int]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("this engine has no tokenizer: pass prompt_token_ids")
      return self.tokenizer.encode(prompt, add_bos=True)
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < self.model_cfg.vocab_size]
    if bad:
      raise ValueError(f"token ids outside the vocabulary [0, {self.model_cfg.vocab_size}): "
                       f"{bad[:5]}")
    return ids

  def _submit(self, ids: list[int], params: SamplingParams) -> _Tracked:
    if not ids:
      raise ValueError("empty prompt")
    if len(ids) >= self.max_context:
      raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of "
                       f"{self.max_context} tokens (at least one token must be generated)")
    params.validate(self.model_cfg.vocab_size, self.max_top_logprobs)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    req = M.Request(prompt=ids, max_tokens=params.max_tokens, temperature=params.temperature,
                    top_p=params.top_p, top_k=params.top_k, seed=seed,
                    stop_ids=tuple(params.stop_token_ids),
                    num_logprobs=max(params.logprobs or 0, params.prompt_logprobs or 0),
                    logprobs=params.logprobs is not None,
                    prompt_logprobs=params.prompt_logprobs is not None,
                    ignore_eos=params.ignore_eos)
    with self._lock:
      while True:
        if self._stopping or not self._loop_thread.is_alive():
          raise EngineStoppedError("the engine is stopped") from self._error
        if self.client.free_slots:
          break
        self._slot_free.wait(0.1)
      slot = self.client.submit(req)
      t = _Tracked(slot, ids, params, self.tokenizer)
      self._active[slot] = t
      return t

  def _poll(self) -> None:
    """Reads output rings of the requests in flight and hands new tokens to their callers."""
    idle = 0
    while True:
      with self._lock:
        items = list(self._active.items())
      if not items and (self._stopping or not self._loop_thread.is_alive()):
        return
      progressed = False
      for slot, t in items:
        out = self.client.poll(slot)
        if out.tokens or out.finished:
          progressed = True
          try:
            self._deliver(t, out)
          except Exception as e:  # one bad request must not stop the others
            log.exception("delivering output of slot %d failed", slot)
            t.events.put(StreamDelta("", [], f"error: {e}"))
            if not out.finished:
              self.client.cancel(slot)
              continue
        if out.finished:
          with self._lock:
            del self._active[slot]
            self.client.release(slot)
            self._slot_free.notify()
      if not self._loop_thread.is_alive():
        with self._lock:  # the loop died: nobody will finish these
          for slot, t in list(self._active.items()):
            t.events.put(None)
            del self._active[slot]
        return
      idle = 0 if progressed else idle + 1
      time.sleep(0 if progressed else min(1e-3, 2e-5 * idle))

  def _deliver(self, t: _Tracked, out: M.Output) -> None:
    now = time.perf_counter()
    if t.prompt_entries_left:
      n = min(t.prompt_entries_left, len(out.tokens))
      k = t.params.prompt_logprobs
      t.prompt_lps += out.logprobs[:n]
      t.prompt_top += [top[:k] for top in out.top[:n]] if out.top else [[] for _ in range(n)]
      t.prompt_entries_left -= n
      out = dataclasses.replace(out, tokens=out.tokens[n:], logprobs=out.logprobs[n:],
                                top=out.top[n:])
    if out.tokens and not t.t_first:
      t.t_first = now
    t.preemptions = out.preemptions
    delta_text, delta_ids = "", []
    for i, tok in enumerate(out.tokens):
      if t.stopped_by_string:
        break
      delta_ids.append(tok)
      t.tokens.append(tok)
      if t.params.logprobs is not None:
        t.lps.append(out.logprobs[i])
        t.top.append(out.top[i][:t.params.logprobs] if out.top else [])
      if t.detok is not None:
        safe = t.stop.push(t.detok.push(tok))
        t.text += safe
        delta_text += safe
        if t.stop.matched is not None:
          t.stopped_by_string = True
          if not t.cancel_sent:
            self.client.cancel(t.slot)
            t.cancel_sent = True
    if delta_ids or delta_text:
      t.events.put(StreamDelta(delta_text, delta_ids))
    if out.finished:
      t.t_done = now
      reason = "stop" if t.stopped_by_string else _finish_name(out.finish_reason, out.error)
      if t.detok is not None and not t.stopped_by_string:
        tail = t.stop.push(t.detok.flush())
        tail += t.stop.flush() if t.stop.matched is None else ""
        if t.stop.matched is not None:
          reason = "stop"
        t.text += tail
        if tail:
          t.events.put(StreamDelta(tail, []))
      t.events.put(StreamDelta("", [], reason))

  def _collect(self, t: _Tracked) -> RequestOutput:
    reason = None
    while reason is None:
      ev = t.events.get()
      if ev is None:
        raise EngineStoppedError("the engine stopped before the request finished") from self._error
      reason = ev.finish_reason
    if reason.startswith("error"):
      raise ValueError(f"the device rejected the request: {reason[7:]}")
    return RequestOutput(
        prompt_token_ids=t.prompt, token_ids=list(t.tokens), text=t.text, finish_reason=reason,
        logprobs=list(t.lps) if t.params.logprobs is not None else None,
        top_logprobs=list(t.top) if t.params.logprobs is not None else None,
        prompt_logprobs=t.prompt_lps if t.params.prompt_logprobs is not None else None,
        prompt_top_logprobs=t.prompt_top if t.params.prompt_logprobs is not None else None,
        ttft_s=(t.t_first or t.t_done) - t.t_submit, e2e_s=t.t_done - t.t_submit,
        preemptions=t.preemptions)

  def generate(self, prompts: str | Sequence[str] | None = None,
               sampling: SamplingParams | None = None, *,
               prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
               stream: bool = False):
    """Generates for one or many prompts (text or token ids).

    Returns a list of RequestOutput (a single one for a single prompt), or with stream=True
    (one prompt) an iterator of StreamDelta.
    """
    sampling = sampling or SamplingParams()
    if (prompts is None) == (prompt_token_ids is None):
      raise ValueError("pass exactly one of prompts and prompt_token_ids")
    if prompts is not None:
      single = isinstance(prompts, str)
      items = [prompts] if single else list(prompts)
      if not all(isinstance(p, str) for p in items):
        raise TypeError("prompts must be strings; pass token ids as prompt_token_ids=")
    else:
      single = len(prompt_token_ids) > 0 and isinstance(prompt_token_ids[0], (int, np.integer))
      items = [prompt_token_ids] if single else list(prompt_token_ids)
    encoded = [self._encode(p) for p in items]
    if stream:
      if not single:
        raise ValueError("stream=True takes a single prompt")
      return self._stream(self._submit(encoded[0], dataclasses.replace(sampling)))
    tracked = [self._submit(ids, dataclasses.replace(sampling)) for ids in encoded]
    outs = [self._collect(t) for t in tracked]
    return outs[0] if single else outs

  def _stream(self, t: _Tracked) -> Iterator[StreamDelta]:
    while True:
      ev = t.events.get()
      if ev is None:
        raise EngineStoppedError("the engine stopped before the request finished")
      yield ev
      if ev.finish_reason is not None:
        return

  # ---- observability ----
  def stats(self) -> dict[str, int]:
    """Counters the device publishes in the mailbox header."""
    h = M.read_header(self.region)
    keys = ["loop_iterations", "steps", "tokens_generated", "prompt_tokens",
            "requests_admitted", "requests_finished", "requests_errored", "requests_cancelled",
            "preemptions", "pages_in_use", "pages_total", "running", "waiting"]
    out = {k: int(h[k]) for k in keys}
    out["engine_state"] = P.EngineState(int(h["engine_state"])).name.lower()
    return out
