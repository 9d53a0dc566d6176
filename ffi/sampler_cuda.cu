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
// bisection's is within rounding of it).
//
// Several blocks per row: a pass is a histogram kernel over a grid of (parts, rows), each block
// counting its part of a row into shared memory and adding its non-empty bins to the row's
// histogram in the workspace, then a pick kernel, a block per row, that finds the bins and
// clears the histogram for the next pass. With one block per row, one SM made all of a row's
// 262,144 first-pass atomics (top-p's float masses crowd into the few bins the logits fall in,
// and a float atomicAdd on shared memory is a compare-and-swap loop on sm_90, ATOMS.CAST.SPIN
// in its SASS, where the counts' are one ATOMS.POPC.INC per warp: 486 us at one row on an
// H100 against the bisection's 182, PERFORMANCE.md "Sampling"); a step of few rows now
// spreads them over up to kMaxParts SMs per row.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kThreads = 256;       // threads of a histogram block
constexpr int kBins = 2048;         // the widest digit: 11 bits
constexpr int kLoads = 4;           // 16-byte loads a thread has in flight per trip
constexpr int kTargetBlocks = 264;  // about two histogram blocks per SM of an H100 / H200
constexpr int kMaxParts = 64;       // blocks per row at most
constexpr unsigned kFull = 0xffffffffu;

// The workspace of a row, in 32-bit words: its histogram (counts, then masses as floats),
// then the state the pick kernel hands to the next pass.
constexpr int kStateWords = 8;
constexpr int64_t kRowWords = 2 * kBins + kStateWords;
enum State { kPrefixK, kAboveK, kPrefixP, kAboveP, kNeed };

// Keys ordered as the floats are: a larger float has a larger key.
__device__ __forceinline__ uint32_t ordered(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float from_ordered(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Digits of the keys: 11, 11, then 10 bits.
__host__ __device__ constexpr int digit_bits(int pass) { return pass < 2 ? 11 : 10; }
__host__ __device__ constexpr int found_bits(int pass) { return pass * 11; }

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

__device__ __forceinline__ bool wants_k(int32_t k, int64_t V) {
  return k > 0 && int64_t(k) < V;  // k >= V keeps every token
}

// One pass's histogram of part blockIdx.x (chunk elements) of row blockIdx.y: the next digit
// of the keys that share the digits found so far (the state's prefixes), counts for top-k
// and masses exp(x - hi) for top-p, added into the row's histogram in the workspace.
__global__ void __launch_bounds__(kThreads)
    histogram_kernel(const float* __restrict__ x, const float* __restrict__ hi,
                     const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                     uint32_t* __restrict__ work, int64_t V, int64_t chunk, int pass) {
  __shared__ uint32_t counts[kBins];
  __shared__ float masses[kBins];
  const int64_t row = blockIdx.y;
  const bool want_k = wants_k(top_k[row], V), want_p = top_p[row] < 1.f;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  if ((!want_k && !want_p) || begin >= V) return;
  const int64_t end = min(V, begin + chunk);
  uint32_t* w = work + row * kRowWords;
  const int found = found_bits(pass), bits = digit_bits(pass);
  const int shift = 32 - found - bits, bins = 1 << bits;
  const uint32_t prefix_k = w[2 * kBins + kPrefixK], prefix_p = w[2 * kBins + kPrefixP];
  const float top = hi[row];
  for (int i = threadIdx.x; i < bins; i += kThreads) counts[i] = 0, masses[i] = 0.f;
  __syncthreads();
  auto count = [&](float v) {
    const uint32_t key = ordered(v);
    const uint32_t high = found ? key >> (32 - found) : 0u;
    const uint32_t bin = (key >> shift) & uint32_t(bins - 1);
    if (want_k && high == prefix_k) atomicAdd(&counts[bin], 1u);
    if (want_p && high == prefix_p) atomicAdd(&masses[bin], __expf(v - top));
  };
  const float* xr = x + row * V;
  int64_t done = begin;
  // kLoads 16-byte loads of a thread in flight at once, then their counting. A part starts
  // at a multiple of 4 floats (chunk is one), so with V a multiple of 4 it is 16-byte aligned.
  if (V % 4 == 0) {
    const float4* xv = reinterpret_cast<const float4*>(xr + begin);
    const int64_t vectors = (end - begin) / 4, step = int64_t(kThreads) * kLoads;
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
    done = begin + vectors * 4;
  }
  for (int64_t i = done + threadIdx.x; i < end; i += kThreads) count(xr[i]);
  __syncthreads();
  float* row_masses = reinterpret_cast<float*>(w + kBins);
  for (int i = threadIdx.x; i < bins; i += kThreads) {
    if (counts[i]) atomicAdd(&w[i], counts[i]);
    if (masses[i] != 0.f) atomicAdd(&row_masses[i], masses[i]);
  }
}

// One pass's picks, a block of two warps per row: warp 0 the top-k digit (counts from the
// top reaching k), warp 1 the top-p digit (masses from the top reaching p times the row's
// whole mass, which the first pass's histogram holds); the prefixes grow by a digit, the
// histogram is cleared for the next pass, and the last pass writes the thresholds.
__global__ void __launch_bounds__(64)
    pick_kernel(const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                uint32_t* __restrict__ work, float* __restrict__ out, int64_t V, int pass) {
  const int64_t row = blockIdx.x;
  const int32_t k = top_k[row];
  const float p = top_p[row];
  const bool want_k = wants_k(k, V), want_p = p < 1.f;
  uint32_t* w = work + row * kRowWords;
  uint32_t* state = w + 2 * kBins;
  float* masses = reinterpret_cast<float*>(w + kBins);
  const int bits = digit_bits(pass), bins = 1 << bits, warp = threadIdx.x / 32;
  if (warp == 0 && want_k) {
    uint32_t rest;
    const int j = pick_bin<uint32_t>(w, bins, state[kAboveK], uint32_t(k), &rest);
    if (threadIdx.x == 0) state[kPrefixK] = (state[kPrefixK] << bits) | j, state[kAboveK] = rest;
  } else if (warp == 1 && want_p) {
    float need = __uint_as_float(state[kNeed]);
    if (pass == 0) {  // every key is in the first pass's histogram: the row's whole mass
      float total = 0.f;
      for (int b = threadIdx.x % 32; b < bins; b += 32) total += masses[b];
#pragma unroll
      for (int off = 16; off; off /= 2) total += __shfl_xor_sync(kFull, total, off);
      need = p * total;
    }
    float rest;
    const int j = pick_bin<float>(masses, bins, __uint_as_float(state[kAboveP]), need, &rest);
    if (threadIdx.x % 32 == 0) {
      state[kPrefixP] = (state[kPrefixP] << bits) | j;
      state[kAboveP] = __float_as_uint(rest), state[kNeed] = __float_as_uint(need);
    }
  }
  __syncthreads();  // both warps have read the histogram
  if (pass < 2) {
    for (int i = threadIdx.x; i < 2 * bins; i += blockDim.x) w[i < bins ? i : kBins + i - bins] = 0;
  } else if (threadIdx.x == 0) {
    out[2 * row] = want_k ? from_ordered(state[kPrefixK]) : -INFINITY;
    out[2 * row + 1] = want_p ? from_ordered(state[kPrefixP]) : -INFINITY;
  }
}

ffi::Error ThresholdsImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> hi,
                          ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::U32> work) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || hi.dimensions().size() != 1 || top_k.dimensions().size() != 1 ||
      top_p.dimensions().size() != 1 || out->dimensions().size() != 2 ||
      work->dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "blink_sample_thresholds: x [R, V], hi, top_k, top_p [R], out [R, 2], work [R, W]");
  const int64_t R = xd[0], V = xd[1];
  if (hi.dimensions()[0] != R || top_k.dimensions()[0] != R || top_p.dimensions()[0] != R ||
      out->dimensions()[0] != R || out->dimensions()[1] != 2 || V < 1 ||
      work->dimensions()[0] != R || work->dimensions()[1] != kRowWords)
    return ffi::Error::InvalidArgument(
        "blink_sample_thresholds: shapes must be x [R, V >= 1], hi, top_k, top_p [R], "
        "out [R, 2], work [R, " + std::to_string(kRowWords) + "]");
  if (R > 0) {
    // Parts per row: enough blocks in all to cover the GPU about twice, at most kMaxParts a
    // row; a part is a multiple of 4 floats (16-byte aligned vector loads).
    const int64_t want = std::min<int64_t>(kMaxParts, std::max<int64_t>(1, kTargetBlocks / R));
    const int64_t chunk = ((V + want - 1) / want + 3) / 4 * 4;
    const unsigned parts = unsigned((V + chunk - 1) / chunk);
    uint32_t* w = work->typed_data();
    const cudaError_t zeroed =
        cudaMemsetAsync(w, 0, size_t(R) * kRowWords * sizeof(uint32_t), stream);
    if (zeroed != cudaSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(zeroed));
    for (int pass = 0; pass < 3; ++pass) {
      histogram_kernel<<<dim3(parts, unsigned(R)), kThreads, 0, stream>>>(
          x.typed_data(), hi.typed_data(), top_k.typed_data(), top_p.typed_data(), w, V, chunk,
          pass);
      pick_kernel<<<unsigned(R), 64, 0, stream>>>(top_k.typed_data(), top_p.typed_data(), w,
                                                  out->typed_data(), V, pass);
    }
  }
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
