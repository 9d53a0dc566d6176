// Execution policies: the scheduler is written once as a sequence of phases, each either
// serial (one thread) or parallel (an index range); a policy runs them on the host (plain
// loops) or inside one CUDA thread block (thread 0 / block-stride loops, __syncthreads between
// phases). Cross-phase values must live in memory (the state buffer), never in locals.
#pragma once
#include <stdint.h>

#include "mailbox.h"

#include <atomic>
#include <chrono>
#include <thread>

// Loads and stores of mailbox memory: the other side may write it at any time.
#ifdef __CUDA_ARCH__
// Acquire/release are single PTX instructions at system scope (ld.acquire.sys /
// st.release.sys): they order only this thread's accesses, unlike a full
// __threadfence_system(), which waits for every outstanding write of the thread to reach the
// host. Mailbox words are 4 or 8 bytes.
template <class T>
__device__ __forceinline__ T blink_load(const void* p) {
  return *reinterpret_cast<const volatile T*>(p);
}
template <class T>
__device__ __forceinline__ T blink_load_acquire(const void* p) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "mailbox words are 4 or 8 bytes");
  if constexpr (sizeof(T) == 4) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return T(v);
  } else {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return T(v);
  }
}
template <class T>
__device__ __forceinline__ void blink_store(void* p, T v) {
  *reinterpret_cast<volatile T*>(p) = v;
}
template <class T>
__device__ __forceinline__ void blink_store_release(void* p, T v) {
  static_assert(sizeof(T) == 4, "release stores publish 4-byte words");
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(uint32_t(v)) : "memory");
}
#else
template <class T>
inline T blink_load(const void* p) {
  return __atomic_load_n(reinterpret_cast<const T*>(p), __ATOMIC_RELAXED);
}
template <class T>
inline T blink_load_acquire(const void* p) {
  return __atomic_load_n(reinterpret_cast<const T*>(p), __ATOMIC_ACQUIRE);
}
template <class T>
inline void blink_store(void* p, T v) {
  __atomic_store_n(reinterpret_cast<T*>(p), v, __ATOMIC_RELAXED);
}
template <class T>
inline void blink_store_release(void* p, T v) {
  __atomic_store_n(reinterpret_cast<T*>(p), v, __ATOMIC_RELEASE);
}
#endif

// Floats travel through the mailbox as bits: reinterpret without UB on both compilers.
BLINK_HD float blink_bits_to_float(uint32_t b) {
  union { uint32_t u; float f; } x;
  x.u = b;
  return x.f;
}
BLINK_HD uint32_t blink_float_to_bits(float f) {
  union { uint32_t u; float f; } x;
  x.f = f;
  return x.u;
}

struct HostExec {
  template <class F>
  void parallel(int64_t n, F f) const {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
  template <class F>
  void serial(F f) const {
    f();
  }
  void sync() const {}
  // Makes the relaxed loads of the last sum_then_lead acquire loads.
  void acquire_reads(int64_t) const { std::atomic_thread_fence(std::memory_order_acquire); }
  // out[i] = sum of value(j) for j < i; returns the total.
  template <class F>
  int32_t exclusive_scan(int64_t n, F value, int32_t* out) const {
    int32_t acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = acc;
      acc += value(i);
    }
    return acc;
  }
  // The leader runs f(sum of value(i) for i < n), wrapping in uint32 (doorbell counts).
  template <class V, class F>
  void sum_then_lead(int64_t n, V value, F f) const {
    uint32_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += value(i);
    f(total);
  }
  static uint64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static void backoff(uint32_t attempt) {
    // Spin briefly, then sleep, twice as long every 2 attempts up to 1 ms: an idle engine must
    // not burn a host CPU (every sleep costs a wake-up: 20 us sleeps kept a core 30 % busy),
    // and a request that arrives waits at most about 1 ms more.
    if (attempt < 64) return;
    const uint32_t doublings = (attempt - 64) / 2;
    std::this_thread::sleep_for(std::chrono::microseconds(doublings >= 10 ? 1000 : 1u << doublings));
  }
  // A paced wait's sleep: at most 200 us at a time, so that a doorbell is seen soon.
  static void pause_ns(uint64_t ns) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns < 200000 ? ns : 200000));
  }
};

#ifdef __CUDACC__
// One thread block (a multiple of 32 threads) runs the scheduler. `scratch` is shared memory
// of at least blockDim.x / 32 ints.
struct DeviceExec {
  int32_t* scratch;

  template <class F>
  __device__ void parallel(int64_t n, F f) const {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) f(i);
    __syncthreads();
  }
  template <class F>
  __device__ void serial(F f) const {
    if (threadIdx.x == 0) f();
    __syncthreads();
  }
  // Thread 0 alone runs f, with no barrier after it (for its own bookkeeping: the phase
  // timers, which only the device build keeps).
  template <class F>
  __device__ void lead(F f) const {
    if (threadIdx.x == 0) f();
  }
  __device__ void sync() const { __syncthreads(); }
  // Makes the relaxed loads that the last sum_then_lead over n indices ran (thread i loaded
  // index i) acquire loads: a fence by each of those threads; the next barrier orders the
  // rest of the block after it.
  __device__ void acquire_reads(int64_t n) const {
    if (threadIdx.x < n) asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
  // Warp-shuffle scan: three barriers whatever the block size (a Hillis-Steele scan over
  // shared memory needs two per doubling).
  template <class F>
  __device__ int32_t exclusive_scan(int64_t n, F value, int32_t* out) const {
    const int t = threadIdx.x, nt = blockDim.x, ln = t & 31, warp = t >> 5;
    const int nwarps = (nt + 31) >> 5;
    const int64_t chunk = (n + nt - 1) / nt, lo = t * chunk;
    const int64_t hi = lo + chunk < n ? lo + chunk : n;
    int32_t local = 0;
    for (int64_t i = lo; i < hi; ++i) local += value(i);
    int32_t incl = local;
    for (int o = 1; o < 32; o <<= 1) {
      int32_t u = __shfl_up_sync(0xffffffffu, incl, o);
      if (ln >= o) incl += u;
    }
    if (ln == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int32_t w = ln < nwarps ? scratch[ln] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        int32_t u = __shfl_up_sync(0xffffffffu, w, o);
        if (ln >= o) w += u;
      }
      if (ln < nwarps) scratch[ln] = w;  // inclusive prefix of warp totals
    }
    __syncthreads();
    int32_t acc = incl - local + (warp > 0 ? scratch[warp - 1] : 0);
    for (int64_t i = lo; i < hi; ++i) {
      out[i] = acc;
      acc += value(i);
    }
    int32_t total = scratch[nwarps - 1];
    __syncthreads();
    return total;
  }
  // A warp-shuffle reduction and one barrier, then thread 0 runs f(total) and a second
  // barrier: two barriers where a scan followed by a serial phase takes four.
  template <class V, class F>
  __device__ void sum_then_lead(int64_t n, V value, F f) const {
    uint32_t local = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) local += value(i);
    for (int o = 16; o > 0; o >>= 1) local += __shfl_down_sync(0xffffffffu, local, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = int32_t(local);
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t total = 0;
      for (int w = 0; w < int(blockDim.x + 31) >> 5; ++w) total += uint32_t(scratch[w]);
      f(total);
    }
    __syncthreads();
  }
  __device__ static uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ static void backoff(uint32_t attempt) {
    __nanosleep(attempt < 64 ? 100 : 1000);
  }
  // A paced wait's sleep: at most 2 us at a time between doorbell reads (one thread, the
  // rest of the block waits at a barrier; the other SMs are idle).
  __device__ static void pause_ns(uint64_t ns) { __nanosleep(ns < 2000 ? uint32_t(ns) : 2000u); }
};
#endif
