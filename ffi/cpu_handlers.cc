// CPU XLA FFI handlers: blink_schedule and blink_commit run the scheduler (scheduler.h) with
// the host execution policy on buffers of the executor's loop carry.
#include <cstring>

#include "handler_common.h"
#include "scheduler.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
// Results alias their inputs when XLA honours input_output_aliases; copy when it did not.
template <ffi::DataType T>
void carry(const ffi::Buffer<T>& in, ffi::ResultBuffer<T>& out) {
  if (in.untyped_data() != out->untyped_data())
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
}

ffi::Error ScheduleImpl(ffi::Buffer<ffi::S32> state, ffi::Buffer<ffi::S32> history,
                        ffi::Buffer<ffi::S32> page_table, ffi::ResultBuffer<ffi::S32> state_out,
                        ffi::ResultBuffer<ffi::S32> history_out,
                        ffi::ResultBuffer<ffi::S32> page_table_out,
                        ffi::ResultBuffer<ffi::S32> batch, BlinkSchedConfig c) {
  if (auto e = blink::CheckState(c, state); e.failure()) return e;
  carry(state, state_out);
  carry(history, history_out);
  carry(page_table, page_table_out);
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), state_out->typed_data(),
             history_out->typed_data(), page_table_out->typed_data(), batch->typed_data())
      .schedule(HostExec{});
  return ffi::Error::Success();
}

ffi::Error CommitImpl(ffi::Buffer<ffi::S32> state, ffi::Buffer<ffi::S32> history,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> batch,
                      ffi::Buffer<ffi::S32> sampled, ffi::Buffer<ffi::F32> logprobs,
                      ffi::Buffer<ffi::S32> top_ids, ffi::Buffer<ffi::F32> top_lps,
                      ffi::Buffer<ffi::F32> row_lps, ffi::Buffer<ffi::S32> row_top_ids,
                      ffi::Buffer<ffi::F32> row_top_lps, ffi::ResultBuffer<ffi::S32> state_out,
                      ffi::ResultBuffer<ffi::S32> history_out, BlinkSchedConfig c) {
  if (auto e = blink::CheckState(c, state); e.failure()) return e;
  carry(state, state_out);
  carry(history, history_out);
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), state_out->typed_data(),
             history_out->typed_data(), const_cast<int32_t*>(page_table.typed_data()),
             const_cast<int32_t*>(batch.typed_data()))
      .commit(HostExec{}, blink::StepOutputs(sampled, logprobs, top_ids, top_lps, row_lps,
                                             row_top_ids, row_top_lps));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkScheduleCpu, ScheduleImpl,
                              blink::ScheduleBinding(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkCommitCpu, CommitImpl, blink::CommitBinding(ffi::Ffi::Bind()));
