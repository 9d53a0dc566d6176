"""The same random workloads through the XLA FFI handlers: CPU always, CUDA where present.

Every output and counter must equal the direct host run (the CPU handlers are that code; the
CUDA handlers are the same source compiled for one thread block).
"""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from blink_jax.client import protocol as P
from blink_jax.native import ffi as F
from tests import sched_harness as H
from tests.host_scheduler import HostScheduler
from tests.xla_scheduler import XlaScheduler
from tests.cuda_lowering import gpus


def _random_jobs(rng: random.Random, vocab: int, max_context: int, n: int) -> list[H.Job]:
  jobs = []
  for _ in range(n):
    plen = rng.randint(1, min(30, max_context - 1))
    j = H.Job(rng.randint(0, 20), [rng.randrange(vocab) for _ in range(plen)],
              max_tokens=rng.randint(1, 30), stop_ids=(rng.randrange(vocab),),
              ignore_eos=rng.random() < 0.5, logprobs=rng.randint(-1, 3),
              prompt_logprobs=rng.random() < 0.3)
    r = rng.random()
    if r < 0.1:
      j.prompt[-1] = vocab + 3
      j.expect_error = P.Error.TOKEN_ID
    elif r < 0.2:
      j.cancel_after = rng.randint(0, 8)
    jobs.append(j)
  return jobs


def _workload(seed: int):
  """(geometry, scheduler parameters, jobs) of random workload `seed`."""
  rng = random.Random(seed)
  geo = P.Geometry(num_slots=6, max_prompt=40, ring_capacity=3, max_top_logprobs=3)
  params = dict(vocab_size=32, max_context=40, page_size=rng.choice([1, 4, 8]),
                max_seqs=rng.randint(1, 6), buckets=(8, 16), eos_ids=(1,))
  params["num_pages"] = -(-40 // params["page_size"]) + rng.randint(0, 4)
  return geo, params, _random_jobs(rng, params["vocab_size"], params["max_context"], 12)


def _run_both(device: jax.Device, seed: int, pace_us: int = 0, prefix_caching: bool = False,
              windowed: bool = False, pace_permille: int = 0, buckets: tuple = ()):
  """`pace_us`, `pace_permille`: step pacing on, a fixed interval or relative to the step's
  length (ARCHITECTURE.md, "Step pacing"): it only delays steps, so the outputs and batches
  still equal the host run's, and some steps must have waited.
  `prefix_caching`: on, over prompts that share prefixes; some must hit (unless windowed).
  `windowed`: windowed pages, a window of 4-12 tokens in a ring of up to 15 tokens more.
  `buckets`: these step sizes instead of the workload's. Returns the host run."""
  geo, params, jobs = _workload(seed)
  if buckets:
    params["buckets"] = buckets
  params["min_step_interval_us"] = pace_us
  params["step_interval_permille"] = pace_permille
  if pace_us or pace_permille > 1000:
    # Pacing holds only while requests keep arriving (ARCHITECTURE.md, "Step pacing"): one
    # arrival every 6 steps and a lane for each slot, so decode-only steps with nothing
    # waiting come between arrivals, not only in the run's tail, where pacing lets go.
    params["max_seqs"] = geo.num_slots
    for i, j in enumerate(jobs):
      j.submit_step = 6 * i
  if windowed:
    rng = random.Random(seed + 1000)
    params["window"] = rng.randint(4, 12)
    ring = params["window"] + rng.randint(1, 7)  # tokens: a lane's chunk is at most 15
    params["window_pages"] = -(-ring // params["page_size"])
  if prefix_caching:
    params["prefix_caching"] = 1
    rng = random.Random(seed)
    base = [rng.randrange(params["vocab_size"]) for _ in range(24)]
    for j in jobs:
      if j.expect_error == P.Error.NONE and rng.random() < 0.7:
        j.prompt = (base[:rng.randint(8, 24)] + j.prompt)[:39]
  results, paced = [], []
  for backend in ("host", "xla"):
    region = H.new_mailbox(geo, params["vocab_size"], params["max_context"])
    cfg = H.make_config(region, geo, **params)
    sched = HostScheduler(cfg) if backend == "host" else XlaScheduler(cfg, device, region)
    try:
      res = H.run(jobs, cfg, region, backend=sched, consume_prob=0.7, seed=seed,
                  check_every_step=backend == "host")
      paced.append(F.counters(np.asarray(sched.state))["paced_steps"])
    finally:
      if isinstance(sched, XlaScheduler):
        sched.close()
    H.check_run(jobs, res, cfg)
    results.append(res)
  host, xla = results
  for a, b in zip(host.results, xla.results):
    assert (a.tokens, a.finish, a.error, a.admit_ticket) == (b.tokens, b.finish, b.error,
                                                             b.admit_ticket)
  assert host.summary == {**xla.summary, "loop_iterations": host.summary["loop_iterations"]}
  assert len(host.trace) == len(xla.trace)
  for x, y in zip(host.trace, xla.trace):
    np.testing.assert_array_equal(x, y)
  assert all(paced) if pace_us or pace_permille > 1000 else not any(paced), paced
  if prefix_caching and not windowed:
    assert host.summary["prefix_hits"] > 0
  if windowed:  # the ring caps a lane's chunk below the step's budget of 16
    assert params["window_pages"] * params["page_size"] - params["window"] + 1 < 16
  if windowed and prefix_caching:
    assert sum(int(np.sum(t)) for t in host.local_rows) > 0, "no local-only rows"
  return host


@pytest.mark.parametrize("seed", range(4))
def test_cpu_handlers_match_host_run(seed):
  _run_both(jax.devices("cpu")[0], seed)


def test_cpu_handlers_match_host_run_with_step_pacing():
  _run_both(jax.devices("cpu")[0], 1, pace_us=2000)


def test_cpu_handlers_match_host_run_with_relative_step_pacing():
  # A paced step waits as long again as the step before it took (the harness's own work
  # included), so every run has paced steps whatever the machine's speed.
  _run_both(jax.devices("cpu")[0], 2, pace_permille=2000)


def test_cpu_handlers_take_the_most_buckets():
  """MAX_BUCKETS step sizes, each its own attribute of the FFI call (bucket0..bucket15): the
  handlers batch as the host run does, and the steps take small, middle and the largest
  sizes (the engine maps a step's bucket index to its branch whatever the index)."""
  from blink_jax.engine_config import MAX_BUCKETS
  from blink_jax.native import batch as B
  buckets = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)
  assert len(buckets) == MAX_BUCKETS
  host = _run_both(jax.devices("cpu")[0], 3, buckets=buckets)
  taken = {int(w[B.BUCKET]) for w in host.trace if int(w[B.NUM_ROWS]) > 0}
  assert min(taken) < 4 and max(taken) == MAX_BUCKETS - 1 and len(taken) >= 6, taken


@pytest.mark.parametrize("seed", range(3))
def test_cpu_handlers_match_host_run_with_prefix_caching(seed):
  _run_both(jax.devices("cpu")[0], seed, prefix_caching=True)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_cpu_handlers_match_host_run_with_windowed_pages(seed, prefix_caching):
  _run_both(jax.devices("cpu")[0], seed, prefix_caching=prefix_caching, windowed=True)



@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="no CUDA GPU")
@pytest.mark.parametrize("seed", range(8))
def test_cuda_handlers_match_host_run(seed):
  _run_both(gpus()[0], seed)


@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="no CUDA GPU")
def test_cuda_handlers_match_host_run_with_step_pacing():
  # The harness drives each step from Python: between two schedule calls on the GPU the
  # launch, the copies back and the harness's own work can take over 2 ms on a busy host,
  # and then no step waits (0 paced steps once on the H200, 2026-12-05). 20 ms leaves room.
  _run_both(gpus()[0], 1, pace_us=20000)
  _run_both(gpus()[0], 2, pace_permille=2000)  # relative: waits however long a step takes


@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="no CUDA GPU")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_handlers_match_host_run_with_prefix_caching(seed):
  _run_both(gpus()[0], seed, prefix_caching=True)


@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="no CUDA GPU")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_cuda_handlers_match_host_run_with_windowed_pages(seed, prefix_caching):
  _run_both(gpus()[0], seed, prefix_caching=prefix_caching, windowed=True)
