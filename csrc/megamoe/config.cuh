// Compile-time configuration of one kernel variant and its shared-memory layout.
#pragma once

#include <stdint.h>

namespace megamoe {

template <int kHidden_, int kInter_, int kTopk_, int kNumExperts_, int kNumRanks_, int kBlockM_, int kNumStages_,
          bool kFastMath_>
struct KernelConfig {
  static constexpr int kHidden = kHidden_;
  static constexpr int kInter = kInter_;
  static constexpr int kTopk = kTopk_;
  static constexpr int kNumExperts = kNumExperts_;
  static constexpr int kNumRanks = kNumRanks_;
  static constexpr int kNumLocalExperts = kNumExperts_ / kNumRanks_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kNumStages = kNumStages_;
  static constexpr bool kFastMath = kFastMath_;

  // A GEMM tile is BLOCK_M pool rows x 256 weight rows x 128 (K); math warpgroup w
  // computes weight rows [128w, 128w+128). BLOCK_M 64: pool rows are the WGMMA M side
  // (m64n128k32). BLOCK_M 8/16/32 (decode tiers): swap-AB, the weight rows are the M side
  // (two m64 sub-tiles per warpgroup) and the pool rows the N side (m64nBLOCK_Mk32), so a
  // tile with a few tokens does not pay for 64 rows of MMA.
  static constexpr bool kSwapAB = kBlockM < 64;
  static constexpr int kSwapSubTiles = 2;  // m64 sub-tiles per warpgroup in swap-AB
  // Accumulator floats per math thread: m64n128 (64), or 2 sub-tiles of m64nBLOCK_M.
  static constexpr int kAccFloats = kSwapAB ? kSwapSubTiles * kBlockM / 2 : 64;
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 128;
  static constexpr int kWgN = 128;
  // K depth accumulated inside WGMMA before promotion to float32 registers (32..128).
  // Measured on H200 (docs/results): 32 instead of 128 lowered the 99th-percentile
  // per-row error only from 1.3e-2 to 8.3e-3 and cost 30-45% of the time, so 128.
  static constexpr int kPromoteK = 128;
  // L1: 256 interleaved gate/up rows = 128 outputs = exactly one requant group.
  static constexpr int kL1NumNBlocks = 2 * kInter / kBlockN;
  static constexpr int kL2NumNBlocks = (kHidden + kBlockN - 1) / kBlockN;
  static constexpr int kL1NumKBlocks = kHidden / kBlockK;
  static constexpr int kL2NumKBlocks = kInter / kBlockK;

  // Threads: warpgroup 0 = TMA producer (warp 0) + idle in GEMM phases; 1-2 = math.
  static constexpr int kNumThreads = 384;
  static constexpr int kNumWarps = kNumThreads / 32;
  static constexpr int kNumMathThreads = 256;

  // Shared memory (bytes from a 1024-aligned base).
  static constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }
  static constexpr int kSmemBarriers = 0;  // full[kNumStages], empty[kNumStages]
  // float [2 parities][2 warpgroups][BLOCK_M]; swap-AB: [2 parities][8 math warps][BLOCK_M]
  static constexpr int kSmemAmax = 1024;
  static constexpr int kAmaxSlots = kSwapAB ? 8 : 2;  // 8 = kNumMathThreads / 32
  static constexpr int kSmemTables = kSmemAmax + 2 * kAmaxSlots * kBlockM * 4;
  // int32 exp_start[E_l], exp_count[E_l], mblk_prefix[E_l + 1]
  static constexpr int kSmemStages = align_up(kSmemTables + (3 * kNumLocalExperts + 1) * 4, 1024);
  static constexpr int kStageA = kBlockM * kBlockK;
  static constexpr int kStageB = kBlockN * kBlockK;
  static constexpr int kStageBytes = align_up(kStageA + kStageB, 1024);
  static constexpr int kSmemBytes = kSmemStages + kNumStages * kStageBytes;
  // Dispatch-phase scratch aliases the stage area: first the per-CTA expert histogram
  // and the send-side prefix over all experts, then per (local expert, source rank)
  // counts and offsets; each plus 32 ints of scan scratch.
  static constexpr int kSendScratchInts = 2 * kNumExperts + 32;
  static constexpr int kRecvScratchInts = 2 * kNumLocalExperts * kNumRanks + 32;
  static constexpr int kScratchInts = kSendScratchInts > kRecvScratchInts ? kSendScratchInts : kRecvScratchInts;

  static_assert(kHidden % 128 == 0 && kInter % 128 == 0, "H and I must be multiples of 128");
  static_assert(kBlockM == 64 || kBlockM == 8 || kBlockM == 16 || kBlockM == 32,
                "this kernel implements BLOCK_M 64 and the swap-AB tiers 8, 16, 32");
  static_assert(kNumExperts % kNumRanks == 0, "E must be a multiple of R");
  static_assert(kNumStages >= 2, "need at least two pipeline stages");
  static_assert(kScratchInts * 4 <= kNumStages * kStageBytes, "dispatch scratch does not fit");
  static_assert(kSmemBytes <= 232448, "shared memory over the SM90 per-block limit");
};

}  // namespace megamoe
