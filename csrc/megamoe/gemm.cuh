// Grouped FP8 GEMM machinery shared by L1 (gate/up) and L2 (down):
//   - TileScheduler: static round-robin of (expert, m-block, n-block) tiles over CTAs,
//     n-major inside an expert so neighbouring CTAs share the weight tile in L2 cache.
//   - produce_tiles: the TMA producer (one elected thread of warp 0) fills the stage ring.
//   - mma_tile / mma_tile_swap: the FP8 main loops (L2, and L1 in fast numerics), WGMMA FP8
//     into a per-k-block accumulator, promoted into float32 with the activation (per row) and
//     weight (per 128x128 block) scales, as DeepGEMM-style block-scaled FP8 GEMMs do.
//   - mma_tile_l1: exact L1's main loop, the same GEMM on FP16 tensor cores (exact products of
//     the FP8 values, float32 accumulation).
// Barriers: full[s] (1 producer arrival + TMA bytes), empty[s] (one arrival per math warp),
// tok_full[b] / tok_empty[b] (L1's FP16 token buffers, filled by warps 1-3).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cuda/ptx>
#include <cuda_fp8.h>
#include <utility>

#include "config.cuh"
#include "dispatch.cuh"
#include "params.h"
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

template <class Cfg>
struct TileScheduler {
  const ExpertTables& tables;
  int num_n_blocks;
  __device__ int num_tiles() const { return tables.mblk_prefix[Cfg::kNumLocalExperts] * num_n_blocks; }
  __device__ Tile decode(int tile) const {
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
// kL1NumNBlocks have. Tiles are handed out in one round-robin over the L1 then the L2
// tiles, and no L1 tile waits on anything, so every wait ends.
template <class Cfg>
__device__ __forceinline__ int global_m_block(const ExpertTables& tables, const Tile& t) {
  return tables.mblk_prefix[t.expert] + t.m_block;
}

template <class Cfg>
__device__ __forceinline__ bool l1_rows_ready(const int* l1_done, int gm) {
  return ld_acquire_gpu(l1_done + gm) >= Cfg::kL1NumNBlocks;
}

// Bounded wait (acquire) for an m-block's L1 rows. Scale 2: a stuck L1 tile's own
// pipeline wait reports first.
template <class Cfg>
__device__ __forceinline__ void wait_l1_rows(const KernelParams& p, const int* l1_done, int gm) {
  bounded_wait(p, kErrL1RowsTimeout, [&] { return l1_rows_ready<Cfg>(l1_done, gm); }, 2);
}

// Shared-memory views of one pipeline stage.
template <class Cfg>
struct StageView {
  uint8_t* stages;
  uint8_t* staging;  // L1 token tiles in FP16, [2 k-block parities] (Cfg::kSmemStaging)
  float* l1_token_scales;  // [2 k-block parities][BLOCK_M]: their token scales (Cfg::kSmemTokenScales)
  __device__ uint8_t* a(int s) const { return stages + s * Cfg::kStageBytes; }
  __device__ uint8_t* b(int s) const { return a(s) + Cfg::kStageA; }
};

__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* tmap, int x, int y, uint64_t* bar) {
  const int32_t crd[2] = {x, y};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem, tmap, crd, bar);
}

// A pipeline wait of the GEMM roles: true once the barrier's phase completed. In a tier that
// rebalances registers (Cfg::kRebalanceRegisters) it reports a timeout and returns false, for
// the role to unwind and trap after its registers are back (kernel.cuh gemm_roles): a trap
// inside the region makes ptxas compile the region at the entry budget (docs/results round 9).
// Elsewhere it traps where it waits (and the callers' checks fold away).
template <class Cfg>
__device__ __forceinline__ bool gemm_wait(const KernelParams& p, uint64_t* bar, uint32_t parity, uint32_t code) {
  if constexpr (Cfg::kRebalanceRegisters) {
    return mbar_poll(p, bar, parity, code);
  } else {
    mbar_wait(p, bar, parity, code);
    return true;
  }
}

// Claims the next stage for one k-block (A + B bytes expected on its full barrier); null after
// a timeout (gemm_wait).
template <class Cfg>
__device__ __forceinline__ uint64_t* claim_stage(const KernelParams& p, uint64_t* full, uint64_t* empty,
                                                 const PipelineState& ps) {
  if (!gemm_wait<Cfg>(p, &empty[ps.stage], ps.phase ^ 1, kErrPipelineEmptyTimeout)) return nullptr;
  uint64_t* bar = &full[ps.stage];
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, bar,
                                       Cfg::kStageA + Cfg::kStageB);
  return bar;
}

// TMA producer for one GEMM phase, tiles first_tile, first_tile + gridDim.x, ...; false after a
// pipeline timeout (gemm_wait).
// A rows come from the pool (expert's rows), B rows from the weights (expert's block).
// The math warps read the A scales themselves. An L2 tile whose act rows are not ready
// yet first streams the weights of as many k-blocks as there are stages, then waits.
template <class Cfg, bool kIsL2>
__device__ bool produce_tiles(const KernelParams& p, uint8_t* base, const TileScheduler<Cfg>& sched, int first_tile,
                              const StageView<Cfg>& sv, uint64_t* full, uint64_t* empty, PipelineState& ps) {
  constexpr int kNumKBlocks = kIsL2 ? Cfg::kL2NumKBlocks : Cfg::kL1NumKBlocks;
  constexpr int kRowsPerExpert = kIsL2 ? Cfg::kHidden : 2 * Cfg::kInter;
  constexpr int kPrefetch = kNumKBlocks < Cfg::kNumStages ? kNumKBlocks : Cfg::kNumStages;
  const CUtensorMap* tmap_a = p.tmaps + (kIsL2 ? kTmapAct : kTmapPoolX);
  const CUtensorMap* tmap_b = p.tmaps + (kIsL2 ? kTmapW2 : kTmapW13);
  const int* l1_done = reinterpret_cast<const int*>(base + p.off.l1_done);
  const int num_tiles = sched.num_tiles();
  for (int tile = first_tile; tile < num_tiles; tile += gridDim.x) {
    const Tile t = sched.decode(tile);
    const int row_a = sched.tables.exp_start[t.expert] + t.m_block * Cfg::kBlockM;
    const int row_b = t.expert * kRowsPerExpert + t.n_block * Cfg::kBlockN;
    int kb = 0;
    if constexpr (kIsL2 && Cfg::kL2TrailsL1) {
      const int gm = global_m_block<Cfg>(sched.tables, t);
      if (!l1_rows_ready<Cfg>(l1_done, gm)) {
        PipelineState ahead = ps;
        for (int i = 0; i < kPrefetch; ++i) {
          tma_load_2d(sv.b(ahead.stage), tmap_b, i * Cfg::kBlockK, row_b, claim_stage<Cfg>(p, full, empty, ahead));
          ahead.advance<Cfg::kNumStages>();
        }
        wait_l1_rows<Cfg>(p, l1_done, gm);
        fence_generic_to_async();
        for (; kb < kPrefetch; ++kb) {
          tma_load_2d(sv.a(ps.stage), tmap_a, kb * Cfg::kBlockK, row_a, &full[ps.stage]);
          ps.advance<Cfg::kNumStages>();
        }
      } else {
        fence_generic_to_async();
      }
    }
    for (; kb < kNumKBlocks; ++kb) {
      uint64_t* bar = claim_stage<Cfg>(p, full, empty, ps);
      if constexpr (Cfg::kRebalanceRegisters) {  // elsewhere claim_stage trapped already
        if (bar == nullptr) return false;
      }
      tma_load_2d(sv.a(ps.stage), tmap_a, kb * Cfg::kBlockK, row_a, bar);
      tma_load_2d(sv.b(ps.stage), tmap_b, kb * Cfg::kBlockK, row_b, bar);
      ps.advance<Cfg::kNumStages>();
    }
  }
  return true;
}

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

// ---------------------------------------------------------------------------------------
// L1 on FP16 tensor cores. Every e4m3 value is exact in FP16 and FP16 WGMMA accumulates in
// float32, so h = a @ B13^T comes out float32-grade; FP8 WGMMA's reduced-precision
// accumulation flips about 1% of the requantized act codes and puts ~1% of tokens past the
// per-token bound of docs/design.md section 2 (docs/results). Layout is swap-AB for every tier:
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

constexpr int kNumTokenConverterThreads = 96;  // warps 1-3

// Warps 1-3 during L1: per k-block, the tile's token scales and its tokens in FP16 (permuted
// K order) into token buffer k-block % 2, converted once for both math warpgroups. Walks
// the math warpgroups' tiles and k-blocks. tok_full[b]: one arrival per converter thread;
// tok_empty[b]: one per math thread, once its WGMMAs and promotions of that k-block are done.
template <class Cfg>
__device__ void convert_l1_tokens(const KernelParams& p, const TileScheduler<Cfg>& sched, const StageView<Cfg>& sv,
                                  uint64_t* full, uint64_t* tok_full, uint64_t* tok_empty) {
  constexpr int kN = Cfg::kBlockM;
  const int t = threadIdx.x - 32;
  const float* pool_sf = reinterpret_cast<const float*>(p.peer_base[p.rank] + p.off.pool_sf);
  PipelineState ps, tok;
  const int num_tiles = sched.num_tiles();
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile tl = sched.decode(tile);
    const float* sfa = pool_sf + sched.tables.exp_start[tl.expert] + tl.m_block * kN;
    for (int kb = 0; kb < Cfg::kL1NumKBlocks; ++kb) {
      const float token_scale = t < kN ? __ldcg(sfa + (int64_t)kb * p.pool_capacity + t) : 0.f;
      mbar_wait(p, &tok_empty[tok.stage], tok.phase ^ 1, kErrPipelineEmptyTimeout);
      mbar_wait(p, &full[ps.stage], ps.phase, kErrPipelineFullTimeout);
      if (t < kN) sv.l1_token_scales[tok.stage * kN + t] = token_scale;
      stage_l1_tokens<kN, kNumTokenConverterThreads>(sv.a(ps.stage), sv.staging + tok.stage * Cfg::kL1TokenBytes, t);
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
  const int thread_in_wg = threadIdx.x % 128, lane = threadIdx.x % 32;
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
    if (lane == 0) cuda::ptx::mbarrier_arrive(&empty[ps.stage]);  // the stage now lives in registers and staging
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
