// What the CPU and CUDA FFI handlers share: attribute decoding of BlinkSchedConfig (the
// scheduler config arrives as named attributes whose names are the struct's fields), the
// argument/result bindings of blink_schedule and blink_commit, and the state check.
#pragma once
#include <utility>
#include "scheduler.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    BlinkSchedConfig, ::xla::ffi::StructMember<int64_t>("mailbox"),
    ::xla::ffi::StructMember<int64_t>("num_slots"), ::xla::ffi::StructMember<int64_t>("max_prompt"),
    ::xla::ffi::StructMember<int64_t>("ring_capacity"),
    ::xla::ffi::StructMember<int64_t>("max_top_logprobs"),
    ::xla::ffi::StructMember<int64_t>("vocab_size"), ::xla::ffi::StructMember<int64_t>("max_seqs"),
    ::xla::ffi::StructMember<int64_t>("max_context"), ::xla::ffi::StructMember<int64_t>("page_size"),
    ::xla::ffi::StructMember<int64_t>("num_pages"),
    ::xla::ffi::StructMember<int64_t>("token_budget"),
    ::xla::ffi::StructMember<int64_t>("num_buckets"), ::xla::ffi::StructMember<int64_t>("bucket0"),
    ::xla::ffi::StructMember<int64_t>("bucket1"), ::xla::ffi::StructMember<int64_t>("bucket2"),
    ::xla::ffi::StructMember<int64_t>("bucket3"), ::xla::ffi::StructMember<int64_t>("bucket4"),
    ::xla::ffi::StructMember<int64_t>("bucket5"), ::xla::ffi::StructMember<int64_t>("bucket6"),
    ::xla::ffi::StructMember<int64_t>("bucket7"), ::xla::ffi::StructMember<int64_t>("bucket8"),
    ::xla::ffi::StructMember<int64_t>("bucket9"), ::xla::ffi::StructMember<int64_t>("bucket10"),
    ::xla::ffi::StructMember<int64_t>("bucket11"), ::xla::ffi::StructMember<int64_t>("bucket12"),
    ::xla::ffi::StructMember<int64_t>("bucket13"), ::xla::ffi::StructMember<int64_t>("bucket14"),
    ::xla::ffi::StructMember<int64_t>("bucket15"), ::xla::ffi::StructMember<int64_t>("eos0"),
    ::xla::ffi::StructMember<int64_t>("eos1"), ::xla::ffi::StructMember<int64_t>("eos2"),
    ::xla::ffi::StructMember<int64_t>("eos3"), ::xla::ffi::StructMember<int64_t>("idle_poll_us"),
    ::xla::ffi::StructMember<int64_t>("arena_tokens"),
    ::xla::ffi::StructMember<int64_t>("min_step_interval_us"),
    ::xla::ffi::StructMember<int64_t>("prefix_caching"),
    ::xla::ffi::StructMember<int64_t>("window"), ::xla::ffi::StructMember<int64_t>("window_pages"),
    ::xla::ffi::StructMember<int64_t>("step_interval_permille"));

namespace blink {

// blink_schedule(state, history, page_table) -> (state, history, page_table, batch)
template <class B>
auto ScheduleBinding(B b) {
  using ::xla::ffi::Buffer;
  using ::xla::ffi::S32;
  return std::move(b).template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Ret<Buffer<S32>>()
      .template Ret<Buffer<S32>>()
      .template Ret<Buffer<S32>>()
      .template Ret<Buffer<S32>>()
      .template Attrs<BlinkSchedConfig>();
}

// blink_commit(state, history, page_table, batch, sampled, logprobs, top_ids, top_logprobs,
//              row_logprobs, row_top_ids, row_top_logprobs) -> (state, history)
// (per sample: max_seqs rows; per batch row: token_budget rows; see BlinkStepOutputs)
template <class B>
auto CommitBinding(B b) {
  using ::xla::ffi::Buffer;
  using ::xla::ffi::F32;
  using ::xla::ffi::S32;
  return std::move(b).template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<F32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<F32>>()
      .template Arg<Buffer<F32>>()
      .template Arg<Buffer<S32>>()
      .template Arg<Buffer<F32>>()
      .template Ret<Buffer<S32>>()
      .template Ret<Buffer<S32>>()
      .template Attrs<BlinkSchedConfig>();
}

// The commit's step outputs from its argument buffers.
template <class I, class F>
BlinkStepOutputs StepOutputs(const I& sampled, const F& logprobs, const I& top_ids,
                             const F& top_lps, const F& row_lps, const I& row_top_ids,
                             const F& row_top_lps) {
  auto dims = top_ids.dimensions();
  return BlinkStepOutputs{
      static_cast<const int32_t*>(sampled.untyped_data()),
      static_cast<const float*>(logprobs.untyped_data()),
      static_cast<const int32_t*>(top_ids.untyped_data()),
      static_cast<const float*>(top_lps.untyped_data()),
      static_cast<const float*>(row_lps.untyped_data()),
      static_cast<const int32_t*>(row_top_ids.untyped_data()),
      static_cast<const float*>(row_top_lps.untyped_data()),
      dims.size() == 2 ? dims[1] : 0};
}

inline ::xla::ffi::Error CheckState(const BlinkSchedConfig& c,
                                    const ::xla::ffi::Buffer<::xla::ffi::S32>& state) {
  if (int64_t(state.element_count()) != BlinkStateLayout(c).total)
    return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInvalidArgument,
                             "scheduler state has the wrong size");
  if (c.mailbox == 0)
    return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInvalidArgument, "no mailbox");
  return ::xla::ffi::Error::Success();
}

}  // namespace blink
