// The scheduler: admission from the mailbox, continuous batching with chunked prefill, KV page
// management with preemption, and commit of sampled tokens. Written once for the host and the
// GPU: every function takes an execution policy (exec_policy.h) and is a sequence of serial and
// parallel phases. Hot per-step work is parallel; serial loops run only when a flag computed in
// parallel says they have something to do (new requests, prefill, finishes).
#pragma once
#include <stdint.h>

#include "exec_policy.h"
#include "mailbox.h"
#include "sched_state.h"

// What the model step produced, read by commit: per sample (max_seqs) the token, its logprob
// and top-n; per batch row (token_budget) the logprob of the row's target token (prompt
// logprobs) and its top-n. top_cols = n columns of both top arrays.
struct BlinkStepOutputs {
  const int32_t* sampled;
  const float* logprobs;
  const int32_t* top_ids;
  const float* top_lps;
  const float* row_lps;
  const int32_t* row_top_ids;
  const float* row_top_lps;
  int64_t top_cols;
};

// Fixed-count loops over a request's stop ids are unrolled on the device, so that
// BlinkRequestCopy stays in registers (no local-memory array).
#ifdef __CUDA_ARCH__
#define BLINK_UNROLL _Pragma("unroll")
#else
#define BLINK_UNROLL
#endif

// A slot's request as the device took it: every field the scheduler uses, loaded once from
// the mailbox (BlinkSched::load_request). The mailbox is untrusted and a writer may change it
// at any moment, also between two loads of one field (docs/ARCHITECTURE.md, "The mailbox
// contract"): so the device validates this copy and admits, sets up the lane, copies stop
// ids and sizes the first chunk from the copy alone, never from a second load; a request
// changed in between is simply the request the device took. Fields keep their mailbox
// types; the floats stay bits.
struct BlinkRequestCopy {
  uint32_t prompt_len;
  uint32_t max_tokens;
  uint32_t temperature;   // float bits
  uint32_t top_p;         // float bits
  uint32_t top_k;         // int32 bits
  uint32_t num_logprobs;
  uint32_t flags;
  uint32_t num_stop_ids;
  uint32_t prompt_offset;
  uint64_t seed;
  int32_t stop_ids[BLINK_MAX_STOP_IDS];  // all of them: entries past num_stop_ids are unused
};

// A compact copy of the hot state (what the CUDA kernels keep in shared memory), in int32
// words: [counters + scalars | lane table | 4 per-lane scratch arrays].
struct BlinkHotLayout {
  int64_t hot_words, lanes, lane_words, lscratch, lscratch_len, total;
  BLINK_HD explicit BlinkHotLayout(const BlinkSchedConfig& c) {
    hot_words = BlinkStateLayout(c).scalars + S_NUM_SCALARS;  // counters start at word 0
    lanes = (hot_words + 3) & ~int64_t(3);                     // 16-byte aligned
    lane_words = blink_lane_words(c);
    lscratch = lanes + lane_words;
    lscratch_len = (c.max_seqs > BLINK_MAX_WORKERS ? c.max_seqs : BLINK_MAX_WORKERS) + 1;
    total = lscratch + 4 * lscratch_len;
  }
};

struct BlinkSched {
  const BlinkSchedConfig& c;
  uint8_t* mb;          // mailbox as this device addresses it
  int32_t* st;          // scheduler state
  int32_t* history;     // [max_seqs, max_context] token ids per lane
  int32_t* page_table;  // [max_seqs, max_pages_per_seq]
  int32_t* batch;       // step descriptor (int32 words)
  BlinkStateLayout lay;
  BlinkGeometry geo;
  int64_t max_pages_per_seq;
  // The hot part of the state: counters + scalars, the lane table and the per-lane scratch
  // arrays. They point into `st` unless a caller (the CUDA kernels) moved them into faster
  // memory with use_hot_copy(); everything else stays in `st`.
  int32_t* hot;
  int32_t* lanes;
  int32_t* lscratch;
  int64_t lscratch_stride;

  BLINK_HD BlinkSched(const BlinkSchedConfig& cfg, uint8_t* mailbox, int32_t* state,
                      int32_t* hist, int32_t* pt, int32_t* b)
      : c(cfg), mb(mailbox), st(state), history(hist), page_table(pt), batch(b), lay(cfg),
        geo(cfg.geometry()), max_pages_per_seq(cfg.max_pages_per_seq()), hot(state),
        lanes(state + lay.lanes), lscratch(state + lay.scratch_a),
        lscratch_stride(lay.scratch_b - lay.scratch_a) {}

  // Points the hot regions at a copy laid out as BlinkHotLayout says; `copy` must be 16-byte
  // aligned and filled from the state by the caller (scratch needs no filling).
  BLINK_HD void use_hot_copy(int32_t* copy) {
    BlinkHotLayout h(c);
    hot = copy;
    lanes = copy + h.lanes;
    lscratch = copy + h.lscratch;
    lscratch_stride = h.lscratch_len;
  }

  // ---- state accessors ----
  BLINK_HD uint64_t& counter(int i) const {
    return reinterpret_cast<uint64_t*>(hot + lay.counters)[i];
  }
  BLINK_HD int32_t& s(int i) const { return hot[lay.scalars + i]; }
  BLINK_HD int32_t& lane(int f, int64_t l) const { return lanes[f * c.max_seqs + l]; }
  // Scratch arrays indexed by lane, admission order or frontend worker (k = 0..3).
  BLINK_HD int32_t* lane_scratch(int k) const { return lscratch + k * lscratch_stride; }
  BLINK_HD int32_t* region(int64_t off) const { return st + off; }
  BLINK_HD int32_t& pt(int64_t l, int64_t p) const { return page_table[l * max_pages_per_seq + p]; }
  BLINK_HD int32_t* tok_array(int a) const { return batch + B_HEADER_WORDS + a * c.token_budget; }
  BLINK_HD int32_t* sample_array(int a) const {
    return batch + B_HEADER_WORDS + BT_NUM * c.token_budget + a * c.max_seqs;
  }

  // ---- mailbox accessors ----
  BLINK_HD BlinkMailboxHeader* hdr() const { return reinterpret_cast<BlinkMailboxHeader*>(mb); }
  BLINK_HD uint8_t* req(int64_t slot) const { return mb + geo.request_offset(uint32_t(slot)); }
  BLINK_HD uint8_t* out(int64_t slot) const { return mb + geo.output_offset(uint32_t(slot)); }
  BLINK_HD uint32_t req_u32(int64_t slot, uint64_t off) const {
    return blink_load<uint32_t>(req(slot) + off);
  }
#define REQ_OFF(field) __builtin_offsetof(BlinkSlotRequest, field)
#define OUT_OFF(field) __builtin_offsetof(BlinkSlotOutput, field)

  BLINK_HD int64_t pages_for(int64_t tokens) const { return (tokens + c.page_size - 1) / c.page_size; }
  BLINK_HD bool ring_has_room(int64_t l) const { return ring_free(l) > 0; }
  BLINK_HD int64_t ring_free(int64_t l) const {
    return int64_t(c.ring_capacity) -
           int64_t(uint32_t(lane(L_OUT_COUNT, l)) - uint32_t(lane(L_CONSUMED, l)));
  }
  BLINK_HD bool wants_prompt_logprobs(int64_t l) const {
    return (lane(L_FLAGS, l) & BLINK_FLAG_PROMPT_LOGPROBS) != 0;
  }
  // The token whose logprob the row at `pos` of lane l reports, or -1: the next prompt token,
  // once (a recompute after preemption does not report a position again).
  BLINK_HD int32_t target_of(int64_t l, int64_t pos) const {
    if (!wants_prompt_logprobs(l) || pos < lane(L_PLP_DONE, l) || pos + 1 >= lane(L_PROMPT_LEN, l))
      return -1;
    return history[l * c.max_context + pos + 1];
  }
  // A prompt chunk of a lane that reports prompt logprobs writes one entry per row (plus the
  // sampled token after the last chunk): cut it to what its ring holds.
  BLINK_HD int64_t fit_ring(int64_t l, int64_t n) const {
    if (!wants_prompt_logprobs(l)) return n;
    int64_t room = ring_free(l) - 1;
    return n < room ? n : room;
  }

  // ---- serial helpers ----
  BLINK_HD void push_free_page(int32_t page) const { region(lay.free_pages)[s(S_FREE_COUNT)++] = page; }
  // An empty free list takes the least recently released evictable cached page first.
  BLINK_HD int32_t pop_free_page() const {
    if (c.prefix_caching && s(S_FREE_COUNT) == 0) push_free_page(pcache().evict());
    return region(lay.free_pages)[--s(S_FREE_COUNT)];
  }
  // Pages a lane may still take: the free list and, with prefix caching, the cached pages no
  // lane holds (PC_NUM_IDLE: all reclaimable, leaves first).
  BLINK_HD int64_t avail() const {
    return s(S_FREE_COUNT) + (c.prefix_caching ? pcache().sc(PC_NUM_IDLE) : 0);
  }
  // The prefix-cache registry (ffi/prefix_cache.h) in the state's global copy: it is not hot.
  // Laid out where used rather than kept as a member: a member made the schedule kernel spill
  // (ptxas: 88 bytes) where it now uses its 128 registers without.
  BLINK_HD BlinkPrefixCache pcache() const {
    return BlinkPrefixCache(st, BlinkPrefixLayout(c.num_pages, c.page_size, lay.prefix));
  }
  BLINK_HD uint64_t chain_of(int64_t l) const {
    return uint64_t(uint32_t(lane(L_CHAIN_LO, l))) | uint64_t(uint32_t(lane(L_CHAIN_HI, l))) << 32;
  }
  BLINK_HD void set_chain(int64_t l, uint64_t h) const {
    lane(L_CHAIN_LO, l) = int32_t(uint32_t(h));
    lane(L_CHAIN_HI, l) = int32_t(uint32_t(h >> 32));
  }
  BLINK_HD int32_t release_tick() const { return int32_t(uint32_t(counter(C_STEPS))); }
  // Drops lane l's references to its registered pages (cached: they stay, evictable once
  // unreferenced); the rest of its pages, page_table[l, L_REG_PAGES:], are its own.
  BLINK_HD void release_registered(int64_t l) const {
    for (int32_t p = 0; p < lane(L_REG_PAGES, l); ++p)
      if (pcache().release(pt(l, p), release_tick())) push_free_page(pt(l, p));
  }

  // Registers lane l's full pages whose K/V are computed, in order (a page's parent is the
  // lane's previous, registered page). A prefix already cached under another page (computed
  // twice, by lanes running together) is shared: the lane switches to the cached page and
  // frees its own copy, which nothing reads again (the step writes positions >= computed).
  BLINK_HD void register_pages(int64_t l) const {
    const BlinkPrefixCache pc = pcache();
    const int64_t full = lane(L_COMPUTED, l) / c.page_size;
    for (int64_t i = lane(L_REG_PAGES, l); i < full && i < lane(L_PAGES, l); ++i) {
      const int32_t* toks = history + int64_t(l) * c.max_context + i * c.page_size;
      const int32_t parent = i > 0 ? pt(l, i - 1) : -1;
      const uint64_t h = blink_page_hash(i > 0 ? chain_of(l) : 0, toks, c.page_size);
      const int32_t hit = pc.lookup(h, parent, toks);
      if (hit >= 0) {
        pc.acquire(hit);
        push_free_page(pt(l, i));
        pt(l, i) = hit;
      } else {
        pc.acquire(pt(l, i));
        pc.insert(pt(l, i), h, parent, toks);
      }
      set_chain(l, h);
      lane(L_REG_PAGES, l) = int32_t(i + 1);
    }
  }

  // Maps the longest cached prefix of lane l's first `tokens` history tokens, in whole pages
  // and leaving at least the last of them to compute (for its logits), into its empty page
  // table; returns the pages mapped. The lane computes on from the end of the prefix or, with
  // windowed pages, from its start: the cache holds the global layers' K/V only, and the
  // sliding-window layers' K/V of a position depend on the window before it at every layer
  // below, so no shorter recompute is exact (docs/ARCHITECTURE.md, "Windowed pages"). Those
  // rows write the lane's ring only: they lie in registered pages (BT_LOCAL_ONLY, fill_batch).
  BLINK_HD int64_t map_cached_prefix(int64_t l, int64_t tokens) const {
    const BlinkPrefixCache pc = pcache();
    const int64_t ps = c.page_size, most = (tokens - 1) / ps;
    const int32_t* h0 = history + int64_t(l) * c.max_context;
    int64_t m = 0;
    uint64_t h = 0;
    for (int32_t parent = -1; m < most; ++m) {
      const uint64_t hm = blink_page_hash(h, h0 + m * ps, ps);
      const int32_t hit = pc.lookup(hm, parent, h0 + m * ps);
      if (hit < 0) break;
      pc.acquire(hit);
      pt(l, m) = hit;
      parent = hit;
      h = hm;
    }
    lane(L_PAGES, l) = lane(L_REG_PAGES, l) = int32_t(m);
    set_chain(l, h);
    lane(L_COMPUTED, l) = c.window > 0 ? 0 : int32_t(m * ps);
    return m;
  }

  // Prefix caching at admission, after copy_prompts: the lane's first chunk moves past the
  // cached prefix; true when it did (the rows it gave back are then packed by pack_rows).
  // The pages taken for the chunk go back first, so the new ones never need more.
  BLINK_HD bool match_prefix(int64_t l) const {
    const int64_t plen = lane(L_PROMPT_LEN, l), ps = c.page_size;
    counter(C_PREFIX_QUERIES) += uint64_t(plen);
    const int32_t* h0 = history + int64_t(l) * c.max_context;
    if ((plen - 1) / ps == 0 || pcache().lookup(blink_page_hash(0, h0, ps), -1, h0) < 0)
      return false;  // the common miss: nothing to undo
    const int64_t n_old = lane(L_SCHED_N, l);
    for (int32_t p = 0; p < lane(L_PAGES, l); ++p) push_free_page(pt(l, p));
    map_cached_prefix(l, plen);
    // Cached tokens are those not computed again (all of them computed, with windowed pages).
    const int64_t from = lane(L_COMPUTED, l);
    lane(L_CACHED_TOKENS, l) = int32_t(from);
    const int64_t left = plen - from, n = n_old < left ? n_old : left;
    alloc_pages(l, from + n);
    lane(L_SCHED_N, l) = int32_t(n);
    lane(L_SAMPLES, l) = from + n == lane(L_LEN, l) ? 1 : 0;
    s(S_PROMPT_ROWS) -= int32_t(n_old - n);
    counter(C_PREFIX_HITS) += uint64_t(from);
    blink_store<uint32_t>(out(lane(L_SLOT, l)) + OUT_OFF(cached_tokens), uint32_t(from));
    return from > 0;
  }

  // Lays the rows of the lanes the serial passes scheduled this step out again, right after
  // the decode rows, once prefix hits have shortened some of their chunks: no padding rows
  // between them, so the step runs the bucket of the tokens it computes.
  BLINK_HD void pack_rows() const {
    int32_t row = s(S_NUM_DECODE);
    for (int32_t k = 0; k < s(S_NUM_STEP_LANES); ++k) {
      const int32_t l = region(lay.step_lanes)[k];
      lane(L_ROW, l) = row;
      row += lane(L_SCHED_N, l);
    }
    s(S_NUM_ROWS) = row;
  }

  // Grows lane l's pages to cover `tokens` tokens; the caller checked there are enough.
  BLINK_HD void alloc_pages(int64_t l, int64_t tokens) const {
    for (int64_t need = pages_for(tokens); lane(L_PAGES, l) < need; ++lane(L_PAGES, l))
      pt(l, lane(L_PAGES, l)) = pop_free_page();
  }
  BLINK_HD void free_lane_pages(int64_t l) const {
    const int32_t reg = c.prefix_caching ? lane(L_REG_PAGES, l) : 0;
    if (reg) release_registered(l);
    for (int32_t p = reg; p < lane(L_PAGES, l); ++p) push_free_page(pt(l, p));
    lane(L_PAGES, l) = 0;
    if (reg) lane(L_REG_PAGES, l) = 0;
  }

  // Finishes a request that holds no lane (queued): output only.
  BLINK_HD void finish_slot(int64_t slot, uint32_t seq, uint32_t reason, uint32_t err) const {
    uint8_t* o = out(slot);
    blink_store<uint32_t>(o + OUT_OFF(finish_reason), reason);
    blink_store<uint32_t>(o + OUT_OFF(error_code), err);
    blink_store_release<uint32_t>(o + OUT_OFF(finished_seq), seq);
    region(lay.busy)[slot] = 0;
    counter(C_FINISHED)++;
    if (reason == BLINK_FINISH_ERROR) counter(C_ERRORED)++;
    if (reason == BLINK_FINISH_CANCELLED) counter(C_CANCELLED)++;
  }

  // Preempts the youngest lane that holds pages, is younger than `ticket` and is not scheduled
  // in this step: its pages are freed and it will recompute its whole history later.
  BLINK_HD bool preempt_younger_than(int32_t ticket) const {
    int32_t* order = region(lay.order);
    for (int32_t i = s(S_ORDER_COUNT) - 1; i >= 0; --i) {
      int32_t v = order[i];
      if (lane(L_TICKET, v) <= ticket) return false;
      if (lane(L_PAGES, v) == 0 || lane(L_SCHED_N, v) > 0 || lane(L_FINISH, v)) continue;
      preempt(v);
      return true;
    }
    return false;
  }
  BLINK_HD void preempt(int64_t v) const {
    free_lane_pages(v);
    lane(L_STATE, v) = LANE_PREEMPTED;
    lane(L_COMPUTED, v) = 0;
    lane(L_PREEMPTS, v) += 1;
    lane(L_TMP, v) = 1;  // preempted in this step: no recompute before the next one
    blink_store<uint32_t>(out(lane(L_SLOT, v)) + OUT_OFF(preemptions), lane(L_PREEMPTS, v));
    counter(C_PREEMPTIONS)++;
  }

  // The only reads of a slot's request fields (seq, cancel and consumed, the handshake words,
  // are read where they are used; the prompt tokens by copy_prompts). Loads every field,
  // unconditionally and independent of each other, so that on the GPU they are in flight
  // together: one PCIe round trip, not one per field.
  BLINK_HD BlinkRequestCopy load_request(int64_t slot) const {
    const uint8_t* r = req(slot);
    BlinkRequestCopy q;
    q.prompt_len = blink_load<uint32_t>(r + REQ_OFF(prompt_len));
    q.max_tokens = blink_load<uint32_t>(r + REQ_OFF(max_tokens));
    q.temperature = blink_load<uint32_t>(r + REQ_OFF(temperature));
    q.top_p = blink_load<uint32_t>(r + REQ_OFF(top_p));
    q.top_k = blink_load<uint32_t>(r + REQ_OFF(top_k));
    q.num_logprobs = blink_load<uint32_t>(r + REQ_OFF(num_logprobs));
    q.flags = blink_load<uint32_t>(r + REQ_OFF(flags));
    q.num_stop_ids = blink_load<uint32_t>(r + REQ_OFF(num_stop_ids));
    q.prompt_offset = blink_load<uint32_t>(r + REQ_OFF(prompt_offset));
    q.seed = blink_load<uint64_t>(r + REQ_OFF(seed));
    BLINK_UNROLL
    for (int i = 0; i < BLINK_MAX_STOP_IDS; ++i)
      q.stop_ids[i] = int32_t(blink_load<uint32_t>(r + REQ_OFF(stop_ids) + 4 * i));
    return q;
  }

  // Validates a request copy; returns a BlinkError. A copy that passes has
  // 1 <= prompt_len <= max_prompt, prompt_len < max_context, prompt_offset + prompt_len <=
  // arena_tokens, num_stop_ids <= BLINK_MAX_STOP_IDS and num_logprobs <= max_top_logprobs: the
  // bounds admit and copy_prompts index with.
  BLINK_HD uint32_t validate(const BlinkRequestCopy& q) const {
    const uint32_t plen = q.prompt_len;
    if (plen == 0 || plen > uint32_t(c.max_prompt) || int64_t(plen) >= c.max_context)
      return BLINK_ERR_PROMPT_LENGTH;
    if (uint64_t(q.prompt_offset) + plen > uint64_t(c.arena_tokens)) return BLINK_ERR_PROMPT_OFFSET;
    if (q.max_tokens == 0) return BLINK_ERR_MAX_TOKENS;
    const float t = blink_bits_to_float(q.temperature);
    if (!(t >= 0.0f && t <= 3.0e38f)) return BLINK_ERR_TEMPERATURE;  // NaN/inf fail too
    const float p = blink_bits_to_float(q.top_p);
    if (!(p > 0.0f && p <= 1.0f)) return BLINK_ERR_TOP_P;
    if (int32_t(q.top_k) < 0) return BLINK_ERR_TOP_K;
    if (q.num_stop_ids > BLINK_MAX_STOP_IDS) return BLINK_ERR_STOP_IDS;
    bool stops_ok = true;
    BLINK_UNROLL
    for (int i = 0; i < BLINK_MAX_STOP_IDS; ++i)
      if (uint32_t(i) < q.num_stop_ids && (q.stop_ids[i] < 0 || q.stop_ids[i] >= c.vocab_size))
        stops_ok = false;
    if (!stops_ok) return BLINK_ERR_STOP_IDS;
    if (q.num_logprobs > uint32_t(c.max_top_logprobs)) return BLINK_ERR_LOGPROBS;
    if (q.flags & ~BLINK_FLAGS_KNOWN) return BLINK_ERR_FLAGS;
    if ((q.flags & BLINK_FLAG_PROMPT_LOGPROBS) && c.ring_capacity < 2) return BLINK_ERR_FLAGS;
    return BLINK_ERR_NONE;
  }

  // Takes a free lane for the request `q` of `slot` (its validated copy: nothing here reads
  // the mailbox's request again) and schedules its first chunk of `n` tokens; pages were
  // checked by the caller.
  BLINK_HD void admit(int64_t slot, uint32_t seq, int64_t n, const BlinkRequestCopy& q) const {
    int32_t l = region(lay.free_lanes)[--s(S_FREE_LANES)];
    const int32_t plen = int32_t(q.prompt_len);  // validated: in [1, max_prompt], < max_context
    const int64_t max_new = c.max_context - plen;
    const int64_t mt = q.max_tokens;
    lane(L_STATE, l) = LANE_ACTIVE;
    lane(L_SLOT, l) = int32_t(slot);
    lane(L_SEQ, l) = int32_t(seq);
    lane(L_LEN, l) = plen;
    lane(L_COMPUTED, l) = 0;
    lane(L_PROMPT_LEN, l) = plen;
    lane(L_GENERATED, l) = 0;
    lane(L_MAX_TOKENS, l) = int32_t(mt < max_new ? mt : max_new);
    lane(L_PAGES, l) = 0;
    lane(L_TICKET, l) = s(S_NEXT_TICKET)++;
    lane(L_FLAGS, l) = int32_t(q.flags);
    lane(L_TEMPERATURE, l) = int32_t(q.temperature);
    lane(L_TOP_P, l) = int32_t(q.top_p);
    lane(L_TOP_K, l) = int32_t(q.top_k);
    lane(L_SEED_LO, l) = int32_t(uint32_t(q.seed));
    lane(L_SEED_HI, l) = int32_t(uint32_t(q.seed >> 32));
    lane(L_NUM_LOGPROBS, l) = int32_t(q.num_logprobs);
    // Validated: num_stop_ids <= BLINK_MAX_STOP_IDS, so the copy stays in lane l's row.
    const int32_t ns = int32_t(q.num_stop_ids);
    lane(L_NUM_STOP, l) = ns;
    int32_t* stops = region(lay.stop_ids) + int64_t(l) * BLINK_MAX_STOP_IDS;
    BLINK_UNROLL
    for (int i = 0; i < BLINK_MAX_STOP_IDS; ++i)
      if (i < ns) stops[i] = q.stop_ids[i];
    lane(L_OUT_COUNT, l) = 0;
    lane(L_CONSUMED, l) = 0;
    lane(L_FINISH, l) = BLINK_FINISH_NONE;
    lane(L_ERROR, l) = BLINK_ERR_NONE;
    lane(L_PREEMPTS, l) = 0;
    lane(L_BAD, l) = 0;
    lane(L_PLP_DONE, l) = 0;
    lane(L_PROMPT_OFF, l) = int32_t(q.prompt_offset);  // validated against the arena's end
    lane(L_REG_PAGES, l) = lane(L_CHAIN_LO, l) = lane(L_CHAIN_HI, l) = 0;
    lane(L_CACHED_TOKENS, l) = 0;
    region(lay.order)[s(S_ORDER_COUNT)++] = l;
    region(lay.new_lanes)[s(S_NUM_ADMITTED)++] = l;
    blink_store<uint32_t>(out(slot) + OUT_OFF(prompt_len), uint32_t(plen));
    blink_store<uint32_t>(out(slot) + OUT_OFF(cached_tokens), 0u);
    blink_store<uint32_t>(out(slot) + OUT_OFF(admit_ticket), uint32_t(lane(L_TICKET, l)) + 1);
    counter(C_ADMITTED)++;
    schedule_chunk(l, n);
  }

  BLINK_HD void schedule_chunk(int64_t l, int64_t n) const {
    alloc_pages(l, lane(L_COMPUTED, l) + n);
    lane(L_STATE, l) = LANE_ACTIVE;
    lane(L_ROW, l) = s(S_NUM_ROWS);
    lane(L_SCHED_N, l) = int32_t(n);
    lane(L_SAMPLES, l) = lane(L_COMPUTED, l) + n == lane(L_LEN, l) ? 1 : 0;
    s(S_NUM_ROWS) += int32_t(n);
    s(S_PROMPT_ROWS) += int32_t(n);
    region(lay.step_lanes)[s(S_NUM_STEP_LANES)++] = int32_t(l);
  }

  BLINK_HD bool needs_prefill(int64_t l) const {
    int32_t st_ = lane(L_STATE, l);
    return lane(L_FINISH, l) == BLINK_FINISH_NONE &&
           (st_ == LANE_PREEMPTED ||
            (st_ == LANE_ACTIVE && lane(L_LEN, l) - lane(L_COMPUTED, l) > 1));
  }
  BLINK_HD bool decode_ready(int64_t l) const {
    return lane(L_STATE, l) == LANE_ACTIVE && lane(L_FINISH, l) == BLINK_FINISH_NONE &&
           lane(L_LEN, l) - lane(L_COMPUTED, l) == 1 && ring_has_room(l);
  }

  // Tokens in lane l's registered (cached, maybe shared) pages: a row below it only recomputes
  // the sliding-window layers' K/V (BT_LOCAL_ONLY), never a shared page's.
  BLINK_HD int32_t registered_tokens(int64_t l) const {
    return c.prefix_caching ? lane(L_REG_PAGES, l) * int32_t(c.page_size) : 0;
  }

  BLINK_HD void register_all() const {
    const int32_t* order = region(lay.order);
    for (int32_t i = 0; i < s(S_ORDER_COUNT); ++i)
      if (lane(L_STATE, order[i]) == LANE_ACTIVE) register_pages(order[i]);
  }

  // ======================= schedule =======================
  // One word of a poll: doorbell w for w < BLINK_MAX_WORKERS, then the shutdown word. A
  // relaxed load: a doorbell only says that something changed; the reads it announces follow
  // an acquire fence (begin_pass) or are acquire loads themselves (slot sequence words).
  BLINK_HD uint64_t poll_word(int64_t w) const {
    return w < BLINK_MAX_WORKERS ? blink_load<uint64_t>(&hdr()->doorbell[w])
                                 : uint64_t(blink_load<uint32_t>(&hdr()->shutdown));
  }

  template <class X>
  BLINK_HD void schedule(const X& x) const {
    schedule(x, [&](int64_t w) { return poll_word(w); });
  }
  // `first_poll(w)`: poll word w for the first pass, which the CUDA kernels load before
  // anything else so that its PCIe round trip overlaps their other work.
  template <class X, class Poll>
  BLINK_HD void schedule(const X& x, const Poll& first_poll) const {
    // The leader's clock at the last phase boundary: every phase ends with a barrier, so the
    // leader reaching a boundary means the phase is done, and timing it adds no barrier.
    // Device only, as C_SCHEDULE_NS: host and device states stay comparable word for word.
    uint64_t mark = 0;
    auto phase_done = [&](int ctr) {
#ifdef __CUDA_ARCH__
      x.lead([&] {
        const uint64_t now = X_now_ns();
        if (ctr >= 0) counter(ctr) += now - mark;
        mark = now;
      });
#else
      (void)ctr;
      (void)mark;
#endif
    };
    if (pacing()) x.serial([&] { pace(); });
    // A paced wait makes the early poll words stale: the first pass then polls afresh.
    const bool fresh_poll = pacing() && s(S_PACE_WAITED) != 0;
    for (int pass = 0; pass < 2; ++pass) {
      phase_done(-1);
      if (pass == 0 && !fresh_poll)
        begin_pass(x, true, first_poll);
      else
        begin_pass(x, pass == 0, [&](int64_t w) { return poll_word(w); });
      if (s(S_SCAN)) scan_slots(x);
      phase_done(C_SCHED_SCAN_NS);
      check_lanes(x);
      if (s(S_ANY_REGISTER)) x.serial([&] { register_all(); });
      if (s(S_ANY_FINISH)) release_finished(x);
      phase_done(C_SCHED_POLL_NS);
      decode_pass(x);
      phase_done(C_SCHED_DECODE_NS);
      // Without admissions (a steady step) the batch header is written in the same phase.
      x.serial([&] {
        if (s(S_ANY_PREFILL)) prefill_pass();
        s(S_COPY_FROM) = 0;
        admit_waiting();
        if (s(S_NUM_ADMITTED) == 0) finalize_schedule();
      });
      // The admitted prompts are copied and, with prefix caching, matched against the cache
      // before the batch is final. Hits shorten first chunks: the rows are packed again and
      // more waiting requests are admitted into the budget they gave back, round after round
      // (docs/ARCHITECTURE.md, "Prefix caching"). Every thread reads the same scalars here:
      // the serial phase before ends with a barrier.
      for (int round = 1; s(S_NUM_ADMITTED) > s(S_COPY_FROM); ++round) {
        copy_prompts(x);
        x.serial([&] {
          const int32_t from = s(S_COPY_FROM), to = s(S_NUM_ADMITTED);
          s(S_COPY_FROM) = to;
          bool hit = false;
          if (c.prefix_caching)
            for (int32_t k = from; k < to; ++k) {
              const int32_t l = region(lay.new_lanes)[k];
              if (!lane(L_BAD, l) && !wants_prompt_logprobs(l)) hit |= match_prefix(l);
            }
          if (hit) {
            pack_rows();
            if (round < BLINK_ADMIT_ROUNDS) admit_waiting();
          }
          if (s(S_NUM_ADMITTED) == s(S_COPY_FROM)) finalize_schedule();
        });
      }
      phase_done(C_SCHED_ADMIT_NS);
      fill_batch(x);
      x.serial([&] { publish_and_idle(); });
      phase_done(C_SCHED_BATCH_NS);
      const bool retry = s(S_IDLE_RETRY) != 0;
      if (!retry) break;
      x.sync();  // everyone has read the flag before begin_pass rewrites it
    }
  }

  // One round trip to the mailbox per step: every doorbell and the shutdown word (poll
  // words, see poll_word) summed, and the leader resets the step's scalars. A doorbell that
  // moved makes the reads acquire: the frontend writes a cancel word before it rings.
  template <class X, class Poll>
  BLINK_HD void begin_pass(const X& x, bool first, const Poll& poll) const {
    int32_t* shutdown = lane_scratch(0);
    x.sum_then_lead(
        BLINK_MAX_WORKERS + 1,
        [&](int64_t w) -> uint32_t {
          const uint64_t word = poll(w);
          if (w < BLINK_MAX_WORKERS) return uint32_t(word);
          shutdown[0] = int32_t(word != 0);
          return 0;
        },
        [&](uint32_t total) {
          if (first) counter(C_LOOP_ITERATIONS)++;
          s(S_NUM_ROWS) = s(S_NUM_DECODE) = s(S_NUM_SAMPLES) = s(S_NUM_ADMITTED) = 0;
          s(S_BLOCKED) = s(S_ANY_FINISH) = s(S_ANY_PREFILL) = s(S_IDLE_RETRY) = 0;
          s(S_ANY_REGISTER) = 0;
          s(S_PROMPT_ROWS) = s(S_NUM_STEP_LANES) = s(S_ANY_TARGET) = 0;
          s(S_SHUTDOWN) = shutdown[0];
          s(S_DOORBELL_NOW) = int32_t(total);
          s(S_SCAN) = total != uint32_t(counter(C_DOORBELL_SEEN)) || s(S_RESCAN);
          counter(C_DOORBELL_SEEN) = total;
        });
    if (s(S_SCAN)) x.acquire_reads(BLINK_MAX_WORKERS + 1);  // scan_slots' barriers follow
  }

  // Finds newly submitted slots and queues them in slot order (FCFS from here on).
  template <class X>
  BLINK_HD void scan_slots(const X& x) const {
    int32_t *flag = region(lay.scratch_a), *off = region(lay.scratch_b),
            *seqs = region(lay.scratch_c), *taken = region(lay.taken);
    int32_t* busy = region(lay.busy);
    x.serial([&] {
      s(S_RESCAN) = 0;
      counter(C_SLOT_SCANS)++;
    });
    x.parallel(c.num_slots, [&](int64_t sl) {
      uint32_t seq = blink_load_acquire<uint32_t>(req(sl) + REQ_OFF(seq));
      seqs[sl] = int32_t(seq);
      flag[sl] = seq != 0 && seq != uint32_t(taken[sl]);
      // A slot republished before its previous request finished waits until it has.
      if (flag[sl] && busy[sl]) {
        flag[sl] = 0;
        s(S_RESCAN) = 1;
      }
    });
    int32_t n = x.exclusive_scan(c.num_slots, [&](int64_t sl) { return flag[sl]; }, off);
    int32_t tail = s(S_Q_TAIL);
    x.parallel(c.num_slots, [&](int64_t sl) {
      if (!flag[sl]) return;
      taken[sl] = seqs[sl];
      busy[sl] = 1;
      region(lay.queue)[(tail + off[sl]) % c.num_slots] = int32_t(sl);
      uint8_t* o = out(sl);
      blink_store<uint32_t>(o + OUT_OFF(count), 0u);
      blink_store<uint32_t>(o + OUT_OFF(finish_reason), 0u);
      blink_store<uint32_t>(o + OUT_OFF(error_code), 0u);
      blink_store<uint32_t>(o + OUT_OFF(preemptions), 0u);
      blink_store<uint32_t>(o + OUT_OFF(admit_ticket), 0u);
      blink_store<uint64_t>(o + OUT_OFF(taken_ns), X_now_ns());
      blink_store<uint64_t>(o + OUT_OFF(first_ns), 0u);
      blink_store_release<uint32_t>(o + OUT_OFF(started_seq), uint32_t(seqs[sl]));
    });
    x.serial([&] {
      s(S_Q_TAIL) = tail + n;
      if (n > 0 && pacing()) note_arrivals(n);
    });
  }

  // Resets per-step lane fields; reads a running request's consumed count only when its ring
  // looks full and its cancel word only when a doorbell rang (frontends ring on cancel), so a
  // steady decode step reads nothing from the mailbox here.
  template <class X>
  BLINK_HD void check_lanes(const X& x) const {
    const bool rang = s(S_SCAN) != 0;
    x.parallel(c.max_seqs, [&](int64_t l) {
      lane(L_SCHED_N, l) = 0;
      lane(L_SAMPLES, l) = 0;
      lane(L_TMP, l) = 0;
      if (lane(L_STATE, l) == LANE_FREE) return;
      int64_t sl = lane(L_SLOT, l);
      // consumed is untrusted too, but bounds nothing: ring_free() is at most ring_capacity
      // whatever it holds (a uint32 difference) and ring indices are taken modulo
      // ring_capacity, so a bad count only stalls this request or overwrites its own unread
      // entries. The cancel word is only compared with the lane's seq.
      if (!ring_has_room(l) || (wants_prompt_logprobs(l) && needs_prefill(l)))
        lane(L_CONSUMED, l) = int32_t(req_u32(sl, REQ_OFF(consumed)));
      if (rang && req_u32(sl, REQ_OFF(cancel)) == uint32_t(lane(L_SEQ, l)) &&
          lane(L_FINISH, l) == BLINK_FINISH_NONE) {
        lane(L_FINISH, l) = BLINK_FINISH_CANCELLED;
        s(S_ANY_FINISH) = 1;  // benign race: every writer stores 1
      }
      if (needs_prefill(l)) s(S_ANY_PREFILL) = 1;
      if (c.prefix_caching && lane(L_STATE, l) == LANE_ACTIVE &&
          lane(L_COMPUTED, l) / c.page_size > lane(L_REG_PAGES, l))
        s(S_ANY_REGISTER) = 1;  // benign race: every writer stores 1
    });
  }

  // One row per decode-ready lane. Fast path in parallel when the free pages suffice;
  // otherwise serially in admission order with preemption of the youngest.
  // One scan numbers both the rows (low 16 bits) and the new pages (high 16 bits): max_seqs
  // is below 2^15 (blink_config_check).
  BLINK_HD int32_t decode_need(int64_t l) const {
    if (!decode_ready(l)) return 0;
    return 1 | (lane(L_COMPUTED, l) % c.page_size == 0 ? 1 << 16 : 0);
  }
  template <class X>
  BLINK_HD void decode_pass(const X& x) const {
    int32_t* off = lane_scratch(0);
    const int32_t total =
        x.exclusive_scan(c.max_seqs, [&](int64_t l) { return decode_need(l); }, off);
    const int32_t nready = total & 0xffff, nneed = total >> 16;
    if (c.prefix_caching && nneed > s(S_FREE_COUNT))
      x.serial([&] {  // evictable cached pages onto the free list for the fast path
        while (s(S_FREE_COUNT) < nneed && pcache().sc(PC_NUM_IDLE) > 0)
          push_free_page(pcache().evict());
      });
    const int32_t free_top = s(S_FREE_COUNT);  // every thread reads it before anyone writes it
    if (nneed <= free_top) {
      x.parallel(c.max_seqs, [&](int64_t l) {
        const int32_t need = decode_need(l);  // lane l's own fields: unchanged so far
        if (!need) return;
        const int32_t row = off[l] & 0xffff;
        if (need >> 16) {
          pt(l, lane(L_PAGES, l)) = region(lay.free_pages)[free_top - 1 - (off[l] >> 16)];
          lane(L_PAGES, l) += 1;
        }
        lane(L_ROW, l) = row;
        lane(L_SCHED_N, l) = 1;
        lane(L_SAMPLES, l) = row + 1;  // decode rows and samples share indices
      });
      x.serial([&] {
        s(S_FREE_COUNT) -= nneed;
        s(S_NUM_ROWS) = s(S_NUM_DECODE) = s(S_NUM_SAMPLES) = nready;
      });
    } else {
      x.serial([&] { decode_pass_serial(); });
    }
  }

  BLINK_HD void decode_pass_serial() const {
    int32_t* order = region(lay.order);
    for (int32_t i = 0; i < s(S_ORDER_COUNT); ++i) {
      int32_t l = order[i];
      if (!decode_ready(l)) continue;
      if (lane(L_COMPUTED, l) % c.page_size == 0) {
        while (avail() == 0 && preempt_younger_than(lane(L_TICKET, l))) {
        }
        if (avail() == 0) {  // nothing younger to take from: step back itself
          preempt(l);
          s(S_BLOCKED) = 1;
          continue;
        }
        alloc_pages(l, lane(L_COMPUTED, l) + 1);
      }
      lane(L_ROW, l) = s(S_NUM_ROWS)++;
      lane(L_SCHED_N, l) = 1;
      lane(L_SAMPLES, l) = ++s(S_NUM_SAMPLES);
      s(S_NUM_DECODE)++;
    }
  }

  // Chunked prefill and recompute of lanes that hold one, oldest first.
  BLINK_HD void prefill_pass() const {
    int32_t* order = region(lay.order);
    for (int32_t i = 0; i < s(S_ORDER_COUNT); ++i) {
      int32_t l = order[i];
      if (!needs_prefill(l) || !ring_has_room(l) || lane(L_TMP, l)) continue;
      int64_t left = c.token_budget - s(S_NUM_ROWS);
      if (left <= 0) break;
      // A preempted lane's recompute starts from what the cache still holds of it (its own
      // pages, released to the cache when it was preempted, if not evicted since).
      if (c.prefix_caching && lane(L_STATE, l) == LANE_PREEMPTED && !wants_prompt_logprobs(l)) {
        map_cached_prefix(l, lane(L_LEN, l));  // the generated tokens' pages too
        lane(L_STATE, l) = LANE_ACTIVE;
      }
      int64_t computed = lane(L_COMPUTED, l), todo = lane(L_LEN, l) - computed;
      if (todo > c.lane_chunk()) todo = c.lane_chunk();
      int64_t n = fit_ring(l, todo < left ? todo : left);
      if (n <= 0) continue;
      while (pages_for(computed + n) - lane(L_PAGES, l) > avail() &&
             preempt_younger_than(lane(L_TICKET, l))) {
      }
      int64_t room = (int64_t(lane(L_PAGES, l)) + avail()) * c.page_size - computed;
      if (room < n) {
        n = room;
        s(S_BLOCKED) = 1;  // an older request waits for pages: admit nothing new
      }
      if (n <= 0) continue;
      schedule_chunk(l, n);
    }
  }

  // FCFS admission from the waiting queue while lanes, budget and pages allow.
  BLINK_HD void admit_waiting() const {
    int32_t* queue = region(lay.queue);
    while (!s(S_BLOCKED) && s(S_Q_HEAD) != s(S_Q_TAIL)) {
      int64_t left = c.token_budget - s(S_NUM_ROWS);
      if (left <= 0) break;
      int32_t slot = queue[s(S_Q_HEAD) % c.num_slots];
      uint32_t seq = uint32_t(region(lay.taken)[slot]);
      if (req_u32(slot, REQ_OFF(cancel)) == seq) {
        s(S_Q_HEAD)++;
        finish_slot(slot, seq, BLINK_FINISH_CANCELLED, BLINK_ERR_NONE);
        continue;
      }
      // One snapshot of the request, validated and then used for everything below and in
      // admit (a request left in the queue is read afresh at its next attempt).
      const BlinkRequestCopy q = load_request(slot);
      uint32_t err = validate(q);
      if (err != BLINK_ERR_NONE) {
        s(S_Q_HEAD)++;
        finish_slot(slot, seq, BLINK_FINISH_ERROR, err);
        continue;
      }
      if (s(S_FREE_LANES) == 0) break;
      int64_t plen = q.prompt_len;
      int64_t n = plen < left ? plen : left;
      if (n > c.lane_chunk()) n = c.lane_chunk();
      if ((q.flags & BLINK_FLAG_PROMPT_LOGPROBS) && n > c.ring_capacity - 1)
        n = c.ring_capacity - 1;  // each prompt row writes an entry (see fit_ring)
      if (pages_for(n) > avail()) break;
      s(S_Q_HEAD)++;
      admit(slot, seq, n, q);
    }
  }

  // Copies the prompts of newly admitted lanes into their history, checking every token id.
  // Each token is loaded once and the checked value is what the history keeps, so a writer
  // that changes the prompt meanwhile changes the request, never the check
  // (docs/ARCHITECTURE.md, "The mailbox contract"). Offset and length are the lane's, which
  // admit took from the validated copy (offset + length <= arena_tokens, length <= max_prompt
  // and < max_context): the loads stay inside the arena and the stores inside lane l's
  // history row.
  template <class X>
  BLINK_HD void copy_prompts(const X& x) const {
    for (int32_t k = s(S_COPY_FROM); k < s(S_NUM_ADMITTED); ++k) {
      int32_t l = region(lay.new_lanes)[k];
      const uint8_t* prompt =
          mb + geo.arena_offset() + 4ull * uint32_t(lane(L_PROMPT_OFF, l));
      int32_t* h = history + int64_t(l) * c.max_context;
      x.parallel(lane(L_PROMPT_LEN, l), [&](int64_t i) {
        int32_t t = int32_t(blink_load<uint32_t>(prompt + 4 * i));
        if (t < 0 || t >= c.vocab_size) {
          lane(L_BAD, l) = 1;
          t = 0;
        }
        h[i] = t;
      });
    }
  }

  // Drops admitted lanes with bad prompts (their rows become padding) and numbers the samples
  // of the serially scheduled lanes.
  BLINK_HD void finalize_schedule() const {
    int32_t* lanes = region(lay.step_lanes);
    for (int32_t k = 0; k < s(S_NUM_STEP_LANES); ++k) {
      int32_t l = lanes[k];
      if (lane(L_BAD, l)) {
        lane(L_BAD, l) = 0;
        s(S_PROMPT_ROWS) -= lane(L_SCHED_N, l);  // its rows stay in the batch as padding
        lane(L_SCHED_N, l) = 0;
        lane(L_SAMPLES, l) = 0;
        lane(L_FINISH, l) = BLINK_FINISH_ERROR;
        lane(L_ERROR, l) = BLINK_ERR_TOKEN_ID;
        s(S_ANY_FINISH) = 1;
        continue;
      }
      if (lane(L_SAMPLES, l)) lane(L_SAMPLES, l) = ++s(S_NUM_SAMPLES);
    }
    const int32_t rows = s(S_NUM_ROWS);
    int32_t b = 0;
    while (b < c.num_buckets - 1 && c.bucket(b) < rows) ++b;
    batch[B_NUM_ROWS] = rows;
    batch[B_BUCKET] = rows == 0 ? -1 : b;
    batch[B_BUCKET_SIZE] = rows == 0 ? 0 : int32_t(c.bucket(b));
    batch[B_NUM_SAMPLES] = s(S_NUM_SAMPLES);
    batch[B_SHUTDOWN] = s(S_SHUTDOWN);
    batch[B_NUM_DECODE] = s(S_NUM_DECODE);
    for (int i = B_NUM_DECODE + 1; i < B_HEADER_WORDS; ++i) batch[i] = 0;
  }

  template <class X>
  BLINK_HD void fill_batch(const X& x) const {
    int32_t *tok = tok_array(BT_TOKENS), *pos = tok_array(BT_POSITIONS),
            *sid = tok_array(BT_SEQ_IDS), *tgt = tok_array(BT_TARGETS),
            *loc = tok_array(BT_LOCAL_ONLY);
    const int64_t rows = batch[B_BUCKET_SIZE];
    x.parallel(rows > c.max_seqs ? rows : c.max_seqs, [&](int64_t i) {
      if (i < rows) {
        tok[i] = 0;
        pos[i] = 0;
        sid[i] = -1;
        tgt[i] = -1;
        loc[i] = 0;
      }
      if (i < c.max_seqs) {
        // An unused sample entry must not look like a request that asks for sampling or
        // logprobs: the step computes those for every entry when any entry wants them.
        sample_array(BS_LANES)[i] = -1;
        sample_array(BS_TEMPERATURE)[i] = 0;  // 0.0f: greedy
        sample_array(BS_NUM_LOGPROBS)[i] = -1;
      }
    });
    x.parallel(c.max_seqs, [&](int64_t l) {
      int32_t n = lane(L_SCHED_N, l);
      if (n == 0) return;
      int32_t r0 = lane(L_ROW, l), c0 = lane(L_COMPUTED, l);
      if (n == 1) {
        tok[r0] = history[l * c.max_context + c0];
        pos[r0] = c0;
        sid[r0] = int32_t(l);
        tgt[r0] = target_of(l, c0);
        loc[r0] = c0 < registered_tokens(l);
        if (tgt[r0] >= 0) s(S_ANY_TARGET) = 1;  // benign race: every writer stores 1
      }
      int32_t si = lane(L_SAMPLES, l) - 1;
      if (si < 0) return;
      sample_array(BS_ROWS)[si] = r0 + n - 1;
      sample_array(BS_LANES)[si] = int32_t(l);
      sample_array(BS_TEMPERATURE)[si] = lane(L_TEMPERATURE, l);
      sample_array(BS_TOP_P)[si] = lane(L_TOP_P, l);
      sample_array(BS_TOP_K)[si] = lane(L_TOP_K, l);
      sample_array(BS_SEED_LO)[si] = lane(L_SEED_LO, l);
      sample_array(BS_SEED_HI)[si] = lane(L_SEED_HI, l);
      sample_array(BS_POSITION)[si] = lane(L_LEN, l);
      sample_array(BS_NUM_LOGPROBS)[si] =
          (lane(L_FLAGS, l) & BLINK_FLAG_LOGPROBS) ? lane(L_NUM_LOGPROBS, l) : -1;
    });
    for (int32_t k = 0; k < s(S_NUM_STEP_LANES); ++k) {
      int32_t l = region(lay.step_lanes)[k];
      int32_t n = lane(L_SCHED_N, l);
      if (n <= 1) continue;
      int32_t r0 = lane(L_ROW, l), c0 = lane(L_COMPUTED, l), reg = registered_tokens(l);
      const int32_t* h = history + int64_t(l) * c.max_context;
      x.parallel(n, [&](int64_t i) {
        tok[r0 + i] = h[c0 + i];
        pos[r0 + i] = c0 + int32_t(i);
        sid[r0 + i] = l;
        tgt[r0 + i] = target_of(l, c0 + i);
        loc[r0 + i] = c0 + int32_t(i) < reg;
        if (tgt[r0 + i] >= 0) s(S_ANY_TARGET) = 1;
      });
    }
  }

  BLINK_HD void publish_counters() const {
    BlinkMailboxHeader* h = hdr();
    blink_store<uint64_t>(&h->loop_iterations, counter(C_LOOP_ITERATIONS));
    blink_store<uint64_t>(&h->steps, counter(C_STEPS));
    blink_store<uint64_t>(&h->tokens_generated, counter(C_TOKENS_GENERATED));
    blink_store<uint64_t>(&h->prompt_tokens, counter(C_PROMPT_TOKENS));
    blink_store<uint64_t>(&h->requests_admitted, counter(C_ADMITTED));
    blink_store<uint64_t>(&h->requests_finished, counter(C_FINISHED));
    blink_store<uint64_t>(&h->requests_errored, counter(C_ERRORED));
    blink_store<uint64_t>(&h->requests_cancelled, counter(C_CANCELLED));
    blink_store<uint64_t>(&h->preemptions, counter(C_PREEMPTIONS));
    // Cached pages that no request holds and that could be evicted count as free.
    blink_store<uint64_t>(&h->pages_in_use, uint64_t(c.num_pages - avail()));
    blink_store<uint64_t>(&h->pages_total, uint64_t(c.num_pages));
    blink_store<uint64_t>(&h->running, uint64_t(s(S_ORDER_COUNT)));
    blink_store<uint64_t>(&h->waiting, uint64_t(s(S_Q_TAIL) - s(S_Q_HEAD)));
    blink_store<uint64_t>(&h->schedule_ns, counter(C_SCHEDULE_NS));
    blink_store<uint64_t>(&h->commit_ns, counter(C_COMMIT_NS));
    blink_store<uint64_t>(&h->prefix_cache_queries, counter(C_PREFIX_QUERIES));
    blink_store<uint64_t>(&h->prefix_cache_hits, counter(C_PREFIX_HITS));
    blink_store<uint64_t>(&h->slot_scans, counter(C_SLOT_SCANS));
    blink_store<uint64_t>(&h->sched_scan_ns, counter(C_SCHED_SCAN_NS));
    blink_store<uint64_t>(&h->sched_poll_ns, counter(C_SCHED_POLL_NS));
    blink_store<uint64_t>(&h->sched_decode_ns, counter(C_SCHED_DECODE_NS));
    blink_store<uint64_t>(&h->sched_admit_ns, counter(C_SCHED_ADMIT_NS));
    blink_store<uint64_t>(&h->sched_batch_ns, counter(C_SCHED_BATCH_NS));
    blink_store<uint64_t>(&h->step_rows, counter(C_STEP_ROWS));
  }

  // The doorbells of the attached workers summed (uint32 wrap, as begin_pass sums them).
  BLINK_HD uint32_t doorbell_total() const {
    uint32_t nw = blink_load<uint32_t>(&hdr()->num_workers);
    const int64_t workers = nw == 0 || nw > BLINK_MAX_WORKERS ? BLINK_MAX_WORKERS : nw;
    uint32_t total = 0;
    for (int64_t w = 0; w < workers; ++w) total += uint32_t(blink_load<uint64_t>(&hdr()->doorbell[w]));
    return total;
  }

  // Whether steps are paced: min_step_interval_us or step_interval_permille set.
  BLINK_HD bool pacing() const { return c.min_step_interval_us > 0 || c.step_interval_permille > 1000; }

  BLINK_HD uint64_t clock_word(int lo) const {
    return uint64_t(uint32_t(s(lo))) | uint64_t(uint32_t(s(lo + 1))) << 32;
  }
  BLINK_HD void set_clock_word(int lo, uint64_t t) const {
    s(lo) = int32_t(uint32_t(t));
    s(lo + 1) = int32_t(uint32_t(t >> 32));
  }

  // The scan found n new requests (leader, with pacing on): the mean gap between arrivals
  // takes the time since the last scan that found any, over n (a burst found at once counts
  // as n arrivals), capped at BLINK_PACE_MAX_GAP_US: the plain mean of the first
  // BLINK_PACE_MEAN_GAPS gaps, a moving average with weight 1 / BLINK_PACE_MEAN_GAPS after.
  BLINK_HD void note_arrivals(int32_t n) const {
    const uint64_t now = X_now_ns(), last = clock_word(S_ARRIVAL_T_LO);
    if (last != 0 && now > last) {
      uint64_t gap = (now - last) / 1000 / uint64_t(n);
      gap = gap < 1 ? 1 : gap > BLINK_PACE_MAX_GAP_US ? BLINK_PACE_MAX_GAP_US : gap;
      if (s(S_ARRIVAL_GAPS) < BLINK_PACE_MEAN_GAPS) s(S_ARRIVAL_GAPS)++;
      const int64_t mean = s(S_ARRIVAL_GAP_US);
      // At least 1 (gap and mean are, and the division truncates toward zero).
      s(S_ARRIVAL_GAP_US) = int32_t(mean + (int64_t(gap) - mean) / s(S_ARRIVAL_GAPS));
    }
    set_clock_word(S_ARRIVAL_T_LO, now);
  }

  // Step pacing (docs/ARCHITECTURE.md, "Step pacing"), run by the leader before the first
  // pass when pacing(): a step that follows a decode-only step with nothing waiting starts no
  // sooner than min_step_interval_us, and no sooner than step_interval_permille / 1000 times
  // the previous step's length (its start to this call), after the previous step started,
  // so a light load batches more sequences per pass over the weights and the GPU idles in
  // between. A moved doorbell (a new request, a cancel) or shutdown ends the wait at once.
  // The wait only pays while requests keep arriving (a later arrival joins a fuller batch):
  // once BLINK_PACE_HOLD_GAPS mean gaps have passed since the last arrival, the sequences
  // left finish back to back, since waiting would only stretch their tokens and hold the
  // GPU at idle power longer (a run's tail). The mean counts once BLINK_PACE_MEAN_GAPS gaps
  // are in it: a server's first requests are paced as without the hold.
  BLINK_HD void pace() const {
    uint64_t now = X_now_ns();
    s(S_PACE_WAITED) = 0;
    if (s(S_PACE)) {
      const uint64_t last = clock_word(S_PACE_T_LO);
      const uint64_t fixed = uint64_t(c.min_step_interval_us) * 1000;
      // At a permille of 1000 or less the relative interval has passed already: no wait.
      const uint64_t length = now > last ? now - last : 0;
      const uint64_t relative = length / 1000 * uint64_t(c.step_interval_permille);
      uint64_t until = last + (fixed > relative ? fixed : relative);
      if (s(S_ARRIVAL_GAPS) >= BLINK_PACE_MEAN_GAPS) {
        const uint64_t hold = clock_word(S_ARRIVAL_T_LO) +
                              uint64_t(s(S_ARRIVAL_GAP_US)) * 1000 * BLINK_PACE_HOLD_GAPS;
        if (hold < until) until = hold;
      }
      const uint64_t start = now;
      while (now < until && doorbell_total() == uint32_t(counter(C_DOORBELL_SEEN)) &&
             blink_load<uint32_t>(&hdr()->shutdown) == 0) {
        X_exec::pause_ns(until - now);
        now = X_now_ns();
        s(S_PACE_WAITED) = 1;
      }
      if (s(S_PACE_WAITED)) {
        counter(C_PACED_STEPS)++;
        counter(C_PACED_NS) += now - start;
#ifdef __CUDA_ARCH__
        counter(C_SCHEDULE_NS) -= now - start;  // the kernel's timer counts scheduling work only
#endif
      }
    }
    set_clock_word(S_PACE_T_LO, now);
  }

  // With nothing to run, polls the doorbells for up to idle_poll_us before returning an empty
  // step; new work found there triggers a second pass of the schedule.
  BLINK_HD void publish_and_idle() const {
    publish_counters();
    if (pacing())
      s(S_PACE) = s(S_NUM_ROWS) > 0 && s(S_PROMPT_ROWS) == 0 && s(S_NUM_ADMITTED) == 0 &&
                  s(S_Q_TAIL) == s(S_Q_HEAD) && !s(S_SHUTDOWN);
    if (s(S_NUM_ROWS) > 0 || s(S_SHUTDOWN) || s(S_ANY_FINISH) || c.idle_poll_us <= 0) return;
    uint64_t start = X_now_ns();
    for (uint32_t attempt = 0;; ++attempt) {
      const uint32_t total = doorbell_total();
      if (total != uint32_t(s(S_DOORBELL_NOW))) {
        s(S_IDLE_RETRY) = 1;
        return;
      }
      if (blink_load<uint32_t>(&hdr()->shutdown) != 0) return;
      if (X_now_ns() - start > uint64_t(c.idle_poll_us) * 1000) return;
      X_exec::backoff(attempt);
    }
  }

  // The clock, backoff and sleep of the side this pass is compiled for (nvcc compiles the
  // class once for the host and once for the device).
#ifdef __CUDA_ARCH__
  using X_exec = DeviceExec;
#else
  using X_exec = HostExec;
#endif
  BLINK_HD static uint64_t X_now_ns() { return X_exec::now_ns(); }

  // Frees pages and lanes of finishing requests and writes their finish to the mailbox.
  template <class X>
  BLINK_HD void release_finished(const X& x) const {
    int32_t *fin = lane_scratch(0), *poff = lane_scratch(1),
            *loff = lane_scratch(2);
    x.parallel(c.max_seqs, [&](int64_t l) {
      fin[l] = lane(L_STATE, l) != LANE_FREE && lane(L_FINISH, l) != BLINK_FINISH_NONE;
    });
    // Prefix caching: a finishing lane's last computed pages are registered too, then its
    // references to registered pages dropped (serially: lanes share cached pages); its own
    // pages, page_table[l, L_REG_PAGES:], go back to the free list below.
    if (c.prefix_caching)
      x.serial([&] {
        for (int64_t l = 0; l < c.max_seqs; ++l) {
          if (!fin[l]) continue;
          register_pages(l);
          release_registered(l);  // L_REG_PAGES is kept for the scan below
        }
      });
    const bool pc_on = c.prefix_caching != 0;
    int32_t npages = x.exclusive_scan(
        c.max_seqs,
        [&](int64_t l) { return fin[l] ? lane(L_PAGES, l) - (pc_on ? lane(L_REG_PAGES, l) : 0) : 0; },
        poff);
    int32_t nlanes = x.exclusive_scan(c.max_seqs, [&](int64_t l) { return fin[l]; }, loff);
    int32_t free_top = s(S_FREE_COUNT), lane_top = s(S_FREE_LANES);
    x.parallel(c.max_seqs, [&](int64_t l) {
      if (!fin[l]) return;
      const int32_t own = pc_on ? lane(L_REG_PAGES, l) : 0;
      for (int32_t p = own; p < lane(L_PAGES, l); ++p)
        region(lay.free_pages)[free_top + poff[l] + p - own] = pt(l, p);
      region(lay.free_lanes)[lane_top + loff[l]] = int32_t(l);
      uint8_t* o = out(lane(L_SLOT, l));
      blink_store<uint32_t>(o + OUT_OFF(finish_reason), uint32_t(lane(L_FINISH, l)));
      blink_store<uint32_t>(o + OUT_OFF(error_code), uint32_t(lane(L_ERROR, l)));
      blink_store_release<uint32_t>(o + OUT_OFF(finished_seq), uint32_t(lane(L_SEQ, l)));
      region(lay.busy)[lane(L_SLOT, l)] = 0;
    });
    // Keep the admission order of the lanes that stay (stable compaction).
    int32_t* order = region(lay.order);
    int32_t* keep = lane_scratch(3);
    int32_t norder = s(S_ORDER_COUNT);
    x.parallel(norder, [&](int64_t i) { keep[i] = !fin[order[i]]; });
    int32_t* dst = lane_scratch(1);  // page offsets are no longer needed
    int32_t nkeep = x.exclusive_scan(norder, [&](int64_t i) { return keep[i]; }, dst);
    int32_t* tmp = lane_scratch(2);   // lane offsets are no longer needed
    x.parallel(norder, [&](int64_t i) {
      if (keep[i]) tmp[dst[i]] = order[i];
    });
    x.parallel(nkeep, [&](int64_t i) { order[i] = tmp[i]; });
    int32_t nerr = x.exclusive_scan(
        c.max_seqs, [&](int64_t l) { return fin[l] && lane(L_FINISH, l) == BLINK_FINISH_ERROR; },
        lane_scratch(1));
    int32_t ncanc = x.exclusive_scan(
        c.max_seqs,
        [&](int64_t l) { return fin[l] && lane(L_FINISH, l) == BLINK_FINISH_CANCELLED; },
        lane_scratch(2));
    x.parallel(c.max_seqs, [&](int64_t l) {
      if (!fin[l]) return;
      lane(L_STATE, l) = LANE_FREE;
      lane(L_FINISH, l) = BLINK_FINISH_NONE;
      lane(L_PAGES, l) = 0;
      lane(L_REG_PAGES, l) = 0;
      lane(L_SCHED_N, l) = 0;
    });
    x.serial([&] {
      counter(C_FINISHED) += uint64_t(nlanes);
      counter(C_ERRORED) += uint64_t(nerr);
      counter(C_CANCELLED) += uint64_t(ncanc);
      s(S_FREE_COUNT) = free_top + npages;
      s(S_FREE_LANES) = lane_top + nlanes;
      s(S_ORDER_COUNT) = nkeep;
      s(S_ANY_FINISH) = 0;
    });
  }

  // ======================= commit =======================
  // Writes output entry e of lane l: the token and, with `logprobs`, its logprob and top-n
  // (k = the lane's num_logprobs).
  BLINK_HD void write_entry(int64_t l, uint32_t e, int32_t token, bool logprobs, float lp,
                            const int32_t* ids, const float* lps, int64_t cols) const {
    int64_t slot = lane(L_SLOT, l);
    uint32_t ri = e % uint32_t(c.ring_capacity);
    blink_store<int32_t>(mb + geo.out_tokens_offset(slot) + 4 * ri, token);
    if (!logprobs) return;
    blink_store<uint32_t>(mb + geo.out_logprobs_offset(slot) + 4 * ri, blink_float_to_bits(lp));
    int32_t k = lane(L_NUM_LOGPROBS, l);
    for (int32_t j = 0; j < k && j < cols; ++j) {
      uint64_t idx = (uint64_t(ri) * c.max_top_logprobs + j) * 4;
      blink_store<int32_t>(mb + geo.out_top_ids_offset(slot) + idx, ids[j]);
      blink_store<uint32_t>(mb + geo.out_top_logprobs_offset(slot) + idx,
                            blink_float_to_bits(lps[j]));
    }
  }

  // Prompt logprobs: one entry per row with a target (its position = its entry index, since
  // entries of such a lane start with prompt position 1), then each lane's count moves on.
  template <class X>
  BLINK_HD void commit_prompt_logprobs(const X& x, const BlinkStepOutputs& step) const {
    const int32_t *tgt = tok_array(BT_TARGETS), *sid = tok_array(BT_SEQ_IDS),
                  *pos = tok_array(BT_POSITIONS);
    x.parallel(batch[B_NUM_ROWS], [&](int64_t r) {
      if (tgt[r] < 0) return;
      write_entry(sid[r], uint32_t(pos[r]), tgt[r], true, step.row_lps[r],
                  step.row_top_ids + r * step.top_cols, step.row_top_lps + r * step.top_cols,
                  step.top_cols);
    });
    x.parallel(c.max_seqs, [&](int64_t l) {
      if (lane(L_SCHED_N, l) == 0 || !wants_prompt_logprobs(l)) return;
      int64_t last = lane(L_COMPUTED, l) + lane(L_SCHED_N, l) - 1;  // last row's position
      if (last > lane(L_PROMPT_LEN, l) - 2) last = lane(L_PROMPT_LEN, l) - 2;
      if (last < lane(L_PLP_DONE, l)) return;
      const bool first = lane(L_OUT_COUNT, l) == 0;  // entry 0 is among these
      lane(L_PLP_DONE, l) = int32_t(last + 1);
      lane(L_OUT_COUNT, l) = int32_t(last + 1);  // no generated entry precedes these
      uint8_t* o = out(lane(L_SLOT, l));
      const uint64_t now = X_now_ns();
      blink_store<uint64_t>(o + OUT_OFF(token_ns), now);
      if (first) blink_store<uint64_t>(o + OUT_OFF(first_ns), now);
      blink_store_release<uint32_t>(o + OUT_OFF(count), uint32_t(last + 1));
    });
  }

  // Appends the sampled tokens, checks stop conditions, frees finished requests, publishes
  // the header's counters.
  template <class X>
  BLINK_HD void commit(const X& x, const BlinkStepOutputs& step) const {
    const int32_t* sampled = step.sampled;
    const float *logprobs = step.logprobs, *top_lps = step.top_lps;
    const int32_t* top_ids = step.top_ids;
    const int64_t top_k_cols = step.top_cols;
    if (s(S_ANY_TARGET)) commit_prompt_logprobs(x, step);
    // One phase for the samples (index i < nsamples) and the lanes' computed prefix (lane
    // i < max_seqs): they touch different lane fields.
    const int32_t nsamples = batch[B_NUM_SAMPLES];
    x.parallel(nsamples > c.max_seqs ? nsamples : c.max_seqs, [&](int64_t i) {
      if (i < c.max_seqs) {
        // Prefill chunks advance the computed prefix (sampled lanes: all but the new token).
        lane(L_COMPUTED, i) += lane(L_SCHED_N, i);
        lane(L_SCHED_N, i) = 0;
      }
      if (i >= nsamples) return;
      int32_t l = sample_array(BS_LANES)[i];
      if (l < 0) return;
      int32_t t = sampled[i];
      if (t < 0 || t >= c.vocab_size) t = 0;  // cannot happen with a sane sampler
      int32_t len = lane(L_LEN, l);
      history[int64_t(l) * c.max_context + len] = t;
      uint8_t* o = out(lane(L_SLOT, l));
      uint32_t e = uint32_t(lane(L_OUT_COUNT, l));
      write_entry(l, e, t, (lane(L_FLAGS, l) & BLINK_FLAG_LOGPROBS) != 0, logprobs[i],
                  top_ids + i * top_k_cols, top_lps + i * top_k_cols, top_k_cols);
      lane(L_OUT_COUNT, l) = int32_t(e + 1);
      const uint64_t now = X_now_ns();
      blink_store<uint64_t>(o + OUT_OFF(token_ns), now);
      if (e == 0) blink_store<uint64_t>(o + OUT_OFF(first_ns), now);
      lane(L_LEN, l) = len + 1;
      lane(L_GENERATED, l) += 1;
      int32_t finish = BLINK_FINISH_NONE;
      if (!(lane(L_FLAGS, l) & BLINK_FLAG_IGNORE_EOS))
        for (int k = 0; k < BLINK_MAX_EOS; ++k)
          if (c.eos(k) >= 0 && t == c.eos(k)) finish = BLINK_FINISH_STOP;
      for (int32_t k = 0; k < lane(L_NUM_STOP, l); ++k)
        if (t == region(lay.stop_ids)[l * BLINK_MAX_STOP_IDS + k]) finish = BLINK_FINISH_STOP;
      if (finish == BLINK_FINISH_NONE &&
          (lane(L_GENERATED, l) >= lane(L_MAX_TOKENS, l) || len + 1 >= c.max_context))
        finish = BLINK_FINISH_LENGTH;
      if (finish != BLINK_FINISH_NONE) {
        lane(L_FINISH, l) = finish;
        s(S_ANY_FINISH) = 1;
      }
      blink_store_release<uint32_t>(o + OUT_OFF(count), e + 1);
    });
    if (s(S_ANY_FINISH)) release_finished(x);
    x.serial([&] {
      if (batch[B_NUM_ROWS] > 0) {
        counter(C_STEPS)++;
        counter(C_STEP_ROWS) += uint64_t(batch[B_BUCKET_SIZE]);
      }
      counter(C_TOKENS_GENERATED) += uint64_t(nsamples);
      counter(C_PROMPT_TOKENS) += uint64_t(s(S_PROMPT_ROWS));
      s(S_PROMPT_ROWS) = 0;
      publish_counters();
    });
  }
#undef REQ_OFF
#undef OUT_OFF
};

// Host-side initialisation of a fresh state: all pages and lanes free, nothing queued.
inline void blink_state_init_host(const BlinkSchedConfig& c, int32_t* st) {
  BlinkStateLayout lay(c);
  for (int64_t i = 0; i < lay.total; ++i) st[i] = 0;
  for (int64_t i = 0; i < c.num_pages; ++i) st[lay.free_pages + i] = int32_t(c.num_pages - 1 - i);
  for (int64_t i = 0; i < c.max_seqs; ++i) st[lay.free_lanes + i] = int32_t(c.max_seqs - 1 - i);
  st[lay.scalars + S_FREE_COUNT] = int32_t(c.num_pages);
  if (c.prefix_caching) BlinkPrefixCache(st, BlinkPrefixLayout(c.num_pages, c.page_size, lay.prefix)).init();
  st[lay.scalars + S_FREE_LANES] = int32_t(c.max_seqs);
}
