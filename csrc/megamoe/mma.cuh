// The FP8 main loops (L2, and L1 in fast numerics): WGMMA FP8 into a per-k-block accumulator,
// promoted into float32 with the activation (per row) and weight (per 128x128 block) scales, as
// DeepGEMM-style block-scaled FP8 GEMMs do. mma_tile: pool rows on the WGMMA M side (BLOCK_M 64
// and the cooperative 128); mma_tile_swap: tokens on the N side (BLOCK_M 8/16/32). Also the
// accumulator fragment layout the epilogues read (FragCoord).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cuda/ptx>
#include <utility>

#include "config.cuh"
#include "params.h"
#include "pipeline.cuh"
#include "scheduler.cuh"
#include "sync.cuh"

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

using WgmmaOp = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;

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
// `sfa` points at the tile's first row in an MN-major scale pool ([k-block][pool row]).
// `weight_scales(kb, block)` gives the scales of the tile's 128-row weight block `block` (0, 1)
// at k-block kb: .x for even 8-column chunks, .y for odd ones (L1: gate, up; L2: the same).
// False after a pipeline timeout (gemm_wait).
template <class Cfg, int kNumKBlocks, class WeightScales>
__device__ __forceinline__ bool mma_tile(const KernelParams& p, const StageView<Cfg>& sv, uint64_t* full,
                                         uint64_t* empty, PipelineState& ps, int wg, const FragCoord& fc,
                                         const float* sfa, float* acc, WeightScales weight_scales) {
  constexpr int kHalves = Cfg::kWgHalves;
  const int row0 = Cfg::wg_first_row(wg);
  float part[64];
#pragma unroll
  for (int i = 0; i < Cfg::kAccFloats; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < kNumKBlocks; ++kb) {
    // Scale loads issued before the barrier wait hide their latency.
    float2 sb[kHalves];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) sb[h] = weight_scales(kb, Cfg::wg_weight_block(wg, h));
    const float sa0 = __ldcg(sfa + (int64_t)kb * p.pool_capacity + row0 + fc.r0);
    const float sa1 = __ldcg(sfa + (int64_t)kb * p.pool_capacity + row0 + fc.r0 + 8);
    if (!gemm_wait<Cfg>(p, &full[ps.stage], ps.phase, kErrPipelineFullTimeout)) return false;
    const uint64_t desc_a = make_smem_desc(sv.a(ps.stage) + row0 * Cfg::kBlockK);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint64_t desc_b = make_smem_desc(sv.b(ps.stage) + Cfg::wg_weight_block(wg, h) * Cfg::kWgN * Cfg::kBlockK);
      // FP8 WGMMA accumulates with reduced precision inside the tensor core, so each k-block
      // gets a fresh accumulator that is promoted into float32 here.
      fence_operands<64>(part);
      cute::warpgroup_arrive();
#pragma unroll
      for (int k = 0; k < Cfg::kBlockK / 32; ++k)  // +32 bytes along K in the 128B swizzle atom: +2 in the address field
        wgmma_call<WgmmaOp>(desc_a + 2 * k, desc_b + 2 * k, part, k > 0, std::make_integer_sequence<int, 64>{});
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_operands<64>(part);
      if (h == kHalves - 1) {
        __syncwarp();
        if (threadIdx.x % 32 == 0) cuda::ptx::mbarrier_arrive(&empty[ps.stage]);
      }
#pragma unroll
      for (int c = 0; c < 16; ++c) {
        const float s = (c % 2 == 0) ? sb[h].x : sb[h].y;
        acc[64 * h + 4 * c + 0] += part[4 * c + 0] * (sa0 * s);
        acc[64 * h + 4 * c + 1] += part[4 * c + 1] * (sa0 * s);
        acc[64 * h + 4 * c + 2] += part[4 * c + 2] * (sa1 * s);
        acc[64 * h + 4 * c + 3] += part[4 * c + 3] * (sa1 * s);
      }
    }
    ps.advance<Cfg::kNumStages>();
  }
  return true;
}

// Swap-AB main loop of one math warpgroup (FP8 GEMMs below BLOCK_M 64: L2, and L1 in fast numerics): the warpgroup's 128 weight rows
// are two m64 sub-tiles on the WGMMA M side, the tile's BLOCK_M pool rows (tokens) the N
// side. acc[kSwapSubTiles][BLOCK_M / 2], fragment of sub-tile i: acc[i][4c + {0,1}] =
// weight row 64i + r0, tokens 8c + 2q + {0,1}; acc[i][4c + {2,3}] = weight row 64i + r0 + 8.
// Promotion scales: per token (sfa, MN-major like mma_tile) and per weight block
// (`weight_scales(kb, wg)`: .x for rows r0, .y for rows r0 + 8; L2 passes the same scale in both).
template <class Cfg, int kNumKBlocks, class WeightScales>
__device__ __forceinline__ void mma_tile_swap(const KernelParams& p, const StageView<Cfg>& sv, uint64_t* full,
                                              uint64_t* empty, PipelineState& ps, int wg, const FragCoord& fc,
                                              const float* sfa, float* acc, WeightScales weight_scales) {
  constexpr int kN = Cfg::kBlockM, kFrag = kN / 2, kChunks = kN / 8;
  using Op = typename SwapWgmma<kN>::Op;
  float part[Cfg::kSwapSubTiles * kFrag];
#pragma unroll
  for (int i = 0; i < Cfg::kAccFloats; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < kNumKBlocks; ++kb) {
    const float2 sb = weight_scales(kb, wg);
    float sa[kChunks][2];
    for_each_fragment_col<kChunks>([&](int c, int j) { sa[c][j] = __ldcg(sfa + (int64_t)kb * p.pool_capacity + fc.col(c, j)); });
    mbar_wait(p, &full[ps.stage], ps.phase, kErrPipelineFullTimeout);
    const uint64_t desc_tokens = make_smem_desc(sv.a(ps.stage));
    uint64_t desc_w[Cfg::kSwapSubTiles];
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i)
      desc_w[i] = make_smem_desc(sv.b(ps.stage) + (wg * Cfg::kWgN + 64 * i) * Cfg::kBlockK);
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
    if (threadIdx.x % 32 == 0) cuda::ptx::mbarrier_arrive(&empty[ps.stage]);
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i)
      for_each_fragment_col<kChunks>([&](int c, int j) {
        acc[i * kFrag + 4 * c + j] += part[i * kFrag + 4 * c + j] * (sa[c][j] * sb.x);
        acc[i * kFrag + 4 * c + 2 + j] += part[i * kFrag + 4 * c + 2 + j] * (sa[c][j] * sb.y);
      });
    ps.advance<Cfg::kNumStages>();
  }
}

}  // namespace megamoe
