"""A writer that rewrites a request while the device reads it cannot fool the device's checks
(issue 22, finding 6).

The mailbox is untrusted memory that a frontend (or anything that can write the shared region,
over RDMA too) may change at any moment (docs/ARCHITECTURE.md, "The mailbox contract"): the
scheduler must read each request field once into device-private state, validate that copy and
use only the copy. Here a writer thread rewrites everything from `prompt_len` to the end of
the request of some slots (the racing slots), and the prompt tokens in the arena that they
name, in a native loop, a whole request at a time with the GIL released, while the scheduler admits and steps them (through ctypes or XLA, which
release the GIL too) and well-formed requests run in the other slots.

After every schedule and commit call the test checks that the device wrote nothing it may
not: the token history and the stop-id state of every lane equal a shadow that the test keeps
from the writes the device may make (canary values everywhere else), so a lane only ever
holds its validated prompt and its sampled tokens; admitted lanes hold validated values;
guard words around the host buffers and past the mailbox are intact; the header and the
other slots' requests are unchanged. At the end every racing request has finished exactly
once, with FINISH_ERROR and an error the writer can cause or with the right output for the
request the device took, and every well-formed request has its oracle's output.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import random
import sys
import threading
import time

import jax
import numpy as np
import pytest

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P
from blink_jax.native import batch as B
from blink_jax.native import ffi as F
from tests import sched_harness as H
from tests.host_scheduler import HostScheduler
from tests.cuda_lowering import gpus

# Each worker's arena share holds 4 longest prompts: its 2 slots' never wait for room.
GEO = P.Geometry(num_slots=6, max_prompt=24, ring_capacity=8, max_top_logprobs=3,
                 arena_tokens=3 * 4 * 24)
PARAMS = dict(vocab_size=64, max_seqs=4, max_context=40, page_size=4, num_pages=20,
              buckets=(8, 16), eos_ids=(1,), idle_poll_us=0)
WORKERS = 3                  # the last worker's slots race; the others' are well-formed
HIST_CANARY = -0x5EED        # never a token: the device writes only ids in [0, vocab)
STOP_CANARY = -0x570F
GUARD_WORDS = 1 << 14        # around the host buffers (64 KiB each way)
MAILBOX_GUARD = 1 << 16      # bytes past the mailbox
MAILBOX_GUARD_BYTE = 0xA5
PER_BURST = 1_500_000        # requests written by one burst (about 10 ms)
SWITCH_S = 5e-4              # the GIL switch interval while racing (Python's default: 5 ms)

# The request the frontend submits on a racing slot, and its whole prompt area.
G_PLEN, G_MAX_TOKENS, G_STOPS, G_NUM_LOGPROBS = 6, 3, (5, 9), 2
G_TEMPERATURE, G_TOP_P, G_TOP_K = 0.5, 0.9, 5
# Errors the writer's variants can cause (one per checked field).
RACE_ERRORS = {P.Error.PROMPT_LENGTH, P.Error.TOKEN_ID, P.Error.MAX_TOKENS,
               P.Error.TEMPERATURE, P.Error.TOP_P, P.Error.TOP_K, P.Error.STOP_IDS,
               P.Error.LOGPROBS, P.Error.FLAGS, P.Error.PROMPT_OFFSET}
# Words of a slot's request the writer rewrites: from prompt_len (word 3) to the request's
# end; seq, cancel and consumed are the frontend's handshake with the device and stay its own.
# Then the max_prompt words of the racing prompt area in the arena.
FIRST_WORD = P.REQUEST_DTYPE.fields["prompt_len"][1] // 4
FIXED_WORDS = P.REQUEST_FIXED_BYTES // 4 - FIRST_WORD


def _layout(cfg: F.SchedConfig) -> dict[str, int]:
  fn = F.library().lib.blink_state_layout
  fn.restype, fn.argtypes = ctypes.c_char_p, [F._i64p]
  ptr, _keep = cfg.words_ptr()
  return F._layout(fn(ptr))


def _bits(x: float) -> int:
  return int(np.float32(x).view(np.int32))


# ---------------------------------------------------------------- the racing writer

def _encode(fields: dict, prompt: np.ndarray) -> np.ndarray:
  """Words FIRST_WORD.. of a request (FIXED_WORDS of them), then its prompt area's."""
  req = np.zeros((), P.REQUEST_DTYPE)
  for k, v in fields.items():
    if k == "stop_ids":
      req[k][:] = 0
      req[k][:len(v)] = v
    else:
      req[k] = v
  raw = req.tobytes() + np.asarray(prompt, np.int64).astype("<i4").tobytes()
  return np.frombuffer(raw, "<u4")[FIRST_WORD:].copy()


@dataclasses.dataclass
class Racing:
  """The racing slots' request (G), its prompt area and the writer's variants of it.

  Both racing slots name one prompt area in the racing worker's arena range (`offset`), past
  the tokens its client allocates for what it submits itself (two prompts of G_PLEN)."""
  geo: P.Geometry
  cfg: F.SchedConfig
  prompt_area: np.ndarray  # max_prompt valid tokens: G's prompt is the first G_PLEN
  offset: int              # the area's first token in the arena
  bursts: list            # each [n, words]: what one burst of the writer cycles through

  @classmethod
  def build(cls, geo: P.Geometry, cfg: F.SchedConfig, seed: int = 7) -> "Racing":
    rng = np.random.default_rng(seed)
    mp, mc, vocab = geo.max_prompt, cfg.max_context, cfg.vocab_size
    assert mp < mc - 1, "max_prompt must be a valid prompt length here"
    area = rng.integers(2, vocab, mp).astype(np.int64)
    lane = geo.worker_arena(WORKERS - 1, WORKERS)
    offset = lane.stop - mp
    assert offset >= lane.start + 2 * G_PLEN, "the racing worker's arena share is too small"
    g = dict(prompt_len=G_PLEN, prompt_offset=offset, max_tokens=G_MAX_TOKENS, temperature=G_TEMPERATURE,
             top_p=G_TOP_P, top_k=G_TOP_K, num_logprobs=G_NUM_LOGPROBS,
             flags=P.FLAG_LOGPROBS, num_stop_ids=len(G_STOPS), stop_ids=list(G_STOPS))
    field_variants = [
        {"prompt_len": v} for v in (0, 1, mp, mp + 1, mc - 1, mc, 10_000, 2**31, 2**32 - 1)
    ] + [
        {"max_tokens": 0},
        {"temperature": math.nan}, {"temperature": -1.0}, {"temperature": math.inf},
        {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": math.nan}, {"top_k": -1},
        {"top_k": -2**31},
        {"num_stop_ids": P.MAX_STOP_IDS + 1}, {"num_stop_ids": 1000},
        {"num_stop_ids": 2**32 - 1},
        {"stop_ids": [vocab, G_STOPS[1]]}, {"stop_ids": [G_STOPS[0], -1]},
        {"num_logprobs": geo.max_top_logprobs + 1}, {"num_logprobs": 2**32 - 1},
        {"flags": P.FLAG_LOGPROBS | 0x80}, {"flags": 2**32 - 1},
        {"prompt_offset": geo.arena_tokens - G_PLEN + 1}, {"prompt_offset": 2**32 - 1},
        {"prompt_offset": 2**32 - G_PLEN + 1},  # wraps around in 32 bits
    ]
    prompt_variants = []
    for pos, tok in ((0, vocab), (G_PLEN - 1, -1), (2, 1000), (mp - 1, 2**31 - 1)):
      bad = area.copy()
      bad[pos] = tok
      prompt_variants.append(bad)
    good = _encode(g, area)
    variants = ([_encode({**g, **v}, area) for v in field_variants]
                + [_encode(g, bad) for bad in prompt_variants])
    # One field flipping between its bad value and G's (the device validates one and may load
    # the other), one burst per variant; then one through every variant in turn. Every burst
    # ends on G: between bursts the slot holds what the frontend submitted.
    bursts = [np.stack([v, good]) for v in variants]
    bursts.append(np.stack([x for v in variants for x in (good, v)] + [good]))
    return cls(geo, cfg, area, offset, bursts)

  def request(self) -> M.Request:
    return M.Request(prompt=self.prompt_area[:G_PLEN].tolist(), max_tokens=G_MAX_TOKENS,
                     temperature=G_TEMPERATURE, top_p=G_TOP_P, top_k=G_TOP_K,
                     stop_ids=G_STOPS, num_logprobs=G_NUM_LOGPROBS, logprobs=True)

  def job(self, plen: int) -> H.Job:
    """The request the device took when it saw prompt_len = plen and G otherwise."""
    return H.Job(0, self.prompt_area[:plen].tolist(), G_MAX_TOKENS, stop_ids=G_STOPS,
                 logprobs=G_NUM_LOGPROBS)

  @property
  def valid_prompt_lens(self) -> set[int]:
    return {1, G_PLEN, self.geo.max_prompt}



class RacingWriter:
  """A thread that keeps rewriting the racing slots' requests, burst after burst (Racing.bursts
  in turn), the slots taking turns.

  A burst is one np.copyto of its requests, broadcast over and over, into a stride-0 view of
  the slot (a record dtype the size of the rewritten words): a native loop of one memcpy per
  request without the GIL, a few ns each, for about 10 ms (longer than the switch interval,
  so the writer spends its time writing rather than waiting for the GIL). The device sees the
  fields change many times during one call.
  """

  def __init__(self, buf: np.ndarray, geo: P.Geometry, slots, offset: int, bursts: list,
               per_burst: int = PER_BURST):
    # Each burst's words split in two: the request's fixed words, rewritten in every racing
    # slot, and the prompt area's, rewritten in the arena at `offset` (one copy per burst).
    words = bursts[0].shape[1]
    parts = ((0, FIXED_WORDS, [geo.request_offset(s) + 4 * FIRST_WORD for s in slots]),
             (FIXED_WORDS, words, [geo.arena_offset + 4 * offset]))
    self._jobs = []  # per burst: (destination, source) pairs
    for b in bursts:
      jobs = []
      for lo, hi, offsets in parts:
        rec = np.dtype((np.void, 4 * (hi - lo)))
        src = np.ascontiguousarray(b[:, lo:hi]).view(rec).reshape(-1)
        for o in offsets:
          one = buf[o:o + 4 * (hi - lo)].view(rec)
          jobs.append((np.lib.stride_tricks.as_strided(
              one, shape=(max(1, per_burst // len(src)), len(src)), strides=(0, 0),
              writeable=True), src))
      self._jobs.append(jobs)
    self.bursts = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="racing-writer", daemon=True)

  def _loop(self) -> None:
    while not self._stop.is_set():
      for dst, src in self._jobs[self.bursts % len(self._jobs)]:
        np.copyto(dst, src)
      self.bursts += 1

  def __enter__(self) -> "RacingWriter":
    # Between bursts the writer waits for the GIL, which the main thread keeps up to the
    # switch interval: a short one keeps the writer writing most of the time.
    self._switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join(10)
    sys.setswitchinterval(self._switch)


# ---------------------------------------------------------------- backends

class _Backend:
  """What both backends do alike through their scheduler `s`."""

  def schedule(self) -> np.ndarray:
    return np.array(self.s.schedule())

  def page_table(self) -> np.ndarray:
    return self.s.page_table


class HostBackend(_Backend):
  """The scheduler through the C API (the CPU handlers' code), buffers between guard words."""

  def __init__(self, cfg: F.SchedConfig, region: M.LocalRegion):
    self.cfg = cfg
    self.s = HostScheduler(cfg, guard=GUARD_WORDS)

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(state, history) as the device left them."""
    return self.s.state, self.s.history

  def set_arrays(self, state: np.ndarray, history: np.ndarray) -> None:
    self.s.state[...] = state
    self.s.history[...] = history

  def commit(self, *outs) -> None:
    self.s.commit(*outs)

  def broken_guards(self) -> list[str]:
    return self.s.broken_guards()

  def close(self) -> None:
    pass


class XlaBackend(_Backend):
  """blink_schedule / blink_commit through XLA on `device` (the CUDA handlers on a GPU, which
  read the mailbox through its host-mapped address)."""

  def __init__(self, cfg: F.SchedConfig, region: M.LocalRegion, device: jax.Device):
    from tests.xla_scheduler import XlaScheduler
    self.s = XlaScheduler(cfg, device, region)
    self.cfg = self.s.cfg
    self.device = device

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    return np.array(self.s.state), np.array(self.s.history)

  def set_arrays(self, state: np.ndarray, history: np.ndarray) -> None:
    self.s.state = jax.device_put(state, self.device)
    self.s.history = jax.device_put(history, self.device)

  def commit(self, *outs) -> None:
    self.s.commit(*outs)
    jax.block_until_ready(self.s.state)

  def broken_guards(self) -> list[str]:
    return []  # XLA owns these buffers

  def close(self) -> None:
    self.s.close()


# ---------------------------------------------------------------- the run

@dataclasses.dataclass
class Admission:
  lane: int
  prompt: list[int]
  stops: list[int]


@dataclasses.dataclass
class Stats:
  racing: int = 0           # racing requests finished
  errors: dict = dataclasses.field(default_factory=dict)
  racing_ok: int = 0
  changed: int = 0          # racing requests whose outcome shows a value the writer wrote
  good: int = 0
  calls: int = 0
  raced_calls: int = 0      # calls with a racing slot's request different before and after
  bursts: int = 0
  seconds: float = 0.0


class Checker:
  """The shadow of what the device may write, checked after every scheduler call."""

  def __init__(self, cfg: F.SchedConfig, region: M.LocalRegion, backend, racing: Racing,
               racing_slots, sent: dict):
    self.cfg, self.region, self.backend, self.racing = cfg, region, backend, racing
    self.racing_slots = set(racing_slots)
    self.sent = sent  # (slot, seq) -> Job of a well-formed request
    self.lay = _layout(cfg)
    ms = cfg.max_seqs
    self.exp_hist = np.full((ms, cfg.max_context), HIST_CANARY, np.int32)
    self.exp_stop = np.full((ms, self.lay["max_stop_ids"]), STOP_CANARY, np.int32)
    self.admissions: dict[tuple[int, int], Admission] = {}
    self.len_before_commit = np.zeros(ms, np.int64)
    state = np.array(backend.arrays()[0])
    self._stop_view(state)[...] = self.exp_stop
    backend.set_arrays(state, self.exp_hist.copy())
    self._frozen_before = None

  # -- views of a state --
  def _lane(self, st: np.ndarray, field: str) -> np.ndarray:
    ms, f = self.cfg.max_seqs, self.lay["l." + field]
    return st[self.lay["lanes"] + f * ms:self.lay["lanes"] + (f + 1) * ms]

  def _stop_view(self, st: np.ndarray) -> np.ndarray:
    n = self.lay["max_stop_ids"]
    return st[self.lay["stop_ids"]:self.lay["stop_ids"] + n * self.cfg.max_seqs].reshape(-1, n)

  # -- the mailbox parts the device never writes --
  def _frozen(self) -> list[bytes]:
    g, buf = self.racing.geo, self.region.buf
    parts = [bytes(buf[:P.HEADER_DTYPE.fields["loop_iterations"][1]]),
             bytes(buf[g.total_bytes:])]
    for s in range(g.num_slots):
      if s not in self.racing_slots:
        parts.append(bytes(buf[g.request_offset(s):g.output_offset(s)]))
    # The arena but the racing prompt area.
    area = g.arena_offset + 4 * self.racing.offset
    parts += [bytes(buf[g.arena_offset:area]), bytes(buf[area + 4 * g.max_prompt:g.total_bytes])]
    return parts

  def before_call(self) -> None:
    self._frozen_before = self._frozen()

  def _common(self, what: str, st, hist) -> None:
    assert not self.backend.broken_guards(), f"{what}: wrote past {self.backend.broken_guards()}"
    assert self._frozen() == self._frozen_before, f"{what}: wrote a frontend-owned mailbox area"
    bad = np.argwhere(hist != self.exp_hist)
    assert not len(bad), (f"{what}: history written outside what the device may write, at "
                          f"(lane, position) {bad[:8].tolist()}: "
                          f"{hist[tuple(bad[:8].T)].tolist()}")
    bad = np.argwhere(self._stop_view(st) != self.exp_stop)
    assert not len(bad), f"{what}: stop-id state written at (lane, index) {bad[:8].tolist()}"
    self._check_lanes(what, st)
    if isinstance(self.backend, HostBackend):
      msg = self.backend.s.check()
      assert not msg, f"{what}: state invariant broken: {msg}"

  def _check_lanes(self, what: str, st) -> None:
    cfg = self.cfg
    active = self._lane(st, "state") != 0
    plen = self._lane(st, "prompt_len")[active]
    assert ((plen >= 1) & (plen <= min(cfg.max_prompt, cfg.max_context - 1))).all(), (
        f"{what}: a lane holds prompt_len {plen.tolist()}")
    length = self._lane(st, "len")[active]
    assert ((length >= plen) & (length <= cfg.max_context)).all(), f"{what}: len {length}"
    ns = self._lane(st, "num_stop")[active]
    assert ((ns >= 0) & (ns <= self.lay["max_stop_ids"])).all(), f"{what}: num_stop {ns}"
    nl = self._lane(st, "num_logprobs")[active]
    assert ((nl >= 0) & (nl <= cfg.max_top_logprobs)).all(), f"{what}: num_logprobs {nl}"
    flags = self._lane(st, "flags")[active]
    assert not (flags & ~(P.FLAG_IGNORE_EOS | P.FLAG_LOGPROBS | P.FLAG_PROMPT_LOGPROBS)).any()
    mt = self._lane(st, "max_tokens")[active]
    assert ((mt >= 1) & (mt <= cfg.max_context - plen)).all(), f"{what}: max_tokens {mt}"
    assert (self._lane(st, "top_k")[active] >= 0).all()
    temp = self._lane(st, "temperature")[active].view(np.float32)
    assert (np.isfinite(temp) & (temp >= 0)).all(), f"{what}: temperature {temp}"
    top_p = self._lane(st, "top_p")[active].view(np.float32)
    assert ((top_p > 0) & (top_p <= 1)).all(), f"{what}: top_p {top_p}"

  def after_schedule(self, words: np.ndarray) -> None:
    st, hist = self.backend.arrays()
    cfg, lay = self.cfg, self.lay
    n_new = int(st[lay["scalars"] + lay["s.num_admitted"]])
    for l in (int(x) for x in st[lay["new_lanes"]:lay["new_lanes"] + n_new]):
      slot, seq = int(self._lane(st, "slot")[l]), int(self._lane(st, "seq")[l]) & 0xFFFFFFFF
      plen, ns = int(self._lane(st, "prompt_len")[l]), int(self._lane(st, "num_stop")[l])
      assert 1 <= plen <= min(cfg.max_prompt, cfg.max_context - 1), (
          f"slot {slot} admitted with prompt_len {plen}")
      assert 0 <= ns <= lay["max_stop_ids"], f"slot {slot} admitted with {ns} stop ids"
      copied = [int(t) for t in hist[l, :plen]]
      stops = [int(t) for t in self._stop_view(st)[l, :ns]]
      fields = {k: int(self._lane(st, k)[l]) for k in
                ("max_tokens", "flags", "num_logprobs", "temperature", "top_p", "top_k")}
      if slot in self.racing_slots:
        # Validated: the only valid values the writer writes are G's (and 3 prompt lengths).
        assert plen in self.racing.valid_prompt_lens, f"racing lane prompt_len {plen}"
        area = self.racing.prompt_area
        assert all(t in (int(area[i]), 0) for i, t in enumerate(copied)), (
            f"racing lane copied {copied}, not from its prompt area {area[:plen].tolist()}")
        assert stops == list(G_STOPS), f"racing lane stop ids {stops}"
        want = dict(max_tokens=G_MAX_TOKENS, flags=P.FLAG_LOGPROBS, num_logprobs=G_NUM_LOGPROBS,
                    temperature=_bits(G_TEMPERATURE), top_p=_bits(G_TOP_P), top_k=G_TOP_K)
        assert fields == want, (f"racing lane admitted with {fields}, not the only valid "
                                f"values {want}")
      else:
        job = self.sent[(slot, seq)]
        assert copied == job.prompt and stops == list(job.stop_ids), (slot, copied, stops)
        flags = ((P.FLAG_LOGPROBS if job.logprobs >= 0 else 0)
                 | (P.FLAG_PROMPT_LOGPROBS if job.prompt_logprobs else 0)
                 | (P.FLAG_IGNORE_EOS if job.ignore_eos else 0))
        assert fields["flags"] == flags and fields["num_logprobs"] == max(job.logprobs, 0)
        assert fields["max_tokens"] == min(job.max_tokens, cfg.max_context - plen)
      self.exp_hist[l, :plen] = copied
      self.exp_stop[l, :ns] = stops
      self.admissions[(slot, seq)] = Admission(l, copied, stops)
    self.len_before_commit[:] = self._lane(st, "len")
    self._common("schedule", st, hist)

  def after_commit(self, words: np.ndarray, sampled: np.ndarray) -> None:
    cfg = self.cfg
    b = B.split(words, cfg.token_budget, cfg.max_seqs, 0, cfg.max_seqs)
    for i in range(int(words[B.NUM_SAMPLES])):
      l = int(b.lanes[i])
      if l >= 0:
        t = int(sampled[i])
        self.exp_hist[l, self.len_before_commit[l]] = t if 0 <= t < cfg.vocab_size else 0
    st, hist = self.backend.arrays()
    self._common("commit", st, hist)


def _random_job(rng: random.Random, cfg: F.SchedConfig) -> H.Job:
  plen = rng.randint(1, cfg.max_prompt)
  return H.Job(0, [rng.randrange(cfg.vocab_size) for _ in range(plen)],
               max_tokens=rng.randint(1, 12),
               stop_ids=tuple(rng.randrange(cfg.vocab_size) for _ in range(rng.randint(0, 3))),
               ignore_eos=rng.random() < 0.5, logprobs=rng.randint(-1, 3),
               prompt_logprobs=rng.random() < 0.3)


def _check_output(what: str, job: H.Job, r: H.JobResult, cfg: F.SchedConfig) -> None:
  if job.prompt_logprobs:
    r = H.split_prompt_entries(0, job, r, cfg)
  want, why = H.oracle(job, cfg.vocab_size, cfg.max_context, [1])
  assert (r.finish, r.tokens) == (why, want), f"{what}: {r.finish!r} {r.tokens} != {why!r} {want}"
  if job.logprobs >= 0:
    assert r.logprobs == [-0.5 - (t % 7) for t in r.tokens], what
    for t, top in zip(r.tokens, r.top):
      assert [a for a, _ in top[:job.logprobs]] == [(t + k) % cfg.vocab_size
                                                   for k in range(job.logprobs)], what


def race(make_backend, *, seconds: float, min_racing: int, seed: int = 0,
         max_seconds: float = 40.0) -> Stats:
  """Runs well-formed requests beside racing slots for `seconds` (and until `min_racing`
  racing requests finished), checking every call; returns what happened."""
  geo = GEO
  buf = np.zeros(geo.total_bytes + MAILBOX_GUARD, np.uint8)
  buf[geo.total_bytes:] = MAILBOX_GUARD_BYTE
  region = M.LocalRegion(buf)
  M.init_header(region, geo, vocab_size=PARAMS["vocab_size"],
                max_context=PARAMS["max_context"], num_workers=WORKERS, eos_id=1)
  cfg = H.make_config(region, geo, **PARAMS)
  backend = make_backend(cfg, region)
  clients = [M.MailboxClient(region, w, WORKERS) for w in range(WORKERS)]
  racing_slots = list(geo.worker_slots(WORKERS - 1, WORKERS))
  racing = Racing.build(geo, cfg)
  sent: dict[tuple[int, int], H.Job] = {}
  checker = Checker(cfg, region, backend, racing, racing_slots, sent)
  model = H.FakePagedModel(cfg)
  rng = random.Random(seed)
  stats = Stats()
  area = geo.arena_offset + 4 * racing.offset
  # The racing prompt area holds G's, as the writer leaves it between bursts.
  buf[area:area + 4 * geo.max_prompt] = np.frombuffer(
      racing.prompt_area.astype("<i4").tobytes(), np.uint8)
  racing_areas = lambda: [bytes(buf[o:o + 4 * FIXED_WORDS]) for o in  # noqa: E731
                          (geo.request_offset(s) + 4 * FIRST_WORD for s in racing_slots)
                          ] + [bytes(buf[area:area + 4 * geo.max_prompt])]
  active: dict[int, tuple[M.MailboxClient, int, H.Job | None, H.JobResult]] = {}
  t0 = time.monotonic()
  try:
    with RacingWriter(buf, geo, racing_slots, racing.offset, racing.bursts) as writer:
      while True:
        elapsed = time.monotonic() - t0
        assert elapsed < max_seconds, f"did not finish in {max_seconds} s: {stats}"
        more = elapsed < seconds or stats.racing < min_racing
        # Frontend: read outputs, finish requests, submit more.
        for slot, (client, seq, job, r) in list(active.items()):
          out = client.poll(slot)
          assert r.finishes_seen == 0 or not out.tokens, "tokens after the finish"
          r.tokens += out.tokens
          r.logprobs += out.logprobs
          r.top += out.top
          if not out.finished:
            continue
          r.finishes_seen += 1
          r.finish, r.error = out.finish_reason, out.error
          client.release(slot)
          del active[slot]
          adm = checker.admissions.get((slot, seq))
          if job is not None:
            _check_output(f"well-formed request on slot {slot}", job, r, cfg)
            stats.good += 1
            continue
          stats.racing += 1
          if r.finish == P.Finish.ERROR:
            assert r.error in RACE_ERRORS and r.tokens == [], (r.error, r.tokens)
            stats.errors[r.error.name] = stats.errors.get(r.error.name, 0) + 1
            # Only a bad prompt token is found after admission (by the prompt copy).
            assert (adm is not None) == (r.error == P.Error.TOKEN_ID), (r.error, adm)
            stats.changed += 1
          else:
            assert adm is not None, "a racing request finished without being admitted"
            plen = len(adm.prompt)
            assert adm.prompt == racing.prompt_area[:plen].tolist(), adm.prompt
            _check_output(f"racing request on slot {slot} (prompt_len {plen})",
                          racing.job(plen), r, cfg)
            stats.racing_ok += 1
            stats.changed += plen != G_PLEN
        for w, client in enumerate(clients):
          job_of = (lambda: None) if w == WORKERS - 1 else (lambda: _random_job(rng, cfg))
          while more and client.free_slots:
            job = job_of()
            req = racing.request() if job is None else M.Request(
                prompt=job.prompt, max_tokens=job.max_tokens, stop_ids=job.stop_ids,
                ignore_eos=job.ignore_eos, logprobs=job.logprobs >= 0,
                prompt_logprobs=job.prompt_logprobs, num_logprobs=max(job.logprobs, 0))
            # A racing request names the racing prompt area (the writer keeps it there).
            slot = client.submit(req, None if job else {"prompt_offset": racing.offset})
            seq = client._seq[slot]
            if job is not None:
              sent[(slot, seq)] = job
            active[slot] = (client, seq, job, H.JobResult())
        if not more and not active:
          break
        # Device: schedule, model, commit, each call checked.
        checker.before_call()
        racing_before = racing_areas()
        words = backend.schedule()
        stats.raced_calls += racing_areas() != racing_before
        checker.after_schedule(words)
        outs = model.step(words, np.asarray(backend.page_table()))
        checker.before_call()
        backend.commit(*outs)
        checker.after_commit(words, outs[0])
        stats.calls += 2
      stats.bursts = writer.bursts
  finally:
    backend.close()
  stats.seconds = time.monotonic() - t0
  summary = F.summarize(cfg, backend.arrays()[0])
  assert summary["free_pages"] == cfg.num_pages and summary["free_lanes"] == cfg.max_seqs
  assert summary["finished"] == stats.racing + stats.good
  print(f"\nscheduler race: {stats}")
  return stats


def _check_stats(stats: Stats, min_racing: int) -> None:
  assert stats.racing >= min_racing and stats.good > 0, stats
  assert stats.bursts > 0, stats
  # The writer rests on the submitted request between bursts: an outcome of another value
  # means the scheduler read the slot while the writer was rewriting it.
  assert stats.changed > 0, f"no scheduler call saw the writer's values: {stats}"
  assert stats.raced_calls > 0, f"the writer never wrote during a schedule call: {stats}"


def test_racing_writer_cannot_fool_the_host_scheduler():
  stats = race(lambda cfg, region: HostBackend(cfg, region), seconds=3.0, min_racing=200)
  _check_stats(stats, 200)


def test_racing_writer_through_the_cpu_ffi_handlers():
  """The XLA path the CUDA test takes, on the CPU handlers."""
  dev = jax.devices("cpu")[0]
  stats = race(lambda cfg, region: XlaBackend(cfg, region, dev), seconds=1.5, min_racing=50)
  _check_stats(stats, 50)



@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="no CUDA GPU")
def test_racing_writer_through_the_cuda_handlers():
  """The CUDA handlers read the host-mapped mailbox over PCIe while the host writer thread
  rewrites it."""
  dev = gpus()[0]
  stats = race(lambda cfg, region: XlaBackend(cfg, region, dev), seconds=5.0, min_racing=300)
  _check_stats(stats, 300)
