// The top-k and top-p thresholds of a step's sampled rows by radix selection: x [R, V] f32
// (the scaled logits), their row maxima hi [R], top_k [R] i32, top_p [R] f32 ->
// thresholds [R, 2] f32 (top-k's, top-p's; -inf where a row asks for neither).
//
// Top-k's threshold is the k-th largest value of the row; top-p's the largest value t with
// sum(exp(x - hi) over x >= t) >= p * sum(exp(x - hi)): the smallest value of the nucleus
// (`blink_jax.model.sampling`, "Filtering without a sort"). XLA's version bisects the value
// range, 32 passes over the row (each reading the logits and, for top-p, their
// exponentials). Here the row's values are read as 32-bit keys ordered like the floats and
// found digit by digit, 11 + 11 + 10 bits: a pass builds a histogram in shared memory (counts
// for top-k, masses for top-p) of the next digit of the keys that share the digits found so
// far, and picks the bin where the count or mass from the top first reaches its target.
// Three passes instead of 32, and the answer is the exact value of a row element (the
// bisection's is within rounding of it). A block per row.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kThreads = 1024;
constexpr int kBins = 2048;  // the widest digit: 11 bits
constexpr int kLoads = 4;    // 16-byte loads a thread has in flight per trip
constexpr unsigned kFull = 0xffffffffu;

// Keys ordered as the floats are: a larger float has a larger key.
__device__ __forceinline__ uint32_t ordered(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float from_ordered(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The largest bin j of hist[0, bins) with above + sum(hist[j:]) >= target, found by one
// warp (a lane per bins / 32 bins); returns j and sets *rest = above + sum(hist[j + 1:]).
// No bin qualifying (the target out of reach by rounding) gives bin 0.
template <class T>
__device__ int pick_bin(const T* hist, int bins, T above, T target, T* rest) {
  const int lane = threadIdx.x % 32, per = bins / 32, first = lane * per;
  T mine = 0;
  for (int b = first; b < first + per; ++b) mine += hist[b];
  T incl = mine;  // lanes >= lane
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const T v = __shfl_down_sync(kFull, incl, off);
    if (lane + off < 32) incl += v;
  }
  const unsigned ok = __ballot_sync(kFull, above + incl >= target);
  const int chosen = ok ? 31 - __clz(ok) : 0;
  int j = first + per - 1;
  T run = above + incl - mine;  // lanes above this one
  for (; j > first; --j) {
    if (run + hist[j] >= target) break;
    run += hist[j];
  }
  const int pick = __shfl_sync(kFull, j, chosen);
  *rest = __shfl_sync(kFull, run, chosen);
  return pick;
}

__global__ void __launch_bounds__(kThreads)
    thresholds_kernel(const float* __restrict__ x, const float* __restrict__ hi,
                      const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                      float* __restrict__ out, int64_t V) {
  __shared__ uint32_t counts[kBins];
  __shared__ float masses[kBins];
  __shared__ uint32_t picked_k, rest_k;
  __shared__ float rest_p, need;
  __shared__ uint32_t picked_p;
  const int64_t row = blockIdx.x;
  const float* xr = x + row * V;
  const float top = hi[row];
  const int32_t k = top_k[row];
  const float p = top_p[row];
  const bool want_k = k > 0 && int64_t(k) < V;  // k >= V keeps every token
  const bool want_p = p < 1.f;
  if (!want_k && !want_p) {
    if (threadIdx.x == 0) out[2 * row] = out[2 * row + 1] = -INFINITY;
    return;
  }
  const int warp = threadIdx.x / 32;
  uint32_t prefix_k = 0, prefix_p = 0, above_k = 0;
  float above_p = 0.f;
  int found = 0;  // bits of the keys found so far
  for (int pass = 0; pass < 3; ++pass) {
    const int bits = pass < 2 ? 11 : 10, shift = 32 - found - bits, bins = 1 << bits;
    for (int i = threadIdx.x; i < bins; i += kThreads) counts[i] = 0, masses[i] = 0.f;
    __syncthreads();
    auto count = [&](float v) {
      const uint32_t key = ordered(v);
      const uint32_t high = found ? key >> (32 - found) : 0u;
      const uint32_t bin = (key >> shift) & uint32_t(bins - 1);
      if (want_k && high == prefix_k) atomicAdd(&counts[bin], 1u);
      if (want_p && high == prefix_p) atomicAdd(&masses[bin], __expf(v - top));
    };
    // kLoads 16-byte loads of a thread in flight at once, then their counting (one element
    // per thread and trip was 7 % slower at one row, 17 % at 64: PERFORMANCE.md, "Sampling";
    // a row's block is bound by its shared-memory atomics, most by top-p's float masses).
    // Rows of a multiple of 4 floats are 16-byte aligned (x is).
    int64_t done = 0;
    if (V % 4 == 0) {
      const float4* xv = reinterpret_cast<const float4*>(xr);
      const int64_t vectors = V / 4, step = int64_t(kThreads) * kLoads;
      for (int64_t base = threadIdx.x; base < vectors; base += step) {
        float4 got[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int64_t i = base + int64_t(u) * kThreads;
          got[u] = i < vectors ? __ldg(xv + i) : make_float4(-INFINITY, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          if (base + int64_t(u) * kThreads >= vectors) break;
          count(got[u].x), count(got[u].y), count(got[u].z), count(got[u].w);
        }
      }
      done = V;
    }
    for (int64_t i = done + threadIdx.x; i < V; i += kThreads) count(xr[i]);
    __syncthreads();
    if (warp == 0 && want_k) {
      uint32_t rest;
      const int j = pick_bin<uint32_t>(counts, bins, above_k, uint32_t(k), &rest);
      if (threadIdx.x == 0) picked_k = j, rest_k = rest;
    } else if (warp == 1 && want_p) {
      if (pass == 0) {  // every key is in the first pass's histogram: the row's whole mass
        float total = 0.f;
        for (int b = threadIdx.x % 32; b < bins; b += 32) total += masses[b];
#pragma unroll
        for (int off = 16; off; off /= 2) total += __shfl_xor_sync(kFull, total, off);
        if (threadIdx.x % 32 == 0) need = p * total;
        __syncwarp();
      }
      float rest;
      const int j = pick_bin<float>(masses, bins, above_p, need, &rest);
      if (threadIdx.x % 32 == 0) picked_p = j, rest_p = rest;
    }
    __syncthreads();
    prefix_k = (prefix_k << bits) | picked_k, above_k = rest_k;
    prefix_p = (prefix_p << bits) | picked_p, above_p = rest_p;
    found += bits;
    __syncthreads();  // every thread has read them before the next pass writes them
  }
  if (threadIdx.x == 0) {
    out[2 * row] = want_k ? from_ordered(prefix_k) : -INFINITY;
    out[2 * row + 1] = want_p ? from_ordered(prefix_p) : -INFINITY;
  }
}

ffi::Error ThresholdsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> hi,
                          ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || hi.dimensions().size() != 1 || top_k.dimensions().size() != 1 ||
      top_p.dimensions().size() != 1 || out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "blink_sample_thresholds: x [R, V], hi, top_k, top_p [R], out [R, 2]");
  const int64_t R = xd[0], V = xd[1];
  if (hi.dimensions()[0] != R || top_k.dimensions()[0] != R || top_p.dimensions()[0] != R ||
      out->dimensions()[0] != R || out->dimensions()[1] != 2 || V < 1)
    return ffi::Error::InvalidArgument(
        "blink_sample_thresholds: shapes must be x [R, V >= 1], hi, top_k, top_p [R], "
        "out [R, 2]");
  if (R > 0)
    thresholds_kernel<<<unsigned(R), kThreads, 0, stream>>>(
        x.typed_data(), hi.typed_data(), top_k.typed_data(), top_p.typed_data(),
        out->typed_data(), V);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(e));
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlinkSampleThresholdsCuda, ThresholdsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
