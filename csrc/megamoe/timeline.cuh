// Per-tile clock records of the GEMM phases, for finding where a tile's time goes (abi.h
// gives the layout, tools/tile_timeline.py reads it). Compiled in only where the JIT defines
// MEGAMOE_TIMELINE (KernelVariant.timeline, which ops.fp8_mega_moe's `_timeline` argument
// selects): elsewhere every function here is empty and the clocks are constant zeros, so the
// served kernels carry none of it.
#pragma once

#include <stdint.h>

#include "params.h"
#include "roles.cuh"

#ifndef MEGAMOE_TIMELINE
#define MEGAMOE_TIMELINE 0
#endif

namespace megamoe {

constexpr bool kTimeline = MEGAMOE_TIMELINE != 0;

// SM cycles for durations (fine-grained, per SM); globaltimer (ns) to line SMs up.
__device__ __forceinline__ uint64_t timeline_clock() {
  if constexpr (kTimeline) return clock64();
  return 0;
}

__device__ __forceinline__ uint64_t timeline_ns() {
  uint64_t t = 0;
  if constexpr (kTimeline) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long* timeline_record(const KernelParams& p, int slot, int record) {
  return p.timeline + ((static_cast<int64_t>(blockIdx.x) * kTimelineSlots + slot) * kTimelineRecords + record) * kTimelineWords;
}

__device__ __forceinline__ void timeline_write(const KernelParams& p, int phase, int record, const uint64_t (&w)[kTimelineWords]) {
  unsigned long long* dst = timeline_record(p, phase, record);
#pragma unroll
  for (int i = 0; i < kTimelineWords; ++i) dst[i] = w[i];
}

// One math warpgroup's tile, recorded by its first thread. 32-bit clocks (a tile lasts far less
// than 2^32 cycles; the reader takes differences modulo 2^32) and no globaltimer at the start:
// the fewer registers live across the main loop, the less the clock reads change it (BLOCK_M 64
// has 168 registers in all).
struct TileClock {
  uint32_t start = tile_clock();
  uint32_t mainloop_end = 0;
  uint32_t full_wait = 0;  // cycles spent waiting for full stages (mma.cuh mma_tile, mma_tile_swap)
  __device__ static uint32_t tile_clock() { return static_cast<uint32_t>(timeline_clock()); }
  __device__ void mainloop_done() { mainloop_end = tile_clock(); }
  __device__ void record(const KernelParams& p, int phase, int tile_of_cta, int wg) const {
    if constexpr (kTimeline) {
      if (p.timeline == nullptr || tile_of_cta >= kTimelineMaxTiles || Role::thread_in_warpgroup() != 0) return;
      const uint64_t w[kTimelineWords] = {start, mainloop_end, tile_clock(), full_wait, timeline_ns(), 0, 0};
      timeline_write(p, phase, 1 + 2 * tile_of_cta + wg, w);
    }
  }
};

// The producer's phase: cycles waiting for empty stages, tiles, span, and cycles waiting for its
// tiles' A rows to arrive (pulled rows in L1, L1's output in trailing L2).
struct ProducerClock {
  uint64_t start = timeline_clock(), start_ns = timeline_ns();
  uint64_t empty_wait = 0, arrival_wait = 0;
  int tiles = 0;
  __device__ void record(const KernelParams& p, int phase) const {
    if constexpr (kTimeline) {
      if (p.timeline == nullptr) return;
      const uint64_t w[kTimelineWords] = {empty_wait, static_cast<uint64_t>(tiles), start, timeline_clock(), start_ns,
                                          timeline_ns(), arrival_wait};
      timeline_write(p, phase, 0, w);
    }
  }
};

// The calling warp's share of the pull has ended: `part` 0 for the rows pulled before L1
// (dispatch.cuh dispatch_pull), 1 for those pulled during it (pull_rows_during_l1). Against the L2
// tiles' records this shows whether the scatter (L2 epilogues) and the pull ever use the links at
// once (tools/tile_timeline.py). Lane 0 of every warp, after its pull loop: part 0 outside the GEMM
// regions, part 1 inside the producer warpgroup's L1 region (its puller warps, kernel.cuh).
__device__ __forceinline__ void record_pull_end(const KernelParams& p, int part) {
  if constexpr (kTimeline) {
    if (p.timeline == nullptr || threadIdx.x % 32 != 0) return;
    timeline_record(p, kTimelinePullSlot, threadIdx.x / 32)[part] = timeline_ns();
  }
}

}  // namespace megamoe
