// numerics="exact": L1 on FP16 tensor cores over the exact FP8 values (float32-faithful):
// warps 1-3 convert each stage's tokens to FP16 once (convert_l1_tokens), the math warpgroups
// convert the FP8 weights in registers and run RS WGMMA (mma_tile_l1).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cuda/ptx>
#include <cuda_fp8.h>
#include <utility>

#include "config.cuh"
#include "mma.cuh"
#include "params.h"
#include "pipeline.cuh"
#include "roles.cuh"
#include "scheduler.cuh"
#include "sync.cuh"

namespace megamoe {

// L1 on FP16 tensor cores. Every e4m3 value is exact in FP16 and FP16 WGMMA accumulates in
// float32, so h = a @ B13^T comes out float32-grade; FP8 WGMMA's reduced-precision
// accumulation flips about 1% of the requantized act codes and puts ~1% of tokens past the
// per-token bound of docs/design.md section 2. Layout is swap-AB for every tier:
// the weights are the WGMMA A operand, converted from the FP8 stage straight into registers
// (ldmatrix + cvt, no shared-memory copy of the big operand), the BLOCK_M tokens the N side,
// converted once per k-block into an FP16 tile both math warpgroups read (convert_l1_tokens).
//
// K order: ldmatrix of the FP8 rows viewed as 16-bit pairs gives lane q of a quad the bytes
// 4q..4q+3 of a 16-wide K slice, while an m64k16 A fragment wants K 2q, 2q+1 (registers 0,
// 1) and 2q+8, 2q+9 (registers 2, 3). Each slice therefore runs in a permuted K order, slot
// 2q + j <- K 4q + j and slot 8 + 2q + j <- K 4q + 2 + j; the token staging applies the same
// permutation, and a dot product does not depend on the order of its terms.

template <int N> struct L1Wgmma;
template <> struct L1Wgmma<8> { using Op = cute::SM90::GMMA::MMA_64x8x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>; };
template <> struct L1Wgmma<16> { using Op = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>; };
template <> struct L1Wgmma<32> { using Op = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>; };
template <> struct L1Wgmma<64> { using Op = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>; };

template <class Op, int... I>
__device__ __forceinline__ void wgmma_rs_call(const uint32_t (&a)[4], uint64_t db, float* d, bool accumulate,
                                              std::integer_sequence<int, I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, d[I]...,
          accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero);
}

// Four e4m3 (bytes 0-3 of w) -> FP16x2 of bytes 0, 1 (lo) and of bytes 2, 3 (hi). The
// halves go to the conversion as 16-bit register halves, which saves a shift per pair.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t smem_addr, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(smem_addr));
}

// The stage's token tile (kN rows x 128 FP8, 128B-swizzled as TMA wrote it) -> FP16 in
// the permuted K order, K-major with the 128B swizzle: two 64-wide K atoms of [kN][128 B].
template <int kN, int kThreads>
__device__ __forceinline__ void stage_l1_tokens(const uint8_t* src, uint8_t* dst, int t) {
#pragma unroll
  for (int i = t; i < kN * 8; i += kThreads) {
    const int r = i / 8, c = i % 8;  // 16-byte chunk c = K slice c
    const uint4 v = *reinterpret_cast<const uint4*>(src + r * 128 + ((c ^ (r & 7)) * 16));
    const uint32_t in[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[8];  // out[g]: slots 2g, 2g + 1 (K 4g, 4g + 1); out[4 + g]: slots 8 + 2g, 9 + 2g
#pragma unroll
    for (int g = 0; g < 4; ++g) e4m3x4_to_f16x2x2(in[g], out[g], out[4 + g]);
    uint8_t* row = dst + (c / 4) * kN * 128 + r * 128;
    const int c8 = 2 * (c % 4);  // the slice's two 16-byte FP16 chunks in its K atom
    *reinterpret_cast<uint4*>(row + ((c8 ^ (r & 7)) * 16)) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(row + (((c8 + 1) ^ (r & 7)) * 16)) = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// Warps 1-3 during L1: per k-block, the tile's token scales and its tokens in FP16 (permuted
// K order) into token buffer k-block % 2, converted once for both math warpgroups. Walks
// the math warpgroups' tiles and k-blocks. tok_full[b]: one arrival per converter thread;
// tok_empty[b]: one per math thread, once its WGMMAs and promotions of that k-block are done.
template <class Cfg>
__device__ void convert_l1_tokens(const KernelParams& p, const TileScheduler<Cfg>& sched, const StageView<Cfg>& sv,
                                  uint64_t* full, uint64_t* tok_full, uint64_t* tok_empty) {
  constexpr int kN = Cfg::kBlockM;
  const int t = Role::converter_thread();
  PipelineState ps, tok;
  const int num_tiles = sched.num_tiles();
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile tl = sched.decode(tile);
    const int row_a = sched.tables.exp_start[tl.expert] + tl.m_block * kN;
    const int sf_skew = row_a - staged_scale_row(row_a);
    for (int kb = 0; kb < Cfg::kL1NumKBlocks; ++kb) {
      mbar_wait(p, &tok_empty[tok.stage], tok.phase ^ 1, kErrPipelineEmptyTimeout);
      mbar_wait(p, &full[ps.stage], ps.phase, kErrPipelineFullTimeout);
      // The stage's token scales come with its tokens (pipeline.cuh load_a): read from global memory
      // instead, their latency would come once per tile before the conversion (docs/design.md
      // section 9).
      if (t < kN) sv.l1_token_scales[tok.stage * kN + t] = sv.a_scales(ps.stage)[sf_skew + t];
      stage_l1_tokens<kN, Role::kNumConverterThreads>(sv.a(ps.stage), sv.staging + tok.stage * Cfg::kL1TokenBytes, t);
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // FP16 stores -> WGMMA reads
      cuda::ptx::mbarrier_arrive(&tok_full[tok.stage]);
      tok.advance<2>();
      ps.advance<Cfg::kNumStages>();
    }
  }
}

// L1 main loop of one math warpgroup, every tier. Accumulator layout and scale contract as
// mma_tile_swap: acc[i][4c + {0,1}] = weight row 64i + r0 (gate), acc[i][4c + {2,3}] = row
// 64i + r0 + 8 (up), tokens 8c + 2q + {0,1}; `weight_scales(kb)` .x gate, .y up.
// Per k-block: wait for the converters' FP16 tokens (convert_l1_tokens), then four quarters
// (sub-tile i, slices 4hh .. 4hh + 3): load and convert a quarter's FP8 weight fragments
// while the WGMMAs of the one before run (two fragment slots), 4 m64nBLOCK_Mk16 WGMMAs per
// quarter into the sub-tile's fresh accumulator, promoted once both of its quarters are
// done. The stage goes back to the producer once the last quarter's fragments are in
// registers.
template <class Cfg, int kNumKBlocks, class WeightScales>
__device__ __forceinline__ void mma_tile_l1(const KernelParams& p, const StageView<Cfg>& sv, uint64_t* full,
                                            uint64_t* empty, uint64_t* tok_full, uint64_t* tok_empty,
                                            PipelineState& ps, PipelineState& tok, int wg, const FragCoord& fc,
                                            float* acc, WeightScales weight_scales) {
  static_assert(Cfg::kSwapSubTiles == 2 && Cfg::kBlockK == 128, "four quarters of 4 K slices per k-block");
  constexpr int kN = Cfg::kBlockM, kFrag = kN / 2, kChunks = kN / 8;
  using Op = typename L1Wgmma<kN>::Op;
  const int thread_in_wg = Role::thread_in_warpgroup(), lane = threadIdx.x % 32;
  // ldmatrix.x4 row addresses: lanes 0-7 / 8-15 / 16-23 / 24-31 give matrices (rows 0-7,
  // slice s), (rows 8-15, s), (rows 0-7, s + 1), (rows 8-15, s + 1) of the warp's 16 rows.
  const int ld_row = wg * Cfg::kWgN + (thread_in_wg / 32) * 16 + lane % 8 + 8 * ((lane / 8) % 2);
  const int ld_slice = lane / 16;
  uint64_t desc_tokens;
  const float* token_scales;
  float part[kFrag];
  uint32_t frag[2][4][4];  // two quarters' A fragments: [slot][slice in quarter][register]

  // FP8 weights of sub-tile i, slices 4hh .. 4hh + 3 -> FP16 A fragments in the permuted K order.
  const auto load_quarter = [&](uint32_t b_stage, int i, int hh, uint32_t (&a)[4][4]) {
#pragma unroll
    for (int s2 = 0; s2 < 2; ++s2) {
      uint32_t raw[4];  // slices 4hh + 2s2 (rows r0, r0 + 8), 4hh + 2s2 + 1 (rows r0, r0 + 8)
      ldmatrix_x4(b_stage + (ld_row + 64 * i) * 128 + (((4 * hh + 2 * s2 + ld_slice) ^ (lane % 8)) * 16), raw);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        e4m3x4_to_f16x2x2(raw[2 * h], a[2 * s2 + h][0], a[2 * s2 + h][2]);
        e4m3x4_to_f16x2x2(raw[2 * h + 1], a[2 * s2 + h][1], a[2 * s2 + h][3]);
      }
    }
  };
  const auto issue_quarter = [&](const uint32_t (&a)[4][4], int hh) {
    cute::warpgroup_arrive();  // orders the fragment (and accumulator) writes before the WGMMAs
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int slice = 4 * hh + s;  // K atom slice / 4, +32 bytes per slice inside it (+2 in the address field)
      wgmma_rs_call<Op>(a[s], desc_tokens + (slice / 4) * ((kN * 128) >> 4) + 2 * (slice % 4), part,
                        hh > 0 || s > 0, std::make_integer_sequence<int, kFrag>{});
    }
    cute::warpgroup_commit_batch();
  };
  const auto promote = [&](int i, float2 sb) {
    for_each_fragment_col<kChunks>([&](int c, int j) {
      const float sa = token_scales[fc.col(c, j)];
      acc[i * kFrag + 4 * c + j] += part[4 * c + j] * (sa * sb.x);
      acc[i * kFrag + 4 * c + 2 + j] += part[4 * c + 2 + j] * (sa * sb.y);
    });
  };

#pragma unroll
  for (int i = 0; i < Cfg::kAccFloats; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < kNumKBlocks; ++kb) {
    const float2 sb = weight_scales(kb, wg);
    mbar_wait(p, &full[ps.stage], ps.phase, kErrPipelineFullTimeout);
    mbar_wait(p, &tok_full[tok.stage], tok.phase, kErrPipelineFullTimeout);
    desc_tokens = make_smem_desc(sv.staging + tok.stage * Cfg::kL1TokenBytes);
    token_scales = sv.l1_token_scales + tok.stage * kN;
    const uint32_t b_stage = static_cast<uint32_t>(__cvta_generic_to_shared(sv.b(ps.stage)));

    load_quarter(b_stage, 0, 0, frag[0]);
    fence_operands<kFrag>(part);
    issue_quarter(frag[0], 0);
    load_quarter(b_stage, 0, 1, frag[1]);  // under sub-tile 0's first WGMMAs
    issue_quarter(frag[1], 1);
    cute::warpgroup_wait<1>();  // slot 0 free
    load_quarter(b_stage, 1, 0, frag[0]);  // under sub-tile 0's last WGMMAs
    cute::warpgroup_wait<0>();
    fence_operands<kFrag>(part);
    promote(0, sb);
    issue_quarter(frag[0], 0);
    load_quarter(b_stage, 1, 1, frag[1]);  // under sub-tile 1's first WGMMAs
    __syncwarp();
    cuda::ptx::mbarrier_arrive(&empty[ps.stage]);  // per thread (mma.cuh mma_tile's release): the stage is in registers
    issue_quarter(frag[1], 1);
    cute::warpgroup_wait<0>();
    fence_operands<kFrag>(part);
    promote(1, sb);
    // Every thread arrives once it has read its token scales. (One arrival per warp after
    // __syncwarp orders the other lanes' reads only through the warp barrier, which
    // compute-sanitizer's racecheck reports as a hazard; a named barrier per warpgroup made
    // ptxas spill at BLOCK_M 64.)
    cuda::ptx::mbarrier_arrive(&tok_empty[tok.stage]);
    tok.advance<2>();
    ps.advance<Cfg::kNumStages>();
  }
}

}  // namespace megamoe
