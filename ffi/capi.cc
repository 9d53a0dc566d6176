// C API of the scheduler library for Python (ctypes): sizes, initial state, config checks,
// the mailbox layout for the protocol mirror test, and direct host entry points used by the
// property tests (the same code the CPU FFI handlers run).
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mailbox.h"
#include "prefix_cache.h"
#include "sched_state.h"
#include "scheduler.h"

namespace {
std::string prefix_check(const BlinkPrefixCache& pc);

const BlinkSchedConfig& as_config(const int64_t* words) {
  return *reinterpret_cast<const BlinkSchedConfig*>(words);
}
thread_local std::string g_message;
}  // namespace

extern "C" {

const char* blink_sched_config_fields() {
  static const char* names[] = {BLINK_SCHED_CONFIG_FIELDS};
  static std::string joined;
  if (joined.empty())
    for (int i = 0; i < BLINK_SCHED_CONFIG_NUM_FIELDS; ++i)
      joined += std::string(i ? "," : "") + names[i];
  return joined.c_str();
}

int64_t blink_state_words(const int64_t* cfg) { return BlinkStateLayout(as_config(cfg)).total; }
int64_t blink_batch_words_c(const int64_t* cfg) { return blink_batch_words(as_config(cfg)); }

void blink_state_init(const int64_t* cfg, int32_t* state) {
  blink_state_init_host(as_config(cfg), state);
}

// Returns "" when the config is usable, else a message naming the bad value.
const char* blink_config_check(const int64_t* words) {
  const BlinkSchedConfig& c = as_config(words);
  char buf[256];
  buf[0] = 0;
  if (c.num_slots < 1) snprintf(buf, sizeof buf, "num_slots=%lld must be >= 1", (long long)c.num_slots);
  else if (c.max_seqs < 1 || c.max_seqs > BLINK_MAX_SEQS)
    snprintf(buf, sizeof buf, "max_seqs=%lld must be in [1, %d]", (long long)c.max_seqs, BLINK_MAX_SEQS);
  else if (c.page_size < 1) snprintf(buf, sizeof buf, "page_size=%lld must be >= 1", (long long)c.page_size);
  else if (c.ring_capacity < 1) snprintf(buf, sizeof buf, "ring_capacity=%lld must be >= 1", (long long)c.ring_capacity);
  else if (c.num_buckets < 1 || c.num_buckets > BLINK_MAX_BUCKETS)
    snprintf(buf, sizeof buf, "num_buckets=%lld must be in [1, %d]", (long long)c.num_buckets, BLINK_MAX_BUCKETS);
  else if (c.bucket(int(c.num_buckets) - 1) != c.token_budget)
    snprintf(buf, sizeof buf, "the largest bucket (%lld) must equal token_budget=%lld",
             (long long)c.bucket(int(c.num_buckets) - 1), (long long)c.token_budget);
  else if (c.token_budget < c.max_seqs)
    snprintf(buf, sizeof buf, "token_budget=%lld must be >= max_seqs=%lld", (long long)c.token_budget, (long long)c.max_seqs);
  else if (c.num_pages < c.max_pages_per_seq())
    snprintf(buf, sizeof buf, "num_pages=%lld cannot hold one sequence of max_context=%lld (%lld pages)",
             (long long)c.num_pages, (long long)c.max_context, (long long)c.max_pages_per_seq());
  else if (c.max_context < 2) snprintf(buf, sizeof buf, "max_context=%lld must be >= 2", (long long)c.max_context);
  else if (c.arena_tokens < c.max_prompt || c.arena_tokens > int64_t(UINT32_MAX))
    snprintf(buf, sizeof buf, "arena_tokens=%lld must hold one prompt of max_prompt=%lld and fit 32 bits",
             (long long)c.arena_tokens, (long long)c.max_prompt);
  else if (c.min_step_interval_us < 0 || c.min_step_interval_us > 1000000)
    snprintf(buf, sizeof buf, "min_step_interval_us=%lld must be in [0, 1000000]",
             (long long)c.min_step_interval_us);
  else if (c.step_interval_permille < 0 || c.step_interval_permille > 10000)
    snprintf(buf, sizeof buf, "step_interval_permille=%lld must be in [0, 10000]",
             (long long)c.step_interval_permille);
  else if (c.prefix_caching != 0 && c.prefix_caching != 1)
    snprintf(buf, sizeof buf, "prefix_caching=%lld must be 0 or 1", (long long)c.prefix_caching);
  else if (c.window < 0 || (c.window > 0 && (c.window_pages < 1 || c.window_pages * c.page_size < c.window)))
    snprintf(buf, sizeof buf, "window=%lld needs window_pages=%lld of page_size=%lld to hold it",
             (long long)c.window, (long long)c.window_pages, (long long)c.page_size);
  for (int i = 1; !buf[0] && i < c.num_buckets; ++i)
    if (c.bucket(i) <= c.bucket(i - 1))
      snprintf(buf, sizeof buf, "buckets must increase: bucket%d=%lld", i, (long long)c.bucket(i));
  g_message = buf;
  return g_message.c_str();
}

// "name=offset;..." for every fixed field of the mailbox structs (checked by the Python mirror).
const char* blink_mailbox_layout() {
  static std::string s;
  if (!s.empty()) return s.c_str();
  char b[96];
#define F(strct, prefix, field)                                                     \
  snprintf(b, sizeof b, "%s.%s=%zu;", prefix, #field, offsetof(strct, field)); \
  s += b;
  F(BlinkMailboxHeader, "header", magic) F(BlinkMailboxHeader, "header", version)
  F(BlinkMailboxHeader, "header", header_bytes) F(BlinkMailboxHeader, "header", num_slots)
  F(BlinkMailboxHeader, "header", max_prompt) F(BlinkMailboxHeader, "header", ring_capacity)
  F(BlinkMailboxHeader, "header", max_top_logprobs) F(BlinkMailboxHeader, "header", request_bytes)
  F(BlinkMailboxHeader, "header", output_bytes) F(BlinkMailboxHeader, "header", total_bytes)
  F(BlinkMailboxHeader, "header", vocab_size) F(BlinkMailboxHeader, "header", max_context)
  F(BlinkMailboxHeader, "header", num_workers) F(BlinkMailboxHeader, "header", eos_id)
  F(BlinkMailboxHeader, "header", engine_state) F(BlinkMailboxHeader, "header", shutdown)
  F(BlinkMailboxHeader, "header", arena_tokens)
  F(BlinkMailboxHeader, "header", prefix_cache_queries)
  F(BlinkMailboxHeader, "header", prefix_cache_hits)
  F(BlinkMailboxHeader, "header", doorbell) F(BlinkMailboxHeader, "header", loop_iterations)
  F(BlinkMailboxHeader, "header", steps) F(BlinkMailboxHeader, "header", tokens_generated)
  F(BlinkMailboxHeader, "header", prompt_tokens) F(BlinkMailboxHeader, "header", requests_admitted)
  F(BlinkMailboxHeader, "header", requests_finished) F(BlinkMailboxHeader, "header", requests_errored)
  F(BlinkMailboxHeader, "header", requests_cancelled) F(BlinkMailboxHeader, "header", preemptions)
  F(BlinkMailboxHeader, "header", pages_in_use) F(BlinkMailboxHeader, "header", pages_total)
  F(BlinkMailboxHeader, "header", running) F(BlinkMailboxHeader, "header", waiting)
  F(BlinkMailboxHeader, "header", last_step_tokens)
  F(BlinkMailboxHeader, "header", schedule_ns)
  F(BlinkMailboxHeader, "header", commit_ns)
  F(BlinkMailboxHeader, "header", slot_scans) F(BlinkMailboxHeader, "header", sched_scan_ns)
  F(BlinkMailboxHeader, "header", sched_poll_ns) F(BlinkMailboxHeader, "header", sched_decode_ns)
  F(BlinkMailboxHeader, "header", sched_admit_ns) F(BlinkMailboxHeader, "header", sched_batch_ns)
  F(BlinkMailboxHeader, "header", step_rows)
  F(BlinkSlotRequest, "request", seq) F(BlinkSlotRequest, "request", cancel)
  F(BlinkSlotRequest, "request", consumed) F(BlinkSlotRequest, "request", prompt_len)
  F(BlinkSlotRequest, "request", request_id) F(BlinkSlotRequest, "request", seed)
  F(BlinkSlotRequest, "request", max_tokens) F(BlinkSlotRequest, "request", temperature)
  F(BlinkSlotRequest, "request", top_p) F(BlinkSlotRequest, "request", top_k)
  F(BlinkSlotRequest, "request", num_logprobs) F(BlinkSlotRequest, "request", flags)
  F(BlinkSlotRequest, "request", num_stop_ids) F(BlinkSlotRequest, "request", prompt_offset)
  F(BlinkSlotRequest, "request", arrival_ns)
  F(BlinkSlotRequest, "request", stop_ids)
  F(BlinkSlotOutput, "output", started_seq) F(BlinkSlotOutput, "output", finished_seq)
  F(BlinkSlotOutput, "output", count) F(BlinkSlotOutput, "output", finish_reason)
  F(BlinkSlotOutput, "output", error_code) F(BlinkSlotOutput, "output", prompt_len)
  F(BlinkSlotOutput, "output", preemptions) F(BlinkSlotOutput, "output", admit_ticket)
  F(BlinkSlotOutput, "output", token_ns) F(BlinkSlotOutput, "output", cached_tokens)
  F(BlinkSlotOutput, "output", taken_ns) F(BlinkSlotOutput, "output", first_ns)
#undef F
  snprintf(b, sizeof b, "const.header_bytes=%d;const.request_fixed_bytes=%d;const.output_fixed_bytes=%d;",
           BLINK_HEADER_BYTES, BLINK_REQUEST_FIXED_BYTES, BLINK_OUTPUT_FIXED_BYTES);
  s += b;
  snprintf(b, sizeof b, "const.max_workers=%d;const.max_stop_ids=%d;const.version=%u;",
           BLINK_MAX_WORKERS, BLINK_MAX_STOP_IDS, BLINK_VERSION);
  s += b;
  return s.c_str();
}

// Indices of the batch descriptor (checked against blink_jax/native/batch.py).
const char* blink_batch_layout() {
  static std::string s;
  if (!s.empty()) return s.c_str();
  char b[512];
  snprintf(b, sizeof b,
           "num_rows=%d;bucket=%d;bucket_size=%d;num_samples=%d;shutdown=%d;num_decode=%d;"
           "header_words=%d;tokens=%d;positions=%d;seq_ids=%d;targets=%d;local_only=%d;"
           "token_arrays=%d;rows=%d;"
           "lanes=%d;"
           "temperature=%d;top_p=%d;top_k=%d;seed_lo=%d;seed_hi=%d;position=%d;num_logprobs=%d;"
           "sample_arrays=%d;",
           B_NUM_ROWS, B_BUCKET, B_BUCKET_SIZE, B_NUM_SAMPLES, B_SHUTDOWN, B_NUM_DECODE,
           B_HEADER_WORDS, BT_TOKENS, BT_POSITIONS, BT_SEQ_IDS, BT_TARGETS, BT_LOCAL_ONLY, BT_NUM, BS_ROWS, BS_LANES,
           BS_TEMPERATURE, BS_TOP_P, BS_TOP_K, BS_SEED_LO, BS_SEED_HI, BS_POSITION,
           BS_NUM_LOGPROBS, BS_NUM);
  s = b;
  return s.c_str();
}

// Indices of the 64-bit counters at the start of the state (BlinkCounter) that benchmarks
// read from a returned state.
const char* blink_counter_layout() {
  static std::string s;
  if (!s.empty()) return s.c_str();
  char b[256];
  snprintf(b, sizeof b,
           "loop_iterations=%d;steps=%d;schedule_ns=%d;commit_ns=%d;sched_poll_ns=%d;"
           "sched_decode_ns=%d;sched_admit_ns=%d;sched_batch_ns=%d;paced_steps=%d;"
           "paced_ns=%d;sched_scan_ns=%d;slot_scans=%d;step_rows=%d;num_counters=%d;",
           C_LOOP_ITERATIONS, C_STEPS, C_SCHEDULE_NS, C_COMMIT_NS, C_SCHED_POLL_NS,
           C_SCHED_DECODE_NS, C_SCHED_ADMIT_NS, C_SCHED_BATCH_NS, C_PACED_STEPS, C_PACED_NS,
           C_SCHED_SCAN_NS, C_SLOT_SCANS, C_STEP_ROWS, C_NUM_COUNTERS);
  s = b;
  return s.c_str();
}

// Geometry-dependent offsets of `slot`: request, arena, output, out tokens, out logprobs,
// out top ids, out top logprobs, total bytes.
void blink_geometry_offsets(const uint32_t* g5, uint32_t slot, uint64_t* out8) {
  BlinkGeometry g{g5[0], g5[1], g5[2], g5[3], g5[4]};
  out8[0] = g.request_offset(slot);
  out8[1] = g.arena_offset();
  out8[2] = g.output_offset(slot);
  out8[3] = g.out_tokens_offset(slot);
  out8[4] = g.out_logprobs_offset(slot);
  out8[5] = g.out_top_ids_offset(slot);
  out8[6] = g.out_top_logprobs_offset(slot);
  out8[7] = g.total_bytes();
}

// Direct host entry points (same code as the CPU FFI handlers, without XLA).
void blink_host_schedule(const int64_t* cfg, int32_t* state, int32_t* history,
                         int32_t* page_table, int32_t* batch) {
  const BlinkSchedConfig& c = as_config(cfg);
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), state, history, page_table, batch)
      .schedule(HostExec{});
}

void blink_host_commit(const int64_t* cfg, int32_t* state, int32_t* history, int32_t* page_table,
                       int32_t* batch, const int32_t* sampled, const float* logprobs,
                       const int32_t* top_ids, const float* top_lps, const float* row_lps,
                       const int32_t* row_top_ids, const float* row_top_lps, int64_t top_cols) {
  const BlinkSchedConfig& c = as_config(cfg);
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), state, history, page_table, batch)
      .commit(HostExec{}, BlinkStepOutputs{sampled, logprobs, top_ids, top_lps, row_lps,
                                           row_top_ids, row_top_lps, top_cols});
}

// Invariants of a state between steps (test hook): every page is free or owned by exactly
// one lane (with prefix caching: or cached, held by as many lanes' registered prefixes as its
// reference count says, the registry's own invariants holding), lanes are free or in the
// admission order exactly once, prefixes fit their pages.
const char* blink_state_check(const int64_t* cfg, int32_t* state, int32_t* page_table) {
  const BlinkSchedConfig& c = as_config(cfg);
  BlinkSched s(c, nullptr, state, nullptr, page_table, nullptr);
  std::string err;
  std::vector<int> page_owner(c.num_pages, -2), lane_seen(c.max_seqs, 0),
      cache_refs(c.num_pages, 0);
  auto fail = [&](const std::string& m) { if (err.empty()) err = m; };
  int32_t nfree = s.s(S_FREE_COUNT);
  if (nfree < 0 || nfree > c.num_pages) fail("free count out of range");
  for (int32_t i = 0; err.empty() && i < nfree; ++i) {
    int32_t p = s.region(s.lay.free_pages)[i];
    if (p < 0 || p >= c.num_pages) fail("free page id out of range");
    else if (page_owner[p] != -2) fail("page " + std::to_string(p) + " free twice");
    else page_owner[p] = -1;
  }
  int32_t norder = s.s(S_ORDER_COUNT), nfl = s.s(S_FREE_LANES);
  if (norder + nfl != c.max_seqs) fail("lanes: order + free != max_seqs");
  for (int32_t i = 0; err.empty() && i < norder; ++i) {
    int32_t l = s.region(s.lay.order)[i];
    if (l < 0 || l >= c.max_seqs || lane_seen[l]++) { fail("order holds a bad or repeated lane"); break; }
    if (s.lane(L_STATE, l) == LANE_FREE) fail("a free lane is in the order");
    if (i > 0 && s.lane(L_TICKET, s.region(s.lay.order)[i - 1]) >= s.lane(L_TICKET, l))
      fail("order is not sorted by admission");
    if (s.lane(L_STATE, l) == LANE_PREEMPTED && s.lane(L_PAGES, l) != 0)
      fail("a preempted lane holds pages");
    if (s.lane(L_COMPUTED, l) > s.lane(L_LEN, l)) fail("computed > len");
    if (s.pages_for(s.lane(L_COMPUTED, l)) > s.lane(L_PAGES, l)) fail("computed tokens exceed pages");
    const int32_t reg = c.prefix_caching ? s.lane(L_REG_PAGES, l) : 0;
    if (reg < 0 || reg > s.lane(L_PAGES, l)) fail("registered pages out of range");
    // With windowed pages a lane computes its cached prefix again (local-only rows).
    if (c.prefix_caching && c.window == 0 && reg > s.lane(L_COMPUTED, l) / c.page_size)
      fail("a registered page is not fully computed");
    for (int32_t p = 0; err.empty() && p < s.lane(L_PAGES, l); ++p) {
      int32_t pg = s.pt(l, p);
      if (pg < 0 || pg >= c.num_pages) fail("page table entry out of range");
      else if (p < reg) {  // cached, possibly shared: counted against its reference count
        if (page_owner[pg] == -1) fail("page " + std::to_string(pg) + " free and held");
        else if (!s.pcache().at(s.pcache().lay.cached, pg)) fail("a registered page is not cached");
        page_owner[pg] = -3;
        cache_refs[pg]++;
      } else if (page_owner[pg] != -2)
        fail("page " + std::to_string(pg) + " owned twice (lane " + std::to_string(l) + ")");
      else if (c.prefix_caching && s.pcache().at(s.pcache().lay.cached, pg))
        fail("an unregistered page of lane " + std::to_string(l) + " is cached");
      else page_owner[pg] = l;
    }
  }
  for (int32_t i = 0; err.empty() && i < nfl; ++i) {
    int32_t l = s.region(s.lay.free_lanes)[i];
    if (l < 0 || l >= c.max_seqs || lane_seen[l]++) fail("free lane list holds a bad or repeated lane");
    else if (s.lane(L_STATE, l) != LANE_FREE) fail("a busy lane is in the free list");
  }
  if (c.prefix_caching) {
    const BlinkPrefixCache pc = s.pcache();
    const BlinkPrefixLayout& L = pc.lay;
    const std::string reg = prefix_check(pc);
    if (!reg.empty()) fail("prefix cache: " + reg);
    for (int64_t p = 0; err.empty() && p < c.num_pages; ++p) {
      const bool cached = pc.at(L.cached, p) != 0;
      if (cached && page_owner[p] == -1) fail("page " + std::to_string(p) + " free and cached");
      if (cached && pc.at(L.ref, p) != cache_refs[p])
        fail("page " + std::to_string(p) + ": reference count " +
             std::to_string(pc.at(L.ref, p)) + ", held by " + std::to_string(cache_refs[p]));
      if (!cached && pc.at(L.ref, p) != 0) fail("an uncached page has references");
      if (cached && page_owner[p] == -2) page_owner[p] = -3;  // cached, held by no lane
    }
  }
  for (int64_t p = 0; err.empty() && p < c.num_pages; ++p)
    if (page_owner[p] == -2) fail("page " + std::to_string(p) + " leaked");
  g_message = err;
  return g_message.c_str();
}

// ---- the prefix-cache page registry (ffi/prefix_cache.h), driven directly by its tests ----
// `np`, `ps`: pages and page size; `buf`: a region of blink_prefix_words(np, ps) int32 words.
namespace {
BlinkPrefixCache prefix_cache(int64_t np, int64_t ps, int32_t* buf) {
  return BlinkPrefixCache(buf, BlinkPrefixLayout(np, ps));
}
}  // namespace

int64_t blink_prefix_words(int64_t np, int64_t ps) { return BlinkPrefixLayout(np, ps).total; }
void blink_prefix_init(int64_t np, int64_t ps, int32_t* buf) { prefix_cache(np, ps, buf).init(); }
uint64_t blink_prefix_hash(uint64_t parent, const int32_t* tokens, int64_t n) {
  return blink_page_hash(parent, tokens, n);
}
int32_t blink_prefix_lookup(int64_t np, int64_t ps, int32_t* buf, uint64_t h, int32_t parent,
                            const int32_t* tokens) {
  return prefix_cache(np, ps, buf).lookup(h, parent, tokens);
}
void blink_prefix_insert(int64_t np, int64_t ps, int32_t* buf, int32_t page, uint64_t h,
                         int32_t parent, const int32_t* tokens) {
  prefix_cache(np, ps, buf).insert(page, h, parent, tokens);
}
void blink_prefix_acquire(int64_t np, int64_t ps, int32_t* buf, int32_t page) {
  prefix_cache(np, ps, buf).acquire(page);
}
int32_t blink_prefix_release(int64_t np, int64_t ps, int32_t* buf, int32_t page, int32_t tick) {
  return prefix_cache(np, ps, buf).release(page, tick) ? 1 : 0;
}
int32_t blink_prefix_evict(int64_t np, int64_t ps, int32_t* buf) {
  return prefix_cache(np, ps, buf).evict();
}
// Page p's fields: cached, ref, kids, parent, tick.
void blink_prefix_page(int64_t np, int64_t ps, int32_t* buf, int32_t p, int32_t* out5) {
  const BlinkPrefixCache pc = prefix_cache(np, ps, buf);
  const BlinkPrefixLayout& L = pc.lay;
  const int64_t regions[5] = {L.cached, L.ref, L.kids, L.parent, L.tick};
  for (int i = 0; i < 5; ++i) out5[i] = pc.at(regions[i], p);
}
// Links the evictable list's insertions have followed since init (the cost of keeping it in
// release order; wraps at 2^32).
uint32_t blink_prefix_lru_links(int64_t np, int64_t ps, int32_t* buf) {
  return uint32_t(prefix_cache(np, ps, buf).sc(PC_LRU_LINKS));
}
// The evictable list from its head (least recently released first); returns its length.
int32_t blink_prefix_lru(int64_t np, int64_t ps, int32_t* buf, int32_t* out) {
  const BlinkPrefixCache pc = prefix_cache(np, ps, buf);
  int32_t n = 0;
  for (int32_t p = pc.sc(PC_LRU_HEAD); p >= 0 && n <= np; p = pc.at(pc.lay.next, p)) out[n++] = p;
  return n;
}

// The registry's invariants (test hook): every cached page once in the table and reachable
// from its home slot, nothing else there; children counts exact; a cached page's parent
// cached; the evictable list = the cached pages with no reference and no child, in tick
// order, linked both ways; counts exact; no negative reference count.
const char* blink_prefix_check(int64_t np, int64_t ps, int32_t* buf) {
  g_message = prefix_check(prefix_cache(np, ps, buf));
  return g_message.c_str();
}
}  // extern "C"

namespace {
std::string prefix_check(const BlinkPrefixCache& pc) {
  const BlinkPrefixLayout& L = pc.lay;
  const int64_t np = L.num_pages;
  std::string err;
  auto fail = [&](const std::string& m) { if (err.empty()) err = m; };
  std::vector<int> in_table(np, 0), kids(np, 0), in_lru(np, 0);
  int32_t ncached = 0, nevict = 0;
  for (int64_t i = 0; i < L.table_size; ++i) {
    const int32_t p = pc.at(L.table, i);
    if (p < -1 || p >= np) { fail("table entry out of range"); continue; }
    if (p < 0) continue;
    if (!pc.at(L.cached, p)) fail("table holds uncached page " + std::to_string(p));
    if (in_table[p]++) fail("page " + std::to_string(p) + " in the table twice");
    // Reachable: no empty slot between its home and here.
    for (int64_t j = pc.home(pc.hash_of(p)); j != i; j = (j + 1) & (L.table_size - 1))
      if (pc.at(L.table, j) < 0) { fail("page " + std::to_string(p) + " unreachable"); break; }
  }
  for (int32_t p = 0; p < np; ++p) {
    if (pc.at(L.ref, p) < 0) fail("page " + std::to_string(p) + " has a negative reference count");
    if (!pc.at(L.cached, p)) continue;
    ncached++;
    if (!in_table[p]) fail("cached page " + std::to_string(p) + " not in the table");
    const int32_t q = pc.at(L.parent, p);
    if (q >= 0 && (q >= np || !pc.at(L.cached, q))) fail("cached page " + std::to_string(p) + " has an uncached parent");
    if (q >= 0 && q < np) kids[q]++;
  }
  for (int32_t p = 0; p < np; ++p)
    if (pc.at(L.kids, p) != kids[p]) fail("children count of page " + std::to_string(p));
  int32_t prev = -1;
  for (int32_t p = pc.sc(PC_LRU_HEAD); p >= 0; p = pc.at(L.next, p)) {
    if (p >= np || in_lru[p]++) { fail("evictable list is broken"); break; }
    if (pc.at(L.prev, p) != prev) fail("evictable list's back links");
    if (!pc.evictable(p)) fail("page " + std::to_string(p) + " listed but not evictable");
    if (prev >= 0 && int32_t(uint32_t(pc.at(L.tick, prev)) - uint32_t(pc.at(L.tick, p))) > 0)
      fail("evictable list out of tick order");
    prev = p;
    nevict++;
  }
  if (pc.sc(PC_LRU_TAIL) != prev) fail("evictable list's tail");
  for (int32_t p = 0; p < np; ++p)
    if (pc.evictable(p) && !in_lru[p]) fail("evictable page " + std::to_string(p) + " not listed");
  if (ncached != pc.sc(PC_NUM_CACHED)) fail("cached count");
  int32_t nidle = 0;
  for (int32_t p = 0; p < np; ++p) nidle += pc.at(L.cached, p) && pc.at(L.ref, p) == 0;
  if (nidle != pc.sc(PC_NUM_IDLE)) fail("idle count");
  if (nevict != pc.sc(PC_NUM_EVICTABLE)) fail("evictable count");
  return err;
}
}  // namespace

extern "C" {

// Word offsets of the state's regions and indices of the lane fields and scalars that the
// scheduler race test (tests/test_scheduler_race.py) reads from a returned state, as
// "name=value;..." (test hook: the layout stays private to sched_state.h otherwise).
// Lane field f of lane l is word lanes + f * max_seqs + l.
const char* blink_state_layout(const int64_t* cfg) {
  const BlinkSchedConfig& c = as_config(cfg);
  BlinkStateLayout lay(c);
  char b[640];
  snprintf(b, sizeof b,
           "scalars=%lld;lanes=%lld;stop_ids=%lld;new_lanes=%lld;total=%lld;max_stop_ids=%d;"
           "s.num_admitted=%d;l.state=%d;l.slot=%d;l.seq=%d;l.len=%d;l.prompt_len=%d;"
           "l.generated=%d;l.max_tokens=%d;l.flags=%d;l.temperature=%d;l.top_p=%d;l.top_k=%d;"
           "l.num_logprobs=%d;l.num_stop=%d;l.out_count=%d;",
           (long long)lay.scalars, (long long)lay.lanes, (long long)lay.stop_ids,
           (long long)lay.new_lanes, (long long)lay.total, BLINK_MAX_STOP_IDS, S_NUM_ADMITTED,
           L_STATE, L_SLOT, L_SEQ, L_LEN, L_PROMPT_LEN, L_GENERATED, L_MAX_TOKENS, L_FLAGS,
           L_TEMPERATURE, L_TOP_P, L_TOP_K, L_NUM_LOGPROBS, L_NUM_STOP, L_OUT_COUNT);
  g_message = b;
  return g_message.c_str();
}

// Scheduler counters and scalars, for tests and engine stats.
void blink_state_summary(const int64_t* cfg, const int32_t* state, int64_t* out16) {
  const BlinkSchedConfig& c = as_config(cfg);
  BlinkStateLayout lay(c);
  const uint64_t* ctr = reinterpret_cast<const uint64_t*>(state + lay.counters);
  const int32_t* sc = state + lay.scalars;
  out16[0] = sc[S_FREE_COUNT];
  out16[1] = sc[S_ORDER_COUNT];
  out16[2] = sc[S_Q_TAIL] - sc[S_Q_HEAD];
  out16[3] = sc[S_FREE_LANES];
  out16[4] = int64_t(ctr[C_STEPS]);
  out16[5] = int64_t(ctr[C_TOKENS_GENERATED]);
  out16[6] = int64_t(ctr[C_PROMPT_TOKENS]);
  out16[7] = int64_t(ctr[C_ADMITTED]);
  out16[8] = int64_t(ctr[C_FINISHED]);
  out16[9] = int64_t(ctr[C_ERRORED]);
  out16[10] = int64_t(ctr[C_CANCELLED]);
  out16[11] = int64_t(ctr[C_PREEMPTIONS]);
  out16[12] = int64_t(ctr[C_LOOP_ITERATIONS]);
  out16[13] = int64_t(ctr[C_PREFIX_QUERIES]);
  out16[14] = int64_t(ctr[C_PREFIX_HITS]);
  out16[15] = c.prefix_caching ? state[BlinkPrefixLayout(c.num_pages, c.page_size, lay.prefix).scalars + PC_NUM_CACHED] : 0;
}
}  // extern "C"
