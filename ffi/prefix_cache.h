// The page registry of automatic prefix caching (issue 26; docs/ARCHITECTURE.md, "Prefix
// caching"): which KV pages hold a known prefix, found by a hash chained over the tokens.
//
// A cached page is one full page of some sequence's tokens whose K/V are computed. It is named
// by the chain hash of its tokens and its parent (the cached page of the previous page_size
// tokens, -1 for a sequence's first page) and registered in an open-addressing table. A lookup
// verifies the candidate's tokens and its parent page, not just the hash: by induction over
// the chain a hit holds exactly the K/V of the whole prefix, so a hash collision never shares
// wrong KV. Pages carry reference counts (lanes whose page table holds them) and a count of
// cached children; a page whose both counts are zero is evictable, and evictable pages form a
// list in least-recently-released order (ties: first released first). Only such a leaf is
// ever evicted, so a cached page's parent stays cached as long as the page is. The registry
// never frees a page itself: release() says when an uncached page may go back to the free
// list, evict() hands one back.
//
// Written once for host and device like the scheduler (serial code, run by the leader): one
// int32 buffer region of BlinkPrefixLayout's words, no globals.
#pragma once
#include <stdint.h>

#include "mailbox.h"

// splitmix64's finalizer: a bijective mix, identical on host and device.
BLINK_HD uint64_t blink_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The chain hash of a page of n tokens after a parent whose hash is `parent` (0 for none).
BLINK_HD uint64_t blink_page_hash(uint64_t parent, const int32_t* tokens, int64_t n) {
  uint64_t h = blink_mix64(parent ^ 0x243f6a8885a308d3ull);
  for (int64_t i = 0; i < n; ++i) h = blink_mix64(h ^ uint64_t(uint32_t(tokens[i])));
  return h;
}

// Word offsets of the registry's arrays inside one int32 region starting at `base`.
struct BlinkPrefixLayout {
  int64_t num_pages, page_size, table_size;
  int64_t scalars, cached, ref, kids, parent, hash_lo, hash_hi, tick, prev, next, tokens, table;
  int64_t total;  // words from base to the region's end
  BLINK_HD BlinkPrefixLayout(int64_t pages, int64_t psize, int64_t base = 0)
      : num_pages(pages), page_size(psize) {
    table_size = 2;  // a power of two, at least twice the pages: probes stay short
    while (table_size < 2 * pages) table_size *= 2;
    scalars = base;
    cached = scalars + 8;  // PC_NUM_SCALARS <= 8
    ref = cached + pages;
    kids = ref + pages;
    parent = kids + pages;
    hash_lo = parent + pages;
    hash_hi = hash_lo + pages;
    tick = hash_hi + pages;
    prev = tick + pages;
    next = prev + pages;
    tokens = next + pages;
    table = tokens + pages * psize;
    total = table + table_size - base;
  }
};

// PC_NUM_IDLE: cached pages that no lane holds. All of them can be reclaimed (evicting
// leaves first): a lane holds its whole registered prefix, so an unreferenced page has no
// referenced descendant. The scheduler counts them as available pages.
enum BlinkPrefixScalar {
  PC_LRU_HEAD = 0, PC_LRU_TAIL, PC_NUM_CACHED, PC_NUM_EVICTABLE, PC_NUM_IDLE,
  PC_LRU_LINKS,  // links lru_insert followed, all calls together (wraps; a cost probe)
  PC_NUM_SCALARS
};
static_assert(PC_NUM_SCALARS <= 8, "BlinkPrefixLayout keeps 8 scalar words");

struct BlinkPrefixCache {
  int32_t* st;
  BlinkPrefixLayout lay;

  BLINK_HD BlinkPrefixCache(int32_t* state, const BlinkPrefixLayout& layout)
      : st(state), lay(layout) {}

  BLINK_HD int32_t& sc(int i) const { return st[lay.scalars + i]; }
  BLINK_HD int32_t& at(int64_t region, int64_t i) const { return st[region + i]; }
  BLINK_HD uint64_t hash_of(int32_t p) const {
    return uint64_t(uint32_t(at(lay.hash_lo, p))) | uint64_t(uint32_t(at(lay.hash_hi, p))) << 32;
  }
  BLINK_HD int64_t home(uint64_t h) const { return int64_t((h ^ (h >> 29)) & uint64_t(lay.table_size - 1)); }
  BLINK_HD bool evictable(int32_t p) const {
    return at(lay.cached, p) && at(lay.ref, p) == 0 && at(lay.kids, p) == 0;
  }

  // Host-side or leader-run initialisation: nothing cached, no references.
  BLINK_HD void init() const {
    sc(PC_LRU_HEAD) = sc(PC_LRU_TAIL) = -1;
    sc(PC_NUM_CACHED) = sc(PC_NUM_EVICTABLE) = sc(PC_NUM_IDLE) = sc(PC_LRU_LINKS) = 0;
    for (int64_t p = 0; p < lay.num_pages; ++p) {
      at(lay.cached, p) = at(lay.ref, p) = at(lay.kids, p) = at(lay.tick, p) = 0;
      at(lay.parent, p) = at(lay.prev, p) = at(lay.next, p) = -1;
      at(lay.hash_lo, p) = at(lay.hash_hi, p) = 0;
    }
    for (int64_t i = 0; i < lay.table_size; ++i) at(lay.table, i) = -1;
  }

  // The cached page holding exactly `tokens` (page_size of them) after cached page `parent`
  // (-1: a sequence's first page), named by hash h; -1 if none.
  BLINK_HD int32_t lookup(uint64_t h, int32_t parent, const int32_t* tokens) const {
    for (int64_t i = home(h), probes = 0; probes < lay.table_size;
         i = (i + 1) & (lay.table_size - 1), ++probes) {
      const int32_t p = at(lay.table, i);
      if (p < 0) return -1;
      if (hash_of(p) != h || at(lay.parent, p) != parent) continue;
      const int32_t* have = st + lay.tokens + int64_t(p) * lay.page_size;
      bool same = true;
      for (int64_t k = 0; k < lay.page_size; ++k) same = same && have[k] == tokens[k];
      if (same) return p;
    }
    return -1;
  }

  // Registers uncached page p (its K/V computed, held by its lane) as `tokens` after cached
  // page `parent`, named by h. The caller looked it up first: the same prefix is not cached.
  BLINK_HD void insert(int32_t p, uint64_t h, int32_t parent, const int32_t* tokens) const {
    at(lay.cached, p) = 1;
    at(lay.parent, p) = parent;
    at(lay.hash_lo, p) = int32_t(uint32_t(h));
    at(lay.hash_hi, p) = int32_t(uint32_t(h >> 32));
    int32_t* have = st + lay.tokens + int64_t(p) * lay.page_size;
    for (int64_t k = 0; k < lay.page_size; ++k) have[k] = tokens[k];
    int64_t i = home(h);
    while (at(lay.table, i) >= 0) i = (i + 1) & (lay.table_size - 1);  // never full: 2x pages
    at(lay.table, i) = p;
    sc(PC_NUM_CACHED)++;
    if (at(lay.ref, p) == 0) sc(PC_NUM_IDLE)++;
    if (parent >= 0) {
      if (evictable(parent)) lru_unlink(parent);
      at(lay.kids, parent)++;
    }
    if (evictable(p)) lru_insert(p);
  }

  // A lane takes a reference to page p (a cache hit, or a page it allocated).
  BLINK_HD void acquire(int32_t p) const {
    if (evictable(p)) lru_unlink(p);
    if (at(lay.cached, p) && at(lay.ref, p) == 0) sc(PC_NUM_IDLE)--;
    at(lay.ref, p)++;
  }

  // A lane drops its reference to page p at step `tick`. Returns true when the page is
  // uncached and unreferenced: the caller puts it back on the free list.
  BLINK_HD bool release(int32_t p, int32_t tick) const {
    at(lay.ref, p)--;
    if (at(lay.ref, p) > 0) return false;
    at(lay.tick, p) = tick;
    if (!at(lay.cached, p)) return true;
    sc(PC_NUM_IDLE)++;
    if (at(lay.kids, p) == 0) lru_insert(p);
    return false;
  }

  // Unregisters the least recently released evictable page and returns it (to go on the
  // free list), or -1 when none is evictable. Its parent may become evictable in turn.
  BLINK_HD int32_t evict() const {
    const int32_t p = sc(PC_LRU_HEAD);
    if (p < 0) return -1;
    lru_unlink(p);
    table_remove(p);
    at(lay.cached, p) = 0;
    sc(PC_NUM_CACHED)--;
    sc(PC_NUM_IDLE)--;
    const int32_t q = at(lay.parent, p);
    at(lay.parent, p) = -1;
    if (q >= 0) {
      at(lay.kids, q)--;
      if (evictable(q)) lru_insert(q);
    }
    return p;
  }

  // ---- the evictable list, in (tick, insertion) order ----
  // Whether page a was released after page b (wrap-safe).
  BLINK_HD bool later(int32_t a, int32_t b) const {
    return int32_t(uint32_t(at(lay.tick, a)) - uint32_t(at(lay.tick, b))) > 0;
  }
  // Puts p after every listed page released no later than it. The spot is sought from both
  // ends at once, a link a side per round, and the first side to reach it wins: a fresh
  // release belongs at the tail, and a parent made evictable by its child's eviction was
  // mostly released with that child, the list's head, so it belongs near the head. A walk
  // from the tail alone crossed the whole list for every such parent: one dependent load per
  // cached sequence, for each page the free list lacked once the cache had filled the pages
  // (docs/ARCHITECTURE.md, "Prefix caching"). PC_LRU_LINKS counts the links followed.
  BLINK_HD void lru_insert(int32_t p) const {
    int32_t fwd = sc(PC_LRU_HEAD), back = sc(PC_LRU_TAIL), after, before;
    uint32_t links = 1;
    for (;; fwd = at(lay.next, fwd), back = at(lay.prev, back), ++links) {
      if (fwd < 0 || later(fwd, p)) {  // the first page released after p, or none
        before = fwd;
        after = fwd >= 0 ? at(lay.prev, fwd) : sc(PC_LRU_TAIL);
        break;
      }
      if (back < 0 || !later(back, p)) {  // the last page released no later than p
        after = back;
        before = back >= 0 ? at(lay.next, back) : sc(PC_LRU_HEAD);
        break;
      }
    }
    sc(PC_LRU_LINKS) = int32_t(uint32_t(sc(PC_LRU_LINKS)) + links);
    at(lay.prev, p) = after;
    at(lay.next, p) = before;
    if (after >= 0) at(lay.next, after) = p; else sc(PC_LRU_HEAD) = p;
    if (before >= 0) at(lay.prev, before) = p; else sc(PC_LRU_TAIL) = p;
    sc(PC_NUM_EVICTABLE)++;
  }
  BLINK_HD void lru_unlink(int32_t p) const {
    const int32_t a = at(lay.prev, p), b = at(lay.next, p);
    if (a >= 0) at(lay.next, a) = b; else sc(PC_LRU_HEAD) = b;
    if (b >= 0) at(lay.prev, b) = a; else sc(PC_LRU_TAIL) = a;
    at(lay.prev, p) = at(lay.next, p) = -1;
    sc(PC_NUM_EVICTABLE)--;
  }

  // Linear probing's deletion by backward shift: no tombstones, so a lookup's probe ends at
  // the first empty slot and chains never grow with churn.
  BLINK_HD void table_remove(int32_t p) const {
    const int64_t mask = lay.table_size - 1;
    int64_t i = home(hash_of(p));
    while (at(lay.table, i) != p) i = (i + 1) & mask;
    for (int64_t j = (i + 1) & mask;; j = (j + 1) & mask) {
      const int32_t q = at(lay.table, j);
      if (q < 0) break;
      const int64_t k = home(hash_of(q));
      // q moves into the hole unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      at(lay.table, i) = q;
      i = j;
    }
    at(lay.table, i) = -1;
  }
};
