// Scheduler configuration and the layout of its device state.
//
// The state is one int32 buffer owned by the executor's loop carry (aliased in and out of the
// FFI handlers, never hidden in globals); only this header knows its layout. Python asks the
// library for its size (blink_state_words) and initialises it with blink_state_init.
#pragma once
#include <stdint.h>

#include "mailbox.h"
#include "prefix_cache.h"

#define BLINK_MAX_BUCKETS 16
// Lanes: the decode pass packs a lane count and a page count into one 32-bit scan.
#define BLINK_MAX_SEQS 32767
#define BLINK_MAX_EOS 4
// Admission rounds per step with prefix caching: each round copies and matches the prompts it
// admitted, and admits more into the budget that cache hits gave back (BlinkSched::schedule).
#define BLINK_ADMIT_ROUNDS 8
// Step pacing holds while requests keep arriving: a step is paced only until this many mean
// gaps between arrivals have passed since the last one (BlinkSched::pace; ARCHITECTURE.md,
// "Step pacing"). Poisson arrivals leave a gap that long once in e^4 = 55.
#define BLINK_PACE_HOLD_GAPS 4
// A gap longer than this (an idle spell) counts as this long in the mean gap.
#define BLINK_PACE_MAX_GAP_US 10000000
// The mean gap counts once it holds this many gaps, their plain mean, then a moving average
// with this weight's inverse (a mean of one or two gaps, two requests of one batch found a
// step apart, would release the pacing of a server's first requests at once).
#define BLINK_PACE_MEAN_GAPS 8

// Passed to the FFI handlers as named attributes (names = field names; see
// BLINK_SCHED_CONFIG_FIELDS) and to the C API as an int64 array in this order.
struct BlinkSchedConfig {
  int64_t mailbox;           // address of the mailbox as the executing device sees it
  int64_t num_slots;
  int64_t max_prompt;
  int64_t ring_capacity;
  int64_t max_top_logprobs;
  int64_t vocab_size;
  int64_t max_seqs;          // batch lanes
  int64_t max_context;       // tokens per sequence (prompt + generated)
  int64_t page_size;
  int64_t num_pages;
  int64_t token_budget;      // tokens per step (= the largest bucket)
  int64_t num_buckets;
  int64_t bucket0, bucket1, bucket2, bucket3, bucket4, bucket5;  // BLINK_MAX_BUCKETS of them
  int64_t bucket6, bucket7, bucket8, bucket9, bucket10, bucket11;
  int64_t bucket12, bucket13, bucket14, bucket15;
  int64_t eos0, eos1, eos2, eos3;  // -1 = unused
  int64_t idle_poll_us;      // how long an idle schedule polls the mailbox before returning
  int64_t arena_tokens;      // prompt tokens of the mailbox's arena (geometry)
  int64_t min_step_interval_us;  // step pacing: 0 = steps back to back (see BlinkSched::pace)
  int64_t prefix_caching;    // 1: automatic prefix caching (prefix_cache.h), 0: off
  // Windowed pages (docs/ARCHITECTURE.md, "Windowed pages"): the sliding-window layers keep a
  // ring of window_pages pages per lane instead of pages for the whole context. 0: off.
  int64_t window;            // the sliding window in tokens (a row reads window keys)
  int64_t window_pages;      // ring pages per lane
  // Step pacing relative to the step's length (see BlinkSched::pace): a paced step starts no
  // sooner than step_interval_permille / 1000 times the previous step's length after that
  // step started. <= 1000: off.
  int64_t step_interval_permille;

  BLINK_HD int64_t bucket(int i) const {
    const int64_t* b = &bucket0;
    return b[i];
  }
  BLINK_HD int64_t eos(int i) const {
    const int64_t* e = &eos0;
    return e[i];
  }
  BLINK_HD int64_t max_pages_per_seq() const { return (max_context + page_size - 1) / page_size; }
  // The most rows one lane may compute in a step: with windowed pages, a chunk's writes must
  // not overwrite the ring entries its first row still reads (window - 1 keys before it).
  BLINK_HD int64_t lane_chunk() const {
    return window > 0 ? window_pages * page_size - window + 1 : token_budget;
  }
  BLINK_HD BlinkGeometry geometry() const {
    return BlinkGeometry{uint32_t(num_slots), uint32_t(max_prompt), uint32_t(ring_capacity),
                         uint32_t(max_top_logprobs), uint32_t(arena_tokens)};
  }
};

#define BLINK_SCHED_CONFIG_FIELDS                                                             \
  "mailbox", "num_slots", "max_prompt", "ring_capacity", "max_top_logprobs", "vocab_size",    \
      "max_seqs", "max_context", "page_size", "num_pages", "token_budget", "num_buckets",      \
      "bucket0", "bucket1", "bucket2", "bucket3", "bucket4", "bucket5", "bucket6", "bucket7",  \
      "bucket8", "bucket9", "bucket10", "bucket11", "bucket12", "bucket13", "bucket14",        \
      "bucket15", "eos0", "eos1", "eos2", "eos3",                                               \
      "idle_poll_us", "arena_tokens", "min_step_interval_us", "prefix_caching", "window",       \
      "window_pages", "step_interval_permille"
#define BLINK_SCHED_CONFIG_NUM_FIELDS 39
static_assert(sizeof(BlinkSchedConfig) == 8 * BLINK_SCHED_CONFIG_NUM_FIELDS, "config fields");

// Scalars of the state (int32 words after the 64-bit counters).
enum BlinkScalar {
  S_Q_HEAD = 0,       // waiting queue (ring of slot ids), head and tail as running counts
  S_Q_TAIL,
  S_FREE_COUNT,       // free_pages[0:S_FREE_COUNT] are free
  S_ORDER_COUNT,      // order[0:S_ORDER_COUNT]: lanes in admission order
  S_NEXT_TICKET,
  S_SCAN,             // this schedule call scans the slots
  S_ARRIVAL_GAP_US,   // pacing: mean gap between arrivals (us; see S_ARRIVAL_GAPS)
  S_NUM_ROWS,         // rows of this step's batch (holes included)
  S_NUM_DECODE,       // rows taken by the decode fast path
  S_NUM_SAMPLES,
  S_NUM_ADMITTED,     // lanes admitted this step (awaiting prompt copy)
  S_BLOCKED,          // an older request could not get pages: admit nothing new
  S_ANY_FINISH,       // some lane finishes in this commit
  S_IDLE_RETRY,       // idle poll saw new work: run the schedule again
  S_SHUTDOWN,
  S_PROMPT_ROWS,      // prefill rows of this step (for counters)
  S_FREE_LANES,       // free_lanes[0:S_FREE_LANES] are unused lanes
  S_NUM_STEP_LANES,   // step_lanes[0:n]: lanes scheduled by the serial passes this step
  S_ANY_PREFILL,      // some lane needs prefill or recompute
  S_DOORBELL_NOW,     // doorbell sum read this step
  S_RESCAN,           // a busy slot was republished: scan again at the next step
  S_ANY_TARGET,       // some row of this step reports a prompt logprob
  S_PACE,             // pacing on, the last batch was decode only and nothing waited
  S_PACE_WAITED,      // this schedule call waited for its pacing interval
  S_PACE_T_LO,        // clock (ns) at the start of the last step, when pacing is on
  S_PACE_T_HI,
  S_ANY_REGISTER,     // prefix caching: some lane has a full computed page not yet registered
  S_COPY_FROM,        // new_lanes[S_COPY_FROM:S_NUM_ADMITTED]: admitted, prompt not copied yet
  S_ARRIVAL_T_LO,     // pacing: clock (ns) when the scan last found new requests (0: never)
  S_ARRIVAL_T_HI,
  S_ARRIVAL_GAPS,     // pacing: gaps in that mean so far (counts up to BLINK_PACE_MEAN_GAPS)
  S_NUM_SCALARS = 32
};
static_assert(S_ARRIVAL_GAPS < S_NUM_SCALARS, "the last scalar fits S_NUM_SCALARS words");

// 64-bit counters (published to the mailbox header).
enum BlinkCounter {
  C_DOORBELL_SEEN = 0,
  C_LOOP_ITERATIONS,
  C_STEPS,
  C_TOKENS_GENERATED,
  C_PROMPT_TOKENS,
  C_ADMITTED,
  C_FINISHED,
  C_ERRORED,
  C_CANCELLED,
  C_PREEMPTIONS,
  C_SCHEDULE_NS,   // device time inside the schedule kernel (CUDA handlers only)
  C_COMMIT_NS,     // device time inside the commit kernel (CUDA handlers only)
  // Time inside schedule by phase (device only; published with C_SCHED_SCAN_NS and
  // C_SLOT_SCANS below):
  C_SCHED_POLL_NS,    // lane checks, release of finished lanes
  C_SCHED_DECODE_NS,  // one row per decode-ready lane
  C_SCHED_ADMIT_NS,   // prefill chunks, admission, prompt copies, the batch's header
  C_SCHED_BATCH_NS,   // the batch's token and sample arrays, counters, idle polling
  C_PACED_STEPS,      // steps that waited for their pacing interval (BlinkSched::pace)
  C_PACED_NS,         // time those waits took (clock of the executing side)
  C_PREFIX_QUERIES,   // prompt tokens of requests admitted with prefix caching on
  C_PREFIX_HITS,      // of those, tokens whose K/V came from cached pages
  C_SCHED_SCAN_NS,    // schedule phase: the doorbells' round trip, and the slot scan if one moved
  C_SLOT_SCANS,       // schedule passes that scanned the slots (a doorbell moved, or a rescan)
  C_STEP_ROWS,        // rows the steps ran: their buckets' sizes, padding included
  // even: the CUDA kernels copy the hot state 16 bytes at a time (one counter spare)
  C_NUM_COUNTERS = 24
};

// Per-lane fields, each an int32 array of max_seqs.
enum BlinkLaneField {
  L_STATE = 0,     // LANE_FREE / LANE_ACTIVE / LANE_PREEMPTED
  L_SLOT,
  L_SEQ,
  L_LEN,           // tokens in history (prompt + generated)
  L_COMPUTED,      // tokens whose K/V are in the cache
  L_PROMPT_LEN,
  L_GENERATED,
  L_MAX_TOKENS,    // effective: min(max_tokens, max_context - prompt_len)
  L_PAGES,         // pages owned (page_table[lane, 0:L_PAGES])
  L_TICKET,        // admission order
  L_FLAGS,
  L_TEMPERATURE,   // float bits
  L_TOP_P,         // float bits
  L_TOP_K,
  L_SEED_LO,
  L_SEED_HI,
  L_NUM_LOGPROBS,
  L_NUM_STOP,
  L_OUT_COUNT,     // output entries written
  L_CONSUMED,      // frontend's consumed count, read this step
  L_SCHED_N,       // tokens scheduled this step
  L_ROW,           // first batch row this step
  L_SAMPLES,       // 1 if this step samples the lane's next token
  L_FINISH,        // pending BlinkFinish
  L_ERROR,
  L_PREEMPTS,
  L_BAD,           // prompt copy found an invalid token id
  L_TMP,
  L_PLP_DONE,      // prompt-logprob entries written (= prompt positions 1..L_PLP_DONE)
  L_PROMPT_OFF,    // the prompt's first token in the mailbox arena (validated copy)
  L_REG_PAGES,     // prefix caching: page_table[lane, 0:L_REG_PAGES] are registered (cached)
  L_CHAIN_LO,      // chain hash of the last registered page (low, high 32 bits)
  L_CHAIN_HI,
  L_CACHED_TOKENS, // prompt tokens that came from the cache at admission
  L_NUM_FIELDS
};

enum BlinkLaneState { LANE_FREE = 0, LANE_ACTIVE = 1, LANE_PREEMPTED = 2 };

// Batch descriptor: int32 words read by the model step (mirrored in blink_jax/native/batch.py).
enum BlinkBatchHeader {
  B_NUM_ROWS = 0,
  B_BUCKET,
  B_BUCKET_SIZE,
  B_NUM_SAMPLES,
  B_SHUTDOWN,
  B_NUM_DECODE,
  B_HEADER_WORDS = 16
};
// Then token arrays of token_budget words: tokens, positions, seq_ids, targets (the next prompt
// token, whose logprob this row reports, or -1), local_only (1: the row recomputes the
// sliding window before a cached prefix, whose global-layer K/V are in shared pages: only
// the sliding-window layers write its K/V); then sample arrays of
// max_seqs words: rows, lanes, temperature (bits), top_p (bits), top_k, seed_lo, seed_hi,
// position of the token being sampled, num_logprobs (-1 = no logprobs).
enum BlinkBatchTokenArray { BT_TOKENS = 0, BT_POSITIONS, BT_SEQ_IDS, BT_TARGETS, BT_LOCAL_ONLY, BT_NUM };
enum BlinkBatchSampleArray {
  BS_ROWS = 0, BS_LANES, BS_TEMPERATURE, BS_TOP_P, BS_TOP_K, BS_SEED_LO, BS_SEED_HI,
  BS_POSITION, BS_NUM_LOGPROBS, BS_NUM
};

BLINK_HD int64_t blink_batch_words(const BlinkSchedConfig& c) {
  return B_HEADER_WORDS + BT_NUM * c.token_budget + BS_NUM * c.max_seqs;
}

// Words of the lane table (L_NUM_FIELDS arrays of max_seqs), rounded up to 16 bytes: the
// CUDA kernels copy it to and from shared memory in 16-byte words, with no tail.
BLINK_HD int64_t blink_lane_words(const BlinkSchedConfig& c) {
  return (int64_t(L_NUM_FIELDS) * c.max_seqs + 3) & ~int64_t(3);
}

// Word offsets of the state regions.
struct BlinkStateLayout {
  int64_t counters, scalars, taken, queue, busy, free_pages, order, free_lanes, new_lanes, step_lanes,
      lanes, stop_ids, scratch_a, scratch_b, scratch_c, scratch_d, prefix, total;

  BLINK_HD explicit BlinkStateLayout(const BlinkSchedConfig& c) {
    // Scratch arrays hold one entry per slot, lane or frontend worker.
    int64_t wide = c.num_slots > c.max_seqs ? c.num_slots : c.max_seqs;
    wide = (wide > BLINK_MAX_WORKERS ? wide : BLINK_MAX_WORKERS) + 1;
    counters = 0;
    scalars = counters + 2 * C_NUM_COUNTERS;
    taken = scalars + S_NUM_SCALARS;
    queue = taken + c.num_slots;
    busy = queue + c.num_slots;
    free_pages = busy + c.num_slots;
    order = free_pages + c.num_pages;
    free_lanes = order + c.max_seqs;
    new_lanes = free_lanes + c.max_seqs;
    step_lanes = new_lanes + c.max_seqs;
    lanes = (step_lanes + c.max_seqs + 3) & ~int64_t(3);  // 16-byte aligned (see above)
    stop_ids = lanes + blink_lane_words(c);
    scratch_a = stop_ids + BLINK_MAX_STOP_IDS * c.max_seqs;
    scratch_b = scratch_a + wide;
    scratch_c = scratch_b + wide;
    scratch_d = scratch_c + wide;
    prefix = scratch_d + wide;  // the prefix-cache registry, when prefix_caching is on
    total = prefix + (c.prefix_caching ? BlinkPrefixLayout(c.num_pages, c.page_size).total : 0);
  }
};
