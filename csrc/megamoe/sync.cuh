// Synchronization primitives, all bounded: every wait gives up after
// KernelParams::timeout_ns, records which wait failed in the host-mapped HostWords::error
// and traps, so a protocol bug fails fast with a name instead of hanging.
//
// Barriers used by the kernel:
//   grid_sync          all CTAs of this rank (persistent grid, one CTA per SM, all resident)
//   rank_sync          all CTAs of all ranks (grid_sync + one CTA signalling every peer)
//   mbarrier full/empty TMA pipeline, see pipeline.cuh
//   named barrier 1    the two math warpgroups' epilogue exchange (epilogue.cuh)
//   named barrier 2    the register hand-over at the start of a rebalanced GEMM phase
//                      (kernel.cuh gemm_roles)
#pragma once

#include <cuda/ptx>

#include "params.h"

namespace megamoe {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records which wait failed, on which rank, in which kernel variant (HostWords::error): the
// host names all three even when nobody synchronizes (a CUDA graph replay). The first wins.
__device__ __forceinline__ void report_failure(const KernelParams& p, uint32_t code) {
  const uint32_t word = code | static_cast<uint32_t>(p.rank) << kErrorRankShift | p.kernel_tag << kErrorTagShift;
  atomicCAS_system(&p.host->error, 0u, word);
  __threadfence_system();
}

// Ends the kernel after a failure was reported (the trap kills the CUDA context).
[[noreturn]] __device__ __noinline__ void trap_reported() {
  __trap();
  __builtin_unreachable();
}

[[noreturn]] __device__ __noinline__ void fail(const KernelParams& p, uint32_t code) {
  report_failure(p, code);
  trap_reported();
}

// Polls `done()` until it is true (returns false) or `timeout_scale` timeouts have passed
// (returns true). A wait that depends on another bounded wait gets the larger scale, so the
// wait that is really stuck reports first (e.g. CTAs held at a grid barrier while CTA 0 waits
// for a missing peer report the peer, not the grid barrier).
template <typename Done>
__device__ __forceinline__ bool timed_out_waiting(const KernelParams& p, Done done, uint32_t timeout_scale) {
  if (done()) return false;
  const uint64_t start = global_timer_ns();
  const uint64_t limit = p.timeout_ns * timeout_scale;
  for (uint32_t i = 1;; ++i) {
    if (done()) return false;
    if ((i & 255) == 0 && global_timer_ns() - start > limit) return true;
  }
}

// Waits for `done()`; on a timeout fails with `code` (reports, traps).
template <typename Done>
__device__ __forceinline__ void bounded_wait(const KernelParams& p, uint32_t code, Done done,
                                             uint32_t timeout_scale = 1) {
  if (timed_out_waiting(p, done, timeout_scale)) fail(p, code);
}

// Waits for `done()`; on a timeout reports `code` and returns false (no trap).
template <typename Done>
__device__ __forceinline__ bool poll_bounded(const KernelParams& p, uint32_t code, Done done,
                                             uint32_t timeout_scale = 1) {
  if (!timed_out_waiting(p, done, timeout_scale)) return true;
  report_failure(p, code);
  return false;
}

// Acquire load of a 32-bit word (int or uint32_t) at GPU scope.
template <class Word>
__device__ __forceinline__ Word ld_acquire_gpu(const Word* ptr) {
  static_assert(sizeof(Word) == 4, "a 32-bit word");
  Word v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// After a fence (release by fence): the adds of a batch of published items share one fence.
__device__ __forceinline__ void red_add_relaxed_gpu(int* ptr, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_gpu(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Global memory written with ordinary stores and read next by TMA (the async proxy)
// on another SM: the writer fences before publishing, the reader after acquiring.
__device__ __forceinline__ void fence_generic_to_async() { cuda::ptx::fence_proxy_async(cuda::ptx::space_global); }

__device__ __forceinline__ void red_add_release_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Every counter that lives across calls is wrap-safe by construction (docs/design.md s.4: a
// server calls the kernel billions of times):
//   - the grid barrier's arrival count resets itself (atom.inc wraps to 0 at the grid size),
//     so it is 0 between barriers whatever the history; its waiters watch a generation word
//     for a change (!=), which is correct across 2^32;
//   - the cross-rank arrival count and the round number only ever grow by whole rounds of
//     kNumRanks (mod 2^32) and are compared by signed difference, correct while the two are
//     within 2^31 of each other (they differ by at most one round).
// tests/gpu/test_wrap.py starts both next to 2^31 and 2^32 and runs calls across the edge.

// The arrival of one CTA at this rank's grid counter; true for the last of gridDim.x, which
// leaves the counter at 0. acq_rel: the last arrival acquires every earlier one (they form
// one release sequence on the counter).
__device__ __forceinline__ bool arrive_grid(uint32_t* counter) {
  uint32_t old;
  asm volatile("atom.inc.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(gridDim.x - 1) : "memory");
  return old == gridDim.x - 1;
}

__device__ __forceinline__ void st_release_gpu(uint32_t* ptr, uint32_t v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Grid-wide barrier over this rank's CTAs. The generation is read before arriving (the
// arrival's release orders the read first), so it is the one this barrier ends: it cannot
// change before every CTA, this one included, has arrived.
__device__ __forceinline__ void grid_sync(const KernelParams& p, uint32_t* signals) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* generation = signals + kSigGridGeneration;
    const uint32_t gen = *reinterpret_cast<volatile uint32_t*>(generation);
    if (arrive_grid(signals + kSigGridArrivals)) {
      st_release_gpu(generation, gen + 1);
    } else {
      bounded_wait(p, kErrGridBarrierTimeout, [&] { return ld_acquire_gpu(generation) != gen; }, 2);
    }
  }
  __syncthreads();
}

// a >= b for counters mod 2^32 that are within 2^31 of each other.
__device__ __forceinline__ bool reached(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// Barrier over every CTA of every rank, in one round: each CTA arrives on this rank's
// grid counter; the last to arrive (which has acquired every other CTA's arrival)
// signals every rank once; every CTA then waits until all ranks have signalled.
// Memory written before it (local or to peers) is visible to every rank after it.
// Writers to peer memory must have issued __threadfence_system() before arriving.
// `round` counts this rank's cross-rank barriers since the buffer was made (mod 2^32):
// every CTA reads the count at kernel start (rank_rounds_done) and passes done + i for
// the i-th barrier of the call; CTA 0 advances the stored count.
template <int kNumRanks>
__device__ __forceinline__ void rank_sync(const KernelParams& p, uint32_t* signals, uint32_t round) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (arrive_grid(signals + kSigGridArrivals)) {
      __threadfence_system();
      for (int r = 0; r < kNumRanks; ++r) {
        uint32_t* peer_signals = reinterpret_cast<uint32_t*>(p.peer_base[r] + p.off.signals);
        red_add_release_sys(peer_signals + kSigRankBarrier, 1);
      }
    }
    const uint32_t target = round * kNumRanks;
    bounded_wait(p, kErrRankBarrierTimeout, [&] { return reached(ld_acquire_sys(signals + kSigRankBarrier), target); });
    if (blockIdx.x == 0) signals[kSigRankBarrierDone] = round;
  }
  __syncthreads();
}

// The number of cross-rank barriers this rank completed in earlier calls (mod 2^32).
__device__ __forceinline__ uint32_t rank_rounds_done(const uint32_t* signals) { return signals[kSigRankBarrierDone]; }

// mbarrier helpers (CTA scope, shared memory).
__device__ __forceinline__ void mbar_wait(const KernelParams& p, uint64_t* bar, uint32_t parity, uint32_t code) {
  bounded_wait(p, code, [&] { return cuda::ptx::mbarrier_try_wait_parity(bar, parity); });
}

// mbar_wait that reports a timeout and returns false (warp-uniformly) instead of trapping.
__device__ __forceinline__ bool mbar_poll(const KernelParams& p, uint64_t* bar, uint32_t parity, uint32_t code) {
  return __all_sync(__activemask(), poll_bounded(p, code, [&] { return cuda::ptx::mbarrier_try_wait_parity(bar, parity); }));
}

__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Counts this thread towards barrier `id`'s num_threads without waiting for the others.
__device__ __forceinline__ void named_barrier_arrive(int id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace megamoe
