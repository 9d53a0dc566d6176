"""Scheduler properties on the host build of ffi/scheduler.h (the code of the CPU handlers)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from blink_jax.client import protocol as P
from blink_jax.native import batch as B
from blink_jax.native.ffi import SchedConfig
from tests.host_scheduler import HostScheduler
from tests import sched_harness as H

GEO = P.Geometry(num_slots=8, max_prompt=40, ring_capacity=4, max_top_logprobs=3)


def _setup(geo=GEO, **kw):
  region = H.new_mailbox(geo, kw.get("vocab_size", 64), kw.get("max_context", 48))
  return region, H.make_config(region, geo, **kw)


def test_single_request_matches_oracle():
  region, cfg = _setup()
  jobs = [H.Job(0, [5, 6, 7, 8, 9], max_tokens=10, ignore_eos=True)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert len(res.results[0].tokens) == 10
  assert res.results[0].finish == P.Finish.LENGTH


def test_each_token_is_stamped_with_the_device_clock():
  """token_ns (the scheduler's clock when the newest entry was written) grows with every
  token: benchmarks read per-token latency from it without the host's scheduling noise.
  taken_ns and first_ns stamp the request's taking from its slot and its entry 0, once."""
  import time

  import numpy as np
  region, cfg = _setup()
  stamps = []

  def hook(step, sched):
    out = np.frombuffer(region.read(GEO.output_offset(0), P.OUTPUT_FIXED_BYTES),
                        P.OUTPUT_DTYPE)[0]
    stamps.append(tuple(int(out[f]) for f in ("count", "token_ns", "taken_ns", "first_ns")))

  t0 = time.monotonic_ns()
  H.run([H.Job(0, [5, 6, 7], max_tokens=6, ignore_eos=True)], cfg, region, step_hook=hook)
  written = [s for s in stamps if s[0] > 0]
  assert [c for c, *_ in written] == list(range(1, 7))
  ns = [t for _, t, _, _ in written]
  assert all(b > a for a, b in zip(ns, ns[1:])), ns
  assert t0 <= ns[0] <= time.monotonic_ns()  # the CPU handlers use the steady clock
  taken, first = {s[2] for s in stamps}, {s[3] for s in written}
  assert len(taken) == 1 and first == {ns[0]}, (taken, first)  # set once each
  assert t0 <= taken.pop() <= ns[0]
  assert all(f == 0 for c, _, _, f in stamps if c == 0)  # no entry yet: no first stamp

  # With prompt logprobs entry 0 is the first prompt token's: stamped when that is written.
  region, cfg = _setup()
  stamps.clear()
  H.run([H.Job(0, [5, 6, 7, 8], max_tokens=3, ignore_eos=True, prompt_logprobs=True)], cfg,
        region, step_hook=hook)
  written = [s for s in stamps if s[0] > 0]
  assert written[0][0] == 3 and {s[3] for s in written} == {written[0][1]}


def test_named_counters_read_from_the_state():
  """ffi.counters names the state's counters from the library's enum: loop iterations and
  steps and slot scans count on the host too; the kernel and phase timers are device-only
  (zero here)."""
  from blink_jax.native import ffi as F
  region, cfg = _setup()
  seen = []
  H.run([H.Job(0, [5, 6, 7], max_tokens=4, ignore_eos=True)], cfg, region,
        step_hook=lambda step, sched: seen.append(F.counters(sched.state)))
  first, last = seen[0], seen[-1]
  assert set(first) == {"loop_iterations", "steps", "schedule_ns", "commit_ns",
                        "sched_poll_ns", "sched_decode_ns", "sched_admit_ns", "sched_batch_ns",
                        "paced_steps", "paced_ns", "sched_scan_ns", "slot_scans", "step_rows"}
  assert 0 < first["loop_iterations"] < last["loop_iterations"]
  # one submit, one doorbell: the slots were scanned once, in the first pass
  assert first["slot_scans"] == last["slot_scans"] == 1
  assert 0 < last["steps"] <= last["loop_iterations"]
  assert all(last[k] == 0 for k in last if k.endswith("_ns"))


def test_long_prompt_is_chunked_and_mixed_with_decode():
  region, cfg = _setup(buckets=(4, 8), max_seqs=4, num_pages=24)
  jobs = [H.Job(0, [3, 4], max_tokens=20, ignore_eos=True),
          H.Job(2, list(range(2, 38)), max_tokens=4, ignore_eos=True)]
  steps = []

  def hook(step, sched):
    steps.append((int(sched.batch[0]), int(sched.batch[5])))  # rows, decode rows

  res = H.run(jobs, cfg, region, step_hook=hook)
  H.check_run(jobs, res, cfg)
  # The 36-token prompt needs several steps of at most 8 rows, each with a decode row.
  assert any(rows == 8 and dec == 1 for rows, dec in steps), steps


def test_step_rows_count_the_buckets_padding_included():
  """The state counts the rows the steps ran, their buckets' sizes (docs/ARCHITECTURE.md,
  "Step buckets and their padding"): a 9-token prompt is one step of 16 rows (buckets 4, 8,
  16, 32), then 1-row decode steps of 4."""
  from blink_jax.native import ffi as F
  region, cfg = _setup(buckets=(4, 8, 16, 32), max_seqs=4, num_pages=24)
  steps, counted = [], []

  def hook(step, sched):
    b = sched.batch
    if b[B.NUM_ROWS]:
      steps.append((int(b[B.NUM_ROWS]), int(b[B.BUCKET_SIZE])))
    counted.append(F.counters(sched.state)["step_rows"])

  jobs = [H.Job(0, list(range(2, 11)), max_tokens=3, ignore_eos=True)]
  H.check_run(jobs, H.run(jobs, cfg, region, step_hook=hook), cfg)
  assert steps == [(9, 16), (1, 4), (1, 4)], steps
  assert counted[-1] == 24


def test_page_pressure_preempts_youngest_and_recomputes():
  # 3 lanes, pages for barely one full context each: decode growth forces preemption.
  region, cfg = _setup(max_seqs=3, max_context=32, page_size=4, num_pages=8, buckets=(8, 16))
  jobs = [H.Job(0, [10 + i, 11, 12, 13, 14, 15], max_tokens=24, ignore_eos=True)
          for i in range(3)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert res.summary["preemptions"] > 0


def test_bad_slots_finish_with_errors_and_do_not_disturb_others():
  region, cfg = _setup()
  good = H.Job(0, [5, 6, 7], max_tokens=6, ignore_eos=True)
  bad = [
      H.Job(0, [], 5, expect_error=P.Error.PROMPT_LENGTH),
      H.Job(0, [1, 2], 5, bad={"prompt_len": 10_000}, expect_error=P.Error.PROMPT_LENGTH),
      H.Job(0, [1, 64], 5, expect_error=P.Error.TOKEN_ID),
      H.Job(0, [1, -3], 5, expect_error=P.Error.TOKEN_ID),
      H.Job(0, [1, 2], 0, expect_error=P.Error.MAX_TOKENS),
      H.Job(1, [1, 2], 5, bad={"temperature": math.nan}, expect_error=P.Error.TEMPERATURE),
      H.Job(1, [1, 2], 5, bad={"temperature": -1.0}, expect_error=P.Error.TEMPERATURE),
      H.Job(1, [1, 2], 5, bad={"temperature": math.inf}, expect_error=P.Error.TEMPERATURE),
      H.Job(1, [1, 2], 5, bad={"top_p": 0.0}, expect_error=P.Error.TOP_P),
      H.Job(1, [1, 2], 5, bad={"top_p": 1.5}, expect_error=P.Error.TOP_P),
      H.Job(2, [1, 2], 5, bad={"top_k": -2}, expect_error=P.Error.TOP_K),
      H.Job(2, [1, 2], 5, bad={"num_stop_ids": 99}, expect_error=P.Error.STOP_IDS),
      H.Job(2, [1, 2], 5, stop_ids=(64,), expect_error=P.Error.STOP_IDS),
      H.Job(2, [1, 2], 5, bad={"num_logprobs": 4}, expect_error=P.Error.LOGPROBS),
      H.Job(2, [1, 2], 5, bad={"flags": 0x80}, expect_error=P.Error.FLAGS),
  ]
  jobs = [good] + bad
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)


def test_cancel_running_and_waiting_requests():
  region, cfg = _setup(max_seqs=1)
  jobs = [H.Job(0, [5, 6], 30, ignore_eos=True, cancel_after=3),
          H.Job(0, [7, 8], 30, ignore_eos=True, cancel_after=1),  # still waiting for a lane
          H.Job(0, [9, 10], 5, ignore_eos=True)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert [r.finish for r in res.results] == [P.Finish.CANCELLED, P.Finish.CANCELLED,
                                             P.Finish.LENGTH]
  assert res.results[1].tokens == [] and res.results[1].admit_ticket == 0


def test_full_ring_stalls_the_request_until_read():
  region, cfg = _setup()
  jobs = [H.Job(0, [5, 6], 20, ignore_eos=True, logprobs=2),
          H.Job(0, [8, 9], 20, ignore_eos=True)]
  res = H.run(jobs, cfg, region, consume_prob=0.2, seed=3)
  H.check_run(jobs, res, cfg)


def test_prompt_logprobs_once_per_position_through_chunks_small_rings_and_preemption():
  # Prompts longer than the step budget and than the ring (chunks are cut to the ring), page
  # pressure that preempts and recomputes: every prompt position is reported exactly once, in
  # order, with the model's logprob of the prompt token, before the generated tokens.
  region, cfg = _setup(max_seqs=3, max_context=40, page_size=4, num_pages=14, buckets=(4, 8))
  jobs = [H.Job(0, list(range(3 + i, 25 + i)), max_tokens=12, ignore_eos=True,
                prompt_logprobs=True, logprobs=2 if i == 0 else -1) for i in range(3)]
  jobs.append(H.Job(1, [7, 8, 9], max_tokens=5, ignore_eos=True))
  res = H.run(jobs, cfg, region, consume_prob=0.5, seed=1)
  H.check_run(jobs, res, cfg)
  assert res.summary["preemptions"] > 0
  assert len(res.results[0].tokens) == 21 + 12


def test_prompt_logprobs_need_a_ring_of_two():
  geo = P.Geometry(num_slots=4, max_prompt=40, ring_capacity=1, max_top_logprobs=3)
  region, cfg = _setup(geo)
  jobs = [H.Job(0, [5, 6, 7], 4, prompt_logprobs=True, expect_error=P.Error.FLAGS),
          H.Job(0, [5, 6, 7], 4, ignore_eos=True)]
  H.check_run(jobs, H.run(jobs, cfg, region), cfg)


def test_stop_ids_and_eos():
  region, cfg = _setup(vocab_size=8, eos_ids=(1, 2))  # small vocab: stops come quickly
  jobs = [H.Job(0, [3, i], 40) for i in range(4)] + [
      H.Job(0, [4, i], 40, stop_ids=(5,), ignore_eos=True) for i in range(4)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert sum(r.finish == P.Finish.STOP for r in res.results) >= 4


def test_resubmitting_a_busy_slot_is_ignored_until_it_finishes():
  region, cfg = _setup()
  sched = HostScheduler(cfg)
  jobs = [H.Job(0, [5, 6], 4, ignore_eos=True)]
  res = H.run(jobs, cfg, region, backend=sched)
  H.check_run(jobs, res, cfg)


def test_config_errors_name_the_value():
  with pytest.raises(ValueError, match="num_pages"):
    SchedConfig.build(mailbox=1, num_slots=4, max_prompt=8, ring_capacity=4,
                      max_top_logprobs=0, vocab_size=10, max_seqs=2, max_context=64,
                      page_size=4, num_pages=3, buckets=(4,))
  with pytest.raises(ValueError, match="token_budget"):
    SchedConfig.build(mailbox=1, num_slots=4, max_prompt=8, ring_capacity=4,
                      max_top_logprobs=0, vocab_size=10, max_seqs=8, max_context=16,
                      page_size=4, num_pages=8, buckets=(4,))
  # The decode pass packs lane and page counts into one 32-bit scan.
  with pytest.raises(ValueError, match=r"max_seqs=32768 must be in \[1, 32767\]"):
    SchedConfig.build(mailbox=1, num_slots=4, max_prompt=8, ring_capacity=4,
                      max_top_logprobs=0, vocab_size=10, max_seqs=32768, max_context=16,
                      page_size=4, num_pages=8, buckets=(32768,))


# ---------------- property tests ----------------

@st.composite
def workloads(draw):
  vocab = draw(st.sampled_from([8, 16, 64]))
  max_context = draw(st.sampled_from([16, 32, 48]))
  page_size = draw(st.sampled_from([1, 2, 4, 8]))
  max_pages = -(-max_context // page_size)
  num_pages = draw(st.integers(max_pages, max_pages + max_pages // 2 + 1))  # page pressure
  max_seqs = draw(st.integers(1, 8))
  budget = draw(st.sampled_from([b for b in (4, 8, 16) if b >= max_seqs]))
  geo = P.Geometry(num_slots=draw(st.integers(1, 8)), max_prompt=40,
                   ring_capacity=draw(st.integers(1, 6)), max_top_logprobs=3)
  n = draw(st.integers(1, 14))
  jobs = []
  for _ in range(n):
    kind = draw(st.sampled_from(["ok"] * 6 + ["bad_token", "bad_len", "bad_temp", "cancel"]))
    plen = draw(st.integers(1, min(30, max_context - 1)))
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=plen, max_size=plen))
    job = H.Job(submit_step=draw(st.integers(0, 30)), prompt=prompt,
                max_tokens=draw(st.integers(1, 40)),
                stop_ids=tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=2))),
                ignore_eos=draw(st.booleans()), logprobs=draw(st.integers(-1, 3)))
    job.prompt_logprobs = geo.ring_capacity >= 2 and draw(st.integers(0, 3)) == 0
    if kind == "bad_token":
      job.prompt = prompt[:-1] + [vocab + draw(st.integers(0, 5))]
      job.expect_error = P.Error.TOKEN_ID
    elif kind == "bad_len":
      job.bad = {"prompt_len": 0}
      job.expect_error = P.Error.PROMPT_LENGTH
    elif kind == "bad_temp":
      job.bad = {"temperature": math.nan}
      job.expect_error = P.Error.TEMPERATURE
    elif kind == "cancel":
      job.cancel_after = draw(st.integers(0, 12))
    jobs.append(job)
  params = dict(vocab_size=vocab, max_context=max_context, page_size=page_size,
                num_pages=num_pages, max_seqs=max_seqs,
                buckets=tuple(b for b in (2, 4, 8, 16) if b <= budget), eos_ids=(1,))
  return geo, params, jobs, draw(st.floats(0.3, 1.0)), draw(st.integers(0, 99))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(w):
  geo, params, jobs, consume, seed = w
  region = H.new_mailbox(geo, params["vocab_size"], params["max_context"])
  cfg = H.make_config(region, geo, **params)
  res = H.run(jobs, cfg, region, consume_prob=consume, seed=seed)
  H.check_run(jobs, res, cfg)
  event(f"preemptions: {min(res.summary['preemptions'], 3)}")
  event(f"cancelled: {res.summary['cancelled'] > 0}")
  event(f"errored: {res.summary['errored'] > 0}")


# ---------------- prefix caching ----------------

@st.composite
def shared_prefix_workloads(draw):
  """workloads() whose prompts share prefixes (a few system prompts, earlier turns), with
  prefix caching on: pages get registered, hit, shared by lanes running together, evicted
  under page pressure, released by cancels and preemption."""
  geo, params, jobs, consume, seed = draw(workloads())
  vocab = params["vocab_size"]
  bases = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=4, max_size=24),
                        min_size=1, max_size=3))
  for j in jobs:
    if j.expect_error != P.Error.NONE or draw(st.integers(0, 3)) == 0:
      continue  # bad requests and some others keep their own prompts
    base = draw(st.sampled_from(bases))
    k = draw(st.integers(0, len(base)))
    room = params["max_context"] - 1 - k
    own = j.prompt[:max(1, min(len(j.prompt), room, geo.max_prompt - k))]
    j.prompt = (base[:k] + own)[:min(geo.max_prompt, params["max_context"] - 1)]
  return geo, {**params, "prefix_caching": 1}, jobs, consume, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_workloads())
def test_random_workloads_with_prefix_caching(w):
  """Every output as the oracle's (which knows nothing of caching), every state invariant
  after every step (pages free, held or cached; reference counts equal the lanes holding a
  page; the registry's table, children counts and LRU list exact)."""
  geo, params, jobs, consume, seed = w
  region = H.new_mailbox(geo, params["vocab_size"], params["max_context"])
  cfg = H.make_config(region, geo, **params)
  res = H.run(jobs, cfg, region, consume_prob=consume, seed=seed)
  H.check_run(jobs, res, cfg)
  hits = res.summary["prefix_hits"]
  assert 0 <= hits <= res.summary["prefix_queries"]
  event(f"prefix hits: {'none' if hits == 0 else 'some'}")
  event(f"preemptions: {min(res.summary['preemptions'], 3)}")


def test_a_shared_system_prompt_is_computed_once():
  """Requests that share a 24-token prefix (6 pages of 4), one after another: the second and
  third map 5 cached pages (the 6th would leave no prompt token to compute for the
  third, whose prompt is the prefix alone plus one), prefill only the rest, and give the
  oracle's tokens."""
  region, cfg = _setup(prefix_caching=1, num_pages=40, max_context=48)
  base = list(range(2, 26))
  jobs = [H.Job(0, base + [30, 31], max_tokens=3, ignore_eos=True),
          H.Job(6, base + [40], max_tokens=3, ignore_eos=True),
          H.Job(12, base[:20] + [50, 51, 52], max_tokens=3, ignore_eos=True)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  # job 1 finds the 6 pages job 0 registered (24 of 25 prompt tokens), job 2 the first 5.
  assert res.summary["prefix_hits"] == 24 + 20
  assert res.summary["prefix_queries"] == 26 + 25 + 23
  assert res.summary["prompt_tokens"] == 26 + 1 + 3
  assert res.summary["cached_pages"] >= 6


def test_cache_hits_give_their_rows_back_to_more_admissions():
  """Six requests that arrive together and share a cached 24-token prefix each compute one
  token: they are admitted in one step (admission rounds fill the budget the hits gave back),
  and that step's batch holds those six rows, no padding left where the chunks were cut."""
  from blink_jax.native import batch as B
  region, cfg = _setup(prefix_caching=1, num_pages=40, max_context=48, max_seqs=8)
  base = list(range(2, 26))
  jobs = [H.Job(0, base + [30], max_tokens=2, ignore_eos=True)]
  jobs += [H.Job(8, base + [40 + i], max_tokens=2, ignore_eos=True) for i in range(6)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert res.summary["prefix_hits"] == 6 * 24
  firsts = [w for w in res.trace if w[B.NUM_SAMPLES] == 6 and w[B.NUM_DECODE] == 0]
  assert len(firsts) == 1, [list(w[:6]) for w in res.trace]
  assert firsts[0][B.NUM_ROWS] == 6 and firsts[0][B.BUCKET_SIZE] == 8


def test_prefix_caching_off_by_config_keeps_every_page_private():
  region, cfg = _setup(num_pages=40, max_context=48)
  base = list(range(2, 26))
  jobs = [H.Job(0, base + [30], max_tokens=2), H.Job(5, base + [31], max_tokens=2)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert (res.summary["prefix_hits"], res.summary["cached_pages"]) == (0, 0)
  assert res.summary["prompt_tokens"] == 50


# ---------------- windowed pages ----------------

@st.composite
def windows(draw, params):
  """A sliding window and a ring for it: from a window of one token to one longer than the
  context, from the smallest ring that holds the window (one row per lane and step) up."""
  ps, ctx = params["page_size"], params["max_context"]
  window = draw(st.integers(1, ctx + 2))
  least = -(-window // ps)
  return dict(window=window, window_pages=draw(st.integers(least, least + 3)))


def _run_windowed_on_and_off(w, windowed):
  geo, params, jobs, consume, seed = w
  out = []
  for extra in ({}, windowed):
    region = H.new_mailbox(geo, params["vocab_size"], params["max_context"])
    cfg = H.make_config(region, geo, **params, **extra)
    res = H.run(jobs, cfg, region, consume_prob=consume, seed=seed)
    H.check_run(jobs, res, cfg)
    out.append(res)
  off, on = out
  for i, (a, b) in enumerate(zip(off.results, on.results)):
    if jobs[i].cancel_after is None:  # a cancel lands where the steps happen to be
      assert (a.tokens, a.finish, a.error) == (b.tokens, b.finish, b.error), f"job {i}"
  return on


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_with_windowed_pages(data):
  """The fake model reads each sampled row's window back through its lane's ring as well as
  through its page table and changes its token where they disagree: outputs equal the
  oracle's and the windowed-off run's over random workloads (chunked prefill capped so that no
  chunk overwrites the ring entries it reads, preemption, cancels, page pressure)."""
  w = data.draw(workloads())
  on = _run_windowed_on_and_off(w, data.draw(windows(w[1])))
  event(f"preemptions: {min(on.summary['preemptions'], 3)}")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_with_windowed_pages_and_prefix_caching(data):
  """The same with shared prefixes and prefix caching: a hit maps the global layers' cached
  pages and recomputes the window before them for the sliding-window layers (local-only rows,
  whose writes to the shared pages are dropped)."""
  w = data.draw(shared_prefix_workloads())
  on = _run_windowed_on_and_off(w, data.draw(windows(w[1])))
  local = sum(int(np.sum(t)) for t in on.local_rows)
  event(f"local-only rows: {'none' if local == 0 else 'some'}")
  event(f"prefix hits: {'none' if on.summary['prefix_hits'] == 0 else 'some'}")


def test_windowed_chunks_never_overwrite_the_window_they_read():
  """A 40-token prompt, window 8, a ring of 3 pages of 4 (12 tokens): each step computes at
  most 12 - 8 + 1 = 5 of its tokens, and the output is the oracle's. The fake model does see
  a ring that is too small: with a 2-page ring behind the scheduler's back the tokens change."""
  region, cfg = _setup(window=8, window_pages=3, max_context=48, num_pages=40)
  jobs = [H.Job(0, list(range(2, 42)), max_tokens=4, ignore_eos=True)]
  res = H.run(jobs, cfg, region)
  H.check_run(jobs, res, cfg)
  assert max(int(t[B.NUM_ROWS]) for t in res.trace) == 5
  small = H.FakePagedModel(cfg.replace(window_pages=2))
  region, cfg = _setup(window=8, window_pages=3, max_context=48, num_pages=40)
  res = H.run(jobs, cfg, region, model=small)
  want, _ = H.oracle(jobs[0], cfg.vocab_size, cfg.max_context, (1,))
  assert res.results[0].tokens != want


def test_with_windowed_pages_a_cached_prefix_is_shared_but_computed_again():
  """Prefix caching with windowed pages: the second request maps the first's 6 cached pages
  (24 tokens: no second copy of the global layers' K/V) but computes all 25 prompt tokens,
  the 24 in shared pages as local-only rows (the sliding-window layers' K/V of a position
  need the window before it at every layer below, so only a whole recompute is exact). It
  reports no cached tokens: none were saved."""
  base = list(range(2, 26))
  jobs = [H.Job(0, base + [30, 31], max_tokens=12, ignore_eos=True),
          H.Job(6, base + [40], max_tokens=3, ignore_eos=True)]
  free = {}
  for caching in (0, 1):
    region, cfg = _setup(prefix_caching=caching, window=6, window_pages=8, num_pages=40,
                         max_context=48)
    free[caching] = []
    res = H.run(jobs, cfg, region, step_hook=lambda step, s: free[caching].append(
        s.summary()["free_pages"]))
    H.check_run(jobs, res, cfg)
  assert res.summary["prefix_hits"] == 0
  assert res.summary["prompt_tokens"] == 26 + 25
  assert sum(int(np.sum(t)) for t in res.local_rows) == 24
  # The same steps as without caching, the 6 shared pages held once while both run.
  assert min(free[1]) == min(free[0]) + 6


def test_window_config_errors_name_the_value():
  region = H.new_mailbox(GEO, 64, 48)
  with pytest.raises(ValueError, match="window=9 needs window_pages=2"):
    H.make_config(region, GEO, window=9, window_pages=2)
