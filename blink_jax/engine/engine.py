"""The engine API: `Engine.from_checkpoint(...)`, `engine.generate(...)`, `engine.stats()`.

The engine owns the mailbox, the executor thread (which runs the serving loop until shutdown)
and a poller thread that reads output rings. `generate` submits through the same mailbox
protocol as the HTTP frontend, so the device cannot tell the two apart.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Iterator, Sequence

import numpy as np

from blink_jax.client import mailbox, mapping, protocol, shm
from blink_jax.client.streaming import ChoiceDecoder, DeviceError
from blink_jax.engine_config import (DeviceMemory, EngineConfig, full_context_pages,
                                     kv_pages_for_memory)
from blink_jax.executor import compilation_cache
from blink_jax.executor.xla_flags import (configure_command_buffers, configure_memory_pool,
                                          pool_fraction)

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
    if len(self.stop_token_ids) > protocol.MAX_STOP_IDS:
      raise ValueError(f"at most {protocol.MAX_STOP_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
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
  cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclasses.dataclass
class StreamDelta:
  text: str
  token_ids: list[int]
  finish_reason: str | None = None


class _Tracked:
  """A request in flight: its slot, its outputs so far, and who waits for them."""

  def __init__(self, slot: int, prompt: list[int], params: SamplingParams, tokenizer):
    self.slot, self.prompt, self.params = slot, prompt, params
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
    # Text, stop strings and their hold-back exactly as the HTTP frontend streams them.
    self.decoder = ChoiceDecoder(tokenizer, params.stop_strings())
    self.reason: str | None = None  # set once, when the caller has been told
    self.cancel_sent = False
    self.preemptions = 0
    self.cached_tokens = 0


def _finish_name(reason: protocol.Finish, error: protocol.Error) -> str:
  if reason == protocol.Finish.ERROR:
    return f"error: {protocol.ERROR_MESSAGES.get(error, error.name)}"
  return {protocol.Finish.STOP: "stop", protocol.Finish.LENGTH: "length",
          protocol.Finish.CANCELLED: "cancelled"}[reason]


class Engine:
  """Serves one model from one device; thread-safe `generate` for many callers.

  config: an `EngineConfig` (default: the defaults); `overrides` replace its fields, and
  KernelOptions' fields by name (`Engine(model, tok, max_seqs=16, attention="pallas")`).
  region: the mailbox's memory (default: anonymous memory; with `shm_name`, POSIX shared
  memory of that name, "" for a random one, that the frontend workers map and this engine
  unlinks at shutdown). donate_model: the engine may delete `model`'s arrays it does not
  hold (its q/k/v and gate/up weights, which it keeps fused; with tensor parallelism the
  unsplit originals), so that their memory goes to the KV cache; `model` cannot run after
  (`from_checkpoint` donates the model it loads).
  """

  def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, *,
               region: Any = None, shm_name: str | None = None, model_name: str = "model",
               tokenizer_path: str | None = None, eos_ids: Sequence[int] | None = None,
               device: Any = None, donate_model: bool = False, **overrides):
    import jax

    cfg = model.cfg
    asked = EngineConfig.from_kwargs(config, **overrides)
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
      raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces but the model only "
                       f"{cfg.vocab_size} embeddings")
    self.device = device or jax.devices()[0]
    c = self.config = asked.resolved(cfg.max_context, self.device.platform,
                                     cfg.sliding_window if cfg.global_every > 1 else None)
    self.model_cfg, self.tokenizer, self.mode = cfg, tokenizer, c.mode
    self.model_name, self.tokenizer_path = model_name, tokenizer_path
    self.dtype = str(np.dtype(model.dtype))
    self.max_context, self.max_top_logprobs = c.max_context, c.max_top_logprobs
    self.eos_ids = tuple(eos_ids if eos_ids is not None else
                         (tokenizer.eos_ids if tokenizer is not None else ()))[:4]
    self._make_mailbox(region, shm_name)
    folder = compilation_cache.enable(c.compilation_cache_dir)
    if folder:
      log.info("compilation cache: %s", folder)
    # From here on a failed start (e.g. a kernel that does not compile) unregisters the
    # mailbox and removes its shared memory: nothing leaks.
    try:
      carry = self._build_executor(model, asked, donate_model)
      self._start(carry)
    except BaseException:
      self._release_memory()
      raise

  def _make_mailbox(self, region, shm_name: str | None) -> None:
    """The mailbox: host memory the device reads in place, with a fresh header."""
    c = self.config
    self.geo = protocol.Geometry(c.num_slots, c.max_context - 1, c.ring_capacity,
                                 c.max_top_logprobs, c.prompt_arena_tokens)
    self.shm_name = None
    # At the same address in every process when it is free: the loop's scheduler calls
    # carry it, and a restart then compiles the same program (`client.mapping`).
    at = mapping.MAILBOX_ADDRESS
    if region is None and shm_name is not None:
      region = shm.create_region(shm_name or None, self.geo.total_bytes, at)
      self.shm_name = region.name
    self._own_shm = self.shm_name is not None
    self.region = region or mailbox.LocalRegion(
        mapping.map_memory(self.geo.total_bytes, address=at))
    # Frontend workers 0..N-1 own the first slot ranges; this engine's own client (generate())
    # is worker N, so the two never write the same slot or doorbell.
    self.mailbox_workers = c.frontend_workers + 1
    mailbox.init_header(self.region, self.geo, vocab_size=self.model_cfg.vocab_size,
                        max_context=c.max_context, num_workers=self.mailbox_workers,
                        eos_id=self.eos_ids[0] if self.eos_ids else 0)
    self._registration = None

  def _build_executor(self, model, asked: EngineConfig, donate_model: bool):
    """Maps the mailbox for the GPU, builds and compiles the executor; returns its carry."""
    from blink_jax.executor.loop import Executor
    from blink_jax.native import ffi, host_memory
    c, cfg = self.config, self.model_cfg
    mailbox_addr = self.region.address
    if self.device.platform == "gpu":
      self._registration = host_memory.Registration(self.region.address, self.geo.total_bytes)
      mailbox_addr = self._registration.device_address
    # Without kv_pages (a GPU) the most pages sequences can use, until the memory is read.
    pages = c.kv_pages or full_context_pages(c.max_context, c.page_size, c.max_seqs)
    self.sched = ffi.SchedConfig.build(
        mailbox=mailbox_addr, num_slots=c.num_slots, max_prompt=self.geo.max_prompt,
        ring_capacity=c.ring_capacity, max_top_logprobs=c.max_top_logprobs,
        vocab_size=cfg.vocab_size, max_seqs=c.max_seqs, max_context=c.max_context,
        page_size=c.page_size, num_pages=pages, buckets=c.buckets,
        eos_ids=self.eos_ids, idle_poll_us=c.idle_poll_us, arena_tokens=self.geo.arena_tokens,
        min_step_interval_us=c.min_step_interval_us,
        step_interval_permille=round(c.step_interval_factor * 1000),
        prefix_caching=int(c.prefix_caching),
        window=cfg.sliding_window if c.windowed_pages else 0,
        window_pages=c.window_pages(cfg.sliding_window) if c.windowed_pages else 0)
    self.executor = Executor(model, self.sched, max_top_logprobs=c.max_top_logprobs,
                             device=self.device, tensor_parallel=c.tensor_parallel,
                             kernels=asked.kernels,  # "auto" kept: it may fall back
                             donate_model=donate_model)
    memory = None
    if c.kv_pages is not None and c.kv_pages > self.executor.max_pages:
      raise ValueError(f"kv_pages {c.kv_pages} exceeds {self.executor.max_pages}, the most "
                       f"pages a layer's KV cache may have (the kernels' 32-bit offsets): "
                       f"lower it or raise page_size")
    if c.kv_pages is None:
      memory = self._size_kv_cache()
      c = self.config
    devices = ", ".join(map(str, self.executor.devices)) + (
        " (tensor parallel)" if c.tensor_parallel > 1 else "")
    log.info("engine: model %s (%s, %d layers), dtype %s, device %s", self.model_name,
             cfg.name, cfg.num_layers, self.dtype, devices)
    log.info("engine config: %s", c.describe(memory))
    carry = self.executor.initial_carry()
    self.compiled = self.executor.compile(carry, c.mode)
    if memory is not None:
      self._check_workspace(memory)
    if self.executor.kernels != c.kernels:  # a Pallas kernel did not compile here
      self.config = dataclasses.replace(c, kernels=self.executor.kernels)
    self.client = mailbox.MailboxClient(self.region, c.frontend_workers, self.mailbox_workers)
    return carry

  def _size_kv_cache(self) -> DeviceMemory:
    """Sets kv_pages from the GPU's memory, read now that the executor holds the weights
    (and their fused copies); returns the figures for the startup log."""
    c, ex = self.config, self.executor
    stats = self.device.memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError(f"{self.device} reports no memory figures (memory_stats): set kv_pages")
    # The pool is pool_fraction() of the device (configure_memory_pool made it the config's
    # fraction unless JAX had started or the user chose): the fraction is of the device.
    limit = int(stats["bytes_limit"])
    memory = DeviceMemory(bytes_limit=limit, bytes_in_use=int(stats.get("bytes_in_use", 0)),
                          workspace_bytes=ex.workspace_bytes, page_bytes=ex.page_bytes,
                          ring_bytes=ex.ring_bytes, max_pages=ex.max_pages,
                          device_bytes=int(limit / pool_fraction()))
    pages = kv_pages_for_memory(**dataclasses.asdict(memory),
                                fraction=c.kv_cache_memory_fraction, max_seqs=c.max_seqs,
                                max_context=c.max_context, page_size=c.page_size,
                                prefix_caching=c.prefix_caching)
    self.config = dataclasses.replace(c, kv_pages=pages)
    ex.set_num_pages(pages)
    self.sched = ex.sched
    return memory

  def _check_workspace(self, memory: DeviceMemory) -> None:
    """Compares the compiled loop's temporaries with the workspace the KV cache left free:
    a loop that needs more would run out of memory at its first large step."""
    try:
      temp = int(self.compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend or version reports it
      return
    if temp > memory.workspace_bytes:
      log.warning("the compiled loop's temporaries take %.2f GiB, more than the %.2f GiB the "
                  "KV cache left for them: lower kv_cache_memory_fraction or set kv_pages",
                  temp / 2**30, memory.workspace_bytes / 2**30)
    else:
      log.info("the compiled loop's temporaries: %.2f GiB of the %.2f GiB workspace",
               temp / 2**30, memory.workspace_bytes / 2**30)

  def _start(self, carry) -> None:
    """Warm-up, then READY, the loop and poll threads, and the loop report."""
    c = self.config
    persistent_gpu = self.device.platform == "gpu" and c.mode == "persistent"
    # Before READY (no frontend submits yet): XLA's first execution of the loop runs op by op;
    # on a GPU it serves a warm-up workload that takes every bucket branch (see warm_up).
    workload = self._warm_up_workload if c.warm_up else None
    if workload or c.mode == "persistent":
      log.info("warm-up: %s in XLA's op-by-op first execution",
               f"every bucket branch {list(self.sched.buckets)} once" if workload else
               "one empty step")
      t0 = time.perf_counter()
      carry = self.executor.warm_up(carry, self.compiled, c.mode, self._write_shutdown,
                                    workload)
      log.info("warm-up done in %.1f s", time.perf_counter() - t0)
    self._lock = threading.Lock()
    self._slot_free = threading.Condition(self._lock)
    self._submitted = threading.Condition(self._lock)  # the poll thread sleeps on it when idle
    self._active: dict[int, _Tracked] = {}
    self._stopping = False
    self._error: BaseException | None = None
    self._final_carry = None
    self._loop_thread = threading.Thread(target=self._run_loop, args=(carry,),
                                         name="blink-loop", daemon=True)
    self._poll_thread = threading.Thread(target=self._poll, name="blink-poll", daemon=True)
    self._set_engine_state(protocol.EngineState.READY)
    _LIVE_ENGINES.add(self)
    if persistent_gpu:
      self._start_loop_checked()
    else:
      self._loop_thread.start()
    self._poll_thread.start()
    self.loop_report = self.executor.loop_report
    self.loop_on_device = self.loop_report.get("device_while")
    log.info("serving loop on the device: %s", self.loop_report)
    if persistent_gpu and not self.loop_on_device:
      log.warning("the serving loop is NOT a device-side WHILE node, the host CPU drives every "
                  "iteration (latency will suffer under CPU load): %s", self.loop_report)

  # ---- construction from a checkpoint ----
  @classmethod
  def from_checkpoint(cls, name_or_path: str, *, dtype: str = "bfloat16",
                      tokenizer_path: str | None = None, **kw) -> "Engine":
    """A checkpoint by catalog name or path, or `random:<config>` (random weights in a known
    shape, for benchmarks; the tokenizer comes from `tokenizer_path` if given). `kw`: the
    keywords of `Engine` (config, region, shm_name, ..., EngineConfig fields)."""
    # The config is made (and validated) before JAX starts and any weights load.
    overrides = {k: kw.pop(k) for k in list(kw) if k not in _ENGINE_KEYWORDS}
    kw["config"] = config = EngineConfig.from_kwargs(kw.get("config"), **overrides)
    configure_command_buffers()
    configure_memory_pool(config.gpu_memory_fraction)
    import jax.numpy as jnp

    from blink_jax.model.gemma import Gemma
    from blink_jax.weights.checkpoint import load_checkpoint, load_tokenizer, resolve_checkpoint

    dtypes = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
    if dtype not in dtypes:
      raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if str(name_or_path).startswith("random:"):
      from flax import nnx

      from blink_jax.client.tokenizer import Tokenizer
      from blink_jax.model.config import get_config
      cfg = get_config(str(name_or_path).split(":", 1)[1])
      log.info("random weights in the %s shape", cfg.name)
      model = Gemma(cfg, dtype=dtypes[dtype], rngs=nnx.Rngs(0))
      tok = Tokenizer(tokenizer_path) if tokenizer_path else None
      return cls(model, tok, model_name=str(name_or_path), tokenizer_path=tokenizer_path,
                 donate_model=True, **kw)
    path = resolve_checkpoint(name_or_path)
    cfg, params = load_checkpoint(path, dtype=dtypes[dtype])
    model = Gemma.from_params(cfg, params, dtype=dtypes[dtype])
    tok = load_tokenizer(path)
    del params  # the model holds them now: donated, the unfused ones are freed
    return cls(model, tok, model_name=str(name_or_path),
               tokenizer_path=tokenizer_path or str(path / "tokenizer.model"),
               donate_model=True, **kw)

  # ---- lifecycle ----
  def _set_engine_state(self, state: protocol.EngineState) -> None:
    mailbox.write_header_word(self.region, "engine_state", state)

  def _warm_up_workload(self, loop_alive) -> None:
    """Requests that make the loop take every bucket branch once: `b` one-token prompts
    decoding together for each bucket b <= max_seqs, one b-token prompt (a prefill step of b
    rows) for each larger bucket. Runs during the warm-up execution, in the engine's slots."""
    sched, client = self.sched, self.client
    rng = np.random.default_rng(0)
    vocab = self.model_cfg.vocab_size
    longest = min(self.geo.max_prompt, self.max_context - 2,
                  (sched.num_pages - 1) * sched.page_size - 2)
    for b in sched.buckets:
      if b <= min(sched.max_seqs, len(client.slots)):
        waves = [mailbox.Request(prompt=[int(rng.integers(3, vocab))], max_tokens=4, ignore_eos=True)
                 for _ in range(b)]
      elif b <= longest:
        waves = [mailbox.Request(prompt=[int(t) for t in rng.integers(3, vocab, b)], max_tokens=1,
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
    from blink_jax.executor import loop_report
    with loop_report.capture_stderr() as log_text:
      start = int(mailbox.read_header(self.region)["loop_iterations"])
      self._loop_thread.start()
      deadline = time.monotonic() + timeout
      while (int(mailbox.read_header(self.region)["loop_iterations"]) < start + 2
             and time.monotonic() < deadline and self._loop_thread.is_alive()):
        time.sleep(0.005)
    op_by_op = loop_report.XLA_OP_BY_OP_LINE in log_text()
    self.executor.loop_report = dict(
        self.executor.loop_report,
        serving_run="op by op, driven by the host (XLA re-ran its warm-up execution)"
        if op_by_op else "CUDA graph")
    if op_by_op:
      log.warning("XLA runs the serving loop op by op, driven by the host: a JAX program was "
                  "compiled after the warm-up (XLA then evicts its CUDA graphs). Compile other "
                  "programs before creating the Engine.")

  def _write_shutdown(self, on: bool) -> None:
    mailbox.write_header_word(self.region, "shutdown", on)

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
      self._set_engine_state(protocol.EngineState.STOPPED)

  def shutdown(self, timeout: float = 60.0) -> None:
    """Cancels what is in flight, stops the loop and joins the threads."""
    with self._lock:
      if self._stopping:
        return
      self._stopping = True
      for t in self._active.values():
        self.client.cancel(t.slot)
      self._submitted.notify_all()
    deadline = time.monotonic() + timeout
    while self._active and time.monotonic() < deadline and self._loop_thread.is_alive():
      time.sleep(0.005)
    self._write_shutdown(True)
    self._loop_thread.join(max(0.0, deadline - time.monotonic()))
    self._poll_thread.join(1.0)
    self._release_memory()
    self._final_carry = None
    with self._lock:
      for t in self._active.values():
        t.events.put(None)
      self._slot_free.notify_all()

  def _release_memory(self) -> None:
    """Unregisters the mailbox from the GPU and removes its shared memory, if this engine
    created it (the frontends' mappings stay valid until they unmap)."""
    if self._registration is not None:
      self._registration.release()
      self._registration = None
    if self._own_shm:
      self.region.unlink()
      self._own_shm = False

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
      # A raw prompt, as the completions API reads it (Tokenizer's docstring).
      return self.tokenizer.encode(prompt, add_bos=True, parse_special=True)
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
    req = mailbox.Request(prompt=ids, max_tokens=params.max_tokens, temperature=params.temperature,
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
      self._submitted.notify()
      return t

  def _poll(self) -> None:
    """Reads output rings of the requests in flight and hands new tokens to their callers.
    Slots are polled only when the device's progress counters moved (`progress`), and at
    least every 50 ms; with nothing in flight the thread sleeps until a request is submitted
    (an idle engine costs no CPU)."""
    idle, last, last_sweep = 0, b"", 0.0
    while True:
      with self._lock:
        while not self._active and not self._stopping and self._loop_thread.is_alive():
          self._submitted.wait(0.5)  # the timeout notices a loop that died
        items = dict(self._active)
      if not items and (self._stopping or not self._loop_thread.is_alive()):
        return
      progressed = False
      now = time.monotonic()
      hint = self.client.progress() if items else last
      if items and (hint != last or now - last_sweep > 0.05):
        last, last_sweep = hint, now
        for slot, out in self.client.poll_many(items):
          progressed = True
          self._deliver_safely(items[slot], out)
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

  def _deliver_safely(self, t: _Tracked, out: mailbox.Output) -> None:
    try:
      self._deliver(t, out)
    except Exception as e:  # one bad request must not stop the others
      log.exception("delivering output of slot %d failed", t.slot)
      t.events.put(StreamDelta("", [], f"error: {e}"))
      t.reason = t.reason or f"error: {e}"
      if not out.finished:
        self.client.cancel(t.slot)

  def _deliver(self, t: _Tracked, out: mailbox.Output) -> None:
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
    t.cached_tokens = max(t.cached_tokens, out.cached_tokens)  # 0 until admitted
    if t.reason is not None:  # stopped by a stop string; the device is finishing the cancel
      if out.finished:
        t.events.put(StreamDelta("", [], t.reason))
      return
    if out.finished:
      t.t_done = now
    try:
      piece = t.decoder.feed(out.tokens, out.logprobs, out.top, out.finished,
                             out.finish_reason, out.error)
    except DeviceError as e:  # cancelled or rejected: what was decoded stands
      piece, t.reason = None, _finish_name(e.finish, e.error)
    if piece is not None:
      if t.params.logprobs is not None:
        k = t.params.logprobs
        t.lps += piece.logprobs
        t.top += [top[:k] for top in piece.top] if out.top else [[] for _ in piece.tokens]
      if piece.text or piece.tokens:
        t.events.put(StreamDelta(piece.text, piece.tokens))
      t.reason = piece.finish_reason
    if t.reason is not None and not out.finished:
      # A stop string ended it before the device did: cancel, and finish the caller's request
      # once the device has released the slot and its pages (the next poll that sees it).
      if not t.cancel_sent:
        self.client.cancel(t.slot)
        t.cancel_sent = True
        t.t_done = now
      return
    if t.reason is not None:
      t.events.put(StreamDelta("", [], t.reason))

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
        prompt_token_ids=t.prompt, token_ids=list(t.decoder.tokens), text=t.decoder.text,
        finish_reason=reason,
        logprobs=list(t.lps) if t.params.logprobs is not None else None,
        top_logprobs=list(t.top) if t.params.logprobs is not None else None,
        prompt_logprobs=t.prompt_lps if t.params.prompt_logprobs is not None else None,
        prompt_top_logprobs=t.prompt_top if t.params.prompt_logprobs is not None else None,
        ttft_s=(t.t_first or t.t_done) - t.t_submit, e2e_s=t.t_done - t.t_submit,
        preemptions=t.preemptions, cached_tokens=t.cached_tokens)

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
    h = mailbox.read_header(self.region)
    keys = ["loop_iterations", "steps", "tokens_generated", "prompt_tokens",
            "requests_admitted", "requests_finished", "requests_errored", "requests_cancelled",
            "preemptions", "pages_in_use", "pages_total", "running", "waiting",
            "prefix_cache_queries", "prefix_cache_hits"]
    out = {k: int(h[k]) for k in keys}
    out["engine_state"] = protocol.EngineState(int(h["engine_state"])).name.lower()
    return out


# Keywords of Engine that are not EngineConfig fields.
_ENGINE_KEYWORDS = frozenset({"config", "region", "shm_name", "model_name", "tokenizer_path",
                              "eos_ids", "device", "donate_model"})
