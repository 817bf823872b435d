// Synchronization primitives, all bounded: every wait gives up after
// KernelParams::timeout_ns, records which wait failed in the host-mapped error word
// and traps, so a protocol bug fails fast with a name instead of hanging.
//
// Barriers used by the kernel:
//   grid_sync          all CTAs of this rank (persistent grid, one CTA per SM, all resident)
//   rank_sync          all CTAs of all ranks (grid_sync + one CTA signalling every peer)
//   mbarrier full/empty TMA pipeline, see pipeline.cuh
//   named barrier 1    the two math warpgroups' epilogue exchange (epilogue.cuh)
#pragma once

#include <cuda/ptx>

#include "params.h"

namespace megamoe {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

[[noreturn]] __device__ __noinline__ void fail(const KernelParams& p, uint32_t code) {
  atomicCAS_system(p.host_error, 0u, code);
  __threadfence_system();
  __trap();
  __builtin_unreachable();
}

// Polls `done()` until it is true; fails with `code` after `timeout_scale` timeouts.
// A wait that depends on another bounded wait gets the larger scale, so the wait that
// is really stuck reports first (e.g. CTAs held at a grid barrier while CTA 0 waits
// for a missing peer report the peer, not the grid barrier).
template <typename Done>
__device__ __forceinline__ void bounded_wait(const KernelParams& p, uint32_t code, Done done,
                                             uint32_t timeout_scale = 1) {
  if (done()) return;
  const uint64_t start = global_timer_ns();
  const uint64_t limit = p.timeout_ns * timeout_scale;
  for (uint32_t i = 1;; ++i) {
    if (done()) return;
    if ((i & 255) == 0 && global_timer_ns() - start > limit) fail(p, code);
  }
}

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int ld_acquire_sys(const int* ptr) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int atomic_add_release_gpu(int* ptr, int v) {
  int old;
  asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void red_add_release_gpu(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Global memory written with ordinary stores and read next by TMA (the async proxy)
// on another SM: the writer fences before publishing, the reader after acquiring.
__device__ __forceinline__ void fence_generic_to_async() { cuda::ptx::fence_proxy_async(cuda::ptx::space_global); }

__device__ __forceinline__ void red_add_release_sys(int* ptr, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Grid-wide barrier over this rank's CTAs. The counter only grows (no reset between
// calls): each arrival round ends at the next multiple of gridDim.x.
__device__ __forceinline__ void grid_sync(const KernelParams& p, int* signals) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = signals + kSigGridBarrier;
    const int old = atomic_add_release_gpu(counter, 1);
    const int target = (old / (int)gridDim.x + 1) * (int)gridDim.x;
    bounded_wait(p, kErrGridBarrierTimeout, [&] { return ld_acquire_gpu(counter) - target >= 0; }, 2);
  }
  __syncthreads();
}

__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* ptr, int v) {
  int old;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
  return old;
}

// Barrier over every CTA of every rank, in one round: each CTA arrives on this rank's
// grid counter; the last to arrive (which has acquired every other CTA's arrival)
// signals every rank once; every CTA then waits until all ranks have signalled.
// Memory written before it (local or to peers) is visible to every rank after it.
// Writers to peer memory must have issued __threadfence_system() before arriving.
// `round` counts this rank's cross-rank barriers since the buffer was made: every CTA
// reads the count at kernel start (rank_rounds_done) and passes done + i for the i-th
// barrier of the call; CTA 0 advances the stored count.
template <int kNumRanks>
__device__ __forceinline__ void rank_sync(const KernelParams& p, int* signals, int round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int old = atomic_add_acq_rel_gpu(signals + kSigGridBarrier, 1);
    if (old % (int)gridDim.x == (int)gridDim.x - 1) {
      __threadfence_system();
      for (int r = 0; r < kNumRanks; ++r) {
        int* peer_signals = reinterpret_cast<int*>(p.peer_base[r] + p.off.signals);
        red_add_release_sys(peer_signals + kSigRankBarrier, 1);
      }
    }
    const int target = round * kNumRanks;
    bounded_wait(p, kErrRankBarrierTimeout,
                 [&] { return ld_acquire_sys(signals + kSigRankBarrier) - target >= 0; });
    if (blockIdx.x == 0) signals[kSigRankBarrierDone] = round;
  }
  __syncthreads();
}

// The number of cross-rank barriers this rank completed in earlier calls.
__device__ __forceinline__ int rank_rounds_done(const int* signals) { return signals[kSigRankBarrierDone]; }

// mbarrier helpers (CTA scope, shared memory).
__device__ __forceinline__ void mbar_wait(const KernelParams& p, uint64_t* bar, uint32_t parity, uint32_t code) {
  bounded_wait(p, code, [&] { return cuda::ptx::mbarrier_try_wait_parity(bar, parity); });
}

__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace megamoe
