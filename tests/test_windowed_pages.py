"""Windowed pages through the engine (docs/ARCHITECTURE.md, "Windowed pages"): the tiny Gemma 3
(window 8) with its sliding-window layers in per-sequence rings gives the dense model's greedy
tokens, with prefix caching on and off and under page pressure; and the capacity they buy at
a long context, from the engine's own sizing arithmetic."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from blink_jax import Engine, SamplingParams
from blink_jax.model.config import get_config, tiny_config
from blink_jax.model.gemma import Gemma, kv_page_bytes, ring_bytes

VOCAB = 320
KW = dict(max_seqs=4, page_size=4, max_context=96, num_slots=16, ring_capacity=8,
          buckets=(4, 16, 32), max_top_logprobs=0, idle_poll_us=100)


@pytest.fixture(scope="module")
def model():
  return Gemma(tiny_config("gemma3", vocab_size=VOCAB), dtype=jnp.float32, rngs=nnx.Rngs(8))


def _greedy(model, prompts, n):
  fwd = jax.jit(model.dense_forward)
  width = KW["max_context"]
  outs = []
  for p in prompts:
    seq = list(p)
    for _ in range(n):
      logits = fwd(jnp.array([seq + [0] * (width - len(seq))]))[0, len(seq) - 1]
      seq.append(int(np.argmax(logits)))
    outs.append(seq[len(p):])
  return outs


def _prompts():
  rng = np.random.default_rng(3)
  shared = [int(t) for t in rng.integers(3, VOCAB, 40)]
  own = [[int(t) for t in rng.integers(3, VOCAB, k)] for k in (1, 9, 23)]
  return [shared + o for o in own] + [[int(t) for t in rng.integers(3, VOCAB, 57)]]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_windowed_pages_keep_the_dense_models_greedy_tokens(model, prefix_caching):
  """Prompts of 41-63 tokens through rings of 3 pages (window 8, chunks of 5): every chunk
  and decode step wraps the ring; with caching the shared 40 tokens' global pages are shared
  and recomputed for the rings. 30 KV pages for 4 requests of up to 19: they preempt."""
  prompts = _prompts()
  want = _greedy(model, prompts, 12)
  with Engine(model, None, windowed_pages=True, window_chunk=5, kv_pages=30,
              prefix_caching=prefix_caching, **KW) as eng:
    assert eng.sched.window == 8 and eng.sched.window_pages == 3
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    first = eng.generate(prompt_token_ids=prompts[:1], sampling=sp)
    outs = first + eng.generate(prompt_token_ids=prompts[1:], sampling=sp)
    stats = eng.stats()
  assert [o.token_ids for o in outs] == want
  assert all(o.cached_tokens == 0 for o in outs)  # nothing saved: computed again
  assert stats["preemptions"] > 0


def test_windowed_pages_need_a_window_shorter_than_the_context(model):
  with pytest.raises(ValueError, match="windowed_pages needs sliding-window layers"):
    Engine(model, None, windowed_pages=True, **{**KW, "max_context": 8})


def test_32k_sequences_fit_over_four_times_as_many_with_windowed_pages():
  """Gemma 3 1B, bf16, 32,768-token context, page 16, in 40 GiB of KV memory: the engine's
  sizing (kv_pages_for_memory, the rings first) holds 5.6x the sequences with windowed pages
  (window 512, chunks of 512: rings of 64 pages). The H200 run that confirms it by serving
  them: docs/PERFORMANCE.md, "Windowed pages on the H200"."""
  from bench.window_capacity import sequences_for_memory
  cfg = get_config("gemma3-1b")
  kw = dict(context=32768, page_size=16, kv_bytes=40 << 30)
  full, _ = sequences_for_memory(cfg, windowed=False, **kw)
  windowed, ring = sequences_for_memory(cfg, windowed=True, window_chunk=512, **kw)
  assert (full, windowed, ring) == (49, 273, 64) and windowed >= 4 * full
  # The arithmetic: 26 layers x 32k tokens x 1 KiB per sequence, against 4 global layers'
  # pages plus 22 sliding-window layers' rings of 1,024 tokens.
  assert kv_page_bytes(cfg, 16) == 26 * 16 * 1024
  assert ring_bytes(cfg, 16, 64) == 22 * 64 * 16 * 1024
