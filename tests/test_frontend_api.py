"""The OpenAI-compatible frontend end to end, over real HTTP on 127.0.0.1.

Engine side: a FakeDevice (the real scheduler through ctypes + a deterministic story model) in
a thread of this process, over POSIX shared memory; for the tcp transport also the relay.
Frontend: a `python -m nic_frontend.worker` process. Clients: the official openai client for
the happy paths, raw http.client / aiohttp for the rest. Every end-to-end test runs once per
transport.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blink_jax.client import protocol as P
from blink_jax.client.tokenizer import Tokenizer
from nic_frontend import openai_api as api
from blink_jax.client import shm
from nic_frontend.transports import tcp
from tests import fake_device as FD

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"
MODEL = "tiny-story"
MAX_BODY = 64 * 1024


wait_until = FD.wait_until


@dataclasses.dataclass
class Stack:
  transport: str
  port: int
  device: FD.FakeDevice
  tok: Tokenizer
  story: list[int]
  proc: subprocess.Popen
  log: Path
  relay: tcp.TcpRelayServer | None = None

  @property
  def base(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def client(self, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

  def aclient(self, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

  def http(self, method: str, path: str, body=None, *, headers=None, auth=True):
    """(status, headers, parsed JSON or raw bytes) of one request on a fresh connection."""
    return FD.http_request(self.port, method, path, body, headers=headers,
                           api_key=API_KEY if auth else None)

  def metrics(self) -> dict:
    status, _, raw = self.http("GET", "/metrics", auth=False)
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(raw.decode()):
      for s in fam.samples:
        out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out

  def metric(self, name: str, **labels) -> float:
    return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

  def expected_ids(self, prompt_len: int, n: int, ignore_eos: bool = False) -> tuple[list, str]:
    """What the story model generates for a prompt of `prompt_len` tokens."""
    out = []
    for k in range(n):
      t = self.story[(prompt_len + k) % len(self.story)]
      out.append(t)
      if t == self.tok.eos_id and not ignore_eos:
        return out, "stop"
    return out, "length"

  def expected(self, prompt_len: int, n: int, ignore_eos: bool = False) -> tuple[str, str, int]:
    ids, why = self.expected_ids(prompt_len, n, ignore_eos)
    return self.tok.decode(ids), why, len(ids)

  def prompt_len(self, text: str) -> int:
    return len(self.tok.encode(text, add_bos=True))


def _start_worker(tmp: Path, tokenizer_path: Path, args: list[str], env: dict) -> tuple:
  return FD.start_worker(tmp, tokenizer_path, MODEL,
                         ["--max-body-bytes", str(MAX_BODY), "--grace-s", "5", *args], env)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def stack(request, tokenizer_path, tmp_path_factory):
  transport = request.param
  tmp = tmp_path_factory.mktemp(f"stack-{transport}")
  with FD.running_device(tokenizer_path) as fake:
    yield from _stack(transport, tmp, tokenizer_path, fake)


def _stack(transport, tmp, tokenizer_path, fake):
  region, device, tok, story = fake.region, fake.device, fake.tokenizer, fake.story
  relay = None
  env = {"BLINK_API_KEY": API_KEY}
  if transport == "shm":
    args = ["--transport", "shm", "--shm-name", region.name]
  else:
    relay = tcp.TcpRelayServer(region, token="relay-token").start()
    args = ["--transport", "tcp", "--relay", relay.address]
    env["BLINK_RELAY_TOKEN"] = "relay-token"
  proc, port, log = _start_worker(tmp, tokenizer_path, args, env)
  st = Stack(transport, port, device, tok, story, proc, log, relay)
  try:
    wait_until(lambda: st.http("GET", "/health")[0] == 200, 20, 0.02, "a healthy frontend")
    yield st
  finally:
    relay = st.relay
    proc.send_signal(signal.SIGTERM)
    try:
      code = proc.wait(20)
    except subprocess.TimeoutExpired:
      proc.kill()
      code = "killed"
    print(f"--- worker log ({transport}) ---\n{log.read_text()[-4000:]}")
    if relay is not None:
      relay.stop()
    assert code == 0, f"worker exit code {code}"


@pytest.fixture
def device_control(stack):
  """Restores the device's pace, pause and state after a test that changed them."""
  yield stack.device
  stack.device.step_delay_s = 0.0
  stack.device.resume()
  stack.device.set_state(P.EngineState.READY)
  wait_until(lambda: stack.http("GET", "/health")[0] == 200, 10, 0.02, "READY again")


# ---- happy paths (openai client) ------------------------------------------------------------

def test_models_and_health(stack):
  models = stack.client().models.list()
  assert [m.id for m in models.data] == [MODEL]
  status, headers, body = stack.http("GET", "/health", auth=False)
  assert status == 200 and body["status"] == "ok" and body["engine_state"] == "ready"
  assert body["slots_total"] == stack.device.dc.num_slots
  status, _, card = stack.http("GET", f"/v1/models/{MODEL}")
  assert status == 200 and card["id"] == MODEL and card["max_model_len"] == 256


def test_completion(stack):
  prompt = "Hello there"
  r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                        temperature=0)
  text, why, n = stack.expected(stack.prompt_len(prompt), 20)
  assert r.object == "text_completion" and r.id.startswith("cmpl-")
  assert r.choices[0].text == text and r.choices[0].finish_reason == why == "length"
  assert r.usage.prompt_tokens == stack.prompt_len(prompt)
  assert r.usage.completion_tokens == n == 20
  assert r.usage.total_tokens == r.usage.prompt_tokens + 20


def test_completion_eos_and_ignore_eos(stack):
  prompt = [2, 10, 11, 12]
  r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=250)
  text, why, n = stack.expected(len(prompt), 250)
  assert why == "stop", "the story ends with <eos> within max_tokens"
  assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text
  assert r.usage.completion_tokens == n  # includes the <eos> token
  r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=n + 5,
                                        extra_body={"ignore_eos": True})
  text, why, n2 = stack.expected(len(prompt), n + 5, ignore_eos=True)
  assert r.choices[0].finish_reason == "length" and r.choices[0].text == text
  assert r.usage.completion_tokens == n + 5


def test_completion_prompt_forms(stack):
  c = stack.client()
  ids = [[2, 7, 8], [2, 7, 8, 9, 10, 11, 12]]
  r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6)
  assert [ch.index for ch in r.choices] == [0, 1]
  for ch, p in zip(r.choices, ids):
    assert ch.text == stack.expected(len(p), 6)[0]
  assert r.usage.prompt_tokens == 10 and r.usage.completion_tokens == 12
  texts = ["a", "a longer prompt here"]
  r = c.completions.create(model=MODEL, prompt=texts, max_tokens=5)
  for ch, p in zip(r.choices, texts):
    assert ch.text == stack.expected(stack.prompt_len(p), 5)[0]
  r = c.completions.create(model=MODEL, prompt=ids[1], max_tokens=3)
  assert r.choices[0].text == stack.expected(7, 3)[0]


def test_chat(stack):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Tell me a story."}]
  r = stack.client().chat.completions.create(model=MODEL, messages=messages,
                                             max_completion_tokens=30, temperature=0)
  plen = len(stack.tok.apply_chat_template(messages))
  text, why, n = stack.expected(plen, 30)
  assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
  msg = r.choices[0].message
  assert msg.role == "assistant" and msg.content == text
  assert r.choices[0].finish_reason == why and r.usage.prompt_tokens == plen
  assert r.usage.completion_tokens == n
  # The turn ends at <end_of_turn> whatever the engine's EOS list.
  rec = stack.device.find_requests(prompt=stack.tok.apply_chat_template(messages))[-1]
  assert rec["stop_ids"] == [stack.tok.end_of_turn_id]
  # Without a token limit the reply may fill the context: it ends at the story's <eos>.
  r = stack.client().chat.completions.create(model=MODEL, messages=messages)
  assert r.choices[0].finish_reason == "stop"


def _sse(stack, path: str, body: dict) -> list:
  """The raw SSE events of a streaming request (parsed JSON, and "[DONE]")."""
  conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
  conn.request("POST", path, body=json.dumps(body),
               headers={"Content-Type": "application/json",
                        "Authorization": f"Bearer {API_KEY}"})
  r = conn.getresponse()
  assert r.status == 200, r.read()
  assert r.getheader("Content-Type").startswith("text/event-stream")
  raw = r.read().decode()
  conn.close()
  assert raw.endswith("data: [DONE]\n\n")
  events = []
  for block in raw.split("\n\n"):
    if not block:
      continue
    assert block.startswith("data: ") and "\n" not in block, repr(block)
    payload = block[len("data: "):]
    events.append(payload if payload == "[DONE]" else json.loads(payload))
  assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
  return events[:-1]


def test_stream_completion_sse_framing(stack):
  prompt = "Stream this"
  body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True,
          "stream_options": {"include_usage": True}}
  events = _sse(stack, "/v1/completions", body)
  text, why, n = stack.expected(stack.prompt_len(prompt), 40)
  *chunks, last = events
  assert all(e["object"] == "text_completion" and e["usage"] is None for e in chunks)
  assert len({e["id"] for e in events}) == 1
  assert "".join(c["choices"][0]["text"] for c in chunks) == text
  assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == why
  assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
  assert not any("\ufffd" in c["choices"][0]["text"] for c in chunks)
  assert last["choices"] == [] and last["usage"] == {
      "prompt_tokens": stack.prompt_len(prompt), "completion_tokens": n,
      "total_tokens": stack.prompt_len(prompt) + n,
      "prompt_tokens_details": {"cached_tokens": 0}}  # the fake device runs no prefix cache
  # Without include_usage: no usage field at all.
  body.pop("stream_options")
  events = _sse(stack, "/v1/completions", body)
  assert all("usage" not in e for e in events)
  assert "".join(e["choices"][0]["text"] for e in events) == text


def test_stream_sends_a_chunk_for_tokens_without_text(stack):
  """Tokens whose text is empty so far (the bytes of an unfinished character, <eos> with
  ignore_eos) still reach the client as chunks, as vLLM streams them: TTFT is the first
  token's, not the first visible character's. One token per step (a slow device), so each
  arrives in its own batch."""
  tok, story = stack.tok, stack.story
  def silent(start, n):  # the first n tokens of a prompt of `start` tokens add no text
    d = tok.detokenizer()
    return all(d.push(story[(start + k) % len(story)]) == "" for k in range(n))
  plen = next(L for L in range(2, 200) if silent(L, 3))
  prompt = [2] + [5] * (plen - 1)
  stack.device.step_delay_s = 0.05
  try:
    events = _sse(stack, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                             "stream": True, "ignore_eos": True})
  finally:
    stack.device.step_delay_s = 0.0
  texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["finish_reason"] is None]
  assert texts[:3] == ["", "", ""], texts
  assert "".join(e["choices"][0]["text"] for e in events) == stack.expected(
      plen, 4, ignore_eos=True)[0]


def test_stream_chat_openai_client(stack):
  messages = [{"role": "user", "content": "Stream a story"}]
  stream = stack.client().chat.completions.create(
      model=MODEL, messages=messages, max_tokens=60, stream=True,
      stream_options={"include_usage": True})
  chunks = list(stream)
  plen = len(stack.tok.apply_chat_template(messages))
  text, why, n = stack.expected(plen, 60)
  assert chunks[0].choices[0].delta.role == "assistant"
  content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert content == text
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[-1] == why and all(f is None for f in finishes[:-1])
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
  assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_several_prompts(stack):
  prompts = [[2, 5], [2, 5, 6, 7, 8]]
  events = _sse(stack, "/v1/completions", {"model": MODEL, "prompt": prompts,
                                           "max_tokens": 12, "stream": True})
  for i, p in enumerate(prompts):
    mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
    assert "".join(c["text"] for c in mine) == stack.expected(len(p), 12)[0]
    assert mine[-1]["finish_reason"] == "length"


def test_n_choices_per_prompt(stack):
  """n samples each prompt n times: choice i*n + j is prompt i's j-th, each in a slot of its
  own with seed choice_seed(seed, j) (choice 0 keeps the request's seed); the prompt's tokens
  count once in the usage, every choice's completion tokens count."""
  c = stack.client()
  prompts = ["first prompt here", "second"]
  r = c.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=7, seed=77,
                           temperature=0.8, extra_body={"ignore_eos": True})
  assert [ch.index for ch in r.choices] == list(range(6))
  for ch in r.choices:
    assert ch.text == stack.expected(stack.prompt_len(prompts[ch.index // 3]), 7, True)[0]
  plens = [stack.prompt_len(p) for p in prompts]
  assert r.usage.prompt_tokens == sum(plens) and r.usage.completion_tokens == 6 * 7
  for i, p in enumerate(prompts):
    ids = stack.tok.encode(p, add_bos=True)
    seeds = sorted(q["seed"] for q in stack.device.requests if q["prompt"] == ids)
    assert seeds == sorted(api.choice_seed(77, j) for j in range(3))
  assert api.choice_seed(77, 0) == 77 and len({api.choice_seed(77, j) for j in range(64)}) == 64
  # Chat, streamed: every choice's role chunk, text and finish, told apart by index.
  events = _sse(stack, "/v1/chat/completions", {
      "model": MODEL, "n": 2, "max_tokens": 5, "stream": True, "ignore_eos": True,
      "stream_options": {"include_usage": True},
      "messages": [{"role": "user", "content": "two answers"}]})
  for j in range(2):
    mine = [ch for e in events for ch in e["choices"] if ch["index"] == j]
    assert mine[0]["delta"].get("role") == "assistant"
    assert mine[-1]["finish_reason"] == "length"
    assert "".join(ch["delta"].get("content") or "" for ch in mine)
  assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


# ---- stop strings ---------------------------------------------------------------------------

@pytest.mark.parametrize("stop", ["STOP", ["zzz", "brûlée"], "é ser", "🎉"])
def test_stop_strings(stack, stop):
  """The text ends right before the stop string (finish "stop"), streamed or not, and no part
  of it is ever sent; stop strings spanning several tokens and multi-byte characters."""
  prompt = [2, 3]
  full, _, _ = stack.expected(len(prompt), 240, ignore_eos=True)
  stops = [stop] if isinstance(stop, str) else stop
  cut = min(full.find(s) for s in stops if s in full)
  want = full[:cut]
  c = stack.client()
  r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=240, stop=stop,
                           extra_body={"ignore_eos": True})
  assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
  assert r.usage.completion_tokens < 240
  stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=240, stop=stop,
                                stream=True, extra_body={"ignore_eos": True})
  pieces = [ch.choices[0].text for ch in stream]
  assert "".join(pieces) == want
  for s in stops:
    assert not any(s in p for p in pieces)
  # A stop string that never completes: its held-back prefixes are released.
  r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=80, stop="STOP here!!",
                           extra_body={"ignore_eos": True})
  assert r.choices[0].text == stack.expected(len(prompt), 80, True)[0]


def test_stop_string_cancels_on_device(stack, device_control):
  """A stop string match cancels the request on the device (its pages are freed at once)."""
  device_control.step_delay_s = 0.003
  before = stack.device.header()["requests_cancelled"]
  r = stack.client().completions.create(model=MODEL, prompt=[2, 3], max_tokens=200,
                                        stop="STOP", extra_body={"ignore_eos": True})
  assert r.choices[0].finish_reason == "stop"
  wait_until(lambda: stack.device.header()["requests_cancelled"] == before + 1, 10,
             what="the device cancellation")
  wait_until(lambda: stack.device.header()["pages_in_use"] == 0, 10, what="pages freed")
  assert stack.metric("blink_frontend_cancelled_requests_total", reason="stop_string") >= 1


def test_stop_token_ids(stack):
  prompt = [2, 3, 4]
  ids, _ = stack.expected_ids(len(prompt), 60, ignore_eos=True)
  stop_id = ids[10]
  k = ids.index(stop_id)
  r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=60,
                                        extra_body={"stop_token_ids": [stop_id]})
  assert r.choices[0].finish_reason == "stop"
  assert r.usage.completion_tokens == k + 1
  assert r.choices[0].text == stack.tok.decode(ids[:k + 1])
  rec = stack.device.find_requests(request_id=stack.device.requests[-1]["request_id"])[0]
  assert rec["stop_ids"] == [stop_id]


# ---- logprobs and sampling fields -----------------------------------------------------------

def test_completion_logprobs(stack):
  prompt = [2, 40, 41]
  r = stack.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=3)
  ids, _ = stack.expected_ids(len(prompt), 12)
  lp = r.choices[0].logprobs
  assert lp.token_logprobs == [-0.5 - (t % 7) for t in ids]
  assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 12
  for t, top in zip(ids, lp.top_logprobs):
    assert len(top) <= 3
    assert list(top.values())[0] == -0.5 - (t % 7)
  assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(stack):
  messages = [{"role": "user", "content": "logprobs please"}]
  r = stack.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                             logprobs=True, top_logprobs=2)
  ids, _ = stack.expected_ids(len(stack.tok.apply_chat_template(messages)), 8)
  content = r.choices[0].logprobs.content
  assert [c.logprob for c in content] == [-0.5 - (t % 7) for t in ids]
  for t, c in zip(ids, content):
    assert len(c.top_logprobs) == 2
    assert [a.logprob for a in c.top_logprobs] == [-0.5 - (t % 7), -1.5 - (t % 7)]
    assert isinstance(c.bytes, list)
  # Streaming carries the same entries, spread over the chunks.
  stream = stack.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                  logprobs=True, top_logprobs=1, stream=True)
  got = [c.logprob for ch in stream if ch.choices and ch.choices[0].logprobs
         for c in ch.choices[0].logprobs.content]
  assert got == [-0.5 - (t % 7) for t in ids]


def test_sampling_fields_reach_the_slot(stack):
  """seed, temperature, top_p, top_k, logprobs, ignore_eos land in the slot as sent; the same
  seed reproduces the output (the fake model is deterministic)."""
  c = stack.client()
  kw = dict(model=MODEL, prompt="seeded", max_tokens=10, seed=1234, temperature=0.7,
            top_p=0.9, extra_body={"top_k": 5, "ignore_eos": True}, logprobs=2, user="u1")
  a = c.completions.create(**kw)
  b = c.completions.create(**kw)
  assert a.choices[0].text == b.choices[0].text
  recs = stack.device.find_requests(seed=1234)
  assert len(recs) == 2
  for rec in recs:
    assert rec["max_tokens"] == 10 and rec["top_k"] == 5 and rec["num_logprobs"] == 2
    assert np.float32(rec["temperature"]) == np.float32(0.7)
    assert np.float32(rec["top_p"]) == np.float32(0.9)
    assert rec["flags"] == P.FLAG_LOGPROBS | P.FLAG_IGNORE_EOS
    assert rec["prompt"] == stack.tok.encode("seeded", add_bos=True)
  # No seed: a fresh random one per request.
  c.completions.create(model=MODEL, prompt="unseeded", max_tokens=2)
  c.completions.create(model=MODEL, prompt="unseeded", max_tokens=2)
  p = stack.tok.encode("unseeded", add_bos=True)
  seeds = [r["seed"] for r in stack.device.requests if r["prompt"] == p]
  assert len(seeds) == 2 and seeds[0] != seeds[1]
  # Negative seeds are accepted (two's complement in the slot).
  c.completions.create(model=MODEL, prompt="neg", max_tokens=1, seed=-1)
  assert stack.device.find_requests(seed=(1 << 64) - 1)


# ---- concurrency ----------------------------------------------------------------------------

def test_64_concurrent_streams(stack):
  async def one(client, i):
    prompt = [2] + [10 + (j % 50) for j in range(i % 40)]
    n = 16 + (i * 7) % 48
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    text, finish, usage = "", None, None
    async for ch in stream:
      if ch.choices:
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
      if ch.usage:
        usage = ch.usage
    want, why, k = stack.expected(len(prompt), n, ignore_eos=True)
    assert text == want, i
    assert finish == why == "length" and usage.completion_tokens == k
    return k

  async def main():
    client = stack.aclient()
    try:
      return await asyncio.gather(*(one(client, i) for i in range(64)))
    finally:
      await client.close()

  t0 = time.monotonic()
  counts = asyncio.run(main())
  assert len(counts) == 64 and all(counts)
  print(f"64 streams over {stack.transport}: {time.monotonic() - t0:.2f}s")
  wait_until(lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == 0, 10,
             what="slots released")
  assert stack.device.header()["pages_in_use"] == 0


# ---- errors ---------------------------------------------------------------------------------

OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD = [
    # (id, path, body, status, param, code)
    ("bad-json", "/v1/completions", b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    ("not-object", "/v1/completions", [1, 2], 400, None, None),
    ("no-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("prompt-type", "/v1/completions", {**OK_C, "prompt": {"a": 1}}, 400, "prompt", None),
    ("prompt-mixed", "/v1/completions", {**OK_C, "prompt": ["a", 3]}, 400, "prompt", None),
    ("prompt-empty", "/v1/completions", {**OK_C, "prompt": []}, 400, "prompt", None),
    ("prompt-empty-ids", "/v1/completions", {**OK_C, "prompt": [[]]}, 400, "prompt", None),
    ("prompt-bad-id", "/v1/completions", {**OK_C, "prompt": [[2, 99999]]}, 400, "prompt", None),
    ("prompt-neg-id", "/v1/completions", {**OK_C, "prompt": [2, -1]}, 400, "prompt", None),
    ("prompt-too-long", "/v1/completions", {**OK_C, "prompt": [5] * 300}, 400, "prompt",
     "context_length_exceeded"),
    ("max-tokens-type", "/v1/completions", {**OK_C, "max_tokens": "ten"}, 400, "max_tokens",
     "invalid_type"),
    ("max-tokens-zero", "/v1/completions", {**OK_C, "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-context", "/v1/completions", {**OK_C, "max_tokens": 1000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("temperature-neg", "/v1/completions", {**OK_C, "temperature": -1}, 400, "temperature",
     None),
    ("temperature-big", "/v1/completions", {**OK_C, "temperature": 3.5}, 400, "temperature",
     None),
    ("temperature-type", "/v1/completions", {**OK_C, "temperature": "hot"}, 400,
     "temperature", "invalid_type"),
    ("top-p-zero", "/v1/completions", {**OK_C, "top_p": 0}, 400, "top_p", None),
    ("top-p-big", "/v1/completions", {**OK_C, "top_p": 1.5}, 400, "top_p", None),
    ("top-k-neg", "/v1/completions", {**OK_C, "top_k": -2}, 400, "top_k", None),
    ("top-k-float", "/v1/completions", {**OK_C, "top_k": 2.5}, 400, "top_k", None),
    ("n-0", "/v1/chat/completions", {**OK_CHAT, "n": 0}, 400, "n", None),
    ("n-big", "/v1/chat/completions", {**OK_CHAT, "n": api.MAX_CHOICES + 1}, 400, "n", None),
    ("n-times-prompts", "/v1/completions", {**OK_C, "prompt": ["a", "b", "c"], "n": 22}, 400,
     "n", None),
    ("seed-type", "/v1/completions", {**OK_C, "seed": "x"}, 400, "seed", None),
    ("logprobs-big", "/v1/completions", {**OK_C, "logprobs": 10}, 400, "logprobs", None),
    ("logprobs-bool", "/v1/completions", {**OK_C, "logprobs": True}, 400, "logprobs", None),
    ("stop-type", "/v1/completions", {**OK_C, "stop": 5}, 400, "stop", None),
    ("stop-empty", "/v1/completions", {**OK_C, "stop": [""]}, 400, "stop", None),
    ("stop-many", "/v1/completions", {**OK_C, "stop": [str(i) for i in range(20)]}, 400,
     "stop", None),
    ("stop-ids-range", "/v1/completions", {**OK_C, "stop_token_ids": [10 ** 6]}, 400,
     "stop_token_ids", None),
    ("stop-ids-many", "/v1/completions", {**OK_C, "stop_token_ids": list(range(5, 25))}, 400,
     "stop_token_ids", None),
    ("ignore-eos-type", "/v1/completions", {**OK_C, "ignore_eos": "yes"}, 400, "ignore_eos",
     None),
    ("stream-type", "/v1/completions", {**OK_C, "stream": 1}, 400, "stream", None),
    ("stream-options-no-stream", "/v1/completions", {**OK_C, "stream_options":
                                                     {"include_usage": True}}, 400,
     "stream_options", None),
    ("user-type", "/v1/completions", {**OK_C, "user": 5}, 400, "user", None),
    ("penalty", "/v1/completions", {**OK_C, "presence_penalty": 1.0}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("echo", "/v1/completions", {**OK_C, "echo": True}, 400, "echo", None),
    ("model-type", "/v1/completions", {**OK_C, "model": 7}, 400, "model", None),
    ("unknown-model", "/v1/completions", {**OK_C, "model": "gpt-9"}, 404, "model",
     "model_not_found"),
    ("unknown-model-chat", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "model",
     "model_not_found"),
    ("no-messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("messages-empty", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages",
     None),
    ("messages-type", "/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, 400, "messages",
     None),
    ("messages-order", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages", None),
    ("messages-content", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "user", "content": 3}]}, 400, "messages", None),
    ("messages-image", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", None),
    ("top-logprobs-no-logprobs", "/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("top-logprobs-big", "/v1/chat/completions",
     {**OK_CHAT, "logprobs": True, "top_logprobs": 20}, 400, "top_logprobs", None),
    ("chat-logprobs-type", "/v1/chat/completions", {**OK_CHAT, "logprobs": 3}, 400, "logprobs",
     None),
    ("max-completion-tokens", "/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": -4},
     400, "max_completion_tokens", None),
    ("tools", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400,
     "tools", None),
    # Strings JSON allows but no tokenizer encodes (they were 500s), and nesting deep enough
    # to exhaust the JSON parser's recursion (a 500 too).
    ("prompt-surrogate", "/v1/completions", {**OK_C, "prompt": "a\ud800b"}, 400, "prompt",
     "invalid_string"),
    ("chat-surrogate", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages",
     "invalid_string"),
    ("model-surrogate", "/v1/completions", {**OK_C, "model": "\ud800"}, 400, "model",
     "invalid_string"),
    ("deep-nesting", "/v1/completions",
     b'{"model": "m", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, None,
     "invalid_json"),
    ("nested-too-deep", "/v1/completions", {**OK_C, "user": functools.reduce(
        lambda x, _: [x], range(40), [])}, 400, "user", "invalid_json"),
]


# The messages of this API's errors name their param.
_check_error = functools.partial(FD.check_error, param_in_message=True)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(stack, case):
  _, path, body, status, param, code = case
  raw = body if isinstance(body, bytes) else json.dumps(body).encode()
  s, h, b = stack.http("POST", path, raw)
  err = _check_error(s, h, b, status, param=param, code=code)
  if status == 400:
    assert err["type"] == "invalid_request_error"


def test_server_keeps_serving_after_errors(stack):
  for _, path, body, status, *_ in BAD[:8]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert stack.http("POST", path, raw)[0] == status
  r = stack.client().completions.create(model=MODEL, prompt="after errors", max_tokens=5)
  assert r.choices[0].text == stack.expected(stack.prompt_len("after errors"), 5)[0]
  assert stack.metric("blink_frontend_requests_total", endpoint="/v1/completions",
                      status="400") >= 7


def test_http_level_errors(stack):
  # Oversized body: 413, whether announced by Content-Length or not.
  big = json.dumps({**OK_C, "prompt": "x" * (MAX_BODY + 10)})
  _check_error(*stack.http("POST", "/v1/completions", big), 413, code="request_too_large")
  conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
  conn.request("POST", "/v1/completions", body=iter([big[:1000].encode(), big[1000:].encode()]),
               headers={"Content-Type": "application/json",
                        "Authorization": f"Bearer {API_KEY}"}, encode_chunked=True)
  r = conn.getresponse()
  _check_error(r.status, dict(r.getheaders()), json.loads(r.read()), 413,
               code="request_too_large")
  conn.close()
  # Unknown route, wrong method.
  _check_error(*stack.http("GET", "/v1/nothing"), 404)
  _check_error(*stack.http("GET", "/v1/completions"), 405)
  _check_error(*stack.http("GET", "/v1/models/gpt-9"), 404, param="model", code="model_not_found")
  # Bad or missing API key on /v1; /health and /metrics stay open.
  for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}, {}):
    s, h, b = stack.http("POST", "/v1/completions", OK_C, headers=headers, auth=False)
    _check_error(s, h, b, 401, code="invalid_api_key")
  # A key of bytes that are not UTF-8 (http.client sends header values as latin-1): a wrong
  # key, not a 500.
  conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
  conn.request("POST", "/v1/completions", body=json.dumps(OK_C).encode(),
               headers={"Content-Type": "application/json", "Authorization": "Bearer \xff\xfe"})
  r = conn.getresponse()
  _check_error(r.status, dict(r.getheaders()), json.loads(r.read()), 401,
               code="invalid_api_key")
  conn.close()
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=stack.base + "/v1", api_key="nope", max_retries=0).models.list()
  assert stack.http("GET", "/health", auth=False)[0] == 200
  assert stack.http("POST", "/v1/completions", OK_C)[0] == 200


def test_503_when_slots_and_queue_are_full(stack, device_control):
  """With every slot of the worker holding a request and no room in its queue (this worker has
  none), the next one gets 503 + Retry-After, as vLLM past its queue bound; the waiting
  requests' clients leave, their slots come back."""
  n = stack.device.dc.num_slots
  device_control.pause()
  conns = []
  try:
    for i in range(n):
      conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
      conn.request("POST", "/v1/completions", body=json.dumps({**OK_C, "stream": True}),
                   headers={"Content-Type": "application/json",
                            "Authorization": f"Bearer {API_KEY}"})
      conns.append(conn)
    wait_until(lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == n, 20,
               what="all slots in use")
    s, h, b = stack.http("POST", "/v1/completions", OK_C)
    _check_error(s, h, b, 503, code="queue_full")
    assert h.get("Retry-After") == "1"
    with pytest.raises(openai.InternalServerError):
      stack.client().completions.create(**OK_C)
  finally:
    for conn in conns:
      conn.close()
  wait_until(lambda: stack.metric("blink_frontend_cancelled_requests_total",
                                  reason="disconnect") >= n, 20, what="disconnects noticed")
  device_control.resume()
  wait_until(lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == 0, 20,
             what="slots released")
  assert stack.http("POST", "/v1/completions", OK_C)[0] == 200


def test_disconnect_cancels_and_frees_pages(stack, device_control):
  device_control.step_delay_s = 0.005
  wait_until(lambda: stack.device.header()["pages_in_use"] == 0, 10, what="an idle device")
  before = int(stack.device.header()["requests_cancelled"])
  conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
  conn.request("POST", "/v1/completions",
               body=json.dumps({**OK_C, "prompt": [2] + [9] * 100, "max_tokens": 150,
                                "ignore_eos": True, "stream": True}),
               headers={"Content-Type": "application/json",
                        "Authorization": f"Bearer {API_KEY}"})
  r = conn.getresponse()
  assert r.status == 200
  first = r.readline()
  assert first.startswith(b"data: ")
  wait_until(lambda: stack.metric("blink_gpu_pages_in_use") > 0, 10, what="pages in use")
  conn.sock.shutdown(2)
  conn.close()
  # The header the frontend publishes in /metrics is refreshed every 50 ms.
  wait_until(lambda: stack.metric("blink_gpu_pages_in_use") == 0, 10, what="pages freed")
  wait_until(lambda: stack.metric("blink_gpu_requests_cancelled_total") == before + 1, 10,
             what="the cancellation counted")
  assert int(stack.device.header()["requests_cancelled"]) == before + 1
  assert stack.metric("blink_frontend_requests_total", endpoint="/v1/completions",
                      status="499") >= 1


@pytest.mark.parametrize("state", [P.EngineState.STARTING, P.EngineState.STOPPED])
def test_503_unless_engine_ready(stack, device_control, state):
  device_control.set_state(state)
  name = {P.EngineState.STARTING: "starting", P.EngineState.STOPPED: "stopped"}[state]
  status, _, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(
      stack.http("GET", "/health", auth=False)), 10, what="health 503")
  assert body["engine_state"] == name
  s, h, b = stack.http("POST", "/v1/completions", OK_C)
  err = _check_error(s, h, b, 503, code=f"engine_{name}")
  assert name in err["message"] and "Retry-After" in h
  with pytest.raises(openai.InternalServerError):
    stack.client().completions.create(**OK_C)


def test_engine_stopping_ends_requests_in_flight(stack, device_control):
  """Requests waiting on an engine that stops get 503 (or an SSE error event if the stream
  had begun); their slots come back if the device still finishes them."""
  device_control.pause()

  async def main():
    client = stack.aclient()
    try:
      plain = asyncio.create_task(client.completions.create(**OK_C))
      await asyncio.sleep(0)
      wait = asyncio.get_running_loop().run_in_executor(None, lambda: wait_until(
          lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == 1, 10,
          what="the request in its slot"))
      await wait
      device_control.set_state(P.EngineState.STOPPED)
      with pytest.raises(openai.InternalServerError) as e:
        await plain
      assert e.value.status_code == 503 and "stopped" in e.value.message
    finally:
      await client.close()

  asyncio.run(main())
  device_control.set_state(P.EngineState.READY)
  device_control.resume()
  wait_until(lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == 0, 10,
             what="the slot back")
  wait_until(lambda: stack.http("GET", "/health")[0] == 200, 10, what="READY again")
  # A stream that already began ends with an error event, then [DONE].
  device_control.step_delay_s = 0.005
  conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
  conn.request("POST", "/v1/completions",
               body=json.dumps({**OK_C, "max_tokens": 200, "ignore_eos": True, "stream": True}),
               headers={"Content-Type": "application/json",
                        "Authorization": f"Bearer {API_KEY}"})
  r = conn.getresponse()
  assert r.status == 200 and r.readline().startswith(b"data: {")
  device_control.set_state(P.EngineState.STOPPED)
  rest = r.read().decode()
  conn.close()
  events = [b[len("data: "):] for b in rest.split("\n\n") if b.startswith("data: ")]
  assert events[-1] == "[DONE]"
  err = json.loads(events[-2])["error"]
  assert err["code"] == "engine_unavailable" and "stopped" in err["message"]
  device_control.set_state(P.EngineState.READY)
  wait_until(lambda: stack.metric("blink_frontend_slots_in_use", worker="0") == 0, 10,
             what="the slot back")


def test_tcp_relay_loss_and_recovery(stack):
  """The relay goes away: 503 (engine unreachable); it comes back on the same port: the
  worker reconnects and serves again."""
  if stack.transport != "tcp":
    pytest.skip("tcp transport only")
  port = stack.relay.port
  stack.relay.stop()
  try:
    status, _, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(
        stack.http("GET", "/health", auth=False)), 10, what="health 503")
    assert body["engine_state"] == "unreachable"
    s, h, b = stack.http("POST", "/v1/completions", OK_C)
    _check_error(s, h, b, 503, code="engine_unreachable")
  finally:
    stack.relay = tcp.TcpRelayServer(stack.device.region, token="relay-token",
                                     port=port).start()
  wait_until(lambda: stack.http("GET", "/health", auth=False)[0] == 200, 15,
             what="the worker reconnected")
  r = stack.client().completions.create(model=MODEL, prompt="back", max_tokens=3)
  assert r.choices[0].text == stack.expected(stack.prompt_len("back"), 3)[0]


def test_metrics(stack):
  parts = ("request_prepare_time_seconds", "request_queue_time_seconds",
           "slot_to_first_output_seconds", "time_to_first_token_seconds")
  before = stack.metrics()
  stack.client().completions.create(model=MODEL, prompt="metrics", max_tokens=8)
  m = stack.metrics()
  get = lambda name, **labels: m.get((name, tuple(sorted(labels.items()))), 0.0)
  grew = lambda name: get(name) - before.get((name, ()), 0.0)  # noqa: E731
  # One request: one observation of each part of TTFT, and the parts fit inside it.
  assert [grew(f"blink_frontend_{h}_count") for h in parts] == [1, 1, 1, 1]
  *each, whole = (grew(f"blink_frontend_{h}_sum") for h in parts)
  assert min(each) >= 0 and sum(each) <= whole + 1e-6, (each, whole)
  # The device's clock (the same host clock here): its part of the slot-to-first-output time,
  # and its time per token, no longer than the whole stream's.
  device = {h: (grew(f"blink_frontend_device_{h}_seconds_count"),
                grew(f"blink_frontend_device_{h}_seconds_sum"))
            for h in ("time_to_first_output", "time_per_output_token")}
  assert device["time_to_first_output"][0] == device["time_per_output_token"][0] == 1
  assert 0 < device["time_to_first_output"][1] <= grew(
      "blink_frontend_slot_to_first_output_seconds_sum")
  assert 0 < 7 * device["time_per_output_token"][1] <= grew(
      "blink_frontend_e2e_request_latency_seconds_sum")
  for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
            "e2e_request_latency_seconds"):
    assert get(f"blink_frontend_{h}_count") >= 1, h
  assert get("blink_frontend_requests_total", endpoint="/v1/completions", status="200") >= 1
  assert get("blink_frontend_generation_tokens_total") >= 8
  assert get("blink_frontend_slots_total", worker="0") == stack.device.dc.num_slots
  assert get("blink_engine_state") == 1
  # The GPU's counters come from the driver's header snapshot, refreshed every header_s.
  m = wait_until(lambda: (lambda m: m if m.get(("blink_gpu_tokens_generated_total", ()), 0) >= 8
                          else None)(stack.metrics()), 5, what="the header snapshot")
  assert get("blink_gpu_steps_total") > 0 and get("blink_gpu_tokens_generated_total") >= 8
  assert get("blink_gpu_pages_total") == stack.device.dc.num_pages
  for g in ("pages_in_use", "running", "waiting", "last_step_tokens"):
    assert (f"blink_gpu_{g}", ()) in m, g
  for kernel in ("schedule", "commit"):  # device time: CUDA only, 0 from the CPU scheduler
    assert m[(f"blink_gpu_{kernel}_seconds_total", ())] == 0.0, kernel
  for phase in ("scan", "poll", "decode", "admit", "batch"):
    assert m[("blink_gpu_schedule_phase_seconds_total", (("phase", phase),))] == 0.0, phase
  # each request rang a doorbell: at least one pass scanned the slots, at most one a loop
  # iteration
  assert 1 <= get("blink_gpu_slot_scans_total") <= get("blink_gpu_loop_iterations_total")


# ---- unit: request parsing ------------------------------------------------------------------

def test_parse_completion_defaults(tokenizer_path):
  tok = Tokenizer(str(tokenizer_path))
  limits = api.Limits((MODEL,), tok.vocab_size, max_context=64, max_prompt=60,
                      max_top_logprobs=4)
  g = api.parse_completion({"prompt": "hello"}, limits, tok)
  assert g.model == MODEL and g.max_tokens == [16] and g.temperature == 1.0
  assert g.prompts[0][0] == tok.bos_id and not g.seed_given and not g.logprobs
  g = api.parse_completion({"prompt": [2] * 60}, limits, tok)  # default clamped to the room
  assert g.max_tokens == [4]
  g = api.parse_chat({"messages": [{"role": "developer", "content": "x"},
                                   {"role": "user", "content": "y"}],
                      "top_k": -1, "seed": 5, "stop": "a"}, limits, tok)
  assert g.top_k == 0 and g.seed == 5 and g.stop == ["a"]
  assert g.max_tokens == [64 - len(g.prompts[0])]
  req = g.slot_request(0, request_id=9)
  assert req.prompt == g.prompts[0] and req.request_id == 9 and not req.logprobs


# ---- the frontend stays JAX-free ------------------------------------------------------------

def test_frontend_does_not_import_jax():
  code = ("import sys, nic_frontend, nic_frontend.server, nic_frontend.worker, "
          "nic_frontend.openai_api, blink_jax.client.streaming, nic_frontend.metrics, nic_frontend.supervisor, "
          "blink_jax.client.shm, nic_frontend.transports.tcp, "
          "nic_frontend.transports.rdma; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]; "
          "assert not bad, bad")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
  assert run.returncode == 0, run.stderr


# ---- the serving supervisor with two workers on one port -----------------------------------

@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_serve_two_workers_share_a_port(tokenizer_path, tmp_path, transport):
  from nic_frontend.supervisor import ServeOptions, Serving
  engine = FD.FakeEngine(tokenizer_path, FD.DeviceConfig(num_workers=2), model_name=MODEL)
  sock_port = FD.free_port()
  opts = ServeOptions(host="127.0.0.1", port=sock_port, transport=transport, workers=2,
                      api_key=API_KEY, grace_s=10.0, run_dir=str(tmp_path))
  server = Serving(engine, opts)
  stopped = False
  try:
    server.start()
    st = Stack(transport, sock_port, engine.device, Tokenizer(str(tokenizer_path)),
               engine.device.model.story.tolist(), None, tmp_path)
    workers = set()
    for i in range(24):
      s, h, b = st.http("POST", "/v1/completions", {**OK_C, "prompt": [2, 3 + i % 5]})
      assert s == 200, b
      assert b["choices"][0]["text"] == st.expected(2, 4)[0]
      workers.add(h["x-blink-worker"])
    assert workers == {"0", "1"}, workers
    # The frontend metrics of both workers add up on either one (multiprocess mode).
    total = st.metric("blink_frontend_requests_total", endpoint="/v1/completions", status="200")
    assert total == 24
    # SIGTERM-style shutdown with a request in flight: it finishes within the grace period.
    engine.device.step_delay_s = 0.004

    async def slow():
      client = st.aclient()
      try:
        return await client.completions.create(model=MODEL, prompt=[2, 3], max_tokens=100,
                                               extra_body={"ignore_eos": True})
      finally:
        await client.close()

    async def race():
      task = asyncio.create_task(slow())
      loop = asyncio.get_running_loop()
      await loop.run_in_executor(None, lambda: wait_until(
          lambda: engine.device.header()["tokens_generated"] > 24 * 4 + 5, 10,
          what="the slow request generating"))
      await loop.run_in_executor(None, server.stop)
      return await task

    r = asyncio.run(race())
    stopped = True
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 100
    assert all(p.returncode == 0 for p in server.procs), [p.returncode for p in server.procs]
    assert not shm.exists(engine.shm_name)
  finally:
    if not stopped:
      server.stop()


def test_serve_flags_are_the_engine_config():
  """serve.py's engine flags are EngineConfig's and KernelOptions' fields (engine_config)."""
  run = subprocess.run([sys.executable, "scripts/serve.py", "--helpfull"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert "--ckpt" in run.stdout, run.stderr  # (absl's --helpfull exits with 1)
  import dataclasses

  from blink_jax.engine_config import EngineConfig, KernelOptions
  for cls in (EngineConfig, KernelOptions):
    for f in dataclasses.fields(cls):
      if f.name != "kernels":
        assert f"--{f.name}:" in run.stdout or f"--[no]{f.name}:" in run.stdout, f.name


def test_worker_exits_when_its_supervisor_dies(tokenizer_path, tmp_path):
  """A worker must not keep serving a mailbox when serve.py was killed outright."""
  dc = FD.DeviceConfig(num_slots=4)
  region = shm.create_region(None, dc.geometry.total_bytes)
  from blink_jax.client import mailbox as M
  M.init_header(region, dc.geometry, vocab_size=320, max_context=dc.max_context, num_workers=1,
                eos_id=1)
  ready = tmp_path / "ready.json"
  code = (
      "import os, subprocess, sys, time\n"
      "p = subprocess.Popen([sys.executable, '-m', 'nic_frontend.worker', '--shm-name', "
      f"{region.name!r}, '--tokenizer', {str(tokenizer_path)!r}, '--model-name', 'm', "
      f"'--port', '0', '--ready-file', {str(ready)!r}, '--parent-pid', str(os.getpid())], "
      "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
      "print(p.pid, flush=True)\n"
      "time.sleep(600)\n")
  sup = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                         text=True)
  try:
    worker = int(sup.stdout.readline())
    wait_until(ready.exists, 30, 0.02, "the worker")
    assert FD.process_alive(worker)
    sup.kill()
    sup.wait()
    wait_until(lambda: not FD.process_alive(worker), 15, 0.05, "the orphaned worker to exit")
  finally:
    if sup.poll() is None:
      sup.kill()
    region.close()
    region.unlink()
