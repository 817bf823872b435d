// Compile-time configuration of one kernel variant and its shared-memory layout.
#pragma once

#include <stdint.h>

#include "abi.h"

namespace megamoe {

template <int kHidden_, int kInter_, int kTopk_, int kNumExperts_, int kNumRanks_, int kBlockM_, int kNumStages_,
          bool kFastMath_, bool kExactL1_, bool kWindowed_ = false, bool kFp4Weights_ = false>
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
  // numerics="exact" (docs/design.md s.2): L1 on FP16 tensor cores over the exact FP8 values
  // (exact_l1.cuh mma_tile_l1). Otherwise ("fast") L1 runs on FP8 tensor cores like L2, promoted
  // into float32 every 128 K.
  static constexpr bool kExactL1 = kExactL1_;
  // The pools hold fewer rows than the worst routing needs (buffer.py BufferShape.windowed: the
  // ring of pool_capacity rows): a rank whose m-blocks need more runs them in windows of
  // consecutive m-blocks, the first in the fused kernel, the rest in the window kernel that the
  // host launches after it (kernel.cuh mega_moe_windows). Unwindowed variants compile none of it.
  static constexpr bool kWindowed = kWindowed_;
  // MXFP4 expert weights (docs/design.md section 2, "FP4 experts"; fp4_weights.cuh): the stages carry
  // the packed E2M1 codes and their E8M0 scales, half the bytes of FP8 weights, and each math
  // warpgroup converts its 128 rows of a k-block into an FP8 tile before the WGMMAs (at BLOCK_M 128
  // both warpgroups read all 256 rows of the tile). So far in fast numerics.
  static constexpr bool kFp4Weights = kFp4Weights_;

  // A GEMM tile is BLOCK_M pool rows x 256 weight rows x 128 (K). Exact L1 is always swap-AB on
  // FP16 tensor cores (weight rows on the WGMMA M side as two m64 sub-tiles per warpgroup,
  // warpgroup w taking weight rows [128w, 128w + 128), pool rows the N side, m64nBLOCK_Mk16;
  // exact_l1.cuh mma_tile_l1). FP8 GEMMs (L2, and L1 in fast mode): BLOCK_M 8/16/32 (decode tiers)
  // swap-AB the same way (m64nBLOCK_Mk32), so a tile with a few tokens does not pay for 64 rows
  // of MMA; BLOCK_M 64 and 128 with pool rows on the M side (m64n128k32, mma.cuh mma_tile).
  static constexpr bool kFp8SwapAB = kBlockM < 64;
  // BLOCK_M 128 (fast numerics only): cooperative, math warpgroup w takes rows [64w, 64w + 64)
  // and all 256 weight rows as two halves that share its token operand, so each weight tile
  // feeds twice the tokens (half the weight traffic per token of BLOCK_M 64). Its 128-float
  // accumulator plus a 64-float k-block part need more than the 168 registers a thread of a
  // 384-thread CTA starts with: the math warpgroups take kMathRegisters, warpgroup 0 (producer)
  // gives up to kProducerRegisters for the GEMM phases (setmaxnreg, kernel.cuh).
  static constexpr int kWgHalves = kBlockM == 128 ? 2 : 1;
  static constexpr bool kRebalanceRegisters = kBlockM == 128;
  static constexpr int kEntryRegisters = 168;  // 65536 / 384, in setmaxnreg's steps of 8
  // 224 x 256 + 56 x 128 = 168 x 384, the CTA's registers at launch: setmaxnreg moves registers
  // within that pool, and a larger sum leaves the math warps' increase waiting forever (232 + 48
  // hangs every BLOCK_M 128 call). The producer warpgroup's warp 1 counts the L2 tiles' rows for
  // the combine (combine.cuh signal_l2_rows), which 40 registers cannot hold without spilling;
  // 224 + 56 compiles clean (docs/design.md section 9).
  static constexpr int kMathRegisters = 224;
  static constexpr int kProducerRegisters = 56;
  // The epilogues' per-row loads go out before the main loop where the registers allow
  // (epilogue.cuh EpilogueRows): at BLOCK_M 128. At BLOCK_M 64, L2's four values live across the
  // main loop made ptxas spill (12 bytes in fast numerics, 32 in exact with fast_math=False).
  static constexpr bool kEarlyEpilogueRows = kRebalanceRegisters;
  // The window kernel (kernel.cuh mega_moe_windows) runs the pool windows after the first in a loop,
  // except at the rebalanced tier: there a loop around the setmaxnreg regions made ptxas spill 1.5 KB
  // and serialize the WGMMAs, and racecheck reported hazards from the loop's second window on
  // (docs/design.md 4.9), so the host launches the window kernel once per window a call can have
  // (buffer.py BufferShape.window_kernel_launches; the JIT source checks it agrees).
  static constexpr bool kWindowLoop = !kRebalanceRegisters;
  // The first pool row of the tile that warpgroup `wg` computes, and the 128-row weight block
  // of the tile its half `h` covers (mma_tile, l1_epilogue, l2_epilogue).
  static constexpr int wg_first_row(int wg) { return kWgHalves == 2 ? 64 * wg : 0; }
  static constexpr int wg_weight_block(int wg, int h) { return kWgHalves == 2 ? h : wg; }
  // L1 tiles start when the rows of their m-block are in the pool (rows_arrived, scheduler.cuh), not
  // after a grid barrier, in both numerics (exact L1's converter warps read their token scales after
  // the stage's full barrier, which orders them after the producer's acquire of the rows). Where
  // kPullDuringL1, every warp pulls kPullHeadRowsPerWarp rows before the GEMM phases (all of a decode
  // call's rows) and the producer warpgroup's warps 1-3, idle in fast L1 (exact L1's token
  // converters), pull the rest while the L1 tiles run (kernel.cuh); elsewhere every warp pulls every
  // row first.
  // Only where L1 has the work per pulled row to hide three warps' pull: 4 I FLOPs per byte,
  // whatever H. At I 768 (the e2e and qwen30 shapes) L1 tiles wait on the pullers, and pulling
  // every row first with all 12 warps is the faster schedule; at I 2048 (v3, v4flash) the two are
  // level (docs/design.md section 9).
  static constexpr bool kPullDuringL1 = !kExactL1 && kInter >= 2048;
  static constexpr int kPullHeadRowsPerWarp = 2;
  // Slots of the L2 tile queue (pipeline.cuh L2TileQueue): more than the tiles the producer can run
  // ahead of the math warpgroups (it runs at most kNumStages k-blocks ahead).
  static constexpr int kL2TileSlots = kNumStages + 2;
  static constexpr int kSwapSubTiles = 2;  // m64 sub-tiles per warpgroup in swap-AB
  // Accumulator floats per math thread: 2 sub-tiles of m64nBLOCK_M (swap-AB), m64n128 (BLOCK_M 64)
  // or two m64n128 halves (BLOCK_M 128): BLOCK_M in every case.
  static constexpr int kAccFloats = kSwapSubTiles * kBlockM / 2;
  static constexpr int kBlockN = megamoe::kBlockN;
  static constexpr int kBlockK = megamoe::kBlockK;
  static constexpr int kWgN = 128;
  // L1: 256 interleaved gate/up rows = 128 outputs = exactly one requant group.
  static constexpr int kL1NumNBlocks = 2 * kInter / kBlockN;
  static constexpr int kL2NumNBlocks = (kHidden + kBlockN - 1) / kBlockN;
  static constexpr int kL1NumKBlocks = kHidden / kBlockK;
  static constexpr int kL2NumKBlocks = kInter / kBlockK;

  // Threads: warpgroup 0 = TMA producer (warp 0) and, in exact L1, token converters (warps 1-3) in
  // the GEMM phases; warpgroups 1-2 = math.
  static constexpr int kNumThreads = megamoe::kNumThreads;
  static constexpr int kNumWarps = kNumThreads / 32;
  static constexpr int kNumMathThreads = megamoe::kNumMathThreads;

  // Shared memory sizes (abi.h, which says why each is what it is); the layout is smem.cuh SharedStorage.
  static constexpr int kAmaxSlots = megamoe::kAmaxSlots;
  static constexpr int kQuadLineBytes = quad_line_bytes(kBlockM, kExactL1);
  static constexpr int kL1TokenBytes = l1_token_bytes(kBlockM, kExactL1);
  static constexpr int kStageA = kBlockM * kBlockK;
  static constexpr int kStageB = stage_b_bytes(kFp4Weights);
  static constexpr int kStageScaleFloats = stage_scale_floats(kBlockM);
  static constexpr int kStageScaleBytes = 4 * kStageScaleFloats;
  static constexpr int kStageWeightScaleBytes = stage_weight_scale_bytes(kFp4Weights);
  static constexpr int kStageBytes = stage_bytes(kBlockM, kFp4Weights);
  // Dispatch-phase scratch aliases the stage area: first the per-CTA expert histogram
  // and the send-side prefix over all experts, then per (local expert, source rank)
  // counts and offsets; each plus 32 ints of scan scratch.
  static constexpr int kSendScratchInts = 2 * kNumExperts + 32;
  static constexpr int kRecvScratchInts = 2 * kNumLocalExperts * kNumRanks + 32;
  static constexpr int kScratchInts = kSendScratchInts > kRecvScratchInts ? kSendScratchInts : kRecvScratchInts;

  static_assert(kHidden % 128 == 0 && kInter % 128 == 0, "H and I must be multiples of 128");
  static_assert(kBlockM == 8 || kBlockM == 16 || kBlockM == 32 || kBlockM == 64 || (kBlockM == 128 && !kExactL1),
                "this kernel implements BLOCK_M 8, 16, 32, 64, and 128 in fast numerics");
  static_assert(!kRebalanceRegisters ||
                    kProducerRegisters * 128 + kMathRegisters * kNumMathThreads <= kEntryRegisters * kNumThreads,
                "register rebalancing within the CTA's registers at launch (setmaxnreg's pool)");
  static_assert(!kRebalanceRegisters || (!kExactL1 && !kFp8SwapAB),
                "a rebalanced tier's GEMM waits must all unwind (pipeline.cuh gemm_wait): only mma_tile's do");
  static_assert(kNumExperts % kNumRanks == 0, "E must be a multiple of R");
  static_assert(kNumStages >= min_stages(kBlockM, kFp4Weights), "too few pipeline stages (abi.h min_stages)");
  static_assert(!kFp4Weights || !kExactL1, "MXFP4 weights: fast numerics only so far");
};

}  // namespace megamoe
