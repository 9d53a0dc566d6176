"""The bundled Gemma 3 270M served by the engine (persistent loop, float32, CPU): greedy output
equals Hugging Face transformers' greedy decode of the same GGUF weights, also for prompts
whose shared system prompt came from the prefix cache (on by default)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from blink_jax import Engine
from blink_jax import SamplingParams
from blink_jax.weights import checkpoint as ckpt
from blink_jax.model.gemma import Gemma

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
SYSTEM = ("You are a helpful assistant. Answer in one short sentence, state only facts, and "
          "never repeat the question back to the user. Question: ")


@pytest.mark.slow
def test_bundled_gemma_greedy_matches_hf(gemma_dir, hf_gemma):
  torch = pytest.importorskip("torch")
  cfg, params = ckpt.load_checkpoint(gemma_dir, dtype=jnp.float32)
  tok = ckpt.load_tokenizer(gemma_dir)
  model = Gemma.from_params(cfg, params, dtype=jnp.float32)
  hf, _ = hf_gemma
  n = 12
  with Engine(model, tok, max_seqs=4, page_size=16, max_context=128, num_slots=8,
              buckets=(4, 32), max_top_logprobs=0) as eng:
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    outs = eng.generate(PROMPTS, sp)
    # One after the other, so the first has registered the shared pages when the others come.
    shared = [eng.generate(SYSTEM + q, sp) for q in ("What is 2 + 2?", "Where is Paris?")]
    assert eng.stats()["pages_in_use"] == 0
  assert shared[0].cached_tokens == 0
  a, b = (o.prompt_token_ids for o in shared)
  common = next(i for i, (x, y) in enumerate(zip(a, b + [-1])) if x != y)
  # Whole pages of the common prefix, leaving the last prompt token to compute.
  assert shared[1].cached_tokens == 16 * (min(common, len(b) - 1) // 16) >= 16
  for prompt, out in zip(PROMPTS + [SYSTEM + "What is 2 + 2?", SYSTEM + "Where is Paris?"],
                         outs + shared):
    ids = tok.encode(prompt, add_bos=True)
    assert out.prompt_token_ids == ids
    with torch.no_grad():
      ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                        min_new_tokens=n)[0, len(ids):].tolist()
    assert out.token_ids == ref, (prompt, tok.decode(out.token_ids), tok.decode(ref))
    assert out.text == tok.decode(ref)
