// CUDA XLA FFI handlers: the same scheduler (scheduler.h) run by one thread block with the
// device execution policy. Pure stream work (no host sync, no allocation, no stream switch),
// so XLA can capture them in a command buffer inside the device-side while loop.
#include <cuda_runtime.h>

#include <cstdint>

#include "handler_common.h"
#include "scheduler.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) schedule_kernel(BlinkSchedConfig c, int32_t* st,
                                                            int32_t* hist, int32_t* pt,
                                                            int32_t* batch) {
  __shared__ int32_t scratch[kThreads + 1];
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), st, hist, pt, batch)
      .schedule(DeviceExec{scratch});
}

__global__ void __launch_bounds__(kThreads) commit_kernel(BlinkSchedConfig c, int32_t* st,
                                                          int32_t* hist, int32_t* pt,
                                                          int32_t* batch, const int32_t* sampled,
                                                          const float* logprobs,
                                                          const int32_t* top_ids,
                                                          const float* top_lps, int64_t cols) {
  __shared__ int32_t scratch[kThreads + 1];
  BlinkSched(c, reinterpret_cast<uint8_t*>(c.mailbox), st, hist, pt, batch)
      .commit(DeviceExec{scratch}, sampled, logprobs, top_ids, top_lps, cols);
}

ffi::Error last_error() {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Results alias their inputs when XLA honours input_output_aliases; copy when it did not.
template <ffi::DataType T>
void carry(cudaStream_t s, const ffi::Buffer<T>& in, ffi::ResultBuffer<T>& out) {
  if (in.untyped_data() != out->untyped_data())
    cudaMemcpyAsync(out->untyped_data(), in.untyped_data(), in.size_bytes(),
                    cudaMemcpyDeviceToDevice, s);
}

ffi::Error ScheduleImpl(cudaStream_t s, ffi::Buffer<ffi::S32> state,
                        ffi::Buffer<ffi::S32> history, ffi::Buffer<ffi::S32> page_table,
                        ffi::ResultBuffer<ffi::S32> state_out,
                        ffi::ResultBuffer<ffi::S32> history_out,
                        ffi::ResultBuffer<ffi::S32> page_table_out,
                        ffi::ResultBuffer<ffi::S32> batch, BlinkSchedConfig c) {
  if (auto e = blink::CheckState(c, state); e.failure()) return e;
  carry(s, state, state_out);
  carry(s, history, history_out);
  carry(s, page_table, page_table_out);
  schedule_kernel<<<1, kThreads, 0, s>>>(c, state_out->typed_data(), history_out->typed_data(),
                                         page_table_out->typed_data(), batch->typed_data());
  return last_error();
}

ffi::Error CommitImpl(cudaStream_t s, ffi::Buffer<ffi::S32> state, ffi::Buffer<ffi::S32> history,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> batch,
                      ffi::Buffer<ffi::S32> sampled, ffi::Buffer<ffi::F32> logprobs,
                      ffi::Buffer<ffi::S32> top_ids, ffi::Buffer<ffi::F32> top_lps,
                      ffi::ResultBuffer<ffi::S32> state_out,
                      ffi::ResultBuffer<ffi::S32> history_out, BlinkSchedConfig c) {
  if (auto e = blink::CheckState(c, state); e.failure()) return e;
  carry(s, state, state_out);
  carry(s, history, history_out);
  auto dims = top_ids.dimensions();
  int64_t cols = dims.size() == 2 ? dims[1] : 0;
  commit_kernel<<<1, kThreads, 0, s>>>(
      c, state_out->typed_data(), history_out->typed_data(),
      const_cast<int32_t*>(page_table.typed_data()), const_cast<int32_t*>(batch.typed_data()),
      sampled.typed_data(), logprobs.typed_data(), top_ids.typed_data(), top_lps.typed_data(),
      cols);
  return last_error();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    BlinkScheduleCuda, ScheduleImpl,
    blink::ScheduleBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    BlinkCommitCuda, CommitImpl,
    blink::CommitBinding(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

// Host-mapped memory for the shared-memory transport: the GPU reads the mailbox in place.
extern "C" int blink_cuda_register_host(void* ptr, uint64_t bytes, uint64_t* device_ptr) {
  cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) return int(e);
  void* d = nullptr;
  e = cudaHostGetDevicePointer(&d, ptr, 0);
  *device_ptr = reinterpret_cast<uint64_t>(d);
  return int(e);
}

extern "C" int blink_cuda_unregister_host(void* ptr) { return int(cudaHostUnregister(ptr)); }

extern "C" const char* blink_cuda_error_string(int code) {
  return cudaGetErrorString(cudaError_t(code));
}
