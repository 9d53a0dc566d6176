"""The prefix-cache page registry (ffi/prefix_cache.h) through its C API, against a plain
Python model: lookups verify tokens and parents (a forced hash collision never shares a page),
reference and children counts exact, eviction only of unreferenced leaves in least recently
released order, no page lost or freed while referenced."""
from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blink_jax.native import ffi as F

_i32p = ctypes.POINTER(ctypes.c_int32)
NP, PS = 12, 2  # pages, tokens per page


def _lib():
  lib = F.library().lib
  lib.blink_prefix_words.restype = ctypes.c_int64
  lib.blink_prefix_words.argtypes = [ctypes.c_int64, ctypes.c_int64]
  lib.blink_prefix_init.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p]
  lib.blink_prefix_hash.restype = ctypes.c_uint64
  lib.blink_prefix_hash.argtypes = [ctypes.c_uint64, _i32p, ctypes.c_int64]
  lib.blink_prefix_lookup.restype = ctypes.c_int32
  lib.blink_prefix_lookup.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, ctypes.c_uint64,
                                      ctypes.c_int32, _i32p]
  lib.blink_prefix_insert.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, ctypes.c_int32,
                                      ctypes.c_uint64, ctypes.c_int32, _i32p]
  lib.blink_prefix_acquire.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, ctypes.c_int32]
  lib.blink_prefix_release.restype = ctypes.c_int32
  lib.blink_prefix_release.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, ctypes.c_int32,
                                       ctypes.c_int32]
  lib.blink_prefix_evict.restype = ctypes.c_int32
  lib.blink_prefix_evict.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p]
  lib.blink_prefix_page.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, ctypes.c_int32,
                                    _i32p]
  lib.blink_prefix_lru.restype = ctypes.c_int32
  lib.blink_prefix_lru_links.restype = ctypes.c_uint32
  lib.blink_prefix_lru_links.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p]
  lib.blink_prefix_lru.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p, _i32p]
  lib.blink_prefix_check.restype = ctypes.c_char_p
  lib.blink_prefix_check.argtypes = [ctypes.c_int64, ctypes.c_int64, _i32p]
  return lib


class Registry:
  """The C registry on a numpy buffer."""

  def __init__(self, np_: int = NP, ps: int = PS):
    self.lib, self.np, self.ps = _lib(), np_, ps
    self.buf = np.zeros(self.lib.blink_prefix_words(np_, ps), np.int32)
    self.ptr = self.buf.ctypes.data_as(_i32p)
    self.lib.blink_prefix_init(np_, ps, self.ptr)

  @staticmethod
  def _toks(tokens):
    a = np.ascontiguousarray(tokens, np.int32)
    return a, a.ctypes.data_as(_i32p)

  def hash(self, parent_hash: int, tokens) -> int:
    a, p = self._toks(tokens)
    return int(self.lib.blink_prefix_hash(parent_hash, p, len(a)))

  def lookup(self, h, parent, tokens) -> int:
    a, p = self._toks(tokens)
    return int(self.lib.blink_prefix_lookup(self.np, self.ps, self.ptr, h, parent, p))

  def insert(self, page, h, parent, tokens):
    a, p = self._toks(tokens)
    self.lib.blink_prefix_insert(self.np, self.ps, self.ptr, page, h, parent, p)

  def acquire(self, page):
    self.lib.blink_prefix_acquire(self.np, self.ps, self.ptr, page)

  def release(self, page, tick) -> bool:
    return bool(self.lib.blink_prefix_release(self.np, self.ps, self.ptr, page, tick))

  def evict(self) -> int:
    return int(self.lib.blink_prefix_evict(self.np, self.ps, self.ptr))

  def page(self, p) -> dict:
    out = np.zeros(5, np.int32)
    self.lib.blink_prefix_page(self.np, self.ps, self.ptr, p, out.ctypes.data_as(_i32p))
    return dict(zip(("cached", "ref", "kids", "parent", "tick"), map(int, out)))

  def lru(self) -> list[int]:
    out = np.zeros(self.np + 1, np.int32)
    n = self.lib.blink_prefix_lru(self.np, self.ps, self.ptr, out.ctypes.data_as(_i32p))
    return [int(x) for x in out[:n]]

  def lru_links(self) -> int:
    return int(self.lib.blink_prefix_lru_links(self.np, self.ps, self.ptr))

  def check(self) -> str:
    return self.lib.blink_prefix_check(self.np, self.ps, self.ptr).decode()


def test_hash_chains_over_parent_and_tokens():
  r = Registry()
  a = r.hash(0, [1, 2])
  assert a == r.hash(0, [1, 2])
  assert len({a, r.hash(0, [2, 1]), r.hash(a, [1, 2]), r.hash(0, [1, 3])}) == 4


def test_a_forced_collision_never_shares_a_page():
  """Two pages under one hash (as a collision would put them): a lookup returns the one whose
  tokens and parent match, and nothing for a third prefix under the same hash."""
  r = Registry()
  h = 12345
  r.acquire(0)
  r.insert(0, h, -1, [1, 2])
  r.acquire(1)
  r.insert(1, h, -1, [3, 4])
  r.acquire(2)
  r.insert(2, h, 0, [3, 4])  # same tokens as page 1, another parent
  assert (r.lookup(h, -1, [1, 2]), r.lookup(h, -1, [3, 4]), r.lookup(h, 0, [3, 4])) == (0, 1, 2)
  assert r.lookup(h, -1, [5, 6]) == -1 and r.lookup(h, 1, [3, 4]) == -1
  assert r.check() == ""


def test_only_unreferenced_leaves_are_evicted_least_recently_released_first():
  r = Registry()
  h0 = r.hash(0, [1, 1])
  h1 = r.hash(h0, [2, 2])
  for p in (0, 1, 2):
    r.acquire(p)
  r.insert(0, h0, -1, [1, 1])
  r.insert(1, h1, 0, [2, 2])
  r.insert(2, r.hash(0, [7, 7]), -1, [7, 7])
  assert r.evict() == -1  # all referenced
  assert r.release(2, tick=5) is False  # cached: stays, evictable
  assert r.release(1, tick=3) is False
  assert r.release(0, tick=3) is False  # has a cached child: not evictable yet
  assert r.lru() == [1, 2]
  assert r.evict() == 1  # tick 3 before tick 5; then its parent (tick 3) comes next
  assert r.lru() == [0, 2]
  assert r.page(0)["kids"] == 0
  assert (r.evict(), r.evict(), r.evict()) == (0, 2, -1)
  assert r.lookup(h0, -1, [1, 1]) == -1
  assert r.check() == ""


def test_a_full_cache_evicts_in_constant_links_per_page():
  """A cache holding many finished sequences (chains of pages, each released at its own
  step) is evicted completely, as a server whose cache has filled its pages does, one page
  per page it allocates. Each eviction of a leaf makes its parent evictable, at the oldest
  tick but one: the evictable list takes it near its head. A walk from the tail alone
  followed a link per listed sequence for every such parent (here 952 links over the whole
  eviction, growing with the square of the cache); now each insertion follows one (112)."""
  seqs, depth, ps = 16, 8, 2
  r = Registry(seqs * depth, ps)
  for s in range(seqs):
    h, parent = 0, -1
    for i in range(depth):
      page, toks = s * depth + i, [s, i]
      h = r.hash(h, toks)
      r.acquire(page)
      r.insert(page, h, parent, toks)
      parent = page
    for i in range(depth):
      r.release(s * depth + i, tick=s + 1)
  assert r.lru() == [s * depth + depth - 1 for s in range(seqs)]  # one leaf per sequence
  inserted = r.lru_links()
  assert inserted == seqs  # a fresh release goes at the tail at once
  evicted = [r.evict() for _ in range(seqs * depth)]
  # Least recently released first: each sequence leaf first, down to its root.
  assert evicted == [s * depth + i for s in range(seqs) for i in reversed(range(depth))]
  assert r.evict() == -1 and r.check() == ""
  assert r.lru_links() - inserted == seqs * (depth - 1)


class RegistryMachine(RuleBasedStateMachine):
  """Lanes take chains of pages: cached prefixes by lookup, new pages from the free list,
  registered in order; lanes end, dropping their references; pages get evicted when the free
  list is empty. A Python model predicts every lookup, eviction and free."""

  def __init__(self):
    super().__init__()
    self.r = Registry()
    self.free = list(range(NP))
    self.tick = 0
    self.lanes: list[list[int]] = []  # pages held, in chain order
    # model: page -> (parent, tokens tuple, hash) for cached pages; refs; release order
    self.cached: dict[int, tuple] = {}
    self.ref = [0] * NP
    self.released: dict[int, tuple[int, int]] = {}  # evictable page -> (tick, seq)
    self.last_tick = [0] * NP
    self.seq = 0
    self.collide = False

  def _kids(self, p):
    return sum(1 for q, (par, _, _) in self.cached.items() if par == p)

  def _refresh(self, p):
    """Model of the evictable list's membership after a change to page p."""
    ev = p in self.cached and self.ref[p] == 0 and self._kids(p) == 0
    if ev and p not in self.released:
      self.released[p] = (self.last_tick[p], self.seq)
      self.seq += 1
    elif not ev:
      self.released.pop(p, None)

  def _hash(self, parent_hash, toks):
    return 777 if self.collide else self.r.hash(parent_hash, toks)

  def _take_page(self):
    if not self.free:
      want = min(self.released, key=lambda p: self.released[p], default=-1)
      got = self.r.evict()
      assert got == want, (got, want, self.released)
      event("evicted a page" if got >= 0 else "nothing evictable")
      if got < 0:
        return -1
      par = self.cached.pop(got)[0]
      self.released.pop(got)
      if par >= 0:
        self._refresh(par)
      self.free.append(got)
    return self.free.pop()

  @rule(collide=st.booleans())
  def set_collisions(self, collide):
    self.collide = collide  # every page hash the same from here: verification must hold

  @rule(chain=st.lists(st.lists(st.integers(0, 2), min_size=PS, max_size=PS), min_size=1,
                       max_size=4))
  def run_lane(self, chain):
    held, parent, parent_hash = [], -1, 0
    for toks in chain:
      h = self._hash(parent_hash, toks)
      # (a page registered before set_collisions changed the hash function is named by its
      # old hash: not found under the new one, as the registry keys by hash)
      want = next((p for p, (par, t, ph) in self.cached.items()
                   if par == parent and t == tuple(toks) and ph == h), -1)
      got = self.r.lookup(h, parent, toks)
      assert got == want, (got, want)
      if got >= 0:
        event("cache hit" if not self.collide else "cache hit under colliding hashes")
        self.r.acquire(got)
        self.ref[got] += 1
        self._refresh(got)
        page = got
      else:
        page = self._take_page()
        if page < 0:
          break  # no page: the lane holds what it has
        self.r.acquire(page)
        self.ref[page] += 1
        self.r.insert(page, h, parent, toks)
        self.cached[page] = (parent, tuple(toks), h)
        if parent >= 0:
          self._refresh(parent)
        self._refresh(page)
      held.append(page)
      parent, parent_hash = page, h
    if held:
      self.lanes.append(held)

  @precondition(lambda self: self.lanes)
  @rule(i=st.integers(0, 100))
  def end_lane(self, i):
    held = self.lanes.pop(i % len(self.lanes))
    self.tick += 1
    for p in reversed(held):
      freed = self.r.release(p, self.tick)
      self.ref[p] -= 1
      self.last_tick[p] = self.tick
      assert freed == (p not in self.cached and self.ref[p] == 0)
      assert self.ref[p] >= 0
      if freed:
        self.free.append(p)
      self._refresh(p)

  @invariant()
  def consistent(self):
    assert self.r.check() == ""
    assert self.r.lru() == sorted(self.released, key=lambda p: self.released[p])
    held = {p for lane in self.lanes for p in lane}
    for p in range(NP):
      info = self.r.page(p)
      assert info["ref"] == self.ref[p]
      assert bool(info["cached"]) == (p in self.cached)
      # every page is free, cached or held: none lost
      assert p in self.free or p in self.cached or p in held, p
      assert not (p in self.free and (p in held or p in self.cached)), p


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                        deadline=None)
