// The FP8 main loops (L2, and L1 in fast numerics): WGMMA FP8 into a per-k-block accumulator,
// promoted into float32 with the activation (per row) and weight (per 128x128 block) scales, as
// DeepGEMM-style block-scaled FP8 GEMMs do. mma_tile: pool rows on the WGMMA M side (BLOCK_M 64
// and the cooperative 128); mma_tile_swap: tokens on the N side (BLOCK_M 8/16/32). Also the
// accumulator fragment layout the epilogues read (FragCoord).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cuda/ptx>
#include <type_traits>
#include <utility>

#include "config.cuh"
#include "fp4_weights.cuh"
#include "params.h"
#include "pipeline.cuh"
#include "scheduler.cuh"
#include "sync.cuh"
#include "timeline.cuh"

namespace megamoe {

// WGMMA shared-memory descriptor for a K-major tile with 128-byte rows, 128B swizzle:
// 8-row core groups 1024 bytes apart (SBO), leading offset unused for swizzled K-major.
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t desc = 0;
  desc |= (uint64_t)((addr & 0x3FFFF) >> 4);
  desc |= (uint64_t)1 << 16;            // leading byte offset (ignored)
  desc |= (uint64_t)(1024 >> 4) << 32;  // stride byte offset
  desc |= (uint64_t)1 << 62;            // SWIZZLE_128B
  return desc;
}


// A value every lane of the warp holds the same copy of, as lane 0's: ptxas cannot prove a
// thread-index expression warp-uniform, a shuffle result it treats as one.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// m64nNk32 FP8 WGMMA for the swap-AB tiers (N = BLOCK_M tokens).
template <int N> struct SwapWgmma;
template <> struct SwapWgmma<8> { using Op = cute::SM90::GMMA::MMA_64x8x32_F32E4M3E4M3_SS_TN<>; };
template <> struct SwapWgmma<16> { using Op = cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_SS_TN<>; };
template <> struct SwapWgmma<32> { using Op = cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_SS_TN<>; };

template <class Op, int... I>
__device__ __forceinline__ void wgmma_call(uint64_t da, uint64_t db, float* d, bool accumulate,
                                           std::integer_sequence<int, I...>) {
  Op::fma(da, db, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

template <int kNum>
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
  for (int i = 0; i < kNum; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator fragment of m64n128 (per thread): d[4c + {0,1}] = row r0, columns 8c + 2q + {0,1};
// d[4c + {2,3}] = row r0 + 8; r0 = 16 * warp_in_wg + lane / 4, q = lane % 4.
struct FragCoord {
  int r0;  // first row within the 64-row tile
  int q;   // lane % 4
  __device__ static FragCoord of(int thread_in_wg) {
    return {(thread_in_wg / 32) * 16 + (thread_in_wg % 32) / 4, thread_in_wg % 4};
  }
  // Column 8c + 2q + j of the fragment (swap-AB: the tile's token 8c + 2q + j).
  __device__ int col(int c, int j) const { return 8 * c + 2 * q + j; }
};

// Calls f(c, j) for the fragment columns 8c + 2q + j, c < kChunks, j < 2, that a thread holds
// (swap-AB: its tokens), unrolled.
template <int kChunks, class F>
__device__ __forceinline__ void for_each_fragment_col(F&& f) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int j = 0; j < 2; ++j) f(c, j);
}

// One math warpgroup's main loop over a tile with pool rows on the WGMMA M side (FP8, BLOCK_M
// 64 and 128): acc = sum_kb sa[row] * sb(col, kb) * (A_kb @ B_kb^T), promoted into float32 once
// per 128-K k-block. At BLOCK_M 64 both warpgroups take the tile's 64 rows and warpgroup w the
// weight rows [128w, 128w + 128); at BLOCK_M 128 (cooperative) warpgroup w takes rows
// [64w, 64w + 64) and all 256 weight rows, as two 128-row halves that share its token operand
// (Cfg::kWgHalves). Half h of a warpgroup accumulates in acc[64h, 64h + 64) with the m64n128
// fragment layout of FragCoord.
//
// The WGMMAs of a k-block go out in batches of kBatchRows weight rows (m64nBATCHk32 x 4 along
// K), each into a part that is promoted once the batch is done:
// - fast numerics (MmaBatching<Cfg>::kPipelined): batches of 64 rows alternating between two
//   32-float parts; a batch's promotion waits only for that batch (wait_group 1), so the
//   warpgroup keeps one batch queued on the tensor cores while it promotes the previous one,
//   across k-blocks too. Waiting for a whole 128-row half before promoting drains the tensor
//   pipe at every batch (docs/design.md section 9).
// - exact numerics: batches of 128 rows into one 64-float part, each waited for in full. Its
//   BLOCK_M 64 L2 runs at up to 8192 tokens, where the 64-row batches' extra shared-memory reads
//   of the token tile (read once per batch) cost more than the waits (docs/design.md section 9).
// One WGMMA per batch and K step, m64nBATCHk32: fast numerics issue only m64n64k32 (a kernel with
// m64n128 accumulators in one GEMM and m64n64 in the other makes ptxas serialize every WGMMA:
// C7511, too few registers for the WGMMA pipeline, and spill).
// A 64-row batch j of half h holds columns [64j, 64j + 64) of the half, i.e. acc[64h + 32j, +32)
// in the m64n128 layout (chunk c of the n64 fragment is chunk 8j + c of the n128 one): batch b's
// part always lands at acc + b * kPartFloats.
// The rows' scales of a k-block come with its stage (pipeline.cuh load_a): the tile's first row
// at `sf_skew` in sv.a_scales.
// `weight_scales(kb, block)` gives the scales of the tile's 128-row weight block `block` (0, 1)
// at k-block kb: .x for even 8-column chunks, .y for odd ones (L1: gate, up; L2: the same).
// False after a pipeline timeout (gemm_wait). `full_wait` gains the cycles spent waiting for
// full stages (timeline.cuh; constant zero unless built with MEGAMOE_TIMELINE).
// MXFP4 weights: each warpgroup converts its 128 weight rows of a stage into an FP8 tile (at BLOCK_M
// 128 both read all 256), the tile's first k-block before any WGMMA, every later one into the other
// of two tiles once the first batch of the k-block before has gone out, so that the conversion runs
// while the tensor cores do. Two barriers a k-block: before the conversion, every WGMMA that read the
// tile it overwrites (the k-block before's) is done; after it, the tile is whole. It waits for the
// next stage at the top of the k-block (a wait between the batches made ptxas spill at BLOCK_M 128),
// so it holds three stages at once (abi.h min_stages).
// (The policy is a template argument so that a benchmark of the main loop alone can instantiate
// the waited 128-row form beside the served one.)
template <class Cfg, bool kPipelinedBatches = !Cfg::kExactL1>
struct MmaBatching {
  static constexpr bool kPipelined = kPipelinedBatches;
  static constexpr int kBatchRows = kPipelined ? 64 : 128;  // weight rows per batch: its WGMMAs' N
  static constexpr int kBatches = Cfg::kWgHalves * Cfg::kWgN / kBatchRows;  // per k-block
  static constexpr int kParts = kPipelined ? 2 : 1;
  static constexpr int kPartFloats = kBatchRows / 2;  // m64nBATCH fragment per thread
  // The last batch of a k-block stays in flight across the next k-block's barrier wait, except
  // with fast_math=False: its IEEE divisions call out of line, and with a batch carried over
  // ptxas spills around those calls (at BLOCK_M 64), so those variants drain each k-block. (MXFP4
  // weights: the next k-block is converted into the other tile, so the carried batch's stays.)
  static constexpr bool kCarryAcrossKBlocks = kPipelined && Cfg::kFastMath;
  using Op = std::conditional_t<kBatchRows == 64, cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>,
                                cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>>;
};

// Waits until stage `s` is full: false after a timeout in a rebalanced tier (gemm_wait; elsewhere the
// wait traps). `full_wait` gains the cycles it took (timeline.cuh; constant zero unless built with
// MEGAMOE_TIMELINE).
template <class Cfg>
__device__ __forceinline__ bool wait_stage_full(const KernelParams& p, uint64_t* full, const PipelineState& s,
                                                uint32_t& full_wait) {
  const uint32_t wait_start = TileClock::tile_clock();
  const bool stage_full = gemm_wait<Cfg>(p, &full[s.stage], s.phase, kErrPipelineFullTimeout);
  if constexpr (kTimeline) full_wait += TileClock::tile_clock() - wait_start;
  return stage_full;
}

// MXFP4 weights: the named barrier of the math threads that share the converted tile. Below BLOCK_M
// 128 each warpgroup's WGMMAs read only the 128 rows it converts, so each has its own; at BLOCK_M 128
// (cooperative) both warpgroups read all 256 rows, each converting half of them, so they meet.
template <class Cfg>
__device__ __forceinline__ void fp4_tile_barrier(int wg) {
  if constexpr (Cfg::kWgHalves == 2) {
    named_barrier_sync(kFp4ConvertBarrierId, Cfg::kNumMathThreads);
  } else {
    named_barrier_sync(kFp4ConvertBarrierId + wg, Cfg::kWgN);
  }
}

// MXFP4 weights: the thread's stores into a converted tile made visible to the WGMMAs of every
// warpgroup that reads it.
template <class Cfg>
__device__ __forceinline__ void fp4_tile_written(int wg) {
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // the tile's stores -> WGMMA reads
  fp4_tile_barrier<Cfg>(wg);
}

// MXFP4 weights (fp4_weights.cuh): this warpgroup's 128 rows of stage `stage` (thread t of the
// warpgroup: row 128 wg + t), one block of the weights, converted at once into FP8 tile `tile`
// (StageView fp4_tile), folded by the block's largest code. Returns the block's scale.
template <class Cfg>
__device__ __forceinline__ float fp4_convert_stage(const StageView<Cfg>& sv, int stage, int tile, int wg) {
  const uint32_t* codes = sv.b_scale_codes(stage);
  const int row = wg * Cfg::kWgN + Role::thread_in_warpgroup(), largest = fp4_block_largest(codes, wg);
  fp4_convert_row(sv.b(stage), codes[row], largest, sv.fp4_tile(tile), row);
  return fp4_block_scale(largest);
}

template <class Cfg, int kNumKBlocks, class WeightScales>
__device__ __forceinline__ bool mma_tile(const KernelParams& p, const StageView<Cfg>& sv, uint64_t* full,
                                         uint64_t* empty, PipelineState& ps, int math_wg, const FragCoord& fc,
                                         int sf_skew, float* acc, WeightScales weight_scales,
                                         uint32_t& full_wait) {
  using B = MmaBatching<Cfg>;
  constexpr int kHalves = Cfg::kWgHalves, kPartFloats = B::kPartFloats;
  // At BLOCK_M 128 the warpgroup and (below) the stage are broadcast from lane 0: ptxas then knows
  // they are warp-uniform and keeps the descriptors in uniform registers, which shortens both main
  // loops (docs/design.md section 9). At BLOCK_M 64, weight-bound, the same broadcast makes decode
  // slower, so it keeps the per-thread values.
  constexpr bool kUniformIndices = Cfg::kBlockM == 128;
  const int wg = kUniformIndices ? warp_uniform(math_wg) : math_wg;
  const int row0 = Cfg::wg_first_row(wg);
  // The promotion scales of one k-block: the rows' (sa) and the halves' weight blocks (sb; MXFP4
  // weights: the converted tile's block scales, the same for gate and up).
  struct KBlockScales {
    float sa[2];
    float2 sb[kHalves];
  };
  // One flat array: a two-dimensional one makes ptxas spill (exact BLOCK_M 64, fast_math=False).
  float parts[B::kParts * kPartFloats];
  const auto part = [&](int i) { return parts + (i % B::kParts) * kPartFloats; };
  const auto promote = [&](int batch, const float* from, const KBlockScales& s) {
    const int h = batch * B::kBatchRows / Cfg::kWgN;
    float* to = acc + batch * kPartFloats;
#pragma unroll
    for (int c = 0; c < kPartFloats / 4; ++c) {
      const float sb = (c % 2 == 0) ? s.sb[h].x : s.sb[h].y;
#pragma unroll
      for (int i = 0; i < 4; ++i) to[4 * c + i] += from[4 * c + i] * (s.sa[i / 2] * sb);
    }
  };
  // Every math thread arrives once its own reads of the stage (WGMMA operands, token scales) are
  // done: one arrival per warp after __syncwarp orders them as well, but racecheck reports it as a
  // hazard. The __syncwarp stays: without it ptxas spills at BLOCK_M 64.
  const auto release = [&](int stage) {
    __syncwarp();
    cuda::ptx::mbarrier_arrive(&empty[stage]);
  };
  constexpr int kLast = B::kBatches - 1;
  // Pipelined: the promotion of a k-block's last batch, once it is done, and its stage's release.
  const auto drain_last = [&](const KBlockScales& s, int stage) {
    cute::warpgroup_wait<0>();
    fence_operands<kPartFloats>(part(kLast));
    promote(kLast, part(kLast), s);
    release(stage);
  };
  static_assert(!Cfg::kFp4Weights || B::kPipelined, "MXFP4 weights: the next k-block converts while a batch runs");
#pragma unroll
  for (int i = 0; i < Cfg::kAccFloats; ++i) acc[i] = 0.f;
  if constexpr (Cfg::kFp4Weights) {  // the first k-block, into tile 0, once every WGMMA that read it is done
    fp4_tile_barrier<Cfg>(wg);
    if (!wait_stage_full<Cfg>(p, full, ps, full_wait)) return false;
    fp4_convert_stage(sv, ps.stage, 0, wg);
    fp4_tile_written<Cfg>(wg);
  }
  KBlockScales prev{};  // carried across k-blocks: the previous k-block's scales
  int prev_stage = 0;
  for (int kb = 0; kb < kNumKBlocks; ++kb) {
    KBlockScales cur;
    // MXFP4 weights: the next k-block's stage, converted into the other tile during this one's WGMMAs.
    PipelineState next = ps;
    next.advance<Cfg::kNumStages>();
    const bool convert_next = Cfg::kFp4Weights && kb + 1 < kNumKBlocks;
    if constexpr (Cfg::kFp4Weights) {  // this k-block's stage is full: waited for in the one before
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const float sb = fp4_block_scale(fp4_block_largest(sv.b_scale_codes(ps.stage), Cfg::wg_weight_block(wg, h)));
        cur.sb[h] = make_float2(sb, sb);
      }
      if (convert_next && !wait_stage_full<Cfg>(p, full, next, full_wait)) {  // waited for here, where the failure path is the FP8 loop's
        cute::warpgroup_wait<0>();
        return false;
      }
    } else {
#pragma unroll
      for (int h = 0; h < kHalves; ++h)  // issued before the barrier wait: the wait hides their latency
        cur.sb[h] = weight_scales(kb, Cfg::wg_weight_block(wg, h));
      if (!wait_stage_full<Cfg>(p, full, ps, full_wait)) {
        // Drained before leaving: a path that leaves with a batch in flight makes ptxas
        // serialize every WGMMA of the loop (warning C7518).
        cute::warpgroup_wait<0>();
        return false;
      }
    }
    const int stage = kUniformIndices ? warp_uniform(ps.stage) : ps.stage;
    const uint8_t* weights = Cfg::kFp4Weights ? sv.fp4_tile(kb & 1) : sv.b(stage);
    const float* sa = sv.a_scales(stage) + sf_skew + row0 + fc.r0;
#pragma unroll
    for (int i = 0; i < 2; ++i) cur.sa[i] = sa[8 * i];
    const uint64_t desc_a = make_smem_desc(sv.a(stage) + row0 * Cfg::kBlockK);
#pragma unroll
    for (int b = 0; b < B::kBatches; ++b) {
      float* mine = part(b);
      const int b_row = Cfg::wg_weight_block(wg, b * B::kBatchRows / Cfg::kWgN) * Cfg::kWgN +
                        (b * B::kBatchRows) % Cfg::kWgN;
      const uint64_t desc_b = make_smem_desc(weights + b_row * Cfg::kBlockK);
      fence_operands<kPartFloats>(mine);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < Cfg::kBlockK / 32; ++k)  // +32 bytes along K in the 128B swizzle atom: +2 in the address field
        wgmma_call<typename B::Op>(desc_a + 2 * k, desc_b + 2 * k, mine, k > 0,
                                   std::make_integer_sequence<int, kPartFloats>{});
      cute::warpgroup_commit_batch();
      if constexpr (B::kParts == 1) {
        cute::warpgroup_wait<0>();
        fence_operands<kPartFloats>(mine);
        if (b == kLast) release(ps.stage);
        promote(b, mine, cur);
      } else {
        // The previous batch (the other part) is done once at most this one is pending.
        cute::warpgroup_wait<1>();
        float* other = part(b + 1);
        fence_operands<kPartFloats>(other);
        if (b > 0) {
          promote(b - 1, other, cur);
        } else if (B::kCarryAcrossKBlocks && kb > 0) {  // the last batch of k-block kb - 1
          promote(kLast, other, prev);
          release(prev_stage);
        }
      }
      if (convert_next && b == 0) {  // every WGMMA of k-block kb - 1 is done (its last batch just above): its tile is free
        fp4_tile_barrier<Cfg>(wg);
        fp4_convert_stage(sv, next.stage, (kb + 1) & 1, wg);
      }
    }
    if (convert_next) fp4_tile_written<Cfg>(wg);
    if constexpr (B::kParts == 2 && !B::kCarryAcrossKBlocks) drain_last(cur, ps.stage);
    if constexpr (B::kCarryAcrossKBlocks) prev = cur, prev_stage = ps.stage;
    ps.advance<Cfg::kNumStages>();
  }
  if constexpr (B::kCarryAcrossKBlocks) drain_last(prev, prev_stage);
  return true;
}

// Swap-AB main loop of one math warpgroup (FP8 GEMMs below BLOCK_M 64: L2, and L1 in fast numerics): the warpgroup's 128 weight rows
// are two m64 sub-tiles on the WGMMA M side, the tile's BLOCK_M pool rows (tokens) the N
// side. acc[kSwapSubTiles][BLOCK_M / 2], fragment of sub-tile i: acc[i][4c + {0,1}] =
// weight row 64i + r0, tokens 8c + 2q + {0,1}; acc[i][4c + {2,3}] = weight row 64i + r0 + 8.
// Promotion scales: per token (from the stage at sf_skew, like mma_tile) and per weight block
// (`weight_scales(kb, wg)`: .x for rows r0, .y for rows r0 + 8; L2 passes the same scale in both),
// or with MXFP4 weights the warpgroup's block scale, from its conversion of the stage (fp4_weights.cuh)
// into its 128 rows of the FP8 tile (StageView fp4_tile). One tile, not one per stage, leaves the
// shared memory to stages (bytes in flight): the warpgroup's barrier after each k-block keeps the
// next conversion behind every thread's reads of the last. The conversion bounds this loop,
// not the WGMMAs' latency, so a second tile to overlap the two gains nothing; within the conversion,
// integer issue is not the bound (docs/design.md 4.10).
template <class Cfg, int kNumKBlocks, class WeightScales>
__device__ __forceinline__ void mma_tile_swap(const KernelParams& p, const StageView<Cfg>& sv, uint64_t* full,
                                              uint64_t* empty, PipelineState& ps, int wg, const FragCoord& fc,
                                              int sf_skew, float* acc, WeightScales weight_scales,
                                              uint32_t& full_wait) {
  constexpr int kN = Cfg::kBlockM, kFrag = kN / 2, kChunks = kN / 8;
  using Op = typename SwapWgmma<kN>::Op;
  float part[Cfg::kSwapSubTiles * kFrag];
#pragma unroll
  for (int i = 0; i < Cfg::kAccFloats; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < kNumKBlocks; ++kb) {
    float2 sb[Cfg::kSwapSubTiles];
    if constexpr (!Cfg::kFp4Weights) {
      sb[0] = weight_scales(kb, wg);
#pragma unroll
      for (int i = 1; i < Cfg::kSwapSubTiles; ++i) sb[i] = sb[0];
    }
    wait_stage_full<Cfg>(p, full, ps, full_wait);  // swap-AB tiers are never rebalanced: a timeout traps
    const uint8_t* weights = sv.b(ps.stage);
    if constexpr (Cfg::kFp4Weights) {
      const float block_scale = fp4_convert_stage(sv, ps.stage, 0, wg);
      fp4_tile_written<Cfg>(wg);
      weights = sv.fp4_tile();
#pragma unroll
      for (int i = 0; i < Cfg::kSwapSubTiles; ++i) sb[i] = make_float2(block_scale, block_scale);
    }
    const float* stage_sa = sv.a_scales(ps.stage) + sf_skew;
    float sa[kChunks][2];
    for_each_fragment_col<kChunks>([&](int c, int j) { sa[c][j] = stage_sa[fc.col(c, j)]; });
    const uint64_t desc_tokens = make_smem_desc(sv.a(ps.stage));
    uint64_t desc_w[Cfg::kSwapSubTiles];
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i)
      desc_w[i] = make_smem_desc(weights + (wg * Cfg::kWgN + 64 * i) * Cfg::kBlockK);
    fence_operands<Cfg::kSwapSubTiles * kFrag>(part);
    cute::warpgroup_arrive();
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i)
#pragma unroll
      for (int k = 0; k < Cfg::kBlockK / 32; ++k)
        wgmma_call<Op>(desc_w[i] + 2 * k, desc_tokens + 2 * k, part + i * kFrag, k > 0,
                       std::make_integer_sequence<int, kFrag>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
    fence_operands<Cfg::kSwapSubTiles * kFrag>(part);
    __syncwarp();
    cuda::ptx::mbarrier_arrive(&empty[ps.stage]);  // per thread, as mma_tile's release says
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i)
      for_each_fragment_col<kChunks>([&](int c, int j) {
        acc[i * kFrag + 4 * c + j] += part[i * kFrag + 4 * c + j] * (sa[c][j] * sb[i].x);
        acc[i * kFrag + 4 * c + 2 + j] += part[i * kFrag + 4 * c + 2 + j] * (sa[c][j] * sb[i].y);
      });
    if constexpr (Cfg::kFp4Weights) fp4_tile_barrier<Cfg>(wg);  // every thread's reads of the tile are done
    ps.advance<Cfg::kNumStages>();
  }
}

}  // namespace megamoe
