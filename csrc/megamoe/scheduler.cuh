// The GEMM phases' tiles: (expert, m-block, n-block), n-major inside an expert so that neighbouring
// tiles share the weight tile in L2 cache (L1's dealt round-robin over CTAs, L2's claimed in order,
// pipeline.cuh L2TileQueue); the
// pipeline position each role carries from tile to tile; the rows_arrived counters by which an L1
// tile waits for the pull of its m-block's rows; and the l1_done counters by
// which an L2 tile trails its m-block's L1 tiles.
#pragma once

#include "config.cuh"
#include "dispatch.cuh"
#include "params.h"
#include "roles.cuh"
#include "sync.cuh"

namespace megamoe {

struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  template <int kNumStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kNumStages) stage = 0, phase ^= 1;
  }
};

struct Tile {
  int expert;  // local expert
  int m_block;
  int n_block;
};

// The global m-blocks [first, end) the GEMM phases run: the current pool window's (windowed
// variants, dispatch.cuh PoolWindow), else all of the call's.
template <class Cfg>
__device__ __forceinline__ int first_gemm_mblock(const ExpertTables& tables) {
  return Cfg::kWindowed ? tables.window->first_mblock : 0;
}
template <class Cfg>
__device__ __forceinline__ int end_gemm_mblock(const ExpertTables& tables) {
  return Cfg::kWindowed ? tables.window->end_mblock : tables.mblk_prefix[Cfg::kNumLocalExperts];
}

template <class Cfg>
struct TileScheduler {
  const ExpertTables& tables;
  int num_n_blocks;
  __device__ int num_tiles() const {
    return (end_gemm_mblock<Cfg>(tables) - first_gemm_mblock<Cfg>(tables)) * num_n_blocks;
  }
  __device__ Tile decode(int tile) const {
    if constexpr (Cfg::kWindowed) {
      // The window's tiles, n-major inside each expert's m-blocks of the window (the branch below is
      // this with the whole call as the window, written apart so that unwindowed variants' SASS does
      // not carry the window's arithmetic).
      const int first_gm = first_gemm_mblock<Cfg>(tables), end_gm = end_gemm_mblock<Cfg>(tables);
      const int el = last_le(tables.mblk_prefix, Cfg::kNumLocalExperts, first_gm + tile / num_n_blocks);
      const int first = max(tables.mblk_prefix[el], first_gm);
      const int num_m = min(tables.mblk_prefix[el + 1], end_gm) - first;
      const int local = tile - (first - first_gm) * num_n_blocks;
      return {el, first - tables.mblk_prefix[el] + local % num_m, local / num_m};
    }
    const int gm = tile / num_n_blocks;  // any m-block of the right expert: find the expert
    const int el = last_le(tables.mblk_prefix, Cfg::kNumLocalExperts, gm);
    const int first = tables.mblk_prefix[el] * num_n_blocks;
    const int num_m = tables.mblk_prefix[el + 1] - tables.mblk_prefix[el];
    const int local = tile - first;
    return {el, local % num_m, local / num_m};
  }
};

// L2 trails L1 without a grid barrier: each L1 tile adds 1 to l1_done[m-block] once its
// act rows are stored (l1_epilogue), and an L2 tile of that m-block starts when all
// kL1NumNBlocks have. Each CTA runs its L1 tiles before it claims L2 tiles, and no L1 tile
// waits on an L2 tile, so every wait ends.
template <class Cfg>
__device__ __forceinline__ int global_m_block(const ExpertTables& tables, const Tile& t) {
  return tables.mblk_prefix[t.expert] + t.m_block;
}

template <class Cfg>
__device__ __forceinline__ bool l1_rows_ready(const int* l1_done, int gm) {
  return ld_acquire_gpu(l1_done + gm) >= Cfg::kL1NumNBlocks;
}

// Bounded wait (acquire) for an m-block's L1 rows; false after a timeout where the tier's waits
// unwind (pipeline.cuh gemm_wait says why), else it traps. Scale 2: a stuck L1 tile's own pipeline
// wait reports first.
template <class Cfg>
__device__ __forceinline__ bool wait_l1_rows(const KernelParams& p, const int* l1_done, int gm) {
  const auto ready = [&] { return l1_rows_ready<Cfg>(l1_done, gm); };
  if constexpr (Cfg::kRebalanceRegisters) {
    return poll_bounded(p, kErrL1RowsTimeout, ready, 2);
  } else {
    bounded_wait(p, kErrL1RowsTimeout, ready, 2);
    return true;
  }
}

// L1 tiles wait for the pull: each pulled row adds 1 to rows_arrived[its
// m-block] (dispatch.cuh publish_pulled_row), and an L1 tile loads its A rows once all of its
// m-block's valid rows have come. The rows past them (the next expert's, which the tile reads
// but never stores) may still be in flight: GEMM rows are independent. The pull waits on
// nothing, so every wait ends.
template <class Cfg>
__device__ __forceinline__ bool pulled_rows_ready(const KernelParams& p, const uint8_t* base,
                                                  const ExpertTables& tables, const Tile& t) {
  const int rows = min(Cfg::kBlockM, tables.exp_count[t.expert] - t.m_block * Cfg::kBlockM);
  return ld_acquire_gpu(reinterpret_cast<const int*>(base + p.off.rows_arrived) + global_m_block<Cfg>(tables, t)) >=
         rows;
}

// Bounded wait for an L1 tile's pulled rows; false after a timeout where the tier's waits unwind
// (pipeline.cuh gemm_wait says why), else it traps.
template <class Cfg>
__device__ __forceinline__ bool wait_pulled_rows(const KernelParams& p, const uint8_t* base,
                                                 const ExpertTables& tables, const Tile& t) {
  const auto ready = [&] { return pulled_rows_ready<Cfg>(p, base, tables, t); };
  if constexpr (Cfg::kRebalanceRegisters) {
    return poll_bounded(p, kErrPulledRowsTimeout, ready);
  } else {
    bounded_wait(p, kErrPulledRowsTimeout, ready);
    return true;
  }
}

// Between the GEMM phases of the rebalanced tier (BLOCK_M 128), every thread of the CTA. The math
// warpgroups acquire every m-block's (windowed: the window's) pulled rows (pool_src) once: the L2 epilogue's per-row loads go
// out at the tile's start (Cfg::kEarlyEpilogueRows), ahead of any stage. Per tile it would be an
// acquire round trip in front of each L2 main loop; here the pull has long ended (every L1 tile
// waited for its rows); inside the math region this makes ptxas spill. Then a CTA barrier: the
// register hand-over barrier of L1 (kernel.cuh gemm_roles) must be complete before a math warp
// arrives on it for L2. Without a barrier here, a math warpgroup with no L1 tiles reaches L2's
// arrival while the producer warpgroup still waits in L1's, which then completes with the wrong
// threads, and the producer's setmaxnreg.inc waits for registers the math warpgroups hold: the
// call hangs (BLOCK_M 128 with 0 tokens). Bounded (traps: outside the regions that must unwind).
template <class Cfg>
__device__ __forceinline__ void wait_pool_pulled(const KernelParams& p, const uint8_t* base, const ExpertTables& tables) {
  if (!Role::producer_warpgroup()) {
    const int end_gm = end_gemm_mblock<Cfg>(tables);
    for (int gm = first_gemm_mblock<Cfg>(tables) + Role::math_thread(); gm < end_gm; gm += Cfg::kNumMathThreads) {
      const int el = last_le(tables.mblk_prefix, Cfg::kNumLocalExperts, gm);
      const Tile t{el, gm - tables.mblk_prefix[el], 0};
      bounded_wait(p, kErrPulledRowsTimeout, [&] { return pulled_rows_ready<Cfg>(p, base, tables, t); });
    }
  }
  __syncthreads();  // each math thread's acquire, for all; and L1's hand-over barrier is complete
}

}  // namespace megamoe
