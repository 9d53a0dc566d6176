// The mailbox: the only memory the frontend (SmartNIC role) and the GPU share.
//
// A flat region, written and read only with one-sided stores and loads, so that POSIX shared
// memory, a TCP relay and RDMA WRITE/READ are interchangeable transports. Mirrored in Python by
// blink_jax/client/protocol.py (no JAX there); tests/test_protocol.py checks every offset against
// this header through blink_mailbox_layout() in layout.cc.
//
// Region = MailboxHeader | Slot[0] | Slot[1] | ... | prompt arena ; Slot = SlotRequest |
// SlotOutput (+ output ring). Sizes depend on the geometry written into the header.
//
// Prompts live in the arena, int32 token ids, not in the slots: a slot's request names its
// prompt by prompt_offset (a token index into the arena) and prompt_len, so 4,096 slots do not
// cost 4,096 x max_context tokens of pinned memory (docs/ARCHITECTURE.md, "The prompt
// arena"). Frontend worker w of W owns arena tokens [w*A/W, (w+1)*A/W) (A = arena_tokens), as
// it owns slots [w*n/W, (w+1)*n/W); it keeps a request's tokens there until the request
// finishes. The GPU reads a prompt once, when it admits the request into a lane, and checks
// only that it lies inside the arena.
//
// Ownership: every field has exactly one writer.
//   engine host code : header geometry, engine_state, shutdown
//   frontend worker w: doorbell[w]; SlotRequest of the slots in its range; its arena range
//   GPU (scheduler)  : header counters; SlotOutput of every slot
// A payload is written first and published by a sequence word written last (release); the
// reader loads the word (acquire) and only then the payload.
//
// Slot state machine. The state is derived from three sequence words with one writer each
// (request.seq by the frontend; output.started_seq and output.finished_seq by the GPU), so no
// field is ever written by both sides and a reused slot cannot be confused with its previous
// request (ABA): request n of a slot carries seq = n (n = 1, 2, ...).
//
//   FREE      : finished_seq == seq, and the frontend has read all output of request seq
//               (only the frontend knows this, and only it moves the slot on).
//   SUBMITTED : frontend wrote the request payload, reset consumed/cancel, then seq = n
//               (release), then bumped its doorbell.       started_seq < n
//   RUNNING   : GPU took the request (admitted or queued): started_seq = n. Output entries are
//               written, then `count` is published (release). The GPU may stall a request whose
//               ring is full (count - consumed == ring_capacity) until the frontend reads.
//   FINISHED  : GPU wrote count, finish_reason, error_code, then finished_seq = n (release).
//   -> FREE   : the frontend reads the remaining entries; it may then write request n + 1.
//
// Cancellation: the frontend writes cancel = n and bumps its doorbell; the GPU finishes the
// request with FINISH_CANCELLED at its next step (or when it would be admitted).
//
// Doorbells are hints: the GPU loads them relaxed (early in its kernels, to hide the PCIe
// round trip) and, when one moved, issues an acquire fence before it reads slots or cancel
// words; so a doorbell bump must follow (release) what it announces.
//
// The GPU trusts nothing here: every request field is validated on the device and a bad
// request is FINISHED with FINISH_ERROR and an error code (see BlinkError), touching nothing
// else. A frontend may also change a request while the device reads it, so the device loads
// each field once into its own copy (BlinkRequestCopy, scheduler.h), validates that copy and
// uses only it; each prompt token is loaded once, checked and kept. A request changed
// meanwhile is then just another request, checked like any other.
#pragma once
#include <stdint.h>

#define BLINK_MAGIC 0x31424d4b4e494c42ULL  // "BLINKMB1" little-endian
#define BLINK_VERSION 5u
#define BLINK_MAX_WORKERS 64
#define BLINK_MAX_STOP_IDS 16
#define BLINK_HEADER_BYTES 1024
#define BLINK_REQUEST_FIXED_BYTES 192
#define BLINK_OUTPUT_FIXED_BYTES 64

// Request flags.
#define BLINK_FLAG_IGNORE_EOS 1u
#define BLINK_FLAG_LOGPROBS 2u
// Prompt logprobs: the output's first prompt_len - 1 entries are the prompt tokens 1.. with
// their logprobs (and top-n, num_logprobs of them) given the tokens before them; generated
// tokens follow. Needs ring_capacity >= 2 (prompt chunks are cut to what the ring holds).
#define BLINK_FLAG_PROMPT_LOGPROBS 4u
#define BLINK_FLAGS_KNOWN (BLINK_FLAG_IGNORE_EOS | BLINK_FLAG_LOGPROBS | BLINK_FLAG_PROMPT_LOGPROBS)

// Engine states (header.engine_state).
enum BlinkEngineState : uint32_t {
  BLINK_ENGINE_STARTING = 0,
  BLINK_ENGINE_READY = 1,
  BLINK_ENGINE_STOPPED = 2,
};

enum BlinkFinish : uint32_t {
  BLINK_FINISH_NONE = 0,
  BLINK_FINISH_STOP = 1,       // EOS or a stop token id
  BLINK_FINISH_LENGTH = 2,     // max_tokens or the context length reached
  BLINK_FINISH_CANCELLED = 3,  // cancel word set by the frontend
  BLINK_FINISH_ERROR = 4,      // the request was invalid: see error_code
};

enum BlinkError : uint32_t {
  BLINK_ERR_NONE = 0,
  BLINK_ERR_PROMPT_LENGTH = 1,  // prompt_len == 0, > max_prompt or >= max_context
  BLINK_ERR_TOKEN_ID = 2,       // a prompt token id outside [0, vocab_size)
  BLINK_ERR_MAX_TOKENS = 3,     // max_tokens == 0
  BLINK_ERR_TEMPERATURE = 4,    // not finite or negative
  BLINK_ERR_TOP_P = 5,          // not in (0, 1]
  BLINK_ERR_TOP_K = 6,          // negative
  BLINK_ERR_STOP_IDS = 7,       // more than BLINK_MAX_STOP_IDS or an id outside the vocabulary
  BLINK_ERR_LOGPROBS = 8,       // num_logprobs > max_top_logprobs
  BLINK_ERR_FLAGS = 9,          // unknown flag bits
  BLINK_ERR_PROMPT_OFFSET = 10, // prompt_offset + prompt_len past the end of the arena
};

struct BlinkMailboxHeader {
  // Geometry: written once by the engine before engine_state = READY.
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint32_t num_slots;
  uint32_t max_prompt;        // prompt token capacity of a slot
  uint32_t ring_capacity;     // output entries of a slot's ring
  uint32_t max_top_logprobs;  // top-n alternatives stored per output entry
  uint32_t request_bytes;     // SlotRequest incl. prompt, 64-byte aligned
  uint32_t output_bytes;      // SlotOutput incl. ring, 64-byte aligned
  uint64_t total_bytes;
  uint32_t vocab_size;
  uint32_t max_context;
  uint32_t num_workers;       // frontend workers; worker w owns slots [w*n/W, (w+1)*n/W)
  uint32_t eos_id;            // informational for frontends
  // Engine control: written by the engine host code.
  uint32_t engine_state;      // BlinkEngineState
  uint32_t shutdown;          // nonzero: the device loop exits at its next iteration
  uint32_t arena_tokens;      // geometry: int32 prompt tokens of the arena after the slots
  uint8_t pad0[128 - 76];
  // Frontend doorbells: worker w increments doorbell[w] after every submit and cancel.
  uint64_t doorbell[BLINK_MAX_WORKERS];
  // Counters published by the GPU after every schedule and commit.
  uint64_t loop_iterations;
  uint64_t steps;               // steps that ran the model
  uint64_t tokens_generated;
  uint64_t prompt_tokens;       // prefill tokens computed (recompute included)
  uint64_t requests_admitted;
  uint64_t requests_finished;   // any finish reason
  uint64_t requests_errored;
  uint64_t requests_cancelled;
  uint64_t preemptions;
  uint64_t pages_in_use;
  uint64_t pages_total;
  uint64_t running;             // requests holding a lane
  uint64_t waiting;             // requests queued for a lane
  uint64_t last_step_tokens;
  uint64_t schedule_ns;         // device time spent in the scheduler kernels (CUDA only):
  uint64_t commit_ns;           // with loop_iterations, what a step costs outside the model
  uint64_t prefix_cache_queries;  // prompt tokens admitted with prefix caching on
  uint64_t prefix_cache_hits;     // of those, tokens whose K/V came from cached pages
  // schedule passes that scanned the slots for new requests (a doorbell moved, or a rescan)
  uint64_t slot_scans;
  // schedule_ns by phase (CUDA only; docs/ARCHITECTURE.md, "The mailbox contract"): the
  // doorbells' round trip and slot scan, lane checks and releases, decode rows, prefill and
  // admission (prompt copies), the batch's arrays and idle polling
  uint64_t sched_scan_ns;
  uint64_t sched_poll_ns;
  uint64_t sched_decode_ns;
  uint64_t sched_admit_ns;
  uint64_t sched_batch_ns;
  // rows the steps ran: the sum of their buckets' sizes, padding rows included
  // (docs/ARCHITECTURE.md, "Step buckets and their padding")
  uint64_t step_rows;
  uint8_t pad1[BLINK_HEADER_BYTES - 640 - 25 * 8];
};

struct BlinkSlotRequest {
  uint32_t seq;          // publication word: written last (release)
  uint32_t cancel;       // = seq to cancel request seq
  uint32_t consumed;     // output entries the frontend has read (flow control)
  uint32_t prompt_len;
  uint64_t request_id;   // opaque to the GPU
  uint64_t seed;
  uint32_t max_tokens;
  float temperature;     // 0 = greedy
  float top_p;           // (0, 1]
  int32_t top_k;         // 0 = disabled
  uint32_t num_logprobs; // top-n alternatives per token (with BLINK_FLAG_LOGPROBS)
  uint32_t flags;
  uint32_t num_stop_ids;
  uint32_t prompt_offset;  // first prompt token's index in the arena (of its worker's range)
  int64_t arrival_ns;    // frontend clock, informational
  int32_t stop_ids[BLINK_MAX_STOP_IDS];
};

struct BlinkSlotOutput {
  uint32_t started_seq;   // = seq once the GPU took the request
  uint32_t finished_seq;  // = seq once finished (written after count and finish_reason)
  uint32_t count;         // output entries produced for started_seq (published after entries)
  uint32_t finish_reason; // BlinkFinish
  uint32_t error_code;    // BlinkError
  uint32_t prompt_len;    // echo of the validated prompt length
  uint32_t preemptions;   // times this request was preempted and recomputed
  uint32_t admit_ticket;  // 1 + admission order among all requests; 0 = not admitted
  uint64_t token_ns;      // device clock (ns) when entry count-1 was written; for latency
  uint32_t cached_tokens; // prompt tokens whose K/V came from the prefix cache (at admission)
  uint32_t pad0;
  // Device clock (ns, the clock of token_ns) when the device took the request from its slot
  // (with started_seq) and when it wrote entry 0 (0 until then): the device's own part of
  // TTFT and, with token_ns, its time per output token (docs/PERFORMANCE.md, "Frontend cores").
  uint64_t taken_ns;
  uint64_t first_ns;
  // Entry e of the request lives at ring index e % ring_capacity:
  //   int32_t tokens[ring]; float logprobs[ring];
  //   int32_t top_ids[ring][max_top_logprobs]; float top_logprobs[ring][max_top_logprobs]
};

#ifdef __cplusplus
static_assert(sizeof(BlinkMailboxHeader) == BLINK_HEADER_BYTES, "header size");
static_assert(sizeof(BlinkSlotRequest) <= BLINK_REQUEST_FIXED_BYTES, "request fixed size");
static_assert(sizeof(BlinkSlotOutput) == BLINK_OUTPUT_FIXED_BYTES, "output fixed size");
static_assert(__builtin_offsetof(BlinkMailboxHeader, doorbell) == 128, "doorbell offset");
static_assert(__builtin_offsetof(BlinkMailboxHeader, loop_iterations) == 640, "counters");
#endif

// Geometry -> byte offsets. Used by host and device code alike.
#ifdef __CUDACC__
#define BLINK_HD __host__ __device__ __forceinline__
#else
#define BLINK_HD inline
#endif

BLINK_HD uint64_t blink_align64(uint64_t x) { return (x + 63) & ~uint64_t(63); }

struct BlinkGeometry {
  uint32_t num_slots, max_prompt, ring_capacity, max_top_logprobs, arena_tokens;

  BLINK_HD uint64_t request_bytes() const { return BLINK_REQUEST_FIXED_BYTES; }
  BLINK_HD uint64_t output_bytes() const {
    return blink_align64(BLINK_OUTPUT_FIXED_BYTES +
                         uint64_t(ring_capacity) * (8ull + 8ull * max_top_logprobs));
  }
  BLINK_HD uint64_t slot_bytes() const { return request_bytes() + output_bytes(); }
  BLINK_HD uint64_t arena_offset() const {
    return BLINK_HEADER_BYTES + uint64_t(num_slots) * slot_bytes();
  }
  BLINK_HD uint64_t total_bytes() const {
    return arena_offset() + blink_align64(4ull * arena_tokens);
  }
  BLINK_HD uint64_t request_offset(uint32_t slot) const {
    return BLINK_HEADER_BYTES + uint64_t(slot) * slot_bytes();
  }
  BLINK_HD uint64_t output_offset(uint32_t slot) const {
    return request_offset(slot) + request_bytes();
  }
  BLINK_HD uint64_t out_tokens_offset(uint32_t slot) const {
    return output_offset(slot) + BLINK_OUTPUT_FIXED_BYTES;
  }
  BLINK_HD uint64_t out_logprobs_offset(uint32_t slot) const {
    return out_tokens_offset(slot) + 4ull * ring_capacity;
  }
  BLINK_HD uint64_t out_top_ids_offset(uint32_t slot) const {
    return out_logprobs_offset(slot) + 4ull * ring_capacity;
  }
  BLINK_HD uint64_t out_top_logprobs_offset(uint32_t slot) const {
    return out_top_ids_offset(slot) + 4ull * ring_capacity * max_top_logprobs;
  }
};
