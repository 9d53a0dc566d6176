"""The engine's one configuration: `EngineConfig`, with the step's kernels as `KernelOptions`.

Both the Python API (`Engine(model, tokenizer, config)`, `Engine.from_checkpoint(name,
**overrides)`) and `scripts/serve.py`'s flags come from these dataclasses: every field is one
flag of the same name (`define_flags`, `from_flags`), with the help text kept next to the
field. A config is validated once, when it is made (`__post_init__`), and `resolved` fills in
the sizes that depend on the model and the device; on a GPU the engine then sizes the KV cache
from the figures it reads off the device (`kv_pages_for_memory`, the arithmetic alone) and
prints the result at startup.
The lowest layer of the package: JAX-free and importing nothing of blink_jax, so the kernel
selection, the executor and the engine all read it, and flags exist before JAX starts.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

KERNEL_KINDS = ("auto", "reference", "pallas")
# Attention also has the blocked jnp kernel, "auto"'s choice off the GPU.
ATTENTION_KINDS = KERNEL_KINDS + ("blocked",)
GEMV_PROJECTIONS = ("qkv", "out", "down", "gate_up")
# What gemv="auto" runs on a GPU: the q/k/v, output and down projections (on the H200, 1B
# shape, a batch-1 token 1.39 instead of 1.38-1.60 ms; the gate/up projection through the
# GEMV was no faster: docs/PERFORMANCE.md).
GEMV_AUTO = ("qkv", "out", "down")
MODES = ("persistent", "host")
# Sequences decoded together when max_seqs is not given: on a GPU vLLM's --max-num-seqs
# default (a decode step reads the weights once for all its rows, so lanes are cheap there);
# on a CPU every row costs its arithmetic, and 8 is what the CPU tests and figures use.
GPU_MAX_SEQS, CPU_MAX_SEQS = 256, 8


def default_compilation_cache_dir() -> str:
  """compilation_cache_dir when none is given: ~/.cache/blink-jax/xla (on an H100 the 1B's
  second start took 41 instead of 152 s, its loop still a device WHILE with the same
  answer: docs/PERFORMANCE.md, "Known gaps")."""
  return str(pathlib.Path.home() / ".cache" / "blink-jax" / "xla")


def default_max_seqs(platform: str) -> int:
  """max_seqs when none is given, on a device of `platform` ("gpu", "cpu", ...)."""
  return GPU_MAX_SEQS if platform == "gpu" else CPU_MAX_SEQS
# The share of a GPU's memory the weights, the step and the KV cache may take when
# kv_cache_memory_fraction is not given: vLLM's --gpu-memory-utilization default.
GPU_MEMORY_FRACTION = 0.9
# With prefix caching a GPU's KV pages hold finished requests' prefixes too, up to this many
# times what max_seqs sequences of max_context tokens use. The scheduler keeps 28 int32 words
# of bookkeeping a page (free list, registry, its tokens, the hash table): a small model on a
# large GPU would otherwise carry millions of pages of it for a cache it seldom fills. At 8
# the 1B's and 270M's caches still take all of an H200 at a 2,048-token context.
PREFIX_CACHE_PAGES_FACTOR = 8
# Tokens one step may take on a GPU when max_num_batched_tokens is not given: a burst of
# prompts prefills 4,096 tokens a step beside the decode rows. Against 2,048 it cut the P99
# TTFT of 200 requests at once from 367 to 160 ms at the same tokens/s, and 8,192 gave no
# more (190 ms); against 256, 2,048 had served 1.08x the tokens/s with 2.3x lower P99 TTFT
# (docs/PERFORMANCE.md, "Step budget").
GPU_BATCHED_TOKENS = 4096
# The most step sizes the scheduler is compiled for (BLINK_MAX_BUCKETS, ffi/sched_state.h).
MAX_BUCKETS = 16
# Default size of the mailbox's prompt arena, in tokens (32 MiB of pinned memory): 4,096
# prompts of 2,048 tokens in flight at once, where storage inside each slot would have cost
# num_slots x max_context (512 MiB for 4,096 slots of a 32k context).
ARENA_TOKENS = 1 << 23


def _field(default: Any, help: str, **kw) -> Any:  # noqa: A002 - the flag's help
  return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  """Which implementation of each kernel family a serving step runs. "auto" means the fast
  kernel of the device: Pallas on a GPU; elsewhere the blocked jnp attention and the jnp
  reference norms (Pallas' interpreter is slow on a CPU). Naming one forces it (on a CPU a
  Pallas kernel then runs in Pallas' interpreter, which the tests use). docs/ARCHITECTURE.md,
  "Kernels", says what each kernel does."""
  attention: str = _field("auto", "Paged attention of decode-sized steps (up to decode_rows "
                          "tokens): the Pallas kernel that reads KV pages in place, the "
                          "blocked jnp kernel (key blocks up to the step's context: the CPU's), "
                          "or the jnp reference (every row's whole page table).",
                          choices=ATTENTION_KINDS)
  prefill: str = _field("auto", "Attention of prefill-sized steps: the Pallas prefill kernel "
                        "(blocks of tokens read each sequence's pages once; on the H200, 1B "
                        "shape, a 4096-token prefill step 13.9 instead of 40.0 ms), the "
                        "blocked jnp kernel, or the jnp reference.", choices=ATTENTION_KINDS)
  norm: str = _field("auto", "Residual add + RMSNorm pairs and each layer's q/k RMSNorm + "
                     "RoPE + cache write: one Pallas kernel each, or the jnp reference.",
                     choices=KERNEL_KINDS)
  gemv: str = _field("auto", "Projections of one-token steps run by the CUDA GEMV: "
                     "auto (qkv+out+down on a GPU, none elsewhere), none, or names from "
                     f"{'+'.join(GEMV_PROJECTIONS)} joined by '+'.")
  decode_rows: int = _field(64, "Largest step (tokens) whose attention is decode-sized.")
  decode_head: int | None = _field(None, "Most rows at the head of a larger step whose "
                                   "attention the decode kernel runs: the step's leading "
                                   "decode rows, counted at run time; the rest the prefill "
                                   "kernel (both Pallas). A step puts its decode rows first, "
                                   "and a prefill block walks the sequences of its tokens one "
                                   "after another, so a block of 16 decode rows costs 16 whole "
                                   "contexts there. "
                                   "Default: max_seqs, a row for every sequence that can "
                                   "decode (on the H200, 1B shape, a 4,096-token step with 128 "
                                   "decode rows 14.7 instead of 23.2 ms; "
                                   "docs/PERFORMANCE.md, \"Decode rows in mixed steps\"). "
                                   "0: the prefill kernel takes every row.")
  split_matmul: bool = _field(False, "The q/k/v, output and down projections of GPU decode "
                              "steps of 2 to decode_rows tokens as XLA matmuls over slices of "
                              "K, whose float32 partial sums the Pallas prepare and add + norm "
                              "kernels add up, instead of XLA's split-K GEMMs and their "
                              "reduction kernels (one launch a projection less). Off until "
                              "its step A/B "
                              "(docs/PERFORMANCE.md, \"Known gaps\"); with the Pallas norm "
                              "kernels only.")

  def __post_init__(self):
    for name, kinds in (("attention", ATTENTION_KINDS), ("prefill", ATTENTION_KINDS),
                        ("norm", KERNEL_KINDS)):
      if getattr(self, name) not in kinds:
        raise ValueError(f"{name} must be one of {kinds}, got {getattr(self, name)!r}")
    self.gemv_projections("gpu")  # validates the names
    if not isinstance(self.split_matmul, bool):
      raise ValueError(f"split_matmul must be True or False, got {self.split_matmul!r}")
    if not isinstance(self.decode_rows, int) or self.decode_rows < 1:
      raise ValueError(f"decode_rows must be an integer >= 1, got {self.decode_rows!r}")
    if self.decode_head is not None and (not isinstance(self.decode_head, int)
                                         or self.decode_head < 0):
      raise ValueError(f"decode_head must be an integer >= 0 or None (max_seqs), got "
                       f"{self.decode_head!r}")

  def gemv_projections(self, platform: str) -> frozenset[str]:
    """The projections the CUDA GEMV runs on a device of `platform` ("gpu", "cpu", ...)."""
    if self.gemv == "auto":
      return frozenset(GEMV_AUTO) if platform == "gpu" else frozenset()
    if self.gemv in ("none", ""):
      return frozenset()
    names = frozenset(self.gemv.split("+"))
    if bad := sorted(names - set(GEMV_PROJECTIONS)):
      raise ValueError(f"gemv={self.gemv!r}: unknown projection(s) {bad}; use auto, none or "
                       f"names from {GEMV_PROJECTIONS} joined by '+'")
    return names

  def resolved(self, platform: str, max_seqs: int | None = None) -> "KernelOptions":
    """The options with every "auto" replaced by what it means on `platform`, and an unset
    decode_head by `max_seqs` (default: the platform's default max_seqs) where both
    attention kernels are Pallas, else 0 (no other pair splits a step)."""
    def pick(kind: str, elsewhere: str) -> str:
      return ("pallas" if platform == "gpu" else elsewhere) if kind == "auto" else kind
    gemv = "+".join(p for p in GEMV_PROJECTIONS if p in self.gemv_projections(platform))
    attention, prefill = pick(self.attention, "blocked"), pick(self.prefill, "blocked")
    head = self.decode_head
    if head is None:
      both = attention == prefill == "pallas"
      head = (max_seqs or default_max_seqs(platform)) if both else 0
    return dataclasses.replace(self, attention=attention, prefill=prefill,
                               norm=pick(self.norm, "reference"), gemv=gemv or "none",
                               decode_head=head)

  def without_pallas(self, families: tuple[str, ...]) -> "KernelOptions":
    """The options with the named families back on the jnp reference (the executor's
    fallback when a Pallas kernel that "auto" chose does not compile on this GPU)."""
    out = dataclasses.replace(self, **{f: "reference" for f in families})
    split = out.attention == out.prefill == "pallas"
    return out if split else dataclasses.replace(out, decode_head=0)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes, the loop's form and the kernels of one engine (docs/ARCHITECTURE.md)."""
  max_seqs: int | None = _field(None, "Sequences decoded together (lanes of the device "
                                "scheduler; default: 256 on a GPU, like vLLM's "
                                "--max-num-seqs; 8 on a CPU).")
  kv_pages: int | None = _field(None, "KV cache pages (default: on a GPU as many as "
                                "kv_cache_memory_fraction of its memory holds after the "
                                "weights and the step's workspace (without prefix caching "
                                "at most max_context worth for every sequence); on a CPU "
                                "max_context worth for every sequence).")
  kv_cache_memory_fraction: float | None = _field(
      None, "Share of the GPU's memory that the weights, the step's workspace and the KV "
      "cache may take when kv_pages is not given, like vLLM's --gpu-memory-utilization "
      "(default: 0.9 on a GPU; unused on a CPU). The engine makes XLA's allocator pool that "
      "share of the device when it starts JAX (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set).")
  page_size: int = _field(16, "Tokens per KV page.")
  max_context: int | None = _field(None, "Context length served (default: the model's, at "
                                   "most 4096).")
  num_slots: int = _field(4096, "Mailbox request slots, shared out among the frontend "
                          "workers: requests in flight, running or queued on the device "
                          "(Blink's ring of 4,096).")
  prompt_arena_tokens: int | None = _field(
      None, "Prompt tokens the mailbox holds for the requests in flight, shared out among the "
      "frontend workers like the slots; a worker whose share is full queues the next request "
      "until one finishes (default: 8,388,608 (32 MiB), at most a longest prompt per slot, "
      "at least one per worker).")
  ring_capacity: int = _field(64, "Entries of each slot's output ring.")
  max_top_logprobs: int = _field(8, "Most top logprobs a request may ask for.")
  max_num_batched_tokens: int | None = _field(
      None, "Tokens one step may take, like vLLM's --max-num-batched-tokens: every decoding "
      "sequence's row first, then chunks of prompts, oldest first (default: "
      "max(4096, max_seqs) on a GPU, max(256, max_seqs) on a CPU, or the largest of buckets).")
  buckets: tuple[int, ...] | None = _field(None, "Token counts the step is compiled for, the "
                                           "largest being max_num_batched_tokens (default: "
                                           "1, 2, 4 ... 64 (on a GPU also 128), then "
                                           "doubling from 256 up to max_num_batched_tokens; "
                                           "at most 16).")
  mode: str = _field("persistent", "persistent: the serving loop runs on the device; host: "
                     "the host drives each step (the conventional design, for comparison).",
                     choices=MODES)
  idle_poll_us: int | None = _field(None, "How long an idle schedule polls the mailbox for "
                                    "work before the loop goes round (default: 200 on a GPU; "
                                    "50000 on a CPU, where each round wakes XLA's threads).")
  min_step_interval_us: int = _field(
      0, "Step pacing: a decode-only step with nothing waiting starts at least this long "
      "after the previous step started (a new request or a cancel ends the wait, and it "
      "holds only while requests keep arriving: at most 4 mean gaps between arrivals after "
      "the last one), trading "
      "time per output token for fewer passes over the weights and an idle GPU in between "
      "(docs/PERFORMANCE.md, \"Energy\"); 0: steps back to back.")
  step_interval_factor: float = _field(
      1.0, "Step pacing relative to the step's own length: a decode-only step with nothing "
      "waiting starts no sooner than this many times the previous step's length after that "
      "step started (1.25: the GPU idles a fifth of the time while it only decodes), so the "
      "pacing follows the model, the GPU and the load; with min_step_interval_us the later "
      "of the two, held only while requests keep arriving as that is; 1.0: off "
      "(docs/ARCHITECTURE.md, \"Step pacing\").")
  prefix_caching: bool = _field(
      True, "Automatic prefix caching in the device scheduler, like vLLM's: full KV pages are "
      "registered by a hash chained over their tokens and a request maps the longest cached "
      "prefix instead of computing it (docs/ARCHITECTURE.md, \"Prefix caching\").")
  windowed_pages: bool = _field(
      False, "The sliding-window layers keep a ring per sequence of their window plus "
      "window_chunk tokens instead of pages for the whole context, so a long context costs "
      "its global layers' pages alone (docs/ARCHITECTURE.md, \"Windowed pages\"); with "
      "prefix caching a hit then shares the global layers' pages but computes the prompt "
      "again.")
  window_chunk: int | None = _field(
      None, "With windowed_pages: the most prompt tokens one sequence computes in a step "
      "(its ring holds window - 1 + window_chunk tokens; default: the model's window).")
  tensor_parallel: int = _field(
      1, "Devices the weights and the KV cache are split over (attention heads, MLP hidden "
      "units, vocabulary), like vLLM's --tensor-parallel-size: one persistent loop, the first "
      "device scheduling for all (docs/ARCHITECTURE.md, \"Tensor parallelism (design)\"); "
      "persistent mode only.")
  frontend_workers: int = _field(0, "Frontend worker processes that share the mailbox "
                                 "(slot ranges 0..N-1; the engine's own generate() is N).")
  warm_up: bool | None = _field(None, "Serve a workload that takes every bucket branch "
                                "before READY (default: on a GPU).")
  compilation_cache_dir: str | None = _field(
      None, "Folder of JAX's persistent compilation cache, where a restarted engine of the "
      "same model and sizes finds its compiled loop instead of compiling it (the process's "
      "jax_compilation_cache_dir, when JAX has none yet; "
      "docs/ARCHITECTURE.md, \"Compilation cache\"); '' leaves it off (default: "
      "~/.cache/blink-jax/xla).")
  kernels: KernelOptions = dataclasses.field(default_factory=KernelOptions)

  def __post_init__(self):
    def positive(name, allow_none=False):
      v = getattr(self, name)
      if v is None and allow_none:
        return
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    for name in ("page_size", "num_slots", "ring_capacity", "tensor_parallel"):
      positive(name)
    for name in ("max_seqs", "kv_pages", "max_context", "max_num_batched_tokens",
                 "prompt_arena_tokens", "window_chunk"):
      positive(name, allow_none=True)
    f = self.kv_cache_memory_fraction
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                          or not 0 < f <= 1):  # NaN fails 0 < f too
      raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {f!r}")
    if not isinstance(self.max_top_logprobs, int) or self.max_top_logprobs < 0:
      raise ValueError(f"max_top_logprobs must be an integer >= 0, got "
                       f"{self.max_top_logprobs!r}")
    if self.max_context is not None and self.max_context < 2:
      raise ValueError(f"max_context must be at least 2, got {self.max_context}")
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.tensor_parallel > 1 and self.mode != "persistent":
      raise ValueError(f"tensor_parallel={self.tensor_parallel} runs the persistent loop "
                       f"only, not mode={self.mode!r}")
    if (self.idle_poll_us is not None and self.idle_poll_us < 0) or self.frontend_workers < 0:
      raise ValueError("idle_poll_us and frontend_workers must be >= 0")
    for name in ("prefix_caching", "windowed_pages"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    m = self.min_step_interval_us
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 1_000_000:
      raise ValueError(f"min_step_interval_us must be an integer in [0, 1000000], got {m!r}")
    f = self.step_interval_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1.0 <= f <= 10.0:
      raise ValueError(f"step_interval_factor must be a number in [1, 10], got {f!r}")
    if self.buckets is not None:
      b = tuple(self.buckets)
      if not b or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b) \
          or list(b) != sorted(set(b)):
        raise ValueError(f"buckets must be increasing integers >= 1, got {self.buckets!r}")
      if len(b) > MAX_BUCKETS:
        raise ValueError(f"at most {MAX_BUCKETS} buckets, got {len(b)}: {b}")
      object.__setattr__(self, "buckets", b)
      if self.max_num_batched_tokens not in (None, b[-1]):
        raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is the "
                         f"largest bucket: buckets {b} end at {b[-1]}")
    if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir,
                                                                    str):
      raise ValueError(f"compilation_cache_dir must be a path or '', got "
                       f"{self.compilation_cache_dir!r}")
    if not isinstance(self.kernels, KernelOptions):
      raise TypeError(f"kernels must be a KernelOptions, got {type(self.kernels).__name__}")
    if self.tensor_parallel > 1 and self.kernels.split_matmul:
      # The sums over the shards would carry every slice's float32 partials.
      raise ValueError(f"split_matmul is for one device, not tensor_parallel="
                       f"{self.tensor_parallel}")

  @classmethod
  def from_kwargs(cls, base: "EngineConfig | None" = None, **kw) -> "EngineConfig":
    """`base` (default: the defaults) with fields replaced by keyword: any EngineConfig
    field, and any KernelOptions field at the top level (attention="pallas", gemv="none")."""
    base = base or cls()
    kernel_names = {f.name for f in dataclasses.fields(KernelOptions)}
    engine_names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kw) - kernel_names - engine_names)
    if unknown:
      raise TypeError(f"unknown engine option(s) {unknown}; known: "
                      f"{sorted(engine_names | kernel_names)}")
    kernels = {k: kw.pop(k) for k in list(kw) if k in kernel_names}
    if kernels:
      kw["kernels"] = dataclasses.replace(kw.get("kernels", base.kernels), **kernels)
    return dataclasses.replace(base, **kw)

  def max_seqs_on(self, platform: str) -> int:
    """max_seqs, or its default on a device of `platform` ("gpu", "cpu", ...)."""
    return self.max_seqs or default_max_seqs(platform)

  @property
  def gpu_memory_fraction(self) -> float:
    """kv_cache_memory_fraction, or its GPU default."""
    f = self.kv_cache_memory_fraction
    return GPU_MEMORY_FRACTION if f is None else f

  def resolved(self, model_max_context: int, platform: str,
               sliding_window: int | None = None) -> "EngineConfig":
    """The config with the model- and device-dependent defaults filled in: max_seqs,
    max_context, kv_pages, kv_cache_memory_fraction, max_num_batched_tokens, buckets,
    idle_poll_us, warm_up, window_chunk and the kernels' "auto". On a GPU without kv_pages,
    kv_pages stays None here: it depends on the memory left once the weights are loaded, so
    the engine fills it in then (`kv_pages_for_memory`). sliding_window: the model's (None:
    it has no sliding-window layers)."""
    max_seqs = self.max_seqs_on(platform)
    max_context = self.max_context or min(model_max_context, 4096)
    if max_context > model_max_context:
      raise ValueError(f"max_context {max_context} exceeds the model's {model_max_context}")
    window_chunk = self.window_chunk
    if self.windowed_pages:
      if not sliding_window or sliding_window >= max_context:
        raise ValueError(f"windowed_pages needs sliding-window layers whose window is shorter "
                         f"than max_context ({max_context}); the model's: {sliding_window}")
      window_chunk = window_chunk or sliding_window
    kv_pages, fraction = self.kv_pages, self.kv_cache_memory_fraction
    if kv_pages is None and platform == "gpu":
      fraction = self.gpu_memory_fraction
    elif kv_pages is None:
      kv_pages = full_context_pages(max_context, self.page_size, max_seqs)
    buckets = self.buckets
    if buckets is None:
      budget = self.max_num_batched_tokens or max(
          GPU_BATCHED_TOKENS if platform == "gpu" else 256, max_seqs)
      # Decode sizes: a CPU pays for every padded row (2 streams in the 8-row step: 1.57x the
      # per-token time of a 2-row step, docs/PERFORMANCE.md, "Decode buckets 2 and 4 on a
      # CPU"), a GPU for padded rows of its small-batch GEMV and, past a dozen sequences, for
      # their arithmetic (sections "Decode buckets 16 and 32" and "Decode buckets 2, 4 and
      # 128 on a GPU": TPOT P50 -25 % at 2 req/s on the H200).
      # Past 256 rows the sizes double, so a step is padded to less than twice its tokens,
      # or grow 4x, 8x ... where doubling up to a large budget would need more than
      # MAX_BUCKETS sizes.
      growth = 2
      while True:
        sizes = [1, 2, 4, 8, 16, 32, 64] + ([128] if platform == "gpu" else []) + [256]
        while sizes[-1] < budget:
          sizes.append(growth * sizes[-1])
        buckets = tuple(sorted({min(b, budget) for b in sizes} | {budget}))
        if len(buckets) <= MAX_BUCKETS:
          break
        growth *= 2
    if self.windowed_pages:  # a lane never computes more than a step's tokens
      window_chunk = min(window_chunk, buckets[-1])
    if buckets[-1] < max_seqs:
      raise ValueError(f"max_num_batched_tokens ({buckets[-1]}) must hold a decode row for "
                       f"each of max_seqs ({max_seqs}) sequences")
    idle_poll_us = self.idle_poll_us
    if idle_poll_us is None:
      idle_poll_us = 200 if platform == "gpu" else 50_000
    arena = self.prompt_arena_tokens
    workers, longest = self.frontend_workers + 1, max_context - 1  # + the engine's own client
    if arena is None:
      arena = min(self.num_slots * longest, max(ARENA_TOKENS, workers * longest))
    elif arena // workers < longest:
      raise ValueError(f"prompt_arena_tokens ({arena}) must give each of the {workers} mailbox "
                       f"clients (frontend_workers + the engine's own) room for one prompt of "
                       f"max_context - 1 = {longest} tokens: at least {workers * longest}")
    if arena >= 2**32:
      raise ValueError(f"prompt_arena_tokens ({arena}) must be below 2**32")
    return dataclasses.replace(
        self, max_seqs=max_seqs, max_context=max_context, kv_pages=kv_pages,
        prompt_arena_tokens=arena,
        kv_cache_memory_fraction=fraction, max_num_batched_tokens=buckets[-1],
        buckets=buckets, idle_poll_us=idle_poll_us, window_chunk=window_chunk,
        warm_up=(platform == "gpu") if self.warm_up is None else self.warm_up,
        compilation_cache_dir=(default_compilation_cache_dir()
                               if self.compilation_cache_dir is None
                               else self.compilation_cache_dir),
        kernels=self.kernels.resolved(platform, max_seqs))

  def describe(self, memory: "DeviceMemory | None" = None) -> str:
    """One line for the startup log: the capacity chosen and why (a resolved config; with
    `memory`, the GPU figures kv_pages was computed from), then every field."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    kernels = fields.pop("kernels")
    text = ", ".join(f"{k}={v}" for k, v in fields.items())
    ks = ", ".join(f"{f.name}={getattr(kernels, f.name)}" for f in dataclasses.fields(kernels))
    return f"{self._capacity(memory)}{text}; kernels: {ks}"

  def window_pages(self, sliding_window: int) -> int:
    """Ring pages per sequence under windowed_pages (a resolved config): the window - 1 keys
    a chunk's first row reads and the chunk itself."""
    return -(-(sliding_window - 1 + self.window_chunk) // self.page_size)

  def _capacity(self, memory: "DeviceMemory | None") -> str:
    if None in (self.max_seqs, self.kv_pages, self.max_context):
      return ""  # not resolved: nothing chosen yet
    worth = full_context_pages(self.max_context, self.page_size, self.max_seqs)
    why = "max_context worth per sequence" if self.kv_pages == worth else "set by kv_pages"
    if memory is not None:
      f = self.kv_cache_memory_fraction
      room = _room(memory, f) // memory.page_bytes
      why = (f"{f} of {_of(memory)}: weights {_gib(memory.bytes_in_use)}, "
             f"workspace {_gib(memory.workspace_bytes)}, "
             + (f"window rings {_gib(memory.ring_bytes)}, " if memory.ring_bytes else "")
             + f"{_gib(self.kv_pages * memory.page_bytes)} of KV")
      bounds = {memory.max_pages: "the most a layer's cache indexes with 32-bit offsets",
                worth * PREFIX_CACHE_PAGES_FACTOR:
                    f"{PREFIX_CACHE_PAGES_FACTOR}x max_context worth per sequence",
                worth: "max_context worth per sequence"}
      if self.kv_pages < room and self.kv_pages in bounds:
        why += f"; capped at {bounds[self.kv_pages]}, room for {room}"
      if self.prefix_caching and self.kv_pages > worth:
        why += f"; {self.kv_pages - worth} past max_context worth per sequence keep prefixes"
    return f"capacity: {self.max_seqs} sequences, {self.kv_pages} KV pages ({why}); "


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """The GPU figures the engine sizes the KV cache from (`kv_pages_for_memory`), kept for
  the startup log: what XLA's allocator may use (memory_stats' bytes_limit), what is in use
  once the weights are loaded, the reserve for the step's temporaries, one page's bytes,
  with windowed pages the sliding-window layers' rings (their size is fixed by max_seqs),
  the most pages a layer's cache may have (`gemma.max_kv_pages`; None: no bound), and the
  device's whole memory (None: bytes_limit is all of it)."""
  bytes_limit: int
  bytes_in_use: int
  workspace_bytes: int
  page_bytes: int
  ring_bytes: int = 0
  max_pages: int | None = None
  device_bytes: int | None = None

  def budget(self, fraction: float) -> int:
    """What the weights, the workspace and the KV cache may take: `fraction` of the device,
    as far as XLA's pool holds it."""
    return min(self.bytes_limit, int((self.device_bytes or self.bytes_limit) * fraction))


def full_context_pages(max_context: int, page_size: int, max_seqs: int) -> int:
  """KV pages for max_seqs sequences of max_context tokens each: the most they can use."""
  return -(-max_context // page_size) * max_seqs


def _gib(n: int) -> str:
  return f"{n / 2**30:.1f} GiB"


def _of(m: DeviceMemory) -> str:
  """The memory a fraction is taken of, for messages: the device, and XLA's pool if smaller."""
  if m.device_bytes is None or m.device_bytes <= m.bytes_limit:
    return _gib(m.device_bytes or m.bytes_limit)
  return f"{_gib(m.device_bytes)} (XLA's pool {_gib(m.bytes_limit)})"


def _room(m: DeviceMemory, fraction: float) -> int:
  """Bytes left for the KV cache (negative when the weights and workspace alone overflow)."""
  return m.budget(fraction) - m.bytes_in_use - m.workspace_bytes - m.ring_bytes


def kv_pages_for_memory(*, bytes_limit: int, bytes_in_use: int, workspace_bytes: int,
                        page_bytes: int, fraction: float, max_seqs: int, max_context: int,
                        page_size: int, prefix_caching: bool, ring_bytes: int = 0,
                        max_pages: int | None = None, device_bytes: int | None = None) -> int:
  """KV pages for a GPU, as vLLM sizes its cache: what fits in `fraction` of the device's
  `device_bytes` (at most XLA's pool, `bytes_limit`; None: the pool is the device) beside the
  `bytes_in_use` (the weights) and the step's `workspace_bytes`, in whole pages of
  `page_bytes`. Without prefix caching no more than max_seqs sequences of max_context tokens
  can hold, since more would never be used; with it the pages past those keep finished
  requests' prefixes for later hits, as vLLM's cache does (docs/ARCHITECTURE.md, "Prefix
  caching"), up to PREFIX_CACHE_PAGES_FACTOR times as many. Never more than `max_pages`, the
  most a layer's cache may have (`gemma.max_kv_pages`). Raises ValueError, with the figures,
  when not one max_context fits."""
  m = DeviceMemory(bytes_limit, bytes_in_use, workspace_bytes, page_bytes, ring_bytes,
                   device_bytes=device_bytes)
  room = _room(m, fraction)
  per_seq = full_context_pages(max_context, page_size, 1)
  pages = max(room, 0) // page_bytes
  if pages < per_seq:
    raise ValueError(
        f"the KV cache does not fit: kv_cache_memory_fraction {fraction} of "
        f"{_of(m)} ({m.budget(fraction)} bytes) less {_gib(bytes_in_use)} in use (the "
        f"weights), {_gib(workspace_bytes)} of step workspace and {_gib(ring_bytes)} of window "
        f"rings leaves {pages} pages of "
        f"{page_bytes} bytes; one sequence of max_context={max_context} needs {per_seq} "
        f"({_gib(per_seq * page_bytes)}). Raise kv_cache_memory_fraction, lower max_context "
        "or serve a smaller model or dtype")
  if max_pages is not None:
    if max_pages < per_seq:
      raise ValueError(f"one sequence of max_context={max_context} needs {per_seq} KV pages, "
                       f"more than the {max_pages} a layer's cache may have (the kernels' "
                       "32-bit offsets): lower max_context or raise page_size")
    pages = min(pages, max_pages)
  worth = full_context_pages(max_context, page_size, max_seqs)
  return min(pages, worth * (PREFIX_CACHE_PAGES_FACTOR if prefix_caching else 1))


# ---- command-line flags (absl), one per field ----

def _flag_fields():
  """(field, default) of every EngineConfig and KernelOptions field but `kernels`."""
  for defaults in (EngineConfig(), KernelOptions()):
    for f in dataclasses.fields(defaults):
      if f.name != "kernels":
        yield f, getattr(defaults, f.name)


def define_flags(flag_values=None) -> None:
  """Defines one absl flag per EngineConfig and KernelOptions field, named after it, whose
  default (unset) means the dataclass's default."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  for f, default in _flag_fields():
    define_field_flag(f, None, f"{f.metadata['help']} (default: {default})", fv)


def define_field_flag(f: dataclasses.Field, default: Any, help_text: str, flag_values) -> None:
  """One absl flag for config field `f`, of the field's type (bench/common.py's kernel flags
  use it too, with the dataclass's defaults)."""
  from absl import flags
  fv = flag_values
  if f.metadata.get("choices"):
    flags.DEFINE_enum(f.name, default, f.metadata["choices"], help_text, flag_values=fv)
  elif f.name == "buckets":
    flags.DEFINE_list(f.name, default, help_text, flag_values=fv)
  elif f.type in ("bool", "bool | None"):
    flags.DEFINE_bool(f.name, default, help_text, flag_values=fv)
  elif f.type in ("int", "int | None"):
    flags.DEFINE_integer(f.name, default, help_text, flag_values=fv)
  elif f.type in ("float", "float | None"):
    flags.DEFINE_float(f.name, default, help_text, flag_values=fv)
  else:
    flags.DEFINE_string(f.name, default, help_text, flag_values=fv)


def from_flags(flag_values=None) -> EngineConfig:
  """The EngineConfig the flags `define_flags` defined ask for (unset flags: defaults)."""
  from absl import flags
  fv = flags.FLAGS if flag_values is None else flag_values
  kw = {f.name: fv[f.name].value for f, _ in _flag_fields() if fv[f.name].value is not None}
  if "buckets" in kw:
    kw["buckets"] = tuple(int(b) for b in kw["buckets"])
  return EngineConfig.from_kwargs(**kw)
