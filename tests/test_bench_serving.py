"""bench/serving.py: workload generators, metrics, and one run against a real frontend
worker backed by the fake device (CPU, a few seconds)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import serving as BS
from tests import fake_device as FD

REPO = Path(__file__).resolve().parents[1]
API_KEY = "bench-key"
MODEL = "tiny-story"


# ---- workload ------------------------------------------------------------------------------

def test_synthetic_lengths_follow_sharegpt_means():
  inp, out = BS.synthetic_lengths(5000, np.random.default_rng(0))
  assert abs(inp.mean() / BS.SHAREGPT_INPUT_MEAN - 1) < 0.15, inp.mean()
  assert abs(out.mean() / BS.SHAREGPT_OUTPUT_MEAN - 1) < 0.15, out.mean()
  assert inp.std() > 300 and out.std() > 100  # a spread, not a constant
  # Seedable.
  again = BS.synthetic_lengths(5000, np.random.default_rng(0))
  assert (again[0] == inp).all() and (again[1] == out).all()


def test_synthetic_lengths_clipped_to_context():
  inp, out = BS.synthetic_lengths(5000, np.random.default_rng(1), max_context=1024,
                                  max_input=600)
  assert inp.min() >= BS.MIN_LEN and inp.max() <= 600 and out.min() >= BS.MIN_LEN
  assert (inp + out <= 1024).all()
  assert inp.max() == 600  # the long tail is clipped, not dropped
  inp, out = BS.synthetic_lengths(100, np.random.default_rng(1), max_context=256,
                                  input_len=32, output_len=500)
  assert (inp == 32).all() and (out == 224).all()


def test_synthetic_requests_ids_and_text():
  reqs = BS.synthetic_requests(50, 3, fmt="ids", vocab_size=320, max_context=256)
  assert all(isinstance(r.prompt, list) and len(r.prompt) == r.input_len for r in reqs)
  assert all(0 <= t < 320 for r in reqs for t in r.prompt)
  assert all(r.input_len + r.max_tokens <= 256 for r in reqs)
  assert [r.prompt for r in BS.synthetic_requests(50, 3, fmt="ids", vocab_size=320,
                                                  max_context=256)] == [r.prompt for r in reqs]
  text = BS.synthetic_requests(5, 3, fmt="text", max_context=256)
  assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.input_len for r in text)


def test_prompt_salt_keeps_lengths_and_changes_every_token_sequence():
  """--prompt_salt: the same seed's lengths (and so the same requests at the same arrival
  times), other tokens in every prompt, the shared prefix and the replies; salt 0 is the
  unsalted set."""
  kw = dict(fmt="ids", vocab_size=32000, max_context=512)
  plain = BS.synthetic_requests(40, 5, **kw)
  assert [r.prompt for r in BS.synthetic_requests(40, 5, salt=0, **kw)] == [r.prompt for r in plain]
  salted = BS.synthetic_requests(40, 5, salt=1, **kw)
  assert [(r.input_len, r.max_tokens) for r in salted] == [(r.input_len, r.max_tokens)
                                                           for r in plain]
  assert all(a.prompt[:8] != b.prompt[:8] for a, b in zip(plain, salted))
  assert [r.prompt for r in BS.synthetic_requests(40, 5, salt=1, **kw)] == [r.prompt
                                                                             for r in salted]
  assert [r.prompt for r in BS.synthetic_requests(40, 5, salt=2, **kw)] != [r.prompt
                                                                             for r in salted]
  p0 = BS.with_shared_prefix(plain, 50, 5, max_context=512)[0].prompt[:50]
  p1 = BS.with_shared_prefix(salted, 50, 5, max_context=512, salt=1)[0].prompt[:50]
  assert p0 != p1
  short = dict(input_len=20, output_len=10, max_context=128)
  c0 = BS.multi_turn(BS.synthetic_requests(4, 0, **short), 2, 0, max_context=128)
  c1 = BS.multi_turn(BS.synthetic_requests(4, 0, salt=1, **short), 2, 0, max_context=128, salt=1)
  assert c0[1].prompt[20:30] != c1[1].prompt[20:30]  # the replies
  assert [(r.input_len, r.follows) for r in c0] == [(r.input_len, r.follows) for r in c1]


def test_shared_prefix_goes_before_every_prompt_and_keeps_the_context():
  reqs = BS.synthetic_requests(20, 0, max_context=256)
  shared = BS.with_shared_prefix(reqs, 100, 0, vocab_size=1000, max_context=256)
  prefix = shared[0].prompt[:100]
  for r, s in zip(reqs, shared):
    assert s.prompt[:100] == prefix and s.prompt[100:] == r.prompt[:len(s.prompt) - 100]
    assert s.input_len == len(s.prompt) and s.input_len + s.max_tokens <= 256
    assert s.max_tokens >= 1
  assert BS.with_shared_prefix(reqs, 0, 0) is reqs


def test_multi_turn_conversations_grow_from_the_previous_turn():
  reqs = BS.synthetic_requests(10, 0, input_len=20, output_len=10, max_context=128)
  conv = BS.multi_turn(reqs, 4, 0, vocab_size=1000, max_context=128)
  # 10 user messages in conversations of 4, 4, 2 turns; each turn after the one before
  assert [r.follows for r in conv] == [None, 0, 1, 2, None, 4, 5, 6, None, 8]
  for k, r in enumerate(conv):
    assert r.input_len == len(r.prompt) and r.input_len + r.max_tokens <= 128
    if r.follows is not None:
      prev = conv[r.follows]
      assert r.prompt[:prev.input_len] == prev.prompt  # the earlier turn's prompt, then
      assert r.input_len == prev.input_len + prev.max_tokens + 20  # reply, user message
  assert conv[0].prompt == reqs[0].prompt and conv[5].prompt[-20:] == reqs[5].prompt
  # a conversation ends where the next turn would not fit the context
  short = BS.multi_turn(reqs, 4, 0, vocab_size=1000, max_context=75)
  assert [r.follows for r in short] == [None, 0, None, 2, None, 4, None, 6, None, 8]
  assert BS.multi_turn(reqs, 1, 0) is reqs


def test_sharegpt_loader(tmp_path):
  convs = [{"id": str(i), "conversations": [
      {"from": "human", "value": "q" * (40 + 4 * i)}, {"from": "gpt", "value": "a" * (80 + 4 * i)},
      {"from": "human", "value": "ignored"}]} for i in range(10)]
  convs.append({"id": "x", "conversations": [{"from": "gpt", "value": "no human turn"}]})
  path = tmp_path / "sg.json"
  path.write_text(json.dumps(convs))
  reqs = BS.sharegpt_requests(str(path), 12, 0, fmt="text", max_context=4096)
  assert len(reqs) == 12
  for r in reqs:  # 4 characters per token without a tokenizer
    assert r.input_len == len(r.prompt) // 4 and r.max_tokens == r.input_len + 10


def test_poisson_arrivals():
  t = BS.arrival_times(20000, 5.0, np.random.default_rng(0))
  gaps = np.diff(np.concatenate([[0.0], t]))
  assert abs(gaps.mean() - 0.2) < 0.2 * 0.03
  assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential: coefficient of variation 1
  assert (np.diff(t) >= 0).all()
  assert (BS.arrival_times(7, float("inf"), np.random.default_rng(0)) == 0).all()


# ---- metrics -------------------------------------------------------------------------------

def _records():
  r1 = BS.Record(10, 4, start=0.1, ok=True, ttft=0.1, e2e=0.3, output_tokens=4,
                 chunk_times=[0.1, 0.15, 0.2, 0.3])
  r2 = BS.Record(20, 2, start=0.2, ok=True, ttft=0.2, e2e=0.5, output_tokens=2,
                 chunk_times=[0.2, 0.4])
  r3 = BS.Record(30, 8, start=0.3, ok=False, error="HTTP 500: boom")
  return [r1, r2, r3]


def test_metrics_on_hand_made_timelines():
  m = BS.compute_metrics(_records(), 2.0, slo_ttft_ms=150, slo_tpot_ms=100)
  A = pytest.approx
  assert (m["num_requests"], m["completed"], m["failed"]) == (3, 2, 1)
  assert m["errors"] == ["HTTP 500: boom"]
  assert m["output_tokens"] == 6 and m["input_tokens"] == 30
  assert m["request_throughput"] == A(1.0) and m["output_throughput"] == A(3.0)
  assert m["ttft_ms_mean"] == A(150) and m["ttft_ms_p50"] == A(150)
  assert m["ttft_ms_p99"] == A(100 + 0.99 * 100)
  # TPOT: (0.3 - 0.1) / 3 and (0.5 - 0.2) / 1.
  assert m["tpot_ms_mean"] == A((200 / 3 + 300) / 2) and m["tpot_ms_n"] == 2
  # ITL: every gap between chunks: 50, 50, 100 and 200 ms.
  assert m["itl_ms_n"] == 4 and m["itl_ms_mean"] == A(100) and m["itl_ms_p50"] == A(75)
  assert m["itl_ms_p90"] == A(np.percentile([50, 50, 100, 200], 90))
  assert m["e2e_ms_mean"] == A(400) and m["e2e_ms_p50"] == A(400)
  # The tail: r2's end (0.2 + 0.5 s) after the last send (r3's, at 0.3 s).
  assert m["tail_s"] == A(0.4)
  # Goodput: only r1 meets TTFT <= 150 ms and TPOT <= 100 ms.
  assert m["good_requests"] == 1 and m["goodput"] == A(0.5)
  m = BS.compute_metrics(_records(), 2.0, slo_ttft_ms=250)
  assert m["good_requests"] == 2 and m["goodput"] == A(1.0)
  m = BS.compute_metrics(_records(), 2.0, slo_tpot_ms=300)
  assert m["good_requests"] == 2
  assert BS.compute_metrics(_records(), 2.0)["goodput"] is None
  # The same figures under vllm bench serve's names.
  assert (m["median_ttft_ms"], m["p99_ttft_ms"], m["mean_e2el_ms"]) == (
      m["ttft_ms_p50"], m["ttft_ms_p99"], m["e2e_ms_mean"])
  assert (m["duration"], m["total_input_tokens"], m["total_output_tokens"]) == (2.0, 30, 6)


@pytest.mark.parametrize("server,parent,child,roles", [
    # blink-jax: serve.py (engine) > a frontend worker > its parser pool (inherits frontend).
    ("blink", "", "nic_frontend", ("engine", "frontend")),
    # vLLM: the API server (its HTTP side) > EngineCore > a helper of it (inherits engine).
    ("vllm", "vllm.entrypoints.openai.api_server", "VLLM::EngineCore", ("frontend", "engine")),
])
def test_server_cpu_counts_a_process_tree_by_role(tmp_path, server, parent, child, roles):
  """A parent that spins 0.4 s, a child that spins 0.3 s, and a grandchild of it that spins
  0.6 s, their command lines marked like the server's: each role's CPU seconds over the
  block, and per 1k tokens."""
  def script(name, seconds, child_script=None):
    launch = (f"import subprocess, sys\nkid = subprocess.Popen([sys.executable, "
              f"{str(tmp_path / child_script)!r}, {child!r}])\n" if child_script else "")
    (tmp_path / name).write_text(
        launch + "import time\ntime.sleep(0.5)\nt = time.process_time()\n"
        f"while time.process_time() - t < {seconds}: pass\n"
        + ("kid.wait()\n" if child_script else "time.sleep(30)\n"))
  script("grandchild.py", 0.6)
  script("child.py", 0.3, "grandchild.py")
  script("parent.py", 0.4, "child.py")
  proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), parent])
  try:
    deadline = time.time() + 20
    while len(BS.process_tree(proc.pid)) < 3 and time.time() < deadline:
      time.sleep(0.02)
    with BS.ServerCPU(proc.pid) as cpu:
      while time.time() < deadline:  # until every spinner is done (then each one sleeps)
        if sum(c for _, c in BS.process_tree(proc.pid).values()) > 1.25:
          break
        time.sleep(0.1)
      time.sleep(0.2)
    r = cpu.result(output_tokens=2000)
  finally:
    for pid in BS.process_tree(proc.pid):
      os.kill(pid, signal.SIGKILL)
    proc.wait()
  by_role = r["host_cpu_s_by_role"]
  root_role, child_role = roles
  assert r["server_processes"] == 3 and set(by_role) == {"engine", "frontend"}, r
  assert by_role[root_role] == pytest.approx(0.4, abs=0.2), r
  assert by_role[child_role] == pytest.approx(0.9, abs=0.3), r
  assert r["host_cpu_s_per_1k_tokens"] == pytest.approx(r["host_cpu_s"] / 2)
  assert r["engine_cpu_s_per_1k_tokens"] == pytest.approx(by_role["engine"] / 2)
  assert BS.ServerCPU(None).result(10) == {}
  gone = BS.ServerCPU(proc.pid)
  with gone:
    pass
  assert "not found" in gone.result(10)["host_cpu_note"]


def test_power_sampler_reports_a_reason_without_nvml():
  s = BS.PowerSampler(0.01)
  with s:
    time.sleep(0.05)
  r = s.result(100)
  if s.reason:
    assert r["energy_per_token_j"] is None and r["energy_note"] == s.reason
  else:
    assert r["energy_j"] > 0 and r["energy_per_token_j"] == pytest.approx(r["energy_j"] / 100)


def test_step_counters_of_vllm_and_blink_metrics():
  """vLLM's steps come from its tokens-per-step histogram (summed over engines), so J per step
  compares across servers; blink's from its device counters."""
  from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
  reg = CollectorRegistry()
  steps = Histogram("vllm:iteration_tokens_total", "tokens per engine step", ["engine"],
                    buckets=(1, 8, 256, 8192), registry=reg)
  queries = Counter("vllm:prefix_cache_queries", "prefix cache queries", ["engine"],
                    registry=reg)
  for engine, tokens in (("0", [5, 300, 1]), ("1", [2])):
    for t in tokens:
      steps.labels(engine).observe(t)
    queries.labels(engine).inc(10)
  got = BS.parse_device_counters(generate_latest(reg).decode())
  assert got == {"steps": 4.0, "step_tokens": 308.0, "prefix_cache_queries": 20.0}

  reg = CollectorRegistry()
  for name, value in (("steps", 40), ("tokens_generated", 100), ("prompt_tokens", 60),
                      ("schedule_seconds", 0.5), ("commit_seconds", 0.25), ("slot_scans", 7)):
    Counter(f"blink_gpu_{name}", name, registry=reg).inc(value)
  phases = Counter("blink_gpu_schedule_phase_seconds", "by phase", ["phase"], registry=reg)
  phases.labels("scan").inc(0.125)
  phases.labels("admit").inc(0.25)
  got = BS.parse_device_counters(generate_latest(reg).decode())
  assert got == {"steps": 40.0, "tokens_generated": 100.0, "prompt_tokens": 60.0,
                 "schedule_seconds": 0.5, "commit_seconds": 0.25, "slot_scans": 7.0,
                 "schedule_scan_seconds": 0.125, "schedule_admit_seconds": 0.25}

  counters = BS.DeviceCounters("http://unused", {})
  counters.before = {"steps": 10.0, "step_tokens": 100.0}
  counters.after = {"steps": 30.0, "step_tokens": 500.0}
  row = counters.result(output_tokens=40)
  assert (row["device_steps"], row["device_tokens_per_step"]) == (20.0, 20.0)
  assert row["device_steps_per_output_token"] == 0.5
  assert row["device_schedule_us_per_iteration"] is None  # vLLM: no loop, no kernel times
  assert row["device_rows_per_step"] is None  # vLLM's steps pad nothing we can count
  counters.before = {"steps": 10.0, "tokens_generated": 50.0, "prompt_tokens": 50.0,
                     "step_rows": 120.0}
  counters.after = {"steps": 30.0, "tokens_generated": 250.0, "prompt_tokens": 250.0,
                    "step_rows": 620.0}
  row = counters.result(output_tokens=200)
  assert (row["device_rows_per_step"], row["device_padding_share"]) == (25.0, pytest.approx(0.2))
  # blink: the scheduler kernels' device time per loop iteration
  counters.before = {"steps": 10.0, "loop_iterations": 100.0, "schedule_seconds": 1.0,
                     "commit_seconds": 0.5, "schedule_scan_seconds": 0.25, "slot_scans": 3.0}
  counters.after = {"steps": 30.0, "loop_iterations": 600.0, "schedule_seconds": 1.005,
                    "commit_seconds": 0.5025, "schedule_scan_seconds": 0.2515,
                    "slot_scans": 53.0}
  row = counters.result(output_tokens=40)
  assert row["device_schedule_us_per_iteration"] == pytest.approx(10.0)
  assert row["device_commit_us_per_iteration"] == pytest.approx(5.0)
  # the schedule kernel's phases, per loop iteration, and how often it scanned the slots
  assert row["device_schedule_scan_us_per_iteration"] == pytest.approx(3.0)
  assert row["device_slot_scans_per_iteration"] == pytest.approx(0.1)
  # 150 W above a 100 W idle for 2 s: 300 J over 40 tokens and 20 steps.
  m = {"avg_power_w": 250.0, "duration_s": 2.0, "output_tokens": 40, **row}
  assert BS.energy_above_idle(m, 100.0) == {"energy_above_idle_per_token_j": 7.5,
                                            "energy_above_idle_per_step_j": 15.0}
  assert BS.energy_above_idle(m, None) == {}


def test_normalize_argv():
  assert BS.normalize_argv(["x", "--base-url=u", "--max-tokens", "8", "--no-plot", "--",
                          "--a-b"]) == \
      ["x", "--base_url=u", "--max_tokens", "8", "--noplot", "--", "--a-b"]


# ---- end to end ----------------------------------------------------------------------------

def _start_worker(tmp: Path, tokenizer_path: Path, args: list[str], env: dict):
  return FD.start_worker(tmp, tokenizer_path, MODEL, ["--grace-s", "5", *args], env)


@pytest.fixture
def server(tmp_path, tokenizer_path):
  with FD.running_device(tokenizer_path) as fake:
    proc, port, log = _start_worker(tmp_path, tokenizer_path,
                                    ["--transport", "shm", "--shm-name", fake.region.name],
                                    {"BLINK_API_KEY": API_KEY})
    try:
      yield f"http://127.0.0.1:{port}/v1", fake.device.dc
    finally:
      FD.terminate(proc)
      print(log.read_text()[-3000:])


def _run_tool(*args, timeout=120):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-m", "bench.serving", *args],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r.stdout


def test_end_to_end_against_frontend_worker(server, tmp_path):
  base_url, dc = server
  out = tmp_path / "results" / "serving_e2e.json"
  interference = ["--interference", "1", "--frontend-cpus", "0"] \
      if len(os.sched_getaffinity(0)) > 1 else []
  stdout = _run_tool("--base-url", base_url, "--api-key", API_KEY, "--num-prompts", "10",
                     "--rates", "40,inf", "--seed", "7", "--vocab-size", str(dc.vocab_size),
                     "--max-input-len", "64", "--max-concurrency", "8", "--label", "e2e",
                     "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out),
                     *interference)
  assert "request_throughput" in stdout  # the printed table
  assert "device_schedule_scan_us_per_iteration" in stdout  # and the device loop's
  doc = BS.load_result(out)
  assert doc["benchmark"] == "serving" and doc["model"] == MODEL
  # The per-request records are in their own gzipped file, not in the result's JSON.
  assert "requests" not in json.loads(out.read_text())
  assert BS.requests_path(out).name == doc["requests_file"]
  assert doc["max_context"] == dc.max_context and doc["label"] == "e2e"
  assert [r["rate"] for r in doc["results"]] == [40.0, "inf"]
  for row in doc["results"]:
    assert row["completed"] == 10 and row["failed"] == 0, row
    assert row["good_requests"] == 10
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
      assert 0 <= row[f"{key}_p50"] <= row[f"{key}_p90"] <= row[f"{key}_p99"], key
    assert row["output_throughput"] > 0
    assert "energy_per_token_j" in row and row["energy_note"]
    # The device's counters from /metrics: concurrent requests share steps (at most one step
    # per output token), and a step carries at least one token.
    assert 0 < row["device_steps"] <= row["device_loop_iterations"], row
    assert 0 < row["device_steps_per_output_token"] <= 1 and row["device_tokens_per_step"] >= 1
    # The steps ran their buckets, padding included: at least a row a step; the padding's
    # share is estimated from the tokens (a request's first token counts as a prompt row and
    # an output token, so with little padding and short requests it can dip below zero).
    assert row["device_rows_per_step"] >= 1 and -0.5 < row["device_padding_share"] < 1, row
    # Every request rang a doorbell, so some passes scanned the slots; the scheduler's phase
    # timers are the CUDA kernels' (zero from the host scheduler).
    assert 0 < row["device_slot_scans_per_iteration"] <= 1, row
    assert row["device_schedule_scan_us_per_iteration"] == 0.0, row
    # The frontend's own TTFT starts when the handler runs: inside the client's; its parts
    # (prepare, queue, slot to first output; one of each per request) fit inside it.
    assert 0 < row["frontend_ttft_mean_ms"] <= row["mean_ttft_ms"], row
    parts = [row[f"frontend_{p}_mean_ms"] for p in ("prepare", "queue", "slot_first_output")]
    assert min(parts) >= 0 and sum(parts) <= row["frontend_ttft_mean_ms"] + 1e-6, row
    assert row["frontend_tpot_mean_ms"] > 0, row
  for rate, reqs in doc["requests"].items():
    assert len(reqs) == 10
    lens = set()
    for r in reqs:
      assert r["ok"] and r["error"] is None, r
      assert r["output_tokens"] == r["max_tokens"], r  # ignore_eos: exactly max_tokens
      assert r["input_len"] + r["max_tokens"] <= dc.max_context and r["input_len"] <= 64
      lens.add(r["max_tokens"])
    assert len(lens) > 1  # lengths from the distribution, not one constant
  if interference:
    assert doc["interference"] == 1 and doc["frontend_cpus"] == [0]
    assert doc["client_cpus"] == [0]  # the load generator runs with the frontend by default
    assert 0 not in doc["interference_cpus"]
  png = out.with_suffix(".png")
  if BS_HAS_MPL:
    assert png.stat().st_size > 10_000

    # --compare: two result files (persistent vs host style) in one plot.
    other = tmp_path / "results" / "serving_other.json"
    doc["label"] = "other"
    other.write_text(json.dumps(doc))
    cmp_png = tmp_path / "cmp.png"
    _run_tool("--compare", str(out), str(other), "--plot-out", str(cmp_png))
    assert cmp_png.stat().st_size > 10_000


try:
  import matplotlib  # noqa: F401
  BS_HAS_MPL = True
except ImportError:
  BS_HAS_MPL = False


def test_fixed_max_tokens_text_prompts(server, tmp_path):
  base_url, dc = server
  out = tmp_path / "fixed.json"
  _run_tool("--base-url", base_url, "--api-key", API_KEY, "--num-prompts", "6", "--rates", "inf",
            "--prompt-format", "text", "--input-len", "20", "--max-tokens", "12", "--no-plot",
            "--out", str(out))
  doc = BS.load_result(out)
  reqs = doc["requests"]["inf"]
  assert all(r["ok"] and r["output_tokens"] == 12 and r["max_tokens"] == 12 for r in reqs)
  assert not out.with_suffix(".png").exists()


def test_multi_turn_turns_wait_for_the_previous_answer(server, tmp_path):
  base_url, dc = server
  out = tmp_path / "turns.json"
  _run_tool("--base-url", base_url, "--api-key", API_KEY, "--num-prompts", "6", "--rates", "inf",
            "--vocab-size", str(dc.vocab_size), "--input-len", "8", "--max-tokens", "4",
            "--multi-turn", "3", "--no-plot", "--out", str(out))
  doc = BS.load_result(out)
  assert doc["multi_turn"] == 3
  reqs = doc["requests"]["inf"]
  assert [r["input_len"] for r in reqs] == [8, 20, 32] * 2 and all(r["ok"] for r in reqs)
  for c in (0, 3):  # a turn starts after the turn before it has ended
    for k in (c + 1, c + 2):
      assert reqs[k]["start_s"] >= reqs[k - 1]["start_s"] + reqs[k - 1]["e2e_s"]


def test_fresh_prompts_give_each_rate_its_own_set(server, tmp_path):
  base_url, dc = server
  for fresh in (False, True):
    out = tmp_path / f"fresh{fresh}.json"
    _run_tool("--base-url", base_url, "--api-key", API_KEY, "--num-prompts", "6", "--rates",
              "100,inf", "--vocab-size", str(dc.vocab_size), "--max-tokens", "2",
              "--max-input-len", "200", "--no-plot", "--out", str(out),
              *([] if fresh else ["--no-fresh-prompts"]))  # fresh by default
    doc = BS.load_result(out)
    assert doc["fresh_prompts"] == fresh
    first, second = ([r["input_len"] for r in reqs] for reqs in doc["requests"].values())
    assert (first == second) == (not fresh), (fresh, first, second)


def test_power_sampler_integrates_nvml_power(monkeypatch):
  """A stand-in pynvml: two GPUs at 100 W each -> ~200 W times the run's length."""
  import types
  fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
                               nvmlDeviceGetHandleByIndex=lambda i: i,
                               nvmlDeviceGetPowerUsage=lambda h: 100_000)  # milliwatts
  monkeypatch.setitem(sys.modules, "pynvml", fake)
  s = BS.PowerSampler(0.01)
  assert s.reason is None
  with s:
    time.sleep(0.3)
  r = s.result(60)
  span = s.samples[-1][0] - s.samples[0][0]
  assert len(s.samples) > 10 and r["gpus"] == 2
  assert r["avg_power_w"] == pytest.approx(200.0)
  assert r["energy_j"] == pytest.approx(200.0 * span)
  assert r["energy_per_token_j"] == pytest.approx(200.0 * span / 60)
  assert "gpu_temp_c_mean" not in r  # this NVML has no temperatures: no figure, no failure
  # With them: the hottest GPU's temperature and the mean SM clock of every sample.
  fake.nvmlDeviceGetTemperature = lambda h, sensor: 50 + 10 * h
  fake.nvmlDeviceGetClockInfo = lambda h, clock: 1500 + 200 * h
  s = BS.PowerSampler(0.01)
  with s:
    time.sleep(0.1)
  r = s.result(60)
  assert (r["gpu_temp_c_mean"], r["gpu_temp_c_max"], r["sm_clock_mhz_mean"]) == (60, 60, 1600)


def test_power_sampler_splits_the_energy_between_requests_and_gaps(monkeypatch):
  """A stand-in NVML whose energy counter runs at 300 W while a request is in flight and
  100 W between them (clock 1,900 / 1,000 MHz): `split` finds both powers from the counter's
  windows, and bench.serving's energy above idle separates the gaps' joules from the steps'."""
  import types
  busy = []  # (start, end) on time.monotonic()

  def in_flight(now):
    return any(s <= now < e for s, e in busy)

  def energy(h):  # millijoules since 0: 100 W always, 200 W more while a request runs
    now = time.monotonic()
    return 1e3 * (100.0 * now + 200.0 * sum(max(0.0, min(now, e) - s) for s, e in busy))

  fake = types.SimpleNamespace(
      nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1,
      nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetPowerUsage=lambda h: 100_000,
      nvmlDeviceGetTemperature=lambda h, sensor: 60 if in_flight(time.monotonic()) else 40,
      nvmlDeviceGetClockInfo=lambda h, clock: 1900 if in_flight(time.monotonic()) else 1000,
      nvmlDeviceGetTotalEnergyConsumption=energy)
  monkeypatch.setitem(sys.modules, "pynvml", fake)
  s = BS.PowerSampler(0.005)
  with s:
    time.sleep(0.2)
    t = time.monotonic()
    busy.append((t, t + 0.3))
    time.sleep(0.5)
  r = s.split(busy)
  assert r["busy_s"] == pytest.approx(0.3, abs=0.03) and r["gap_s"] > 0.3
  # a window that straddles a request's start or end counts as busy
  assert r["gap_power_w"] == pytest.approx(100.0, rel=0.05)
  assert 250 < r["busy_power_w"] <= 300.5
  assert (r["gap_sm_clock_mhz"], r["gap_gpu_temp_c"]) == (1000, 40)
  assert r["busy_sm_clock_mhz"] > 1500
  m = {"avg_power_w": 150.0, "duration_s": 1.0, "output_tokens": 10, "device_steps": 5, **r}
  e = BS.energy_above_idle(m, 90.0)
  assert e["gap_energy_above_idle_j"] == pytest.approx((r["gap_power_w"] - 90.0) * r["gap_s"])
  assert e["busy_energy_above_idle_per_step_j"] == pytest.approx(
      (r["busy_power_w"] - 90.0) * r["busy_s"] / 5)
  assert BS.PowerSampler(0.01).split(busy) == {}  # no samples: nothing to split
  # The whole run's average from the counter, beside the sampled power's.
  whole = s.result(10)
  assert whole["counter_avg_power_w"] == pytest.approx(
      (r["busy_power_w"] * r["busy_s"] + r["gap_power_w"] * r["gap_s"])
      / (r["busy_s"] + r["gap_s"]))


def test_per_request_records_live_beside_the_result(tmp_path):
  """A result names the gzipped file of its per-request records, which load_result reads
  back; a result with its records inline (older files) loads as it is."""
  records = {"4.0": [{"input_len": 7, "max_tokens": 3, "ok": True, "error": None,
                      "start_s": 0.25, "ttft_s": 0.01, "e2e_s": 0.03, "output_tokens": 3,
                      "chunks": 3}], "inf": []}
  out = tmp_path / "serving_x_quiet.json"
  side = BS.write_requests(out, records)
  assert side == tmp_path / "serving_x_quiet.requests.json.gz"
  assert side.read_bytes() == BS.write_requests(out, records).read_bytes()  # no timestamp
  out.write_text(json.dumps({"results": [], "requests_file": side.name}))
  assert BS.load_result(out) == {"results": [], "requests_file": side.name,
                                 "requests": records}
  renamed = tmp_path / "serving_y_quiet.json"  # the result and its records renamed together
  out.rename(renamed)
  side.rename(BS.requests_path(renamed))
  assert BS.load_result(renamed)["requests"] == records
  inline = tmp_path / "old.json"
  inline.write_text(json.dumps({"results": [], "requests": records}))
  assert BS.load_result(inline) == {"results": [], "requests": records}


def test_goodput_recomputed_from_saved_requests():
  recs = _records()
  saved = {"results": [{"rate": 4.0, "duration_s": 2.0}],
           "requests": {"4.0": [{"input_len": r.input_len, "max_tokens": r.max_tokens,
                                 "ok": r.ok, "error": r.error, "start_s": r.start,
                                 "ttft_s": r.ttft, "e2e_s": r.e2e,
                                 "output_tokens": r.output_tokens,
                                 "chunks": len(r.chunk_times)} for r in recs]}}
  for slo in ((150, 100), (250, None), (None, 300)):
    want = BS.compute_metrics(recs, 2.0, *slo)
    got = BS.regoodput(saved, *slo)["results"][0]
    assert (got["good_requests"], got["goodput"]) == (want["good_requests"], want["goodput"])
    assert (got["slo_ttft_ms"], got["slo_tpot_ms"]) == slo


def _four_requests(tmp_path, tokenizer_path, *args) -> tuple[dict, list[dict]]:
  """bench.serving sends 4 requests (8 prompt tokens, 3 out, all at once, and `args`) to a
  worker over a recording fake device: (the result, the requests the device saw)."""
  with FD.running_device(tokenizer_path) as fake:
    proc, port, log = _start_worker(tmp_path, tokenizer_path,
                                    ["--transport", "shm", "--shm-name", fake.region.name],
                                    {"BLINK_API_KEY": API_KEY})
    try:
      out = tmp_path / "four.json"
      _run_tool("--base-url", f"http://127.0.0.1:{port}/v1", "--api-key", API_KEY,
                "--num-prompts", "4", "--rates", "inf", "--vocab-size",
                str(fake.device.dc.vocab_size), "--input-len", "8", "--max-tokens", "3",
                "--no-plot", "--out", str(out), *args)
    finally:
      FD.terminate(proc)
    return BS.load_result(out), fake.device.requests


def test_sampling_flags_reach_every_request(tmp_path, tokenizer_path):
  """--temperature / --top_p / --top_k are sent with every request (as `vllm bench serve`'s
  flags are) and recorded in the result."""
  doc, seen = _four_requests(tmp_path, tokenizer_path, "--temperature", "0.7", "--top-p",
                             "0.9", "--top-k", "40")
  assert len(seen) == 4 and all(r["top_k"] == 40 for r in seen)
  assert all(abs(r["temperature"] - 0.7) < 1e-6 and abs(r["top_p"] - 0.9) < 1e-6
             for r in seen)
  assert doc["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 40}


def test_warm_cache_requests_are_their_own_prompts():
  reqs = BS.warm_cache_requests(250, 100, 0, vocab_size=320, max_context=64)
  assert [(r.input_len, r.max_tokens, len(r.prompt)) for r in reqs] == [(63, 1, 63)] * 4
  measured = BS.synthetic_requests(50, 0, vocab_size=320, max_context=64)
  firsts = {tuple(r.prompt[:16]) for r in reqs}
  assert len(firsts) == 4 and not firsts & {tuple(r.prompt[:16]) for r in measured}


def test_warm_cache_runs_before_the_first_rate(tmp_path, tokenizer_path):
  """--warm_cache_tokens sends its one-token prompts first, all of them, then the rates."""
  doc, seen = _four_requests(tmp_path, tokenizer_path, "--warm-cache-tokens", "100",
                             "--warm-cache-prompt-len", "40")
  assert [r["prompt_len"] for r in seen] == [40] * 3 + [8] * 4, seen
  assert doc["warm_cache"]["requests"] == 3 and doc["warm_cache"]["prompt_tokens"] == 120
  assert doc["results"][0]["completed"] == 4


def test_client_procs_send_every_request_on_the_schedule_of_one(server, tmp_path):
  """--client_procs 2: the same requests as one process sends (every conversation in one
  process, its turns in order), arrivals on one shared clock, all answered."""
  base_url, dc = server
  docs = {}
  for procs in (1, 2):
    out = tmp_path / f"procs{procs}.json"
    _run_tool("--base-url", base_url, "--api-key", API_KEY, "--num-prompts", "8", "--rates",
              "50", "--vocab-size", str(dc.vocab_size), "--input-len", "8", "--max-tokens",
              "3", "--multi-turn", "2", "--client-procs", str(procs), "--no-plot", "--out",
              str(out))
    docs[procs] = BS.load_result(out)
  one, two = (docs[p]["requests"]["50.0"] for p in (1, 2))
  assert docs[2]["client_procs"] == 2 and docs[2]["results"][0]["completed"] == 8
  assert [r["input_len"] for r in one] == [r["input_len"] for r in two]
  assert all(r["ok"] for r in two)
  for k in range(0, 8, 2):  # a turn starts after the turn before it has ended
    assert two[k + 1]["start_s"] >= two[k]["start_s"] + two[k]["e2e_s"]
  # First turns leave at the drawn arrival times (rate 50: tens of ms apart) from either
  # process, never before them (one process's starts are the schedule, within a few ms).
  firsts = [(a["start_s"], b["start_s"]) for a, b in zip(one[::2], two[::2])]
  assert all(a - 0.01 <= b <= a + 0.5 for a, b in firsts), firsts


def test_energy_panels_label_their_log_axis(tmp_path, monkeypatch):
  """The energy and step panels' log y axes keep labelled ticks when the values span less
  than a decade (only minor ticks fall inside: switching them off left the axes unlabelled)."""
  figure = pytest.importorskip("matplotlib.figure")
  saved = []
  savefig = figure.Figure.savefig

  def keep(fig, *args, **kwargs):
    savefig(fig, *args, **kwargs)
    saved.append(fig)

  monkeypatch.setattr(figure.Figure, "savefig", keep)

  def rows(joules, steps):
    return [{"rate": rate, "output_throughput": 100.0 * rate, "request_throughput": rate,
             "energy_per_token_j": joules / rate, "device_steps_per_output_token": steps / rate,
             "ttft_ms_p99": 10.0, "tpot_ms_p99": 2.0} for rate in (16, 32)]

  BS.plot_results([("ours", rows(0.9, 1.4)), ("peer", rows(0.7, 0.75))], tmp_path / "p.png",
                  ("p99",))
  (fig,) = saved
  for ax in fig.axes[6:8]:
    labels = [t.get_text() for t in ax.get_yticklabels(which="both")
              if ax.get_ylim()[0] <= t.get_position()[1] <= ax.get_ylim()[1]]
    assert any(labels), ax.get_title()
  assert [t.get_text() for t in fig.axes[6].get_xticklabels()] == ["16", "32"]
