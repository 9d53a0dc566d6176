"""End to end through real HTTP: the real Engine (persistent loop, CPU) behind a frontend
worker process over shared memory, driven with the official openai client.

The fake-device tests (test_frontend_api.py) cover the HTTP surface in depth; these check that
the real executor, scheduler and model produce through HTTP exactly what an independent oracle
gives: a dense greedy decode of the same random model, and transformers' greedy decode of the
bundled Gemma 3 270M.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from blink_jax import Engine
from blink_jax.weights import checkpoint as ckpt
from blink_jax.model.config import tiny_config
from blink_jax.model.gemma import Gemma
from blink_jax.client import shm
from blink_jax.client.tokenizer import Tokenizer
from tests import fake_device as FD
from tests.fake_device import tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _serve(model, tok, tok_path: Path, tmp: Path, name: str, worker_args=(), **kw):
  """(engine, worker process, base url): the engine over shm and one frontend worker."""
  eng_kw = dict(max_seqs=4, page_size=8, max_context=128, num_slots=8, ring_capacity=16,
                buckets=(8, 32), max_top_logprobs=2, idle_poll_us=100)
  eng_kw.update(kw)
  from blink_jax.client import protocol as P
  geo = P.Geometry(eng_kw["num_slots"], eng_kw["max_context"] - 1, eng_kw["ring_capacity"],
                   eng_kw["max_top_logprobs"])
  region = shm.create_region(None, geo.total_bytes)
  engine = Engine(model, tok, region=region, model_name=name, **eng_kw)
  proc, port, _ = FD.start_worker(tmp, tok_path, name, ["--transport", "shm", "--shm-name",
                                                      region.name, *worker_args])
  return engine, region, proc, f"http://127.0.0.1:{port}/v1"


def _tiny_model(tmp: Path):
  """(model, tokenizer, its path): the tiny tokenizer and a tiny random Gemma 3 over it, of a
  seed whose greedy text is printable."""
  tok_path = tiny_tokenizer(tmp)
  tok = Tokenizer(str(tok_path))
  model = Gemma(tiny_config("gemma3", vocab_size=tok.vocab_size), dtype=jnp.float32,
                rngs=nnx.Rngs(8))
  return model, tok, tok_path


def _stop(engine, region, proc):
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(30) == 0
  engine.shutdown()
  region.close()
  region.unlink()


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("e2e")
  model, tok, tok_path = _tiny_model(tmp)
  engine, region, proc, url = _serve(model, tok, tok_path, tmp, "tiny-real")
  yield model, tok, engine, openai.OpenAI(base_url=url, api_key="unused")
  _stop(engine, region, proc)


def _dense_greedy(model, ids, n, width=128):
  fwd = jax.jit(model.dense_forward)
  seq = list(ids)
  for _ in range(n):
    logits = fwd(jnp.array([seq + [0] * (width - len(seq))]))[0, len(seq) - 1]
    seq.append(int(np.argmax(logits)))
  return seq[len(ids):]


def test_completion_equals_dense_greedy(tiny_stack):
  model, tok, engine, client = tiny_stack
  prompt = "the quick brown fox"
  r = client.completions.create(model="tiny-real", prompt=prompt, max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True})
  want = _dense_greedy(model, tok.encode(prompt, add_bos=True), 10)
  assert r.choices[0].text == tok.decode(want)
  assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_stream_equals_non_stream_and_seeds_reproduce(tiny_stack):
  _, _, engine, client = tiny_stack
  kw = dict(model="tiny-real", prompt="hello world", max_tokens=12, temperature=0.9, seed=5,
            extra_body={"ignore_eos": True})
  a = client.completions.create(**kw).choices[0].text
  b = client.completions.create(**kw).choices[0].text
  streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                     if c.choices)
  assert a == b == streamed
  assert engine.stats()["pages_in_use"] == 0


def test_n_choices_sample_apart_and_reproduce(tiny_stack):
  # n = 3 sampled choices of one prompt: the first is what n = 1 gives with the same seed, the
  # three differ from each other, and the same seeded request repeats all three.
  _, _, engine, client = tiny_stack
  kw = dict(model="tiny-real", prompt="once upon a time", max_tokens=12, temperature=1.0,
            seed=11, extra_body={"ignore_eos": True})
  one = client.completions.create(**kw).choices[0].text
  a = client.completions.create(n=3, **kw)
  b = client.completions.create(n=3, **kw)
  texts = [ch.text for ch in a.choices]
  assert [ch.index for ch in a.choices] == [0, 1, 2] and texts[0] == one
  assert len(set(texts)) == 3 and texts == [ch.text for ch in b.choices]
  assert a.usage.completion_tokens == 36
  greedy = client.completions.create(n=2, **{**kw, "temperature": 0})
  assert greedy.choices[0].text == greedy.choices[1].text
  assert engine.stats()["pages_in_use"] == 0


def test_chat_and_bad_input_keep_serving(tiny_stack):
  _, _, engine, client = tiny_stack
  r = client.chat.completions.create(model="tiny-real", max_tokens=5,
                                     messages=[{"role": "user", "content": "hello"}])
  assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 5
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model="tiny-real", prompt="x", max_tokens=5, temperature=-1)
  assert client.completions.create(model="tiny-real", prompt="x", max_tokens=3).usage



def test_repeated_prompt_reports_cached_tokens_and_keeps_its_text(tiny_stack):
  # Prefix caching is on by default: the second request's prompt comes from the cache, in
  # whole pages of 8 leaving its last token to compute, and its greedy text is the first's.
  model, tok, engine, client = tiny_stack
  prompt = "zebras run over the lazy dog and far away into the woods"  # no other test's prefix
  n_prompt = len(tok.encode(prompt, add_bos=True))
  assert n_prompt > 9
  kw = dict(model="tiny-real", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True})
  first, second = (client.completions.create(**kw) for _ in range(2))
  assert first.usage.prompt_tokens_details.cached_tokens == 0
  assert second.usage.prompt_tokens_details.cached_tokens == 8 * ((n_prompt - 1) // 8)
  assert second.choices[0].text == first.choices[0].text == tok.decode(
      _dense_greedy(model, tok.encode(prompt, add_bos=True), 6))
  assert engine.stats()["pages_in_use"] == 0

@pytest.mark.slow
def test_bundled_gemma_through_http_matches_hf(gemma_dir, hf_gemma, tmp_path):
  torch = pytest.importorskip("torch")
  cfg, params = ckpt.load_checkpoint(gemma_dir, dtype=jnp.float32)
  tok = ckpt.load_tokenizer(gemma_dir)
  model = Gemma.from_params(cfg, params, dtype=jnp.float32)
  engine, region, proc, url = _serve(model, tok, gemma_dir / "tokenizer.model", tmp_path,
                                     "gemma", buckets=(8, 32))
  try:
    client = openai.OpenAI(base_url=url, api_key="unused")
    prompt = "The capital of France is"
    r = client.completions.create(model="gemma", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = tok.encode(prompt, add_bos=True)
    hf, _ = hf_gemma
    with torch.no_grad():
      ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False)[0, len(ids):].tolist()
    assert r.choices[0].text == tok.decode(ref)
  finally:
    _stop(engine, region, proc)


def test_stop_strings_and_logprobs(tiny_stack):
  model, tok, engine, client = tiny_stack
  prompt = "hello world the quick brown"
  full = client.completions.create(model="tiny-real", prompt=prompt, max_tokens=16,
                                   temperature=0, extra_body={"ignore_eos": True})
  text = full.choices[0].text
  assert len(text) >= 4 and "\ufffd" not in text[:4]
  stop = text[1:3]
  r = client.completions.create(model="tiny-real", prompt=prompt, max_tokens=16, temperature=0,
                                stop=[stop], extra_body={"ignore_eos": True})
  assert r.choices[0].finish_reason == "stop"
  assert r.choices[0].text == text[:text.index(stop)]
  lp = client.completions.create(model="tiny-real", prompt=prompt, max_tokens=4, temperature=0,
                                 logprobs=2, extra_body={"ignore_eos": True})
  ids = tok.encode(prompt, add_bos=True)
  want = _dense_greedy(model, ids, 4)
  logits = np.asarray(model.dense_forward(jnp.array([ids + want]))[0])
  ref = jax.nn.log_softmax(logits, axis=-1)
  got = lp.choices[0].logprobs.token_logprobs
  np.testing.assert_allclose(got, [ref[len(ids) - 1 + i, t] for i, t in enumerate(want)],
                             atol=1e-4)


def test_concurrent_streams_all_complete(tiny_stack):
  import asyncio
  model, tok, engine, client = tiny_stack
  prompts = [f"the model {i}" for i in range(24)]

  async def one(ac, p):
    text = ""
    async for c in await ac.completions.create(model="tiny-real", prompt=p, max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
      if c.choices:
        text += c.choices[0].text
    return text

  async def main():
    ac = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused")
    try:
      return await asyncio.gather(*(one(ac, p) for p in prompts))
    finally:
      await ac.close()

  texts = asyncio.run(main())
  for p, t in zip(prompts, texts):
    assert t == tok.decode(_dense_greedy(model, tok.encode(p, add_bos=True), 8)), p
  assert engine.stats()["pages_in_use"] == 0


def test_disconnect_frees_pages(tiny_stack):
  import http.client
  _, _, engine, client = tiny_stack
  host, port = client.base_url.host, client.base_url.port
  conn = http.client.HTTPConnection(host, port, timeout=30)
  body = json.dumps({"model": "tiny-real", "prompt": "hello", "max_tokens": 120,
                     "stream": True, "ignore_eos": True})
  conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
  resp = conn.getresponse()
  assert resp.status == 200
  resp.read1(64)  # the stream has started
  deadline = time.monotonic() + 20
  while engine.stats()["pages_in_use"] == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
  conn.close()  # the client goes away mid-stream
  while engine.stats()["pages_in_use"] != 0 and time.monotonic() < deadline:
    time.sleep(0.02)
  s = engine.stats()
  assert s["pages_in_use"] == 0 and s["running"] == 0
  assert s["requests_cancelled"] >= 1
