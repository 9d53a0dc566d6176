// The batch-1 matrix-vector product of the decode step's projections: x [1, K] bf16 times
// w [K, N] bf16 -> split partial sums [S, 1, N] f32 (S splits of K; the add + norm kernel or
// an XLA fusion adds them up). XLA runs these GEMVs as GEMM kernels tuned on hot caches; here
// every weight byte is read once with 16-byte loads, all of a thread's rows in flight at
// once, from enough blocks to cover the GPU (blink_jax/kernels/cuda_gemv.py picks S). Steps
// of 2-8 tokens ran faster through XLA's kernels (docs/PERFORMANCE.md, "The GEMV at one
// token only"), so the kernel takes one.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kThreads = 256;                      // 8 warps
constexpr int kColumns = 64;                       // output columns per block
constexpr int kPerThread = 8;                      // columns per thread: one 16-byte load
constexpr int kGroupLanes = kColumns / kPerThread;  // threads reading one row: 8 (128 bytes)
constexpr int kGroups = kThreads / kGroupLanes;     // rows read at once: 32
// Rows each thread has in flight (blink_jax/kernels/cuda_gemv.py _ROWS_IN_FLIGHT): with
// splits chosen so that a block's rows fit one pass, every load of the kernel is issued
// before any returns: one trip to HBM instead of one per 4 rows (the first version took 4
// trips for the 1B down projection and ran at ~1 TB/s; docs/NOTES.md, "The CUDA GEMV: one
// pass per block").
constexpr int kRowsInFlight = 8;

// Block (column block c, split s): rows [s * chunk, min(K, (s + 1) * chunk)) of columns
// [c * 64, c * 64 + 64). Thread (group g, lane j) reads columns j * 8 .. j * 8 + 7 of rows
// g, g + 32, ...; its sums are reduced over the warp's 4 groups by shuffles and over the
// 8 warps in shared memory.
__global__ void __launch_bounds__(kThreads, 4)
    gemv_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                float* __restrict__ out, int64_t K, int64_t N, int64_t chunk) {
  constexpr int U = kRowsInFlight;
  const int j = threadIdx.x % kGroupLanes, g = threadIdx.x / kGroupLanes;
  const int64_t col = int64_t(blockIdx.x) * kColumns + j * kPerThread;
  const int64_t k0 = int64_t(blockIdx.y) * chunk;
  const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
  float acc[kPerThread];
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) acc[c] = 0.f;

  for (int64_t base = k0 + g; base < k1; base += kGroups * U) {
    uint4 rows[U];
    float xs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load first (weights and inputs), then the math
      const int64_t k = base + int64_t(u) * kGroups;
      const bool in = k < k1;  // rows past the split's end count as zeros
      rows[u] = in ? __ldg(reinterpret_cast<const uint4*>(w + k * N + col)) : make_uint4(0, 0, 0, 0);
      xs[u] = in ? __bfloat162float(x[k]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&rows[u]);
#pragma unroll
      for (int c = 0; c < kPerThread / 2; ++c) {
        const float2 wv = __bfloat1622float2(pair[c]);
        acc[2 * c] += xs[u] * wv.x;
        acc[2 * c + 1] += xs[u] * wv.y;
      }
    }
  }
  // Lanes j, j + 8, j + 16, j + 24 of a warp hold the same columns.
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {
    acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], 8);
    acc[c] += __shfl_xor_sync(0xffffffffu, acc[c], 16);
  }
  __shared__ float warp_sums[kThreads / 32][kColumns];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < kGroupLanes)
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) warp_sums[warp][lane * kPerThread + c] = acc[c];
  __syncthreads();
  float* o = out + int64_t(blockIdx.y) * N + int64_t(blockIdx.x) * kColumns;
  if (threadIdx.x < kColumns) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < kThreads / 32; ++v) s += warp_sums[v][threadIdx.x];
    o[threadIdx.x] = s;
  }
}

ffi::Error GemvImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("blink_gemv: x [T, K], w [K, N], out [S, T, N]");
  const int64_t T = xd[0], K = xd[1], N = wd[1], S = od[0];
  if (wd[0] != K || od[1] != T || od[2] != N || N % kColumns != 0 || T != 1 || S < 1 || S > K)
    return ffi::Error::InvalidArgument(
        "blink_gemv: shapes must be x [1, K], w [K, N], out [S, 1, N] with N a multiple of "
        "64 and 1 <= S <= K");
  const int64_t chunk = (K + S - 1) / S;
  gemv_kernel<<<dim3(unsigned(N / kColumns), unsigned(S)), kThreads, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(w.untyped_data()), out->typed_data(), K, N, chunk);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkGemvCuda, GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
