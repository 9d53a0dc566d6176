// The scheduler core driven through its C API (capi.cc, what Python loads through ctypes) on
// host buffers, with a frontend that speaks the mailbox protocol (mailbox.h) and a fake paged
// model. Built and run by Bazel: `bazel test //ffi:scheduler_test`.
//
// The fake model stores every token it is given at (page, offset) through the page table, the
// way the real paged KV cache does, and samples for a row a hash of the whole sequence read
// back through the page table. A request's expected output therefore depends on its prompt
// alone (oracle() computes it), and a lost, shared or stale page, a skipped or repeated
// position, or a wrong recompute after preemption shows up as a wrong token.
//
// Workloads: admission (more requests than lanes and slots: FCFS tickets, slot reuse, output
// flow control), chunked prefill (a prompt longer than the step budget, mixed with decode),
// preemption (page pressure, recompute), bad slots (each invalid field rejected with its error
// code, the good requests beside them untouched), cancellation, and config checks. After every
// step the library's own invariant check (blink_state_check) must pass.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mailbox.h"
#include "sched_state.h"

// The C API (ffi/capi.cc). The config is BlinkSchedConfig as an int64 array.
extern "C" {
const char* blink_config_check(const int64_t* cfg);
int64_t blink_state_words(const int64_t* cfg);
int64_t blink_batch_words_c(const int64_t* cfg);
void blink_state_init(const int64_t* cfg, int32_t* state);
void blink_host_schedule(const int64_t* cfg, int32_t* state, int32_t* history,
                         int32_t* page_table, int32_t* batch);
void blink_host_commit(const int64_t* cfg, int32_t* state, int32_t* history, int32_t* page_table,
                       int32_t* batch, const int32_t* sampled, const float* logprobs,
                       const int32_t* top_ids, const float* top_lps, const float* row_lps,
                       const int32_t* row_top_ids, const float* row_top_lps, int64_t top_cols);
const char* blink_state_check(const int64_t* cfg, int32_t* state, int32_t* page_table);
void blink_state_summary(const int64_t* cfg, const int32_t* state, int64_t* out16);
void blink_geometry_offsets(const uint32_t* g5, uint32_t slot, uint64_t* out8);
}

namespace {

int g_failures = 0;
int g_checks = 0;
const char* g_case = "";

#define CHECK(cond, ...)                                                          \
  do {                                                                            \
    ++g_checks;                                                                   \
    if (!(cond)) {                                                                \
      ++g_failures;                                                               \
      std::fprintf(stderr, "%s:%d: [%s] CHECK(%s) failed: ", __FILE__, __LINE__, \
                   g_case, #cond);                                                \
      std::fprintf(stderr, __VA_ARGS__);                                          \
      std::fputc('\n', stderr);                                                   \
    }                                                                             \
  } while (0)

// ---- the fake model -------------------------------------------------------------------------

uint64_t mix(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 29;
  return h;
}

// The token the fake model samples after `seq` (FNV-1a over the ids, then mixed).
int32_t next_token(const std::vector<int32_t>& seq, int64_t vocab) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int32_t t : seq) h = (h ^ uint64_t(uint32_t(t))) * 0x100000001b3ULL;
  return int32_t(mix(h) % uint64_t(vocab));
}
float token_logprob(int32_t t) { return -0.25f - float(t % 5); }
int32_t top_id(int32_t t, int j, int64_t vocab) { return int32_t((t + 1 + j) % vocab); }

struct Job {
  int submit_step = 0;
  std::vector<int32_t> prompt;
  uint32_t max_tokens = 8;
  bool ignore_eos = true;
  uint32_t num_logprobs = 0;  // with BLINK_FLAG_LOGPROBS when > 0
  std::vector<int32_t> stop_ids;
  int cancel_after = -1;  // steps after submission
  // Forges an invalid request after the normal encoding; expect_error is what the device says.
  std::function<void(BlinkSlotRequest&, int32_t* prompt)> corrupt;
  uint32_t expect_error = BLINK_ERR_NONE;
};

struct Result {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<int32_t>> top_ids;
  uint32_t finish = BLINK_FINISH_NONE, error = BLINK_ERR_NONE, admit_ticket = 0, preemptions = 0;
  int slot = -1, submitted = -1, first_token_seen = -1, finishes = 0;
  bool cancel_sent = false;
};

// What the request must produce: generated tokens and the finish reason.
std::vector<int32_t> oracle(const Job& j, const BlinkSchedConfig& c, uint32_t* why) {
  std::vector<int32_t> seq = j.prompt, gen;
  for (;;) {
    int32_t t = next_token(seq, c.vocab_size);
    gen.push_back(t);
    seq.push_back(t);
    bool eos = false;
    for (int i = 0; i < BLINK_MAX_EOS; ++i) eos |= c.eos(i) >= 0 && t == c.eos(i);
    bool stop = false;
    for (int32_t s : j.stop_ids) stop |= t == s;
    if ((eos && !j.ignore_eos) || stop) {
      *why = BLINK_FINISH_STOP;
      return gen;
    }
    if (gen.size() >= j.max_tokens || int64_t(seq.size()) >= c.max_context) {
      *why = BLINK_FINISH_LENGTH;
      return gen;
    }
  }
}

struct Params {
  int64_t num_slots = 8, max_prompt = 40, ring_capacity = 4, max_top_logprobs = 2;
  int64_t vocab_size = 50, max_seqs = 4, max_context = 48, page_size = 4, num_pages = 16;
  std::vector<int64_t> buckets = {4, 8, 16};
  int64_t eos = 1;
};

struct StepInfo {
  int32_t num_rows, num_decode, num_samples;
  int64_t running, waiting;
};

struct Summary {
  int64_t free_pages, running, waiting, free_lanes, steps, tokens_generated, prompt_tokens,
      admitted, finished, errored, cancelled, preemptions, loop_iterations;
};

// One scheduler with its mailbox, a frontend (one worker) and the fake model.
class Harness {
 public:
  explicit Harness(const Params& p) {
    std::memset(&c_, 0, sizeof c_);
    c_.num_slots = p.num_slots;
    c_.max_prompt = p.max_prompt;
    c_.ring_capacity = p.ring_capacity;
    c_.max_top_logprobs = p.max_top_logprobs;
    c_.vocab_size = p.vocab_size;
    c_.max_seqs = p.max_seqs;
    c_.max_context = p.max_context;
    c_.page_size = p.page_size;
    c_.num_pages = p.num_pages;
    c_.num_buckets = int64_t(p.buckets.size());
    int64_t* b = &c_.bucket0;
    for (size_t i = 0; i < p.buckets.size(); ++i) b[i] = p.buckets[i];
    c_.token_budget = p.buckets.back();
    c_.eos0 = p.eos;
    c_.eos1 = c_.eos2 = c_.eos3 = -1;
    c_.idle_poll_us = 0;
    c_.arena_tokens = p.num_slots * p.max_prompt;  // slot s's prompt at s * max_prompt
    g_ = c_.geometry();
    mem_.assign(g_.total_bytes() / 8 + 8, 0);
    base_ = reinterpret_cast<uint8_t*>(mem_.data());
    c_.mailbox = int64_t(reinterpret_cast<uintptr_t>(base_));
    std::string msg = blink_config_check(words());
    CHECK(msg.empty(), "config rejected: %s", msg.c_str());

    BlinkMailboxHeader* h = header();
    h->magic = BLINK_MAGIC;
    h->version = BLINK_VERSION;
    h->header_bytes = BLINK_HEADER_BYTES;
    h->num_slots = g_.num_slots;
    h->max_prompt = g_.max_prompt;
    h->ring_capacity = g_.ring_capacity;
    h->max_top_logprobs = g_.max_top_logprobs;
    h->request_bytes = uint32_t(g_.request_bytes());
    h->output_bytes = uint32_t(g_.output_bytes());
    h->total_bytes = g_.total_bytes();
    h->vocab_size = uint32_t(c_.vocab_size);
    h->max_context = uint32_t(c_.max_context);
    h->num_workers = 1;
    h->arena_tokens = g_.arena_tokens;
    h->eos_id = uint32_t(p.eos);
    h->engine_state = BLINK_ENGINE_READY;

    state_.assign(blink_state_words(words()), 0);
    blink_state_init(words(), state_.data());
    history_.assign(c_.max_seqs * c_.max_context, 0);
    page_table_.assign(c_.max_seqs * c_.max_pages_per_seq(), 0);
    batch_.assign(blink_batch_words_c(words()), 0);
    kv_.assign(c_.num_pages * c_.page_size, -1);
    seq_.assign(c_.num_slots, 0);
    read_.assign(c_.num_slots, 0);
    for (int64_t s = c_.num_slots - 1; s >= 0; --s) free_.push_back(int(s));
  }

  const BlinkSchedConfig& config() const { return c_; }
  const int64_t* words() const { return reinterpret_cast<const int64_t*>(&c_); }
  BlinkMailboxHeader* header() { return reinterpret_cast<BlinkMailboxHeader*>(base_); }
  BlinkSlotRequest* request(int s) {
    return reinterpret_cast<BlinkSlotRequest*>(base_ + g_.request_offset(s));
  }
  int32_t* prompt(int s) {
    return reinterpret_cast<int32_t*>(base_ + g_.arena_offset()) + int64_t(s) * c_.max_prompt;
  }
  BlinkSlotOutput* output(int s) {
    return reinterpret_cast<BlinkSlotOutput*>(base_ + g_.output_offset(s));
  }
  const int32_t* batch() const { return batch_.data(); }

  Summary summary() {
    int64_t o[16];
    blink_state_summary(words(), state_.data(), o);
    return Summary{o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11], o[12]};
  }

  // Frontend: payload first, then the sequence word, then the doorbell.
  int submit(const Job& j) {
    int s = free_.back();
    free_.pop_back();
    uint32_t seq = ++seq_[s];
    read_[s] = 0;
    BlinkSlotRequest r;
    std::memset(&r, 0, sizeof r);
    r.seq = request(s)->seq;  // unchanged until the payload is in place
    r.prompt_len = uint32_t(j.prompt.size());
    r.request_id = uint64_t(s) << 32 | seq;
    r.seed = 1234 + s;
    r.max_tokens = j.max_tokens;
    r.temperature = 0.f;
    r.top_p = 1.f;
    r.top_k = 0;
    r.num_logprobs = j.num_logprobs;
    r.flags = (j.ignore_eos ? BLINK_FLAG_IGNORE_EOS : 0u) |
              (j.num_logprobs ? BLINK_FLAG_LOGPROBS : 0u);
    r.num_stop_ids = uint32_t(j.stop_ids.size());
    r.prompt_offset = uint32_t(int64_t(s) * c_.max_prompt);
    for (size_t i = 0; i < j.stop_ids.size() && i < BLINK_MAX_STOP_IDS; ++i)
      r.stop_ids[i] = j.stop_ids[i];
    size_t n = j.prompt.size() < size_t(c_.max_prompt) ? j.prompt.size() : size_t(c_.max_prompt);
    std::memcpy(prompt(s), j.prompt.data(), n * sizeof(int32_t));
    if (j.corrupt) j.corrupt(r, prompt(s));
    std::memcpy(request(s), &r, sizeof r);
    __atomic_store_n(&request(s)->seq, seq, __ATOMIC_RELEASE);
    ring_doorbell();
    return s;
  }

  void cancel(int s) {
    __atomic_store_n(&request(s)->cancel, seq_[s], __ATOMIC_RELEASE);
    ring_doorbell();
  }

  // Reads the new entries of slot s into r (marking them consumed); true once it finished.
  bool poll(int s, Result& r, int step) {
    BlinkSlotOutput* o = output(s);
    uint32_t seq = seq_[s];
    if (__atomic_load_n(&o->started_seq, __ATOMIC_ACQUIRE) != seq) return false;
    bool finished = __atomic_load_n(&o->finished_seq, __ATOMIC_ACQUIRE) == seq;
    uint32_t count = __atomic_load_n(&o->count, __ATOMIC_ACQUIRE);
    CHECK(count >= read_[s], "slot %d: count went back from %u to %u", s, read_[s], count);
    CHECK(count - read_[s] <= uint32_t(c_.ring_capacity),
          "slot %d: %u unread entries overflow a ring of %lld", s, count - read_[s],
          (long long)c_.ring_capacity);
    if (count - read_[s] > max_unread_) max_unread_ = count - read_[s];
    const uint8_t* ring = base_;
    const int32_t* tok = reinterpret_cast<const int32_t*>(ring + g_.out_tokens_offset(s));
    const float* lp = reinterpret_cast<const float*>(ring + g_.out_logprobs_offset(s));
    const int32_t* top = reinterpret_cast<const int32_t*>(ring + g_.out_top_ids_offset(s));
    for (uint32_t e = read_[s]; e < count; ++e) {
      uint32_t i = e % uint32_t(c_.ring_capacity);
      if (r.first_token_seen < 0) r.first_token_seen = step;
      r.tokens.push_back(tok[i]);
      r.logprobs.push_back(lp[i]);
      r.top_ids.emplace_back(top + i * c_.max_top_logprobs, top + (i + 1) * c_.max_top_logprobs);
    }
    if (count != read_[s]) {
      read_[s] = count;
      __atomic_store_n(&request(s)->consumed, count, __ATOMIC_RELEASE);
    }
    if (finished) {
      r.finishes++;
      r.finish = o->finish_reason;
      r.error = o->error_code;
      r.admit_ticket = o->admit_ticket;
      r.preemptions = o->preemptions;
      free_.insert(free_.begin(), s);  // least recently used slot next
    }
    return finished;
  }

  bool has_free_slot() const { return !free_.empty(); }
  // The most entries a poll found unread (= ring_capacity: some ring was full).
  uint32_t max_unread() const { return max_unread_; }

  // Device: schedule, the fake model, commit; then the state invariants.
  StepInfo step(int step_no) {
    blink_host_schedule(words(), state_.data(), history_.data(), page_table_.data(),
                        batch_.data());
    const int32_t* w = batch_.data();
    StepInfo info{w[B_NUM_ROWS], w[B_NUM_DECODE], w[B_NUM_SAMPLES], 0, 0};
    CHECK(w[B_NUM_ROWS] <= c_.token_budget && w[B_NUM_ROWS] <= w[B_BUCKET_SIZE],
          "step %d: %d rows in a bucket of %d (budget %lld)", step_no, w[B_NUM_ROWS],
          w[B_BUCKET_SIZE], (long long)c_.token_budget);
    CHECK(w[B_NUM_SAMPLES] <= c_.max_seqs, "step %d: %d samples", step_no, w[B_NUM_SAMPLES]);
    model();
    blink_host_commit(words(), state_.data(), history_.data(), page_table_.data(), batch_.data(),
                      sampled_.data(), lps_.data(), top_ids_.data(), top_lps_.data(),
                      row_lps_.data(), row_top_ids_.data(), row_top_lps_.data(),
                      c_.max_top_logprobs);
    std::string msg = blink_state_check(words(), state_.data(), page_table_.data());
    CHECK(msg.empty(), "step %d: state invariant broken: %s", step_no, msg.c_str());
    Summary s = summary();
    info.running = s.running;
    info.waiting = s.waiting;
    CHECK(s.running <= c_.max_seqs, "step %d: %lld running on %lld lanes", step_no,
          (long long)s.running, (long long)c_.max_seqs);
    return info;
  }

 private:
  void ring_doorbell() {
    __atomic_store_n(&header()->doorbell[0], ++doorbell_, __ATOMIC_RELEASE);
  }

  const int32_t* tok_array(int a) const { return batch_.data() + B_HEADER_WORDS + a * c_.token_budget; }
  const int32_t* sample_array(int a) const {
    return batch_.data() + B_HEADER_WORDS + BT_NUM * c_.token_budget + a * c_.max_seqs;
  }
  int32_t& kv(int32_t lane, int32_t pos) {
    int32_t page = page_table_[lane * c_.max_pages_per_seq() + pos / c_.page_size];
    return kv_[page * c_.page_size + pos % c_.page_size];
  }

  void model() {
    const int64_t k = c_.max_top_logprobs, seqs = c_.max_seqs, budget = c_.token_budget;
    sampled_.assign(seqs, 0);
    lps_.assign(seqs, 0.f);
    top_ids_.assign(seqs * k, 0);
    top_lps_.assign(seqs * k, 0.f);
    row_lps_.assign(budget, 0.f);
    row_top_ids_.assign(budget * k, 0);
    row_top_lps_.assign(budget * k, 0.f);
    const int32_t *tokens = tok_array(BT_TOKENS), *pos = tok_array(BT_POSITIONS),
                  *sid = tok_array(BT_SEQ_IDS);
    const int32_t rows = batch_[B_BUCKET_SIZE];
    for (int32_t r = 0; r < rows; ++r) {
      if (sid[r] < 0) continue;
      CHECK(sid[r] < seqs && pos[r] >= 0 && pos[r] < c_.max_context, "row %d: lane %d pos %d", r,
            sid[r], pos[r]);
      CHECK(tokens[r] >= 0 && tokens[r] < c_.vocab_size, "row %d: token %d", r, tokens[r]);
      kv(sid[r], pos[r]) = tokens[r];
    }
    const int32_t *srow = sample_array(BS_ROWS), *slane = sample_array(BS_LANES),
                  *spos = sample_array(BS_POSITION);
    for (int32_t i = 0; i < batch_[B_NUM_SAMPLES]; ++i) {
      int32_t lane = slane[i], row = srow[i];
      if (lane < 0) continue;
      CHECK(row >= 0 && row < rows && sid[row] == lane, "sample %d: row %d is not lane %d's", i,
            row, lane);
      CHECK(spos[i] == pos[row] + 1, "sample %d: position %d after row position %d", i, spos[i],
            pos[row]);
      std::vector<int32_t> seq;
      for (int32_t p = 0; p <= pos[row]; ++p) seq.push_back(kv(lane, p));
      int32_t t = next_token(seq, c_.vocab_size);
      sampled_[i] = t;
      lps_[i] = token_logprob(t);
      for (int64_t j = 0; j < k; ++j) {
        top_ids_[i * k + j] = top_id(t, int(j), c_.vocab_size);
        top_lps_[i * k + j] = lps_[i] - float(j + 1);
      }
    }
  }

  BlinkSchedConfig c_;
  BlinkGeometry g_;
  std::vector<uint64_t> mem_;
  uint8_t* base_;
  std::vector<int32_t> state_, history_, page_table_, batch_, kv_;
  std::vector<int32_t> sampled_, top_ids_, row_top_ids_;
  std::vector<float> lps_, top_lps_, row_lps_, row_top_lps_;
  std::vector<uint32_t> seq_, read_;
  std::vector<int> free_;
  uint64_t doorbell_ = 0;
  uint32_t max_unread_ = 0;
};

struct Run {
  std::vector<Result> results;
  std::vector<StepInfo> steps;
  Summary summary;
  BlinkMailboxHeader header;
};

// Runs the jobs to completion. The frontend reads the outputs at every `read_every`-th step
// only (flow control: a full ring stalls its request).
Run run(Harness& h, const std::vector<Job>& jobs, int read_every = 1, int max_steps = 2000) {
  Run out;
  out.results.assign(jobs.size(), Result{});
  std::vector<size_t> pending;
  for (size_t i = 0; i < jobs.size(); ++i) pending.push_back(i);
  std::vector<std::pair<int, size_t>> active;  // (slot, job)
  int step = 0;
  for (; step < max_steps; ++step) {
    while (!pending.empty() && jobs[pending.front()].submit_step <= step && h.has_free_slot()) {
      size_t i = pending.front();
      pending.erase(pending.begin());
      Result& r = out.results[i];
      r.slot = h.submit(jobs[i]);
      r.submitted = step;
      active.emplace_back(r.slot, i);
    }
    for (size_t a = 0; a < active.size();) {
      auto [slot, i] = active[a];
      Result& r = out.results[i];
      const Job& j = jobs[i];
      if (j.cancel_after >= 0 && !r.cancel_sent && step >= r.submitted + j.cancel_after) {
        h.cancel(slot);
        r.cancel_sent = true;
      }
      if (step % read_every == 0 && h.poll(slot, r, step)) {
        active.erase(active.begin() + a);
        continue;
      }
      ++a;
    }
    if (pending.empty() && active.empty()) break;
    out.steps.push_back(h.step(step));
  }
  CHECK(step < max_steps, "the workload did not finish in %d steps", max_steps);
  out.summary = h.summary();
  std::memcpy(&out.header, h.header(), sizeof out.header);
  return out;
}

// What every finished run must satisfy.
void check_run(Harness& h, const std::vector<Job>& jobs, const Run& run) {
  const BlinkSchedConfig& c = h.config();
  int64_t errored = 0, cancelled = 0, tokens = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    const Result& r = run.results[i];
    CHECK(r.finishes == 1, "job %zu finished %d times", i, r.finishes);
    tokens += int64_t(r.tokens.size());
    if (j.expect_error != BLINK_ERR_NONE) {
      CHECK(r.finish == BLINK_FINISH_ERROR && r.error == j.expect_error,
            "job %zu: finish %u error %u, want error %u", i, r.finish, r.error, j.expect_error);
      CHECK(r.tokens.empty(), "bad job %zu produced %zu tokens", i, r.tokens.size());
      ++errored;
      continue;
    }
    CHECK(r.error == BLINK_ERR_NONE, "good job %zu: error %u", i, r.error);
    uint32_t why = 0;
    std::vector<int32_t> want = oracle(j, c, &why);
    if (r.finish == BLINK_FINISH_CANCELLED) {
      CHECK(j.cancel_after >= 0, "job %zu cancelled without a cancel", i);
      CHECK(r.tokens.size() <= want.size() &&
                std::equal(r.tokens.begin(), r.tokens.end(), want.begin()),
            "job %zu: cancelled output diverges from the oracle", i);
      ++cancelled;
    } else {
      CHECK(r.finish == why, "job %zu: finish %u, oracle %u", i, r.finish, why);
      CHECK(r.tokens == want, "job %zu: %zu tokens differ from the oracle's %zu", i,
            r.tokens.size(), want.size());
    }
    if (j.num_logprobs) {
      for (size_t e = 0; e < r.tokens.size(); ++e) {
        CHECK(r.logprobs[e] == token_logprob(r.tokens[e]), "job %zu entry %zu: logprob %f", i,
              e, r.logprobs[e]);
        for (uint32_t q = 0; q < j.num_logprobs; ++q)
          CHECK(r.top_ids[e][q] == top_id(r.tokens[e], int(q), c.vocab_size),
                "job %zu entry %zu: top id %u is %d", i, e, q, r.top_ids[e][q]);
      }
    }
  }
  // First come, first served: tickets follow (submission step, slot) among the admitted.
  for (size_t a = 0; a < jobs.size(); ++a)
    for (size_t b = 0; b < jobs.size(); ++b) {
      const Result &x = run.results[a], &y = run.results[b];
      if (x.admit_ticket && y.admit_ticket && x.submitted < y.submitted)
        CHECK(x.admit_ticket < y.admit_ticket, "job %zu (step %d) admitted after job %zu (step %d)",
              a, x.submitted, b, y.submitted);
    }
  const Summary& s = run.summary;
  const BlinkMailboxHeader& hd = run.header;
  CHECK(s.finished == int64_t(jobs.size()) && hd.requests_finished == jobs.size(),
        "finished: state %lld, header %llu, jobs %zu", (long long)s.finished,
        (unsigned long long)hd.requests_finished, jobs.size());
  CHECK(s.errored == errored && int64_t(hd.requests_errored) == errored, "errored %lld / %lld",
        (long long)s.errored, (long long)errored);
  CHECK(s.cancelled == cancelled && int64_t(hd.requests_cancelled) == cancelled,
        "cancelled %lld / %lld", (long long)s.cancelled, (long long)cancelled);
  CHECK(s.tokens_generated == tokens && int64_t(hd.tokens_generated) == tokens,
        "tokens: state %lld, header %llu, frontend %lld", (long long)s.tokens_generated,
        (unsigned long long)hd.tokens_generated, (long long)tokens);
  CHECK(s.free_pages == c.num_pages && hd.pages_in_use == 0, "pages leaked: %lld free of %lld",
        (long long)s.free_pages, (long long)c.num_pages);
  CHECK(s.free_lanes == c.max_seqs && s.running == 0 && s.waiting == 0 && hd.running == 0 &&
            hd.waiting == 0,
        "lanes left busy: %lld free, %lld running, %lld waiting", (long long)s.free_lanes,
        (long long)s.running, (long long)s.waiting);
  CHECK(s.preemptions == int64_t(hd.preemptions), "preemptions: state %lld header %llu",
        (long long)s.preemptions, (unsigned long long)hd.preemptions);
}

std::vector<int32_t> iota(int n, int32_t first, int64_t vocab) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(int32_t((first + 3 * i) % vocab));
  return v;
}

// ---- workloads ------------------------------------------------------------------------------

void test_admission() {
  g_case = "admission";
  Params p;
  p.num_slots = 4;  // fewer slots than requests: slots are reused (seq 2, 3, ...)
  p.max_seqs = 2;   // fewer lanes than slots: requests wait for a lane
  p.num_pages = 24;
  Harness h(p);
  std::vector<Job> jobs;
  for (int i = 0; i < 10; ++i) {
    Job j;
    j.submit_step = i < 6 ? 0 : 3 * i;
    j.prompt = iota(2 + i % 5, 7 + i, p.vocab_size);
    j.max_tokens = 3 + uint32_t(i % 4) * 3;
    j.ignore_eos = i % 3 != 0;  // some stop at the EOS id when the model samples it
    j.num_logprobs = i % 2 ? 2 : 0;
    if (i == 4) j.stop_ids = {next_token(j.prompt, p.vocab_size)};  // stops at its first token
    jobs.push_back(j);
  }
  Run r = run(h, jobs, /*read_every=*/5);  // rings of 4 fill between reads: flow control
  check_run(h, jobs, r);
  CHECK(h.max_unread() == uint32_t(p.ring_capacity), "no ring filled up (at most %u unread)",
        h.max_unread());
  int max_running = 0, max_waiting = 0;
  for (const StepInfo& s : r.steps) {
    max_running = s.running > max_running ? int(s.running) : max_running;
    max_waiting = s.waiting > max_waiting ? int(s.waiting) : max_waiting;
  }
  CHECK(max_running == 2, "both lanes should have been busy at some step, saw %d", max_running);
  CHECK(max_waiting >= 1, "requests should have waited for a lane");
  CHECK(r.summary.admitted == 10, "admitted %lld", (long long)r.summary.admitted);
  CHECK(jobs[4].stop_ids.size() == 1 && r.results[4].finish == BLINK_FINISH_STOP &&
            r.results[4].tokens.size() == 1,
        "the stop id ends job 4 at its first token");
  std::vector<int> seen_slot(p.num_slots, 0);
  for (const Result& x : r.results) seen_slot[x.slot]++;
  int reused = 0;
  for (int n : seen_slot) reused += n > 1;
  CHECK(reused > 0, "some slot should have carried more than one request");
}

void test_chunked_prefill() {
  g_case = "chunked prefill";
  Params p;
  p.buckets = {4, 8};
  p.num_pages = 24;
  Harness h(p);
  const int long_len = 30;
  Job shortj;
  shortj.prompt = {3, 4};
  shortj.max_tokens = 16;
  Job longj;
  longj.submit_step = 2;
  longj.prompt = iota(long_len, 5, p.vocab_size);
  longj.max_tokens = 4;
  std::vector<Job> jobs = {shortj, longj};
  Run r = run(h, jobs);
  check_run(h, jobs, r);
  int mixed = 0, prefill_steps = 0;
  for (const StepInfo& s : r.steps) {
    mixed += s.num_rows == 8 && s.num_decode >= 1;
    prefill_steps += s.num_rows > s.num_decode;
  }
  CHECK(mixed >= 1, "no step mixed a decode row with a full prefill chunk");
  // 30 prompt tokens in steps of at most 8 rows: at least 4 steps before the first token.
  const Result& lr = r.results[1];
  CHECK(lr.first_token_seen >= lr.submitted + (long_len + 7) / 8,
        "first token of the long prompt seen at step %d, submitted at %d", lr.first_token_seen,
        lr.submitted);
  CHECK(prefill_steps >= (long_len + 7) / 8, "%d prefill steps", prefill_steps);
  CHECK(r.summary.prompt_tokens == long_len + 2, "prompt tokens %lld",
        (long long)r.summary.prompt_tokens);
  CHECK(r.summary.preemptions == 0, "no page pressure here, yet %lld preemptions",
        (long long)r.summary.preemptions);
}

void test_preemption() {
  g_case = "preemption";
  Params p;
  p.max_seqs = 3;
  p.max_context = 32;
  p.page_size = 4;
  p.num_pages = 8;  // one full context: three growing sequences cannot all keep their pages
  p.buckets = {8, 16};
  Harness h(p);
  std::vector<Job> jobs;
  for (int i = 0; i < 3; ++i) {
    Job j;
    j.prompt = iota(6, 11 + 5 * i, p.vocab_size);
    j.max_tokens = 22;
    jobs.push_back(j);
  }
  Run r = run(h, jobs);
  check_run(h, jobs, r);
  uint32_t per_request = 0;
  for (const Result& x : r.results) per_request += x.preemptions;
  CHECK(r.summary.preemptions > 0, "page pressure should preempt");
  CHECK(per_request == r.header.preemptions, "requests report %u preemptions, header %llu",
        per_request, (unsigned long long)r.header.preemptions);
  // Recompute: the prompt tokens counter counts the recomputed prefixes too.
  CHECK(r.summary.prompt_tokens > 18, "prompt tokens %lld with recompute",
        (long long)r.summary.prompt_tokens);
}

void test_bad_slots() {
  g_case = "bad slots";
  Params p;
  Harness h(p);
  const int64_t V = p.vocab_size;
  auto bad = [&](int step, std::function<void(BlinkSlotRequest&, int32_t*)> f, uint32_t err) {
    Job j;
    j.submit_step = step;
    j.prompt = {2, 3, 4};
    j.max_tokens = 5;
    j.corrupt = std::move(f);
    j.expect_error = err;
    return j;
  };
  Job good;
  good.prompt = {5, 6, 7};
  good.max_tokens = 6;
  Job good2 = good;
  good2.submit_step = 2;
  good2.prompt = {8, 9};
  good2.num_logprobs = 2;
  std::vector<Job> jobs = {
      good,
      bad(0, [](BlinkSlotRequest& r, int32_t*) { r.prompt_len = 0; }, BLINK_ERR_PROMPT_LENGTH),
      bad(0, [&](BlinkSlotRequest& r, int32_t*) { r.prompt_len = uint32_t(p.max_prompt) + 1; },
          BLINK_ERR_PROMPT_LENGTH),
      bad(0, [&](BlinkSlotRequest&, int32_t* pr) { pr[1] = int32_t(V); }, BLINK_ERR_TOKEN_ID),
      bad(0, [](BlinkSlotRequest&, int32_t* pr) { pr[2] = -1; }, BLINK_ERR_TOKEN_ID),
      bad(1, [](BlinkSlotRequest& r, int32_t*) { r.max_tokens = 0; }, BLINK_ERR_MAX_TOKENS),
      bad(1, [](BlinkSlotRequest& r, int32_t*) { r.temperature = std::nanf(""); },
          BLINK_ERR_TEMPERATURE),
      bad(1, [](BlinkSlotRequest& r, int32_t*) { r.top_p = 1.5f; }, BLINK_ERR_TOP_P),
      good2,
      bad(2, [](BlinkSlotRequest& r, int32_t*) { r.top_k = -3; }, BLINK_ERR_TOP_K),
      bad(2, [](BlinkSlotRequest& r, int32_t*) { r.num_stop_ids = BLINK_MAX_STOP_IDS + 1; },
          BLINK_ERR_STOP_IDS),
      bad(3, [&](BlinkSlotRequest& r, int32_t*) {
            r.num_stop_ids = 1;
            r.stop_ids[0] = int32_t(V);
          },
          BLINK_ERR_STOP_IDS),
      bad(3, [&](BlinkSlotRequest& r, int32_t*) {
            r.flags |= BLINK_FLAG_LOGPROBS;
            r.num_logprobs = uint32_t(p.max_top_logprobs) + 1;
          },
          BLINK_ERR_LOGPROBS),
      bad(3, [](BlinkSlotRequest& r, int32_t*) { r.flags = 0x80; }, BLINK_ERR_FLAGS),
      bad(4, [&](BlinkSlotRequest& r, int32_t*) {
            r.prompt_offset = uint32_t(h.config().arena_tokens) - 2;  // 3 tokens: one past
          },
          BLINK_ERR_PROMPT_OFFSET),
      bad(4, [](BlinkSlotRequest& r, int32_t*) { r.prompt_offset = 0xFFFFFFFFu; },
          BLINK_ERR_PROMPT_OFFSET),
  };
  Run r = run(h, jobs);
  check_run(h, jobs, r);
  CHECK(r.summary.errored == 14, "errored %lld", (long long)r.summary.errored);
}

void test_cancel() {
  g_case = "cancel";
  Params p;
  p.max_seqs = 1;
  Harness h(p);
  Job running;
  running.prompt = {5, 6};
  running.max_tokens = 30;
  running.cancel_after = 4;
  Job waiting = running;
  waiting.prompt = {7, 8};
  waiting.cancel_after = 1;  // still waiting for the one lane
  Job last = running;
  last.prompt = {9, 10};
  last.max_tokens = 5;
  last.cancel_after = -1;
  std::vector<Job> jobs = {running, waiting, last};
  Run r = run(h, jobs);
  check_run(h, jobs, r);
  CHECK(r.results[0].finish == BLINK_FINISH_CANCELLED && !r.results[0].tokens.empty(),
        "the running request is cancelled after some tokens");
  CHECK(r.results[1].finish == BLINK_FINISH_CANCELLED && r.results[1].tokens.empty() &&
            r.results[1].admit_ticket == 0,
        "the waiting request is cancelled before admission");
  CHECK(r.results[2].finish == BLINK_FINISH_LENGTH, "the last request runs to its length");
}

void test_config_checks() {
  g_case = "config checks";
  BlinkSchedConfig c;
  std::memset(&c, 0, sizeof c);
  c.mailbox = 1;
  c.num_slots = 4;
  c.max_prompt = 8;
  c.ring_capacity = 4;
  c.vocab_size = 10;
  c.max_seqs = 2;
  c.max_context = 16;
  c.page_size = 4;
  c.num_pages = 8;
  c.num_buckets = 2;
  c.bucket0 = 2;
  c.bucket1 = 4;
  c.token_budget = 4;
  c.eos0 = c.eos1 = c.eos2 = c.eos3 = -1;
  c.arena_tokens = 32;
  auto check = [](BlinkSchedConfig x) {
    return std::string(blink_config_check(reinterpret_cast<const int64_t*>(&x)));
  };
  CHECK(check(c).empty(), "a good config rejected: %s", check(c).c_str());
  struct Bad {
    std::function<void(BlinkSchedConfig&)> f;
    const char* names;
  } bad[] = {
      {[](BlinkSchedConfig& x) { x.num_slots = 0; }, "num_slots"},
      {[](BlinkSchedConfig& x) { x.max_seqs = BLINK_MAX_SEQS + 1; }, "max_seqs"},
      {[](BlinkSchedConfig& x) { x.token_budget = 8; }, "token_budget"},
      {[](BlinkSchedConfig& x) { x.bucket0 = 4; }, "bucket"},
      {[](BlinkSchedConfig& x) { x.num_pages = 3; }, "num_pages"},
      {[](BlinkSchedConfig& x) { x.num_buckets = BLINK_MAX_BUCKETS + 1; }, "num_buckets"},
      {[](BlinkSchedConfig& x) { x.arena_tokens = 7; }, "arena_tokens"},
  };
  for (const Bad& b : bad) {
    BlinkSchedConfig x = c;
    b.f(x);
    std::string msg = check(x);
    CHECK(msg.find(b.names) != std::string::npos, "a bad %s gave '%s'", b.names, msg.c_str());
  }
  // The library's geometry is this header's.
  BlinkGeometry g{5, 13, 7, 3, 29};
  uint32_t g5[5] = {5, 13, 7, 3, 29};
  uint64_t o[8];
  blink_geometry_offsets(g5, 4, o);
  CHECK(o[0] == g.request_offset(4) && o[1] == g.arena_offset() && o[2] == g.output_offset(4) &&
            o[6] == g.out_top_logprobs_offset(4) && o[7] == g.total_bytes(),
        "geometry offsets differ");
}

}  // namespace

int main() {
  const struct {
    const char* name;
    void (*fn)();
  } tests[] = {
      {"admission", test_admission},         {"chunked_prefill", test_chunked_prefill},
      {"preemption", test_preemption},       {"bad_slots", test_bad_slots},
      {"cancel", test_cancel},               {"config_checks", test_config_checks},
  };
  int passed = 0, failed = 0;
  for (const auto& t : tests) {
    int before = g_failures;
    t.fn();
    bool ok = g_failures == before;
    std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", t.name);
    (ok ? passed : failed)++;
  }
  std::printf("%d checks; %d passed, %d failed\n", g_checks, passed, failed);
  return failed ? 1 : 0;
}
