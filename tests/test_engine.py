"""Engine API and executor on CPU with a tiny random Gemma 3 (float32)."""
from __future__ import annotations

import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from blink_jax import Engine
from blink_jax import EngineStoppedError
from blink_jax import SamplingParams
from blink_jax.client import mailbox as M
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
from blink_jax.client.tokenizer import Tokenizer
from tests.fake_device import tiny_tokenizer

ENGINE_KW = dict(max_seqs=4, page_size=4, max_context=96, num_slots=16, ring_capacity=8,
                 buckets=(4, 16, 32), max_top_logprobs=3, idle_poll_us=100)


VOCAB = 320  # the tiny tokenizer's


@pytest.fixture(scope="module")
def model():
  return Gemma(tiny_config("gemma3", vocab_size=VOCAB), dtype=jnp.float32,
               rngs=nnx.Rngs(8))  # a seed whose greedy text is printable


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
  tok = Tokenizer(str(tiny_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)))
  with Engine(model, tok, **ENGINE_KW) as eng:
    yield eng


@pytest.fixture(scope="module")
def dense(model):
  fwd = jax.jit(model.dense_forward)
  width = ENGINE_KW["max_context"]

  def logits(seq):  # causal: padding after the sequence changes nothing; one compile
    return np.asarray(fwd(jnp.array([list(seq) + [0] * (width - len(seq))]))[0, :len(seq)])

  def greedy(prompt, n):
    seq = list(prompt)
    for _ in range(n):
      seq.append(int(np.argmax(logits(seq)[-1])))
    return seq[len(prompt):]

  greedy.logits = logits
  return greedy


def _prompts(rng, n, lo=1, hi=40):
  return [[int(t) for t in rng.integers(3, VOCAB, rng.integers(lo, hi))] for _ in range(n)]


def test_single_request_equals_dense_greedy(engine, dense):
  p = [5, 6, 7, 8, 9, 10, 11]
  out = engine.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=12,
                                                                    ignore_eos=True))
  assert out.token_ids == dense(p, 12)
  assert out.finish_reason == "length"


def test_many_concurrent_callers_equal_dense_greedy(engine, dense):
  rng = np.random.default_rng(0)
  prompts = _prompts(rng, 10, 1, 60)  # more requests than lanes; long ones are chunked
  results = {}

  def worker(i):
    results[i] = engine.generate(prompt_token_ids=prompts[i],
                                 sampling=SamplingParams(max_tokens=8, ignore_eos=True))

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i, p in enumerate(prompts):
    assert results[i].token_ids == dense(p, 8), f"request {i}"
  assert engine.stats()["pages_in_use"] == 0


def test_batch_generate_keeps_order(engine, dense):
  prompts = [[3, 4], [5, 6, 7, 8, 9], [10]]
  outs = engine.generate(prompt_token_ids=prompts,
                         sampling=SamplingParams(max_tokens=5, ignore_eos=True))
  assert [o.token_ids for o in outs] == [dense(p, 5) for p in prompts]


def test_seed_reproduces_whatever_else_is_in_the_batch(engine):
  sp = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234,
                      ignore_eos=True)
  p = [20, 21, 22, 23]
  alone = engine.generate(prompt_token_ids=p, sampling=sp).token_ids
  crowd = engine.generate(prompt_token_ids=[[9, 9, 9], p, [30] * 20, [7]], sampling=sp)
  assert crowd[1].token_ids == alone
  other = engine.generate(prompt_token_ids=p, sampling=SamplingParams(
      max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)).token_ids
  assert other != alone


def test_top_k_one_is_greedy(engine, dense):
  p = [40, 41, 42]
  out = engine.generate(prompt_token_ids=p, sampling=SamplingParams(
      max_tokens=6, temperature=1.5, top_k=1, ignore_eos=True))
  assert out.token_ids == dense(p, 6)


def test_stop_token_ids(engine, dense):
  p = [50, 51, 52, 53]
  ref = dense(p, 10)
  stop = ref[4]
  out = engine.generate(prompt_token_ids=p, sampling=SamplingParams(
      max_tokens=10, stop_token_ids=[stop], ignore_eos=True))
  assert out.token_ids == ref[:ref.index(stop) + 1]
  assert out.finish_reason == "stop"


def test_stop_strings_cut_the_text(engine):
  sp = SamplingParams(max_tokens=24, ignore_eos=True)
  p = "hello world the quick brown"
  full = engine.generate(p, sp)
  assert len(full.text) > 6
  stop = full.text[3:6]
  out = engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop, "@@@"]))
  assert out.finish_reason == "stop"
  assert out.text == full.text[:full.text.index(stop)]
  assert stop not in out.text
  assert engine.stats()["pages_in_use"] == 0


def test_streamed_text_never_shows_a_stop_string(engine):
  full = engine.generate("hello world the quick brown", SamplingParams(max_tokens=24,
                                                                     ignore_eos=True)).text
  stop = full[2:5]
  sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=stop)
  deltas = list(engine.generate("hello world the quick brown", sp, stream=True))
  seen = ""
  for d in deltas:
    seen += d.text
    assert stop not in seen
  assert seen == full[:full.index(stop)] and deltas[-1].finish_reason == "stop"


def test_stream_deltas_add_up(engine):
  sp = SamplingParams(max_tokens=10, ignore_eos=True)
  full = engine.generate("the model", sp)
  deltas = list(engine.generate("the model", sp, stream=True))
  assert "".join(d.text for d in deltas) == full.text
  assert sum((d.token_ids for d in deltas), []) == full.token_ids
  assert deltas[-1].finish_reason == "length"


def test_logprobs_match_the_model(engine, dense):
  p = [60, 61, 62, 63, 64]
  out = engine.generate(prompt_token_ids=p, sampling=SamplingParams(
      max_tokens=4, logprobs=3, ignore_eos=True))
  logits = dense.logits(p + out.token_ids)
  lp = jax.nn.log_softmax(logits, axis=-1)
  for i, tok in enumerate(out.token_ids):
    row = np.asarray(lp[len(p) - 1 + i])
    assert out.logprobs[i] == pytest.approx(row[tok], abs=1e-4)
    top = [a for a, _ in out.top_logprobs[i]]
    assert top == list(np.argsort(-row)[:3])


def test_bad_requests_raise_clear_errors(engine):
  with pytest.raises(ValueError, match="temperature"):
    engine.generate(prompt_token_ids=[1, 2], sampling=SamplingParams(temperature=-1.0))
  with pytest.raises(TypeError, match="prompt_token_ids"):
    engine.generate([1, 2])
  with pytest.raises(ValueError, match="top_p"):
    engine.generate(prompt_token_ids=[1, 2], sampling=SamplingParams(top_p=0.0))
  with pytest.raises(ValueError, match="context"):
    engine.generate(prompt_token_ids=[5] * 200)
  with pytest.raises(ValueError, match="vocabulary"):
    engine.generate(prompt_token_ids=[5, 100_000])
  with pytest.raises(ValueError, match="logprobs"):
    engine.generate(prompt_token_ids=[5], sampling=SamplingParams(logprobs=50))
  with pytest.raises(ValueError, match="exactly one"):
    engine.generate()
  # The engine still serves.
  assert engine.generate(prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=2)).token_ids


def test_stats_after_work(engine):
  s = engine.stats()
  assert s["pages_in_use"] == 0 and s["running"] == 0 and s["waiting"] == 0
  assert s["tokens_generated"] > 0 and s["steps"] > 0
  assert s["requests_finished"] == s["requests_admitted"]


def test_cpu_capacity_is_max_context_worth_per_sequence(engine):
  """The CPU rule, as the startup line reports it; the scheduler holds that many pages, and
  `page_bytes` (what a GPU's cache is sized with) is what the carry's cache costs a page."""
  from blink_jax.model.gemma import init_kv_cache
  assert engine.config.describe().startswith(
      "capacity: 4 sequences, 96 KV pages (max_context worth per sequence); ")
  assert engine.stats()["pages_total"] == 96 == engine.sched.num_pages
  cache = init_kv_cache(engine.model_cfg, 96, 4, engine.executor.kv_dtype)
  assert sum(x.nbytes for x in cache) == 96 * engine.executor.page_bytes


def test_warm_up_run_leaves_the_loop_serving(engine):
  """The persistent loop ran once with the shutdown word set (XLA's warm-up execution); the
  word is clear again and the real run has iterated since."""
  h = M.read_header(engine.region)
  assert int(h["shutdown"]) == 0 and engine.running
  deadline = time.monotonic() + 30
  while int(M.read_header(engine.region)["loop_iterations"]) < 2:
    assert time.monotonic() < deadline, "the loop did not iterate after its warm-up run"
    time.sleep(0.01)


@pytest.mark.parametrize("mode", ["persistent", "host"])
def test_warm_up_workload_takes_every_bucket_then_serves(model, dense, mode):
  """The GPU warm-up (here forced on CPU): one-token prompts decoding together for the
  buckets up to max_seqs, one prompt as long as each larger bucket; afterwards nothing is
  left running and the engine answers like the dense model."""
  p = [5, 6, 7, 8]
  # Before the engine holds an XLA CPU thread (docs/NOTES.md, "A persistent loop holds an XLA
  # CPU thread").
  want = dense(p, 5)
  with Engine(model, None, mode=mode, warm_up=True, **ENGINE_KW) as eng:
    s = eng.stats()
    small = [b for b in ENGINE_KW["buckets"] if b <= ENGINE_KW["max_seqs"]]
    large = [b for b in ENGINE_KW["buckets"] if b > ENGINE_KW["max_seqs"]]
    assert s["requests_admitted"] == s["requests_finished"] == sum(small) + len(large)
    assert s["prompt_tokens"] >= sum(small) + sum(large)
    assert s["pages_in_use"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert eng.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=5)).token_ids \
        == want


@pytest.mark.parametrize("mode", ["host", "persistent"])
def test_every_carry_output_reuses_its_donated_buffer(model, mode):
  """Each output of the compiled step (host) or loop aliases a donated carry input, so the
  buffers keep their addresses from step to step and XLA need not re-record the CUDA graphs
  that use them (a carry field a step does not read was pruned and lost its alias)."""
  with Engine(model, None, mode=mode, **ENGINE_KW) as eng:
    header = eng.compiled.as_text().split("\n", 1)[0]
    aliased = {int(o) for o in re.findall(r"\{(\d+)\}: \(\d+, \{\}, may-alias\)", header)}
    assert aliased == set(range(len(jax.tree.leaves(eng.compiled.out_info))))


@pytest.mark.parametrize("mode", ["persistent", "host"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_compiled_loop_never_copies_the_kv_cache(kv_heads, mode):
  """The loop (and the host-driven step) update the cache in place on the CPU backend too: no
  `lax.switch` around the cache there and no one-row dynamic-update-slice (docs/NOTES.md,
  "Whole-cache copies on the CPU backend"). With a [.., K, h] cache and K == 1, the Gemma 3
  270M and 1B shapes, XLA also re-laid-out the whole cache around every branch: the
  [.., K * h] storage removed those copies."""
  cfg = tiny_config("gemma3", vocab_size=VOCAB, num_kv_heads=kv_heads)
  model = Gemma(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
  with Engine(model, None, mode=mode, **ENGINE_KW) as eng:
    hlo = eng.compiled.as_text()
    pages = eng.sched.num_pages
  width = 2 * kv_heads * cfg.head_dim
  # Either view of a layer's cache: [P, page, width] or the flat [P * page, width].
  cache = rf"f32\[({pages},{ENGINE_KW['page_size']}|{pages * ENGINE_KW['page_size']}),{width}\]"
  copies = [l for l in hlo.splitlines() if re.search(rf"= {cache}\S* copy\(", l)]
  assert not copies, copies[:3]


IDLE_SCRIPT = """
import json, resource, sys, time
import jax.numpy as jnp
from flax import nnx
from blink_jax import Engine, SamplingParams
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
kw = json.loads(sys.argv[1])
kw["buckets"] = tuple(kw["buckets"])
model = Gemma(tiny_config("gemma3", vocab_size=320), dtype=jnp.float32, rngs=nnx.Rngs(0))
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
with Engine(model, None, mode=sys.argv[2], **kw) as eng:
  eng.generate(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3))
  time.sleep(0.5)
  c0, t0, i0 = cpu(), time.monotonic(), eng.stats()["loop_iterations"]
  time.sleep(4.0)
  print(json.dumps({"cores": (cpu() - c0) / (time.monotonic() - t0),
                    "iterations": eng.stats()["loop_iterations"] - i0}))
"""


def test_an_idle_engine_uses_under_5_percent_of_a_core():
  # In a process of its own, so that only this engine's threads count: the loop's idle
  # schedule sleeps (growing to 1 ms) between doorbell checks for idle_poll_us (50 ms by
  # default on a CPU) and the poll thread waits for a submission.
  import json
  import subprocess
  import sys
  kw = {k: v for k, v in ENGINE_KW.items() if k != "idle_poll_us"}
  # The persistent loop, the engine's form (host mode, the comparison baseline, launches a
  # step program every idle_poll_us: about 0.09 cores on the CI machine).
  out = subprocess.run([sys.executable, "-c", IDLE_SCRIPT, json.dumps(kw), "persistent"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["iterations"] > 0  # the loop is alive, going round every idle_poll_us
  assert got["cores"] < 0.05, got


def test_host_mode_equals_persistent(model, dense):
  with Engine(model, None, mode="host", **ENGINE_KW) as eng:
    prompts = [[3, 4, 5], [6] * 20]
    outs = eng.generate(prompt_token_ids=prompts,
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [dense(p, 6) for p in prompts]


@pytest.mark.parametrize("mode", ["persistent", "host"])
def test_step_pacing_keeps_the_greedy_outputs(model, dense, mode):
  """A paced loop (min_step_interval_us, step_interval_factor) only delays decode steps: same
  tokens, and its decode steps are at least the interval apart (unpaced, this tiny model's
  five steps take a few ms)."""
  prompts = [[3, 4, 5], [6] * 20]
  # The reference first: with this engine's and the module's engine's persistent loops each
  # holding one of a 2-core machine's XLA CPU threads, nothing else would run meanwhile.
  want = [dense(p, 6) for p in prompts]
  with Engine(model, None, mode=mode, min_step_interval_us=150_000, step_interval_factor=1.5,
              **ENGINE_KW) as eng:
    assert eng.sched.step_interval_permille == 1500  # the later of the two: 150 ms here
    outs = eng.generate(prompt_token_ids=prompts,
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    t0 = time.monotonic()
    eng.generate(prompt_token_ids=[7, 8], sampling=SamplingParams(max_tokens=5,
                                                                  ignore_eos=True))
    # 1 prefill step + 4 decode steps, the last 3 of them paced: at least 450 ms.
    assert time.monotonic() - t0 >= 0.45


@pytest.mark.parametrize("mode", ["persistent", "host"])
def test_prefix_caching_keeps_the_greedy_outputs_and_counts_cached_tokens(model, dense, mode):
  """With prefix caching a request that repeats another's first 24 tokens (6 pages of 4)
  maps them from the cache: the same greedy tokens as the dense model, 24 cached tokens in
  its output and the header's counters; a request with a new first page hits nothing."""
  base = [(7 * i + 3) % VOCAB for i in range(30)]
  prompts = [base, base[:24] + [5, 6], [9] + base[1:24] + [5, 6]]
  want = [dense(p, 6) for p in prompts]  # before the engine (see the test above)
  with Engine(model, None, mode=mode, prefix_caching=True, **ENGINE_KW) as eng:
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first, again, other = (eng.generate(prompt_token_ids=[p], sampling=sp)[0] for p in prompts)
    assert [first.token_ids, again.token_ids, other.token_ids] == want
    assert (first.cached_tokens, again.cached_tokens, other.cached_tokens) == (0, 24, 0)
    stats = eng.stats()
    assert stats["prefix_cache_hits"] == 24
    assert stats["prefix_cache_queries"] == 30 + 26 + 26


def test_shutdown_leaves_no_thread_and_rejects_requests(model):
  before = {t.name for t in threading.enumerate()}
  eng = Engine(model, None, **ENGINE_KW)
  eng.generate(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))
  eng.shutdown()
  after = {t.name for t in threading.enumerate()}
  assert not {n for n in after - before if n.startswith("blink")}
  assert eng.stats()["engine_state"] == "stopped"
  with pytest.raises(EngineStoppedError):
    eng.generate(prompt_token_ids=[1, 2, 3])


@pytest.mark.parametrize("donate", [False, True])
def test_the_loop_holds_the_fused_weights_once(model, dense, donate):
  """The q/k/v and gate/up weights reach the loop only as their fused copies (placeholders
  in their place), so the loop's inputs are the model's bytes, not 1.6x them as when both
  were kept; a donated model's unfused arrays are deleted, the rest of it (held by the
  loop) kept, and the outputs stay the model's greedy ones."""
  from blink_jax.model.gemma import Block
  if donate:  # a copy: the module's fixture model serves the other tests
    model = Gemma(tiny_config("gemma3", vocab_size=VOCAB), dtype=jnp.float32, rngs=nnx.Rngs(8))
  paths = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  names = ["/".join(str(getattr(k, "key", k)) for k in p[:-1]) for p, _ in paths]
  fused_away = {n for n in names if tuple(n.split("/")[-2:]) in Block.FUSED_AWAY}
  assert len(fused_away) == 5 * model.cfg.num_layers
  total = sum(a.nbytes for _, a in paths)
  away_bytes = sum(a.nbytes for (_, a), n in zip(paths, names) if n in fused_away)
  with Engine(model, None, donate_model=donate, **ENGINE_KW) as eng:
    ex = eng.executor
    held = sum(a.nbytes for a in jax.tree.leaves((ex.params, ex.fused)))
    assert held == total  # each weight once: unfused or in a fused copy
    assert sum(a.nbytes for a in ex.params) == total - away_bytes
    prompt = [5, 9, 14, 2, 77]
    out = eng.generate(prompt_token_ids=prompt,
                       sampling=SamplingParams(max_tokens=6, ignore_eos=True))
  assert out.token_ids == dense(prompt, 6)
  deleted = {n for n, (_, a) in zip(names, paths) if a.is_deleted()}
  assert deleted == (fused_away if donate else set())


def test_random_checkpoint_names_a_known_shape():
  with pytest.raises(ValueError, match="unknown model config 'nope'"):
    Engine.from_checkpoint("random:nope")


def _prompt_logprobs_of(engine):
  # A prompt longer than the largest bucket and than the ring (chunks are cut to what the ring
  # holds), batched with a short one.
  rng = np.random.default_rng(5)
  prompts = [[int(t) for t in rng.integers(3, 300, 70)], [9, 8, 7]]
  sp = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=1)
  return prompts, engine.generate(prompt_token_ids=prompts, sampling=sp)


def _check_prompt_logprobs(prompts, outs, dense):
  for p, out in zip(prompts, outs):
    lp = np.asarray(jax.nn.log_softmax(dense.logits(p + out.token_ids), axis=-1))
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
      assert out.prompt_logprobs[i] == pytest.approx(lp[i - 1][p[i]], abs=1e-4), i
      assert [a for a, _ in out.prompt_top_logprobs[i]] == list(np.argsort(-lp[i - 1])[:2])
    for i, tok in enumerate(out.token_ids):  # generated tokens follow, with their logprobs
      assert tok == int(np.argmax(lp[len(p) - 1 + i]))
      assert out.logprobs[i] == pytest.approx(lp[len(p) - 1 + i][tok], abs=1e-4)


def test_prompt_logprobs_match_the_model(engine, dense):
  prompts, outs = _prompt_logprobs_of(engine)
  _check_prompt_logprobs(prompts, outs, dense)
  plain = engine.generate(prompt_token_ids=prompts[1], sampling=SamplingParams(max_tokens=2))
  assert plain.prompt_logprobs is None and len(plain.token_ids) == 2
  with pytest.raises(ValueError, match="prompt_logprobs"):
    engine.generate(prompt_token_ids=[5, 6], sampling=SamplingParams(prompt_logprobs=99))


def test_prompt_logprobs_in_pieces_match_the_model(model, dense, monkeypatch):
  """A step whose rows pass PROMPT_LOGPROB_ROWS computes their prompt logprobs a piece at a
  time (the 16- and 32-row buckets here in pieces of 6: uneven, the last one short)."""
  from blink_jax.executor import loop
  monkeypatch.setattr(loop, "PROMPT_LOGPROB_ROWS", 6)
  with Engine(model, None, **ENGINE_KW) as eng:
    got = _prompt_logprobs_of(eng)
    assert eng.stats()["pages_in_use"] == 0
  _check_prompt_logprobs(*got, dense)  # with this engine's loop gone (two share 2 CPUs)


@pytest.mark.parametrize("mode,attention,norm", [
    ("persistent", "pallas", "reference"), ("host", "pallas", "reference"),
    ("persistent", "pallas", "pallas"), ("host", "pallas", "pallas"),
    ("persistent", "reference", "pallas")])
def test_pallas_kernels_equal_the_dense_reference(model, dense, mode, attention, norm):
  # Every bucket of ENGINE_KW is decode-sized (<= 64 tokens), so prefill chunks and decode
  # steps alike run the chosen Pallas kernels (Pallas' interpreter on CPU); with both, the
  # q/k kernel hands the attention its query grouped and padded.
  prompts = [[3, 4, 5], [6] * 20, list(range(10, 50))]
  want = [dense(p, 6) for p in prompts]
  with Engine(model, None, mode=mode, attention=attention, norm=norm, **ENGINE_KW) as eng:
    assert (eng.config.kernels.attention, eng.config.kernels.norm) == (attention, norm)
    outs = eng.generate(prompt_token_ids=prompts,
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert eng.stats()["pages_in_use"] == 0


def _pallas_engine_equals_the_dense_reference(model, dense, **kernels):
  prompts = [[3, 4, 5], [6] * 20, list(range(10, 50))]
  want = [dense(p, 6) for p in prompts]
  with Engine(model, None, attention="pallas", norm="pallas", **kernels, **ENGINE_KW) as eng:
    outs = eng.generate(prompt_token_ids=prompts,
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert eng.stats()["pages_in_use"] == 0


def test_pallas_prefill_kernel_equals_the_dense_reference(model, dense):
  # Steps above 4 tokens take the prefill kernel (blocks of tokens, each block's pages read
  # once) for all but their first 2 rows, which take the decode kernel, as steps above 64 do
  # with prefill="pallas", the default decode_rows and decode_head=256.
  _pallas_engine_equals_the_dense_reference(model, dense, prefill="pallas", decode_rows=4,
                                            decode_head=2)


def test_gemv_partial_sums_equal_the_dense_reference(model, dense):
  # Steps of one token run all four projections through the GEMV (jnp partial sums off the
  # GPU), whose output and down partial sums the add + norm kernel adds up and whose q/k/v
  # ones the q/k prepare kernel does; larger steps keep XLA's matmuls.
  _pallas_engine_equals_the_dense_reference(model, dense, gemv="qkv+out+down+gate_up")


def test_unknown_kernels_are_refused(model):
  with pytest.raises(ValueError, match="attention must be one of"):
    Engine(model, None, attention="flash", **ENGINE_KW)
  with pytest.raises(ValueError, match="norm must be one of"):
    Engine(model, None, norm="fused", **ENGINE_KW)
  with pytest.raises(ValueError, match="unknown projection"):
    Engine(model, None, gemv="qkv+lm_head", **ENGINE_KW)
  with pytest.raises(TypeError, match="unknown engine option"):
    Engine(model, None, atention="pallas", **ENGINE_KW)


def test_auto_kernels_are_pallas_on_a_gpu_and_the_blocked_attention_elsewhere(model):
  from blink_jax.engine import KernelOptions
  gpu, cpu = KernelOptions().resolved("gpu"), KernelOptions().resolved("cpu")
  assert (gpu.attention, gpu.norm, gpu.prefill, gpu.gemv) == ("pallas", "pallas", "pallas",
                                                              "qkv+out+down")
  assert (cpu.attention, cpu.norm, cpu.prefill, cpu.gemv) == ("blocked", "reference", "blocked",
                                                              "none")
  assert KernelOptions(attention="reference").resolved("gpu").attention == "reference"
  with Engine(model, None, **ENGINE_KW) as eng:  # the default on this CPU
    assert eng.executor.kernels == cpu
    assert eng.config.kernels == cpu


def test_auto_kernels_fall_back_loudly_when_they_do_not_compile(model, monkeypatch, caplog):
  # A GPU whose Triton cannot build a kernel: "auto" serves with the jnp reference and says
  # so; asked for by name, the error stands.
  import dataclasses

  from blink_jax.engine import KernelOptions
  from blink_jax.kernels import pallas_attention

  def fail(*a, **k):
    raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")
  real_resolved = KernelOptions.resolved
  monkeypatch.setattr(KernelOptions, "resolved", lambda self, platform, max_seqs=None: (
      dataclasses.replace(real_resolved(self, "gpu", max_seqs), gemv="none")))
  monkeypatch.setattr(pallas_attention, "paged_decode_attention", fail)
  with caplog.at_level("WARNING", logger="blink_jax"):
    with Engine(model, None, **ENGINE_KW) as eng:
      assert eng.executor.kernels.attention == "reference"
      assert eng.config.kernels.attention == "reference"
      out = eng.generate(prompt_token_ids=[3, 4, 5], sampling=SamplingParams(max_tokens=3))
      assert len(out.token_ids) == 3
  assert "falling back to the jnp reference" in caplog.text
  with pytest.raises(RuntimeError, match="Shared memory"):
    Engine(model, None, attention="pallas", **ENGINE_KW)
