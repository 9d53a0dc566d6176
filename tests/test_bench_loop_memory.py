"""bench/loop_memory.py: XLA's temporaries of the compiled loop against the engine's reserve.
With the prompt logprobs in pieces of 512 rows, a 2,048-row step holds the logits of one
piece, not of all its rows (docs/PERFORMANCE.md, "The step's workspace")."""
import jax.numpy as jnp

from bench import loop_memory
from blink_jax.model.config import tiny_config


def test_the_loop_holds_one_piece_of_logits_within_the_reserve():
  r = loop_memory.measure(tiny_config("gemma3", vocab_size=8192), 2048, 8, 2, jnp.float32)
  assert 0 < r["temp_bytes"] <= r["workspace_bytes"] and r["logit_rows"] == 512, r
  # In one piece: four [2048, vocab] float32 arrays (256 MiB); in pieces of 512: one
  # piece's four, 64 MiB, with the rest of the step's temporaries.
  assert r["temp_bytes"] < r["budget_logits_bytes"], r
