// CUDA XLA FFI handlers: the same scheduler (scheduler.h) run by one thread block with the
// device execution policy. Pure stream work (no host sync, no allocation, no stream switch),
// so XLA can capture them in a command buffer inside the device-side while loop.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "handler_common.h"
#include "scheduler.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
// One block per kernel (`__launch_bounds__(kThreads, 1)`): ptxas may then use up to 128
// registers a thread; left to its default it capped the kernels at 64 and spilled.
constexpr int kThreads = 512;
// Dynamic shared memory a launch may use without opting in (cudaFuncSetAttribute is not a
// stream operation, so it cannot be recorded into a command buffer).
constexpr int64_t kSharedLimit = 48 * 1024 - 64 * sizeof(int32_t);

// n words (a multiple of 4, both ends 16-byte aligned: the layouts pad and align the hot
// regions, and the handlers check the state's address) from src to dst by the whole block,
// in 16-byte words. A plain block-stride loop: an unrolled copy (8 loads in flight) made the
// kernels' code larger and the 1-lane schedule ~1.8 us slower (docs/NOTES.md, "Scheduler
// code: fewer phases, plain copies, all inlined").
__device__ void block_copy(int32_t* dst, const int32_t* src, int64_t n) {
  for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x)
    reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<const int4*>(src)[i];
}

// Runs `fn` on a scheduler whose hot state (counters, scalars, lane table, lane scratch) lives
// in shared memory when it fits: the phases then touch on-chip memory instead of L2.
// Adds the kernel's own duration to counter `timer` (how much of a loop iteration the
// scheduler itself takes, as opposed to launches around it).
template <class Fn>
__device__ void with_hot_state(BlinkSched& S, int32_t* st, bool shared, int timer, Fn fn) {
  extern __shared__ __align__(16) int32_t hot_copy[];
  const uint64_t t0 = DeviceExec::now_ns();
  const BlinkHotLayout h(S.c);
  if (shared) {
    S.use_hot_copy(hot_copy);
    block_copy(S.hot, st, h.hot_words);
    block_copy(S.lanes, st + S.lay.lanes, h.lane_words);
    __syncthreads();
  }
  fn(S);
  __syncthreads();
  if (threadIdx.x == 0) S.counter(timer) += DeviceExec::now_ns() - t0;
  if (!shared) return;
  __syncthreads();
  block_copy(st, S.hot, h.hot_words);
  block_copy(st + S.lay.lanes, S.lanes, h.lane_words);
}

// The schedule's poll words, loaded by thread i for index i (as DeviceExec::sum_then_lead
// assigns them) before any other work: the loads cross PCIe (~1-2 us) while the kernel copies
// its hot state; the schedule then reads them from registers.
static_assert(kThreads > BLINK_MAX_WORKERS, "one poll word per thread");
__device__ uint64_t early_poll(const BlinkSched& S) {
  return threadIdx.x <= BLINK_MAX_WORKERS ? S.poll_word(threadIdx.x) : 0;
}

__global__ void __launch_bounds__(kThreads, 1) schedule_kernel(BlinkSchedConfig c, int32_t* st,
                                                            int32_t* hist, int32_t* pt,
                                                            int32_t* batch, bool shared) {
  __shared__ int32_t scratch[kThreads / 32 + 1];
  BlinkSched S(c, reinterpret_cast<uint8_t*>(c.mailbox), st, hist, pt, batch);
  const uint64_t polled = early_poll(S);
  with_hot_state(S, st, shared, C_SCHEDULE_NS, [&](BlinkSched& s) {
    s.schedule(DeviceExec{scratch}, [&](int64_t) { return polled; });
  });
}

__global__ void __launch_bounds__(kThreads, 1) commit_kernel(BlinkSchedConfig c, int32_t* st,
                                                          int32_t* hist, int32_t* pt,
                                                          int32_t* batch, BlinkStepOutputs step,
                                                          bool shared) {
  __shared__ int32_t scratch[kThreads / 32 + 1];
  BlinkSched S(c, reinterpret_cast<uint8_t*>(c.mailbox), st, hist, pt, batch);
  with_hot_state(S, st, shared, C_COMMIT_NS, [&](BlinkSched& s) {
    s.commit(DeviceExec{scratch}, step);
  });
}

// Dynamic shared memory for the hot state, or 0 when it does not fit or the state is not
// 16-byte aligned (the state stays in L2).
int64_t hot_bytes(const BlinkSchedConfig& c, const void* state) {
  static_assert((2 * C_NUM_COUNTERS + S_NUM_SCALARS) % 4 == 0, "hot words copied by 16 bytes");
  int64_t b = BlinkHotLayout(c).total * int64_t(sizeof(int32_t));
  bool aligned = reinterpret_cast<uintptr_t>(state) % 16 == 0;
  return aligned && b <= kSharedLimit ? b : 0;
}

ffi::Error last_error() {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Handler calls whose results did not alias their inputs (XLA honours input_output_aliases,
// so this stays 0; read by blink_cuda_unaliased_calls for diagnostics).
std::atomic<int64_t> g_unaliased{0};

__global__ void copy_words(int32_t* dst, const int32_t* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Results alias their inputs when XLA honours input_output_aliases; copy when it did not,
// with a kernel (a kernel node, unlike a memcpy node, runs inside a device-side graph loop
// without the driver's help).
template <ffi::DataType T>
void carry(cudaStream_t s, const ffi::Buffer<T>& in, ffi::ResultBuffer<T>& out) {
  if (in.untyped_data() == out->untyped_data()) return;
  g_unaliased.fetch_add(1);
  int64_t n = int64_t(in.size_bytes() / sizeof(int32_t));
  int blocks = int(n / 1024 + 1 < 264 ? n / 1024 + 1 : 264);
  copy_words<<<blocks, 256, 0, s>>>(reinterpret_cast<int32_t*>(out->untyped_data()),
                                     reinterpret_cast<const int32_t*>(in.untyped_data()), n);
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
  int64_t smem = hot_bytes(c, state_out->untyped_data());
  schedule_kernel<<<1, kThreads, smem, s>>>(c, state_out->typed_data(),
                                            history_out->typed_data(),
                                            page_table_out->typed_data(), batch->typed_data(),
                                            smem > 0);
  return last_error();
}

ffi::Error CommitImpl(cudaStream_t s, ffi::Buffer<ffi::S32> state, ffi::Buffer<ffi::S32> history,
                      ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> batch,
                      ffi::Buffer<ffi::S32> sampled, ffi::Buffer<ffi::F32> logprobs,
                      ffi::Buffer<ffi::S32> top_ids, ffi::Buffer<ffi::F32> top_lps,
                      ffi::Buffer<ffi::F32> row_lps, ffi::Buffer<ffi::S32> row_top_ids,
                      ffi::Buffer<ffi::F32> row_top_lps, ffi::ResultBuffer<ffi::S32> state_out,
                      ffi::ResultBuffer<ffi::S32> history_out, BlinkSchedConfig c) {
  if (auto e = blink::CheckState(c, state); e.failure()) return e;
  carry(s, state, state_out);
  carry(s, history, history_out);
  int64_t smem = hot_bytes(c, state_out->untyped_data());
  commit_kernel<<<1, kThreads, smem, s>>>(
      c, state_out->typed_data(), history_out->typed_data(),
      const_cast<int32_t*>(page_table.typed_data()), const_cast<int32_t*>(batch.typed_data()),
      blink::StepOutputs(sampled, logprobs, top_ids, top_lps, row_lps, row_top_ids, row_top_lps),
      smem > 0);
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

// Copies to or from device memory on a private non-blocking stream, so that it runs beside a
// serving loop that occupies XLA's stream (a frontend writing a mailbox kept in GPU memory,
// as an RDMA NIC would).
extern "C" int blink_cuda_copy(void* dst, const void* src, uint64_t bytes) {
  static cudaStream_t stream = nullptr;
  if (stream == nullptr) {
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) return int(e);
  }
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
  if (e != cudaSuccess) return int(e);
  return int(cudaStreamSynchronize(stream));
}

// A zeroed mailbox in GPU memory (see blink_jax/native/device_region.py).
extern "C" int blink_cuda_alloc(uint64_t bytes, void** ptr) {
  cudaError_t e = cudaMalloc(ptr, bytes);
  if (e != cudaSuccess) return int(e);
  e = cudaMemset(*ptr, 0, bytes);
  if (e != cudaSuccess) return int(e);
  return int(cudaDeviceSynchronize());
}

extern "C" int blink_cuda_free(void* ptr) { return int(cudaFree(ptr)); }

extern "C" int64_t blink_cuda_unaliased_calls() { return g_unaliased.load(); }
