"""The mailbox's prompt arena (ffi/mailbox.h; docs/ARCHITECTURE.md, "The prompt arena"): the
frontend's first-fit allocator and what a worker does when its share is full."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blink_jax.client import mailbox as M
from blink_jax.client import protocol as P


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.integers(1, 64),
       st.lists(st.tuples(st.booleans(), st.integers(1, 20)), max_size=60))
def test_allocations_never_overlap_and_free_ranges_merge(start, size, ops):
  arena = M.PromptArena(range(start, start + size))
  taken: dict[int, int] = {}  # start -> length
  for alloc, n in ops:
    if alloc or not taken:
      at = arena.alloc(n)
      if at is None:
        # First fit fails only when no free range is that long.
        assert all(e - s < n for s, e in zip(arena._starts, arena._ends))
        continue
      assert start <= at and at + n <= start + size
      assert all(at + n <= s or s + m <= at for s, m in taken.items()), "overlap"
      taken[at] = n
    else:
      at = sorted(taken)[n % len(taken)]
      arena.free(at, taken.pop(at))
    assert arena.free_tokens == size - sum(taken.values())
    # Free ranges are sorted, disjoint and never adjacent (merged).
    assert all(e < s for e, s in zip(arena._ends, arena._starts[1:]))
  for at, n in list(taken.items()):
    arena.free(at, n)
  assert (arena._starts, arena._ends) == ([start], [start + size])


def test_double_free_is_refused():
  arena = M.PromptArena(range(10))
  at = arena.alloc(4)
  arena.free(at, 4)
  with pytest.raises(ValueError, match="already free"):
    arena.free(at, 4)
  with pytest.raises(ValueError, match="already free"):
    arena.free(2, 3)


def _client(geo: P.Geometry, worker: int = 0, workers: int = 1) -> M.MailboxClient:
  region = M.LocalRegion(np.zeros(geo.total_bytes, np.uint8))
  M.init_header(region, geo, vocab_size=100, max_context=geo.max_prompt + 1,
                num_workers=workers, eos_id=1)
  return M.MailboxClient(region, worker, workers)


def test_a_full_share_makes_the_request_wait_and_a_finish_makes_room():
  geo = P.Geometry(num_slots=8, max_prompt=10, ring_capacity=4, max_top_logprobs=0,
                   arena_tokens=2 * 16)
  client = _client(geo, worker=1, workers=2)
  assert client.arena.tokens == range(16, 32)
  a = client.submit(M.Request(prompt=[5] * 10, max_tokens=1))
  with pytest.raises(M.SlotsFullError, match="prompt arena of worker 1 has no room for 7"):
    client.submit(M.Request(prompt=[6] * 7, max_tokens=1))
  b = client.submit(M.Request(prompt=[7] * 6, max_tokens=1))  # the 6 tokens left
  req = client._request(b)
  at = int(req["prompt_offset"])
  assert at == 26 and int(req["prompt_len"]) == 6
  words = np.frombuffer(client.region.read(geo.arena_offset + 4 * at, 24), "<i4")
  assert words.tolist() == [7] * 6
  client.release(a)  # (a finished request's slot goes back with its tokens)
  c = client.submit(M.Request(prompt=[6] * 7, max_tokens=1))
  assert int(client._request(c)["prompt_offset"]) == 16


def test_a_prompt_longer_than_the_share_is_refused_at_once():
  geo = P.Geometry(num_slots=4, max_prompt=20, ring_capacity=4, max_top_logprobs=0,
                   arena_tokens=2 * 12)
  client = _client(geo, worker=0, workers=2)
  with pytest.raises(ValueError, match="exceeds the slot capacity 12"):
    client.submit(M.Request(prompt=[3] * 13, max_tokens=1))


def test_the_default_arena_costs_far_less_than_a_prompt_per_slot():
  from blink_jax.engine_config import ARENA_TOKENS, EngineConfig
  c = EngineConfig(max_context=32768).resolved(32768, "gpu")
  assert c.num_slots == 4096 and c.prompt_arena_tokens == ARENA_TOKENS
  geo = P.Geometry(c.num_slots, c.max_context - 1, c.ring_capacity, c.max_top_logprobs,
                   c.prompt_arena_tokens)
  inline = P.Geometry(c.num_slots, c.max_context - 1, c.ring_capacity, c.max_top_logprobs)
  assert geo.total_bytes < 64 << 20 < (512 << 20) < inline.total_bytes
  # Small: never more than a longest prompt per slot.
  small = EngineConfig(num_slots=4, max_context=64).resolved(64, "cpu")
  assert small.prompt_arena_tokens == 4 * 63
  with pytest.raises(ValueError, match="prompt_arena_tokens .* room for one prompt"):
    EngineConfig(max_context=64, frontend_workers=3, prompt_arena_tokens=200).resolved(64, "cpu")
