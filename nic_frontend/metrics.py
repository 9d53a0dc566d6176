"""Prometheus metrics of a frontend worker, and the GPU's counters from the mailbox header.

Frontend metrics (per worker; summed over workers in prometheus-client's multiprocess mode when
PROMETHEUS_MULTIPROC_DIR is set, which scripts/serve.py does for several workers):
  blink_frontend_time_to_first_token_seconds, blink_frontend_time_per_output_token_seconds,
  blink_frontend_e2e_request_latency_seconds (histograms), blink_frontend_requests_total
  {endpoint, status}, blink_frontend_{prompt,generation}_tokens_total, blink_frontend_slots
  _{in_use,total}{worker} and the ring occupancy ratio, blink_frontend_output_ring_fill_ratio,
  and the queue of requests waiting for a slot under vLLM's names: blink_frontend_num_requests
  _waiting{worker} and blink_frontend_request_queue_time_seconds (every request, 0 for one that
  found a free slot); TTFT's other parts: blink_frontend_request_prepare_time_seconds (arrival
  to submission) and blink_frontend_slot_to_first_output_seconds (slot written to first output
  read), of which blink_frontend_device_time_to_first_output_seconds is the device's part;
  blink_frontend_device_time_per_output_token_seconds (TPOT on the device's clock).
Engine metrics, read from the mailbox header at scrape time (published by the GPU):
  blink_engine_state, blink_gpu_<counter>_total for the monotonic counters,
  blink_gpu_{schedule,commit}_seconds_total (the scheduler kernels' device time) and
  blink_gpu_<gauge> for pages_in_use, pages_total, running, waiting, last_step_tokens.
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest, multiprocess)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blink_jax import env
from blink_jax.client import protocol

GPU_COUNTERS = ("loop_iterations", "steps", "tokens_generated", "prompt_tokens",
                "requests_admitted", "requests_finished", "requests_errored",
                "requests_cancelled", "preemptions",
                # vLLM's prefix-cache counters (tokens), 0 with prefix caching off
                "prefix_cache_queries", "prefix_cache_hits",
                # schedule passes that scanned the slots for new requests
                "slot_scans",
                # rows the steps ran, padding included (docs/ARCHITECTURE.md, "Step buckets
                # and their padding")
                "step_rows")
GPU_GAUGES = ("pages_in_use", "pages_total", "running", "waiting", "last_step_tokens")
# Device time inside the scheduler's two kernels, published in ns (CUDA only: 0 on the CPU),
# exported in seconds: per loop iteration, what a step costs outside the model, the part
# that reads and writes the mailbox in host memory.
GPU_SECONDS = {"schedule_ns": "schedule_seconds", "commit_ns": "commit_seconds"}

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)
_QUEUE_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  20.0, 40.0, 80.0, 160.0, 320.0)
_FILL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class HeaderCollector:
  """Yields the engine's state and the GPU-published counters of the latest header snapshot."""

  def __init__(self, source: Callable[[], dict | None]):
    self._source = source

  def describe(self):
    return []

  def collect(self):
    h = self._source()
    state = GaugeMetricFamily("blink_engine_state",
                              "Engine state from the mailbox header: 0 starting, 1 ready, "
                              "2 stopped, -1 unreachable")
    state.add_metric([], -1 if h is None else h["engine_state"])
    yield state
    if h is None:
      return
    for name in GPU_COUNTERS:
      c = CounterMetricFamily(f"blink_gpu_{name}", f"GPU-published counter {name}")
      c.add_metric([], h[name])
      yield c
    for field, name in GPU_SECONDS.items():
      c = CounterMetricFamily(f"blink_gpu_{name}", f"Device time in the scheduler's "
                              f"{field[:-3]} kernel (CUDA only)")
      c.add_metric([], h[field] / 1e9)
      yield c
    # The schedule kernel's time by phase (header sched_<phase>_ns), one family labelled by
    # phase: which part grows when a step slows down (docs/ARCHITECTURE.md, "The mailbox
    # contract").
    phases = CounterMetricFamily(
        "blink_gpu_schedule_phase_seconds", "Device time in the scheduler's schedule kernel by "
        "phase (CUDA only): scan (doorbells, slot scan), poll (lane checks, releases), decode, "
        "admit (prefill chunks, admissions, prompt copies), batch (arrays, idle polling)",
        labels=["phase"])
    for phase in protocol.SCHEDULE_PHASES:
      phases.add_metric([phase], h[f"sched_{phase}_ns"] / 1e9)
    yield phases
    for name in GPU_GAUGES:
      g = GaugeMetricFamily(f"blink_gpu_{name}", f"GPU-published gauge {name}")
      g.add_metric([], h[name])
      yield g


class _WorkersCollector(multiprocess.MultiProcessCollector):
  """prometheus-client's multiprocess collector, less the files of a worker that is still
  starting: a process creates its file empty and sizes it a moment later, and a scrape that
  read it in between failed with a struct.error, a 500 from a sibling worker's /metrics
  while another (re)started. A file removed under the scrape (a dead worker's, cleaned up)
  gets the same treatment: the scrape reads the directory again."""

  def collect(self):
    for attempt in range(3):
      files = []
      for f in glob.glob(os.path.join(self._path, "*.db")):
        with contextlib.suppress(OSError):
          if os.path.getsize(f) > 0:
            files.append(f)
      try:
        return self.merge(files, accumulate=True)
      except FileNotFoundError:
        if attempt == 2:
          raise


class FrontendMetrics:
  """The metrics of one frontend worker; `render()` is the /metrics body."""

  def __init__(self, worker: int = 0, header_source: Callable[[], dict | None] | None = None,
               multiprocess_dir: str | None = None):
    self.worker = str(worker)
    mp_dir = multiprocess_dir if multiprocess_dir is not None else env.get(
        env.PROMETHEUS_MULTIPROC_DIR)
    self.multiprocess = bool(mp_dir)
    if self.multiprocess:
      own = None  # values live in the directory's files; exposition merges every worker's
      self.registry = CollectorRegistry()
      _WorkersCollector(self.registry, path=mp_dir)
      gauge_kw = {"multiprocess_mode": "livesum"}
    else:
      own = self.registry = CollectorRegistry()
      gauge_kw = {}
    if header_source is not None:
      self.registry.register(HeaderCollector(header_source))
    self.ttft = Histogram("blink_frontend_time_to_first_token_seconds",
                          "Time from request arrival to its first output token",
                          buckets=_TTFT_BUCKETS, registry=own)
    self.tpot = Histogram("blink_frontend_time_per_output_token_seconds",
                          "Mean time between output tokens of a request",
                          buckets=_TPOT_BUCKETS, registry=own)
    self.e2e = Histogram("blink_frontend_e2e_request_latency_seconds",
                         "Time from request arrival to its last byte", buckets=_E2E_BUCKETS,
                         registry=own)
    self.requests = Counter("blink_frontend_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=own)
    self.prompt_tokens = Counter("blink_frontend_prompt_tokens", "Prompt tokens submitted",
                                 registry=own)
    self.generation_tokens = Counter("blink_frontend_generation_tokens",
                                     "Completion tokens returned", registry=own)
    self.cancelled = Counter("blink_frontend_cancelled_requests",
                             "Requests cancelled on the device by the frontend (client "
                             "disconnect, stop string, shutdown)", ["reason"], registry=own)
    self.slots_in_use = Gauge("blink_frontend_slots_in_use",
                              "Mailbox slots of this worker holding a request", ["worker"],
                              registry=own, **gauge_kw)
    self.slots_total = Gauge("blink_frontend_slots_total", "Mailbox slots of this worker",
                             ["worker"], registry=own, **gauge_kw)
    self.ring_occupancy = Gauge("blink_frontend_ring_occupancy_ratio",
                                "Fraction of this worker's slot ring in use", ["worker"],
                                registry=own, **({"multiprocess_mode": "max"}
                                                 if self.multiprocess else {}))
    self.waiting = Gauge("blink_frontend_num_requests_waiting",
                         "Requests of this worker waiting (FIFO) for a free mailbox slot",
                         ["worker"], registry=own, **gauge_kw)
    self.queue_time = Histogram("blink_frontend_request_queue_time_seconds",
                                "Time from a request's submission to its mailbox slot",
                                buckets=_QUEUE_BUCKETS, registry=own)
    # TTFT's parts as the frontend sees them (docs/PERFORMANCE.md, "Frontend cores"): before
    # the mailbox (prepare, then queue_time), and from the slot's write to the driver's first
    # read of its output (the device's admission and prefill, the ring, the driver's poll).
    self.prepare_time = Histogram("blink_frontend_request_prepare_time_seconds",
                                  "Time from request arrival to its submission: body, "
                                  "validation, tokenization", buckets=_QUEUE_BUCKETS,
                                  registry=own)
    self.slot_to_first_output = Histogram(
        "blink_frontend_slot_to_first_output_seconds",
        "Time from the start of a request's write into its mailbox slot to the driver's first "
        "read of its output", buckets=_TTFT_BUCKETS, registry=own)
    # The same two on the device's clock (the output header's stamps, ffi/mailbox.h): from
    # taking a request out of its slot to its first entry (its wait for a lane and its
    # prefill), and per output token. Beside slot_to_first_output and tpot, they tell a
    # slower device loop from a slower mailbox round trip or stream under interference.
    self.device_first_output = Histogram(
        "blink_frontend_device_time_to_first_output_seconds",
        "Device clock from taking a request out of its slot to writing its first output",
        buckets=_TTFT_BUCKETS, registry=own)
    self.device_tpot = Histogram("blink_frontend_device_time_per_output_token_seconds",
                                 "Mean time between a request's output tokens on the device's "
                                 "clock", buckets=_TPOT_BUCKETS, registry=own)
    self.output_fill = Histogram("blink_frontend_output_ring_fill_ratio",
                                 "Fill of a slot's output ring when the frontend read it",
                                 buckets=_FILL_BUCKETS, registry=own)
    self.set_waiting(0)

  def set_slots(self, in_use: int, total: int) -> None:
    self.slots_in_use.labels(self.worker).set(in_use)
    self.slots_total.labels(self.worker).set(total)
    self.ring_occupancy.labels(self.worker).set(in_use / total if total else 0.0)

  def set_waiting(self, n: int) -> None:
    self.waiting.labels(self.worker).set(n)

  def request_done(self, endpoint: str, status: int) -> None:
    self.requests.labels(endpoint, str(status)).inc()

  def render(self) -> tuple[bytes, str]:
    return generate_latest(self.registry), CONTENT_TYPE_LATEST
