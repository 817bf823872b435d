// Synchronization primitives, all bounded: every wait gives up after
// KernelParams::timeout_ns, records which wait failed in the host-mapped HostWords::error
// and traps, so a protocol bug fails fast with a name instead of hanging.
//
// Barriers used by the kernel:
//   grid_sync          all CTAs of this rank (persistent grid, one CTA per SM, all resident)
//   rank_sync          all CTAs of all ranks (grid_sync + one CTA signalling every peer), which
//                      also checks that every rank makes the same call
//   mbarrier full/empty TMA pipeline, see pipeline.cuh
//   named barrier 1    the two math warpgroups' epilogue exchange (epilogue.cuh)
//   named barrier 2    the register hand-over at the start of a rebalanced GEMM phase
//   named barriers 3-4 math warpgroup 0's / 1's MXFP4 weight conversion (mma.cuh fp4_convert_stage)
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

// Records which wait failed, on which rank, in which kernel variant (HostWords::error): the host
// names all three even when nobody synchronizes (a CUDA graph replay). The first wins.
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

// What a failing wait saw (HostWords::detail, whose low byte is the code), stored before its fail():
// every failing thread stores its whole detail before its compare-and-swap of the error word, so a
// reader that finds the error word set reads a whole detail, even if the kernel traps meanwhile.
__device__ __forceinline__ void store_failure_detail(const KernelParams& p, unsigned long long detail) {
  *reinterpret_cast<volatile unsigned long long*>(&p.host->detail) = detail;
  __threadfence_system();
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

__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* ptr) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(unsigned long long* ptr, unsigned long long v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Every counter that lives across calls is wrap-safe by construction (docs/design.md s.4: a
// server calls the kernel billions of times):
//   - the grid barrier's arrival count resets itself (atom.inc wraps to 0 at the grid size),
//     so it is 0 between barriers whatever the history; its waiters watch a generation word
//     for a change (!=), which is correct across 2^32;
//   - the call numbers (a rank's completed cross-rank barriers, and the numbers its peers' arrival
//     slots hold) grow by one per call (mod 2^32) and are compared by signed difference, correct
//     while two are within 2^31 of each other (they differ by at most one call).
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

// This rank's arrival slot for peer `src` (abi.h kSigRankArrivals).
__device__ __forceinline__ unsigned long long* rank_arrival_slot(uint32_t* signals, int src) {
  return reinterpret_cast<unsigned long long*>(signals + kSigRankArrivals) + src;
}

// Barrier over every CTA of every rank, in one round, that also checks every rank makes the same
// call. Each CTA arrives on this rank's grid counter; the last to arrive (which has acquired every
// other CTA's arrival) stores {call, p.call_tag} into this rank's slot at every rank; every CTA then
// waits until each slot here holds this call or a later one. A slot that holds this call with
// another tag means the ranks paired different calls (one skipped a call, made an extra one, called
// another layer or numerics mode, or refused its call): every rank sees the other's slot, so each
// stops with kErrCallMismatch naming the other, and none passes the barrier. A later call in a
// slot is a peer that passed this barrier, so it had found this rank's tag equal to its own.
// A timeout names the first rank, waiting from this one in rank order, whose slot stayed behind.
// Memory written before it (local or to peers) is visible to every rank after it: each CTA's thread 0
// fences at system scope after the CTA barrier, before arriving, which orders every thread's writes
// that the barrier ordered before it (a fence is cumulative), so the writers need no fence of their own.
// `call` numbers this rank's calls on the buffer since it was made (mod 2^32): every CTA reads the
// count at kernel start (rank_rounds_done) and passes done + 1; CTA 0 advances the stored count.
template <int kNumRanks>
__device__ __forceinline__ void rank_sync(const KernelParams& p, uint32_t* signals, uint32_t call) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (arrive_grid(signals + kSigGridArrivals)) {
      __threadfence_system();
      const unsigned long long arrival = static_cast<unsigned long long>(p.call_tag) << 32 | call;
      for (int r = 0; r < kNumRanks; ++r) {
        if (r == p.rank) continue;
        uint32_t* peer_signals = reinterpret_cast<uint32_t*>(p.peer_base[r] + p.off.signals);
        st_release_sys_u64(rank_arrival_slot(peer_signals, p.rank), arrival);
      }
      // Its own slot last: once it shows, every peer holds this rank's arrival (release), so a rank
      // that stops at the check below has told every peer what it called first, and each peer stops
      // by name too, instead of waiting for an arrival that a trap cut off.
      st_release_sys_u64(rank_arrival_slot(signals, p.rank), arrival);
    }
    // Rank by rank, from this one: a timeout's code names the rank waited for (kErrRankNotArrived + r). The
    // failure paths are this lean on purpose: a mask of every missing rank, computed here or in a
    // helper, cost the BLOCK_M 64 variants 28-124 B of spills.
    for (int i = 0; i < kNumRanks; ++i) {
      const int r = (p.rank + i) % kNumRanks;  // this rank's own slot first (see above)
      unsigned long long slot;
      bounded_wait(p, kErrRankNotArrived + r, [&] {
        slot = ld_acquire_sys_u64(rank_arrival_slot(signals, r));
        return reached(static_cast<uint32_t>(slot), call);
      });
      if (static_cast<uint32_t>(slot) == call && static_cast<uint32_t>(slot >> 32) != p.call_tag) {
        store_failure_detail(p, kErrCallMismatch | static_cast<unsigned long long>(r) << kDetailPeerShift |
                                    static_cast<unsigned long long>(p.call_tag) << kDetailOwnTagShift |
                                    (slot >> 32) << kDetailPeerTagShift);
        fail(p, kErrCallMismatch);
      }
    }
    if (blockIdx.x == 0) signals[kSigRankBarrierDone] = call;
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

constexpr int kFp4ConvertBarrierId = 3;  // + the math warpgroup

__device__ __forceinline__ void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// Counts this thread towards barrier `id`'s num_threads without waiting for the others.
__device__ __forceinline__ void named_barrier_arrive(int id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

}  // namespace megamoe
