"""Soak: 1,000 mixed requests through real HTTP against the real engine (tiny model, CPU).

Streaming and non-streaming completions and chats, malformed requests and clients that hang up
mid-stream, 24 at a time against 16 mailbox slots (so requests also wait in the frontend's
queue). Every greedy completion must equal the dense greedy decode of the same model (no lost,
duplicated or reordered token), every bad request must get an OpenAI-style 4xx, and at the end
the engine's pages, lanes and queue and the frontend's slots must all be free.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import aiohttp
import openai
import pytest

from tests.test_serving_e2e import _dense_greedy, _serve, _stop, _tiny_model

REQUESTS = 1000
CONCURRENCY = 24
MAX_TOKENS = 6
BAD_BODIES = [
    b"{not json",
    json.dumps({"model": "tiny-soak", "prompt": "x", "max_tokens": -1}).encode(),
    json.dumps({"model": "tiny-soak", "prompt": "x", "temperature": "hot"}).encode(),
    json.dumps({"model": "nope", "prompt": "x"}).encode(),
    json.dumps({"model": "tiny-soak", "prompt": [[-5, 2]]}).encode(),
    json.dumps({"model": "tiny-soak", "messages": "hello"}).encode(),
    json.dumps({"model": "tiny-soak", "prompt": "x" * 5000}).encode(),
]


@pytest.fixture(scope="module")
def soak_stack(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("soak")
  model, tok, tok_path = _tiny_model(tmp)
  engine, region, proc, url = _serve(model, tok, tok_path, tmp, "tiny-soak", max_seqs=8,
                                     num_slots=16, worker_args=["--max-queued-requests", "64"])
  yield model, tok, engine, url
  _stop(engine, region, proc)


def test_soak_mixed_requests(soak_stack):
  model, tok, engine, url = soak_stack
  prompts = [f"soak prompt {i} of the quick brown fox" for i in range(12)]
  want = {p: tok.decode(_dense_greedy(model, tok.encode(p, add_bos=True), MAX_TOKENS))
          for p in prompts}
  rng = random.Random(22)
  plan = [(rng.choice(["stream", "stream", "plain", "chat", "bad", "disconnect"]),
           rng.choice(prompts)) for _ in range(REQUESTS)]
  counts: dict[str, int] = {}
  failures: list[str] = []

  async def completion(ac, prompt, stream):
    kw = dict(model="tiny-soak", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
      text, finishes = "", []
      async for c in await ac.completions.create(stream=True, **kw):
        for ch in c.choices:
          text += ch.text
          if ch.finish_reason:
            finishes.append(ch.finish_reason)
      return text, finishes
    r = await ac.completions.create(**kw)
    assert r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text, [r.choices[0].finish_reason]

  async def one(i, kind, prompt, ac, session, sem):
    async with sem:
      try:
        if kind in ("stream", "plain"):
          text, finishes = await completion(ac, prompt, kind == "stream")
          if text != want[prompt] or finishes != ["length"]:
            failures.append(f"{i} {kind}: {text!r} {finishes} != {want[prompt]!r}")
        elif kind == "chat":
          r = await ac.chat.completions.create(
              model="tiny-soak", max_tokens=MAX_TOKENS, temperature=0,
              messages=[{"role": "user", "content": prompt}], extra_body={"ignore_eos": True})
          if r.usage.completion_tokens != MAX_TOKENS or r.choices[0].finish_reason != "length":
            failures.append(f"{i} chat: {r.usage} {r.choices[0].finish_reason}")
        elif kind == "bad":
          body = BAD_BODIES[i % len(BAD_BODIES)]
          async with session.post(f"{url}/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
            data = await r.json(content_type=None)
            if not (400 <= r.status < 500 and set(data["error"]) >= {"message", "type",
                                                                       "code"}):
              failures.append(f"{i} bad: {r.status} {data}")
        else:  # a client that hangs up after the first event
          body = {"model": "tiny-soak", "prompt": prompt, "max_tokens": 64, "stream": True,
                  "ignore_eos": True}
          async with session.post(f"{url}/completions", json=body) as r:
            if r.status != 200:
              failures.append(f"{i} disconnect: {r.status}")
            await r.content.readany()
            r.close()
        counts[kind] = counts.get(kind, 0) + 1
      except Exception as e:  # noqa: BLE001 - every failure is reported with its request
        failures.append(f"{i} {kind}: {type(e).__name__}: {e}")

  async def main():
    sem = asyncio.Semaphore(CONCURRENCY)
    ac = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
      try:
        await asyncio.gather(*(one(i, k, p, ac, session, sem)
                               for i, (k, p) in enumerate(plan)))
      finally:
        await ac.close()

  def health():
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:
      return json.loads(r.read())

  before = engine.stats()
  asyncio.run(main())
  assert not failures, f"{len(failures)} of {REQUESTS} failed, e.g. {failures[:5]}"
  assert sum(counts.values()) == REQUESTS
  deadline = time.monotonic() + 10  # cancelled streams finish on the device within steps
  while time.monotonic() < deadline:
    s, h = engine.stats(), health()
    if s["pages_in_use"] == s["running"] == s["waiting"] == h["slots_in_use"] == 0:
      break
    time.sleep(0.05)
  assert (s["pages_in_use"], s["running"], s["waiting"]) == (0, 0, 0), s
  reached = REQUESTS - counts["bad"]  # every other request was valid and reached the device
  assert s["requests_admitted"] - before["requests_admitted"] == reached, (before, s)
  assert s["requests_finished"] - before["requests_finished"] == reached, (before, s)
  assert s["requests_errored"] == before["requests_errored"], (before, s)
  assert h["status"] == "ok" and h["slots_in_use"] == 0, h
