"""A workload driver for the scheduler: a fake frontend and a fake paged model.

The fake model keeps a KV store of token ids addressed by (page, offset) exactly as the real
model's paged cache is, writes every row of a step, then for each sampled row reads its whole
sequence back through the page table and returns a hash of it. So the expected output of a
request depends on its prompt alone (an oracle computes it), and any lost, duplicated, shared
or stale page, any missing or repeated position, any bad recompute after preemption changes
the tokens the test sees.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

import numpy as np

from blink_jax.native import batch as B
from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P
from blink_jax.native.ffi import SchedConfig
from tests.host_scheduler import HostScheduler

TOP = 3  # top logprob columns the fake model returns


def seq_hash(tokens, vocab: int) -> int:
  h = 0
  for t in tokens:
    h = (h * 1_000_003 + int(t) + 1) % (1 << 61)
  return (h ^ (h >> 17)) % vocab


def prompt_lp(tokens) -> float:
  """The fake model's logprob of tokens[-1] after tokens[:-1] (prompt logprobs)."""
  return -0.01 - seq_hash(tokens, 1000) / 100


@dataclasses.dataclass
class Job:
  submit_step: int
  prompt: list[int]
  max_tokens: int
  stop_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  logprobs: int = -1                 # -1: none; else top-n
  prompt_logprobs: bool = False      # entries start with prompt tokens 1.. and their logprobs
  cancel_after: int | None = None    # steps after submission
  bad: dict | None = None            # raw request overrides that make it invalid
  expect_error: P.Error = P.Error.NONE


@dataclasses.dataclass
class JobResult:
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  top: list = dataclasses.field(default_factory=list)
  finish: P.Finish = P.Finish.NONE
  error: P.Error = P.Error.NONE
  finishes_seen: int = 0
  admit_ticket: int = 0
  submitted_at: int = -1
  slot: int = -1
  cancel_sent: bool = False


def oracle(job: Job, vocab: int, max_context: int, eos_ids) -> tuple[list[int], P.Finish]:
  seq, gen = list(job.prompt), []
  while True:
    t = seq_hash(seq, vocab)
    gen.append(t)
    seq.append(t)
    if (not job.ignore_eos and t in eos_ids) or t in job.stop_ids:
      return gen, P.Finish.STOP
    if len(gen) >= job.max_tokens or len(seq) >= max_context:
      return gen, P.Finish.LENGTH


class FakePagedModel:
  def __init__(self, cfg: SchedConfig):
    self.cfg = cfg
    self.kv = np.full((cfg.num_pages, cfg.page_size), -1, np.int64)
    # Windowed pages: the sliding-window layers' ring of window_pages pages per lane.
    self.ring = np.full((cfg.max_seqs * max(cfg.window_pages, 1), cfg.page_size), -1, np.int64)

  def ring_page(self, lane: int, pos: int) -> int:
    return lane * self.cfg.window_pages + (pos // self.cfg.page_size) % self.cfg.window_pages

  def read(self, page_table: np.ndarray, sid: int, pos: int) -> list[int]:
    """Tokens 0..pos of lane sid as the global layers read them (its page table); with
    windowed pages also the last `window` of them as the sliding-window layers read them (its
    ring): where the two disagree, the result is changed, so a ring entry overwritten too
    early or a window not recomputed changes the tokens the test sees."""
    ps = self.cfg.page_size
    seq = [int(self.kv[page_table[sid, p // ps], p % ps]) for p in range(pos + 1)]
    return seq if self.window_ok(page_table, sid, pos) else seq + [-2]

  def window_ok(self, page_table: np.ndarray, sid: int, pos: int) -> bool:
    """Whether the ring holds what the page table does for the window of lane sid's row at
    pos (always, without windowed pages)."""
    ps, w = self.cfg.page_size, self.cfg.window
    return w == 0 or all(
        self.ring[self.ring_page(sid, p), p % ps] == self.kv[page_table[sid, p // ps], p % ps]
        for p in range(max(0, pos - w + 1), pos + 1))

  def step(self, words: np.ndarray, page_table: np.ndarray):
    cfg = self.cfg
    rows, ns = int(words[B.BUCKET_SIZE]), int(words[B.NUM_SAMPLES])
    b = B.split(words, cfg.token_budget, cfg.max_seqs, rows, cfg.max_seqs)
    ps = cfg.page_size
    for tok, pos, sid, local in zip(b.tokens, b.positions, b.seq_ids, b.local_only):
      if sid < 0:
        continue
      assert not local or cfg.window > 0, "a local-only row without windowed pages"
      if cfg.window > 0:
        self.ring[self.ring_page(sid, pos), pos % ps] = tok
      if not local:
        self.kv[page_table[sid, pos // ps], pos % ps] = tok
    # Every row attends to its window after all of the step's writes (as the model's layers
    # do): a row that reads a wrong window computes a wrong K/V for itself, here a token no
    # oracle sequence holds, so what reads it later changes too.
    if cfg.window > 0:
      for pos, sid, local in zip(b.positions, b.seq_ids, b.local_only):
        if sid >= 0 and not self.window_ok(page_table, sid, pos):
          self.ring[self.ring_page(sid, pos), pos % ps] = -3
          if not local:
            self.kv[page_table[sid, pos // ps], pos % ps] = -3
    sampled = np.zeros(cfg.max_seqs, np.int32)
    lps = np.zeros(cfg.max_seqs, np.float32)
    top_ids = np.zeros((cfg.max_seqs, TOP), np.int32)
    top_lps = np.zeros((cfg.max_seqs, TOP), np.float32)
    row_lps = np.zeros(cfg.token_budget, np.float32)
    row_ids = np.zeros((cfg.token_budget, TOP), np.int32)
    row_top = np.zeros((cfg.token_budget, TOP), np.float32)
    for r, (pos, sid, tgt) in enumerate(zip(b.positions, b.seq_ids, b.targets)):
      if tgt < 0:
        continue
      assert sid >= 0, "a padding row has a prompt-logprob target"
      seq = self.read(page_table, sid, pos)
      row_lps[r] = prompt_lp(seq + [int(tgt)])
      row_ids[r] = [(int(tgt) + j) % cfg.vocab_size for j in range(TOP)]
      row_top[r] = [row_lps[r] - j for j in range(TOP)]
    for i in range(ns):
      lane, row = int(b.lanes[i]), int(b.rows[i])
      if lane < 0:
        continue
      pos = int(b.positions[row])
      assert int(b.seq_ids[row]) == lane, "sample row belongs to another lane"
      assert int(b.position[i]) == pos + 1, "sample position is not the next token's"
      t = seq_hash(self.read(page_table, lane, pos), cfg.vocab_size)
      sampled[i] = t
      lps[i] = -0.5 - (t % 7)
      top_ids[i] = [(t + j) % cfg.vocab_size for j in range(TOP)]
      top_lps[i] = [lps[i] - j for j in range(TOP)]
    return sampled, lps, top_ids, top_lps, row_lps, row_ids, row_top


@dataclasses.dataclass
class RunResult:
  results: list[JobResult]
  steps: int
  summary: dict
  header: np.ndarray
  trace: list  # per-step batch words (for comparing backends)
  local_rows: list  # per step, the local_only flags of its rows


def make_config(region: M.LocalRegion, geo: P.Geometry, **kw) -> SchedConfig:
  defaults = dict(vocab_size=64, max_seqs=4, max_context=48, page_size=4, num_pages=16,
                  buckets=(4, 8, 16), eos_ids=(1,), idle_poll_us=0)
  defaults.update(kw)
  return SchedConfig.build(mailbox=region.address, num_slots=geo.num_slots,
                           max_prompt=geo.max_prompt, ring_capacity=geo.ring_capacity,
                           max_top_logprobs=geo.max_top_logprobs,
                           arena_tokens=geo.arena_tokens, **defaults)


def new_mailbox(geo: P.Geometry, vocab: int, max_context: int):
  buf = np.zeros(geo.total_bytes, np.uint8)
  region = M.LocalRegion(buf)
  M.init_header(region, geo, vocab_size=vocab, max_context=max_context, num_workers=1,
                eos_id=1)
  return region


def run(jobs: list[Job], cfg: SchedConfig, region: M.LocalRegion, *,
        backend: HostScheduler | None = None, consume_prob: float = 1.0, seed: int = 0,
        max_steps: int = 4000, check_every_step: bool = True,
        step_hook: Callable | None = None, model: FakePagedModel | None = None) -> RunResult:
  """Runs the jobs to completion; `backend` provides schedule()/commit()/page_table."""
  rng = random.Random(seed)
  sched = backend or HostScheduler(cfg)
  client = M.MailboxClient(region)
  model = model or FakePagedModel(cfg)
  results = [JobResult() for _ in jobs]
  pending = sorted(range(len(jobs)), key=lambda i: jobs[i].submit_step)
  active: dict[int, int] = {}  # slot -> job index
  trace, local_rows = [], []
  step = 0
  while step < max_steps:
    # Frontend: submissions, cancels, reads.
    while pending and jobs[pending[0]].submit_step <= step and client.free_slots:
      i = pending[0]
      j = jobs[i]
      req = M.Request(prompt=j.prompt, max_tokens=j.max_tokens, stop_ids=j.stop_ids,
                      ignore_eos=j.ignore_eos, logprobs=j.logprobs >= 0,
                      prompt_logprobs=j.prompt_logprobs,
                      num_logprobs=max(j.logprobs, 0), request_id=i)
      try:
        slot = client.submit(req, overrides=j.bad)
      except M.SlotsFullError:  # no contiguous arena room yet: wait as a frontend's queue does
        break
      pending.pop(0)
      results[i].submitted_at, results[i].slot = step, slot
      active[slot] = i
    for slot, i in list(active.items()):
      r, j = results[i], jobs[i]
      if (j.cancel_after is not None and not r.cancel_sent
          and step >= r.submitted_at + j.cancel_after):
        client.cancel(slot)
        r.cancel_sent = True
      if rng.random() > consume_prob:
        continue
      out = client.poll(slot)
      assert r.finishes_seen == 0 or not out.tokens, "tokens after the finish"
      r.tokens += out.tokens
      r.logprobs += out.logprobs
      r.top += out.top
      if out.finished:
        r.finishes_seen += 1
        r.finish, r.error = out.finish_reason, out.error
        r.admit_ticket = out.admit_ticket
        client.release(slot)
        del active[slot]
    if not pending and not active:
      break
    # Device: schedule, model, commit.
    words = np.array(sched.schedule())
    trace.append(words[:B.HEADER_WORDS].copy())
    rows = int(words[B.NUM_ROWS])
    local_rows.append(B.split(words, cfg.token_budget, cfg.max_seqs, rows, 0).local_only.copy())
    sched.commit(*model.step(words, np.asarray(sched.page_table)))
    if check_every_step and isinstance(sched, HostScheduler):
      msg = sched.check()
      assert not msg, f"step {step}: state invariant broken: {msg}"
    if step_hook:
      step_hook(step, sched)
    step += 1
  else:
    raise AssertionError(f"workload did not finish in {max_steps} steps")
  summary = sched.summary()
  return RunResult(results, step, summary, M.read_header(region), trace, local_rows)


def split_prompt_entries(i: int, j: Job, r: JobResult, cfg: SchedConfig) -> JobResult:
  """Checks the prompt-logprob entries (prompt tokens 1.., each once, with the fake model's
  logprob and top-n) and returns the result with only the generated entries."""
  n = min(len(j.prompt) - 1, len(r.tokens))
  if r.finish != P.Finish.CANCELLED:
    assert n == len(j.prompt) - 1, f"job {i}: {n} prompt entries"
  assert r.tokens[:n] == list(j.prompt[1:n + 1]), f"job {i}: prompt entries {r.tokens[:n]}"
  want = [prompt_lp(j.prompt[:p + 1]) for p in range(1, n + 1)]
  assert np.allclose(r.logprobs[:n], want, atol=1e-6), f"job {i}: prompt logprobs"
  k = max(j.logprobs, 0)
  for t, top in zip(r.tokens[:n], r.top[:n]):
    assert [a for a, _ in top[:k]] == [(t + q) % cfg.vocab_size for q in range(k)]
  return dataclasses.replace(r, tokens=r.tokens[n:], logprobs=r.logprobs[n:], top=r.top[n:])


def check_run(jobs: list[Job], res: RunResult, cfg: SchedConfig) -> None:
  """Every property the issue names, for one finished run."""
  eos = [e for e in (cfg.eos0, cfg.eos1, cfg.eos2, cfg.eos3) if e >= 0]
  n_err = n_canc = n_tokens = 0
  for i, (j, r) in enumerate(zip(jobs, res.results)):
    assert r.finishes_seen == 1, f"job {i} finished {r.finishes_seen} times"
    if j.prompt_logprobs and j.expect_error == P.Error.NONE:
      r = split_prompt_entries(i, j, r, cfg)
    n_tokens += len(r.tokens)
    if j.expect_error != P.Error.NONE:
      assert (r.finish, r.error) == (P.Finish.ERROR, j.expect_error), (i, r.finish, r.error)
      assert r.tokens == [], f"bad job {i} produced tokens"
      n_err += 1
      continue
    want, why = oracle(j, cfg.vocab_size, cfg.max_context, eos)
    if r.finish == P.Finish.CANCELLED:
      assert j.cancel_after is not None, f"job {i} cancelled without a cancel"
      assert r.tokens == want[:len(r.tokens)], f"job {i}: cancelled output diverges"
      n_canc += 1
    else:
      assert r.finish == why, f"job {i}: finish {r.finish!r}, oracle {why!r}"
      assert r.tokens == want, f"job {i}: tokens {r.tokens} != oracle {want}"
    if j.logprobs >= 0 and r.tokens:
      assert r.logprobs == [-0.5 - (t % 7) for t in r.tokens]
      for t, top in zip(r.tokens, r.top):
        assert [a for a, _ in top[:j.logprobs]] == [(t + k) % cfg.vocab_size
                                                   for k in range(j.logprobs)]
  # FCFS: admitted requests got tickets in (submission step, slot) order.
  admitted = [(r.submitted_at, r.slot, r.admit_ticket) for r in res.results if r.admit_ticket]
  admitted.sort()
  tickets = [t for _, _, t in admitted]
  assert tickets == sorted(tickets), "admission was not first come first served"
  s, h = res.summary, res.header
  assert s["finished"] == len(jobs) == int(h["requests_finished"])
  assert s["errored"] == n_err == int(h["requests_errored"])
  assert s["cancelled"] == n_canc == int(h["requests_cancelled"])
  assert s["tokens_generated"] == n_tokens == int(h["tokens_generated"])
  if cfg.prefix_caching:  # what is not free is cached (unreferenced: every request is done)
    assert s["free_pages"] + s["cached_pages"] == cfg.num_pages, "pages leaked"
    assert int(h["pages_in_use"]) <= s["cached_pages"]
  else:
    assert s["free_pages"] == cfg.num_pages and int(h["pages_in_use"]) == 0, "pages leaked"
  assert s["running"] == s["waiting"] == 0 == int(h["running"]) == int(h["waiting"])
  assert s["free_lanes"] == cfg.max_seqs
