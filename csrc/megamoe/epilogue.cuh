// GEMM epilogues, run by the math warpgroups on their register accumulators.
//
// L1: the 256 interleaved weight rows of a tile are gate/up pairs of 128 outputs (one
// requant group); a token's amax is reduced over the threads that hold its outputs (through
// shared memory, named barrier 1, where they span warpgroups), then all quantize with the same
// float32 scale. l1_epilogue_swap takes the swap-AB accumulators (exact L1, and fast L1 below
// BLOCK_M 64), l1_epilogue the m64n128 ones (fast L1 at BLOCK_M 64 and 128).
// Then publish_l1_tile counts the tile into l1_done[m-block] (its L2 tiles wait on it).
// L2: BF16 rows are stored straight into the combine buffer of the rank that owns the
// token (over NVLink for remote tokens), at the token's (slot) position.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "config.cuh"
#include "mma.cuh"
#include "params.h"
#include "roles.cuh"
#include "scheduler.cuh"
#include "sync.cuh"

namespace megamoe {

constexpr int kEpilogueBarrierId = 1;
constexpr float kFp8Max = 448.f;
constexpr float kScaleEps = 1e-10f;

template <bool kFastMath>
__device__ __forceinline__ float silu(float x) {
  if constexpr (kFastMath) return __fdividef(x, 1.f + __expf(-x));
  else return x / (1.f + expf(-x));
}

// After the L1 epilogue: publish the tile's act rows to the L2 tiles of its m-block
// (scheduler.cuh l1_done). Each math thread fences its stores for the readers' TMA (proxy fence);
// once both warpgroups are at the barrier one thread fences at GPU scope and releases. That fence
// is cumulative over the stores the barrier ordered before it (the pattern of cooperative groups'
// grid barrier), so the other 255 threads do not each wait for their stores to land.
template <class Cfg>
__device__ __forceinline__ void publish_l1_tile(const KernelParams& p, const ExpertTables& tables, const Tile& t) {
  fence_generic_to_async();
  named_barrier_sync(kEpilogueBarrierId, Cfg::kNumMathThreads);
  if (Role::first_math_thread()) {
    __threadfence();
    red_add_release_gpu(p.l1_done + global_m_block<Cfg>(tables, t), 1);
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The pool rows a math warpgroup's thread holds in a BLOCK_M 64 / 128 tile (mma.cuh FragCoord):
// row_base + r0 + 8 * half, half < 2, valid below valid_rows.
template <class Cfg>
struct TileRows {
  int row_base, valid_rows;
  __device__ static TileRows of(const ExpertTables& tables, const Tile& t, int wg) {
    return {tables.exp_start[t.expert] + t.m_block * Cfg::kBlockM + Cfg::wg_first_row(wg),
            tables.exp_count[t.expert] - t.m_block * Cfg::kBlockM - Cfg::wg_first_row(wg)};
  }
  __device__ bool valid(const FragCoord& fc, int half) const { return fc.r0 + 8 * half < valid_rows; }
  __device__ int row(const FragCoord& fc, int half) const { return row_base + fc.r0 + 8 * half; }
};

// What the epilogue of a BLOCK_M 64 / 128 tile reads per row from global memory (L1: the routing
// weight; L2: the (source rank, token * K + slot) destination). Where the registers allow
// (Cfg::kEarlyEpilogueRows) the loads go out when the tile starts (at_tile_start) and the epilogue
// takes the values (row); elsewhere row() loads them where the epilogue needs them. Read after the
// main loop, these loads queue behind the next tile's stage loads, which the producer issues as
// soon as the main loop frees its stages, and the epilogue waits for them (docs/design.md section 9).
template <class Cfg, bool kIsL2>
struct EpilogueRows {
  using Value = std::conditional_t<kIsL2, int2, float>;
  static constexpr bool kEarly = Cfg::kEarlyEpilogueRows;
  Value early[kEarly ? 2 : 1];

  __device__ static const Value* source(const KernelParams& p, uint8_t* base) {
    return reinterpret_cast<const Value*>(base + (kIsL2 ? p.off.pool_src : p.off.pool_weight));
  }
  // The epilogue recomputes the tile's rows from the tables (TileRows::of), so that only the
  // loaded values stay live across the main loop.
  __device__ static EpilogueRows at_tile_start(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                               const Tile& t, int wg, const FragCoord& fc) {
    EpilogueRows e{};  // value-initialized: without early loads it is returned unset otherwise (nvcc #549-D)
    if constexpr (kEarly) {
      const TileRows<Cfg> rows = TileRows<Cfg>::of(tables, t, wg);
#pragma unroll
      for (int half = 0; half < 2; ++half) e.early[half] = load(source(p, base), rows, fc, half);
    }
    return e;
  }
  // Row r0 + 8 * half's value; zero for a row past the tile's valid rows.
  __device__ Value row(const KernelParams& p, uint8_t* base, const TileRows<Cfg>& rows, const FragCoord& fc,
                       int half) const {
    if constexpr (kEarly) return early[half];
    else return load(source(p, base), rows, fc, half);
  }

 private:
  __device__ static Value load(const Value* src, const TileRows<Cfg>& rows, const FragCoord& fc, int half) {
    Value v{};
    // (src + row_base) + row in the tile, as before this struct: src + (row_base + ...) made ptxas
    // spill 32 bytes instead of 12 at BLOCK_M 64, fast_math=False (H7168-I3072-K1-E1).
    if (rows.valid(fc, half)) v = __ldcg(src + rows.row_base + fc.r0 + 8 * half);
    return v;
  }
};

// A 16-byte global store if `pred`, as one predicated instruction: with a guarded C++ store ptxas
// wraps every store of the L2 epilogue in a divergent region of its own (BSSY / BSYNC and branches,
// where that epilogue's warps stall).
__device__ __forceinline__ void store_16_if(bool pred, void* dst, uint4 v) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.v4.b32 [%1], {%2, %3, %4, %5};\n}\n" ::"r"(
          static_cast<int>(pred)),
      "l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// The BLOCK_M 64 / 128 epilogues' quad exchange: in the m64n128 fragment a row's outputs are
// spread over its quad's 4 lanes, a few bytes per 8-column chunk; through this warp's lines of
// SharedStorage::quad_lines each lane gets 16 contiguous bytes of the row to store as one vector.
// One 64-byte line per fragment row of the warp (lane / 4); its four 16-byte chunks are
// XOR-swizzled by row / 2, so that neither the quad's small writes nor the 16-byte reads meet on
// a bank. Every lane of the warp takes part (valid row or not): write(), sync(), chunk(), sync().
// Why shared memory: in registers the exchange takes three shuffles and select chains per 4 words,
// and L1's codes go out 2 bytes at a time (docs/design.md 4.5).
struct QuadLines {
  static constexpr int kWarpBytes = 8 * 64;
  uint8_t* lines;  // SharedStorage::quad_lines
  int line, q;     // this lane's line (byte offset) and its lane in the quad
  __device__ static QuadLines of(uint8_t* quad_lines, int wg, const FragCoord& fc) {
    return {quad_lines, (wg * 4 + fc.r0 / 16) * kWarpBytes + (fc.r0 % 16) * 64, fc.q};  // fc.r0 % 16 = lane / 4
  }
  // Byte `byte` of the row's 64, in the swizzled line (chunks XOR row / 2 = line / 128).
  __device__ uint8_t* at(int byte) const { return lines + line + ((byte / 16) ^ ((line / 128) % 4)) * 16 + byte % 16; }
  template <class T>
  __device__ void write(int byte, T v) const { *reinterpret_cast<T*>(at(byte)) = v; }
  __device__ static void sync() { __syncwarp(); }
  __device__ uint4 chunk() const { return *reinterpret_cast<const uint4*>(at(16 * q)); }  // bytes 16q ..
};

// Fast L1 at BLOCK_M 64 and 128 (mma.cuh mma_tile): a warpgroup's half h holds m64n128
// accumulators (acc + 64h) of pool rows row0 + r0 and row0 + r0 + 8, weight rows in 8-wide
// chunks that alternate gate (even chunk 2j) and up (odd chunk 2j + 1) of output
// 64 b + 8 j + 2 q + {0, 1}, b the half's weight block (Cfg::wg_weight_block). A row's amax
// spans the tile's 128 outputs: at BLOCK_M 128 one warpgroup holds all of them (the quad
// reduces); at BLOCK_M 64 the two warpgroups hold 64 each and meet in shared memory.
// The act values overwrite the gate slots of acc.
template <class Cfg>
__device__ __forceinline__ void l1_epilogue(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                            const Tile& t, int wg, const FragCoord& fc,
                                            const EpilogueRows<Cfg, false>& weights, float* acc,
                                            float* amax_exchange, uint8_t* quad_lines, int parity) {
  constexpr int kHalves = Cfg::kWgHalves;
  const TileRows<Cfg> rows = TileRows<Cfg>::of(tables, t, wg);
  const bool valid[2] = {rows.valid(fc, 0), rows.valid(fc, 1)};
  const float w[2] = {weights.row(p, base, rows, fc, 0), weights.row(p, base, rows, fc, 1)};
  const float clamp = p.activation_clamp;

  // acc[64h + 8j + i], i < 4: output pair j of half h (gate chunk 2j; the up chunk 2j + 1 is
  // acc[64h + 8j + 4 + i]); fragment slot i: row r0 for i < 2, r0 + 8 otherwise.
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float* slot = acc + 64 * h + 8 * j + i;
        const float gate = fminf(slot[0], clamp);
        const float up = fminf(fmaxf(slot[4], -clamp), clamp);
        slot[0] = silu<Cfg::kFastMath>(gate) * up * w[i / 2];
        amax[i / 2] = fmaxf(amax[i / 2], fabsf(slot[0]));
      }
#pragma unroll
  for (int half = 0; half < 2; ++half) amax[half] = quad_max(amax[half]);
  if constexpr (kHalves == 1) {
    float* mine = amax_exchange + (parity * 2 + wg) * Cfg::kBlockM;
    const float* other = amax_exchange + (parity * 2 + (wg ^ 1)) * Cfg::kBlockM;
    if (fc.q == 0) mine[fc.r0] = amax[0], mine[fc.r0 + 8] = amax[1];
    named_barrier_sync(kEpilogueBarrierId, Cfg::kNumMathThreads);
#pragma unroll
    for (int half = 0; half < 2; ++half) amax[half] = fmaxf(amax[half], other[fc.r0 + 8 * half]);
  }

  // Row r0 + 8 * half's 64 codes of half h (outputs 64 b + [0, 64)) go out as 16-byte vectors after
  // the quad exchange (QuadLines): lane q stores outputs 64 b + 16 q + [0, 16).
  uint8_t* act_out = base + p.off.act;
  const QuadLines lines = QuadLines::of(quad_lines, wg, fc);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float scale = fmaxf(amax[half], kScaleEps) / kFp8Max;
    const int row = rows.row(fc, half);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // outputs 8j + 2q, + 1
        float2 v = make_float2(acc[64 * h + 8 * j + 2 * half], acc[64 * h + 8 * j + 2 * half + 1]);
        if constexpr (Cfg::kFastMath) v.x *= 1.f / scale, v.y *= 1.f / scale;
        else v.x /= scale, v.y /= scale;
        lines.write(8 * j + 2 * fc.q, __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3));
      }
      QuadLines::sync();
      const uint4 codes = lines.chunk();
      QuadLines::sync();  // read before the next half overwrites the line
      store_16_if(valid[half], act_out + (int64_t)row * Cfg::kInter + t.n_block * 128 + 64 * Cfg::wg_weight_block(wg, h) +
                                   16 * fc.q,
                  codes);
    }
    if (valid[half] && (kHalves == 2 || wg == 0) && fc.q == 0)
      reinterpret_cast<float*>(base + p.off.act_sf)[(int64_t)t.n_block * p.pool_capacity + row] = scale;
  }
}

// Transposes a 4x4 block of 32-bit values across the 4 lanes of a quad in registers (exact numerics'
// L2 epilogue; QuadLines says why): lane q holds
// w[j] = M[q][j] and ends with w[p] = M[p][q]. Rotation k sends M[q][(q + k) % 4] to lane
// q + k; indices are resolved with selects (no dynamically indexed registers).
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int q) {
  const auto pick = [&](int i) { return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3]; };
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = w[j];  // out[q] = w[q] stays; the others are replaced
#pragma unroll
  for (int k = 1; k < 4; ++k) {
    const uint32_t recv = __shfl_sync(0xffffffffu, pick((q + k) & 3), (threadIdx.x & ~3) | ((q - k) & 3));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (j == ((q - k) & 3)) out[j] = recv;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = out[j];
}

// L2 (BLOCK_M 64 and 128, mma.cuh mma_tile): a row's BF16 values go out as 16-byte vectors after
// the quad exchange (QuadLines): over NVLink 16-byte stores beat 32-bit ones at large M
// (docs/design.md section 9). Lane q stores chunks 4g + q. Half h of the warpgroup covers hidden columns
// 128 b + [0, 128) of the tile, b = Cfg::wg_weight_block(wg, h).
template <class Cfg>
__device__ __forceinline__ void l2_epilogue(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                            const Tile& t, int wg, const FragCoord& fc,
                                            const EpilogueRows<Cfg, true>& dests, const float* acc,
                                            uint8_t* quad_lines) {
  const TileRows<Cfg> rows = TileRows<Cfg>::of(tables, t, wg);
  const QuadLines lines = QuadLines::of(quad_lines, wg, fc);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool valid = rows.valid(fc, half);              // uniform over the quad (one row)
    const int2 src = dests.row(p, base, rows, fc, half);  // (source rank, token * K + slot)
    __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(p.peer_base[src.x] + p.off.combine) +
                         (int64_t)src.y * Cfg::kHidden;
#pragma unroll
    for (int h = 0; h < Cfg::kWgHalves; ++h) {
      const int col0 = t.n_block * Cfg::kBlockN + Cfg::wg_weight_block(wg, h) * Cfg::kWgN;
      if (col0 >= Cfg::kHidden) continue;  // the last n-block of an H that is an odd multiple of 128 (warpgroup-uniform)
      uint4* dst = reinterpret_cast<uint4*>(row + col0);
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        uint32_t w[4];  // chunk 4g + j: this lane's columns 2q, 2q + 1 of it
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = 4 * g + j;
          const __nv_bfloat162 v = __floats2bfloat162_rn(acc[64 * h + 4 * c + 2 * half], acc[64 * h + 4 * c + 2 * half + 1]);
          w[j] = *reinterpret_cast<const uint32_t*>(&v);
        }
        uint4 chunk;  // chunk 4g + q
        if constexpr (Cfg::kQuadLineBytes > 0) {
#pragma unroll
          for (int j = 0; j < 4; ++j) lines.write(16 * j + 4 * fc.q, w[j]);
          QuadLines::sync();
          chunk = lines.chunk();
          QuadLines::sync();  // read before the next group overwrites the line
        } else {
          quad_transpose(w, fc.q);
          chunk = make_uint4(w[0], w[1], w[2], w[3]);
        }
        store_16_if(valid, dst + 4 * g + fc.q, chunk);
      }
    }
  }
}

// Swap-AB epilogues (L1: exact mode, exact_l1.cuh mma_tile_l1, and fast mode below BLOCK_M 64,
// mma_tile_swap; L2: BLOCK_M 8/16/32, mma_tile_swap): a thread holds weight rows
// 64i + r0 and 64i + r0 + 8 of its warpgroup's 128 for tokens 8c + 2q + {0,1}.
//
// L1: with the interleave of 8, rows 64i + r0 and 64i + r0 + 8 are the gate and up rows
// of output n_block * 128 + 64 wg + 32 i + 8 w4 + lane / 4 (w4: warp in the warpgroup).
// A token's requant amax spans the tile's 128 outputs: in-thread over i, across lane / 4
// by shuffles, across the 8 math warps through shared memory (named barrier 1).
template <class Cfg>
__device__ __forceinline__ void l1_epilogue_swap(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                                 const Tile& t, int wg, const FragCoord& fc, const float* acc,
                                                 float* amax_exchange, int parity) {
  constexpr int kN = Cfg::kBlockM, kFrag = kN / 2, kChunks = kN / 8, kSub = Cfg::kSwapSubTiles;
  const int row_base = tables.exp_start[t.expert] + t.m_block * kN;
  const int valid_rows = tables.exp_count[t.expert] - t.m_block * kN;
  const float* pool_weight = reinterpret_cast<const float*>(base + p.off.pool_weight);
  const float clamp = p.activation_clamp;
  const int lane = threadIdx.x % 32, math_warp = Role::math_warp();

  float act[kSub][kChunks][2];
  float amax[kChunks][2];
  for_each_fragment_col<kChunks>([&](int c, int j) {
    const int token = fc.col(c, j);
    const float w = token < valid_rows ? __ldcg(pool_weight + row_base + token) : 0.f;
    amax[c][j] = 0.f;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      const float gate = fminf(acc[i * kFrag + 4 * c + j], clamp);
      const float up = fminf(fmaxf(acc[i * kFrag + 4 * c + 2 + j], -clamp), clamp);
      const float v = silu<Cfg::kFastMath>(gate) * up * w;
      act[i][c][j] = v;
      amax[c][j] = fmaxf(amax[c][j], fabsf(v));
    }
#pragma unroll
    for (int mask = 4; mask < 32; mask *= 2)
      amax[c][j] = fmaxf(amax[c][j], __shfl_xor_sync(0xffffffffu, amax[c][j], mask));
  });
  float* mine = amax_exchange + (parity * Cfg::kAmaxSlots + math_warp) * kN;
  if (lane < 4) for_each_fragment_col<kChunks>([&](int c, int j) { mine[fc.col(c, j)] = amax[c][j]; });
  named_barrier_sync(kEpilogueBarrierId, Cfg::kNumMathThreads);

  uint8_t* act_out = base + p.off.act;
  float* act_sf = reinterpret_cast<float*>(base + p.off.act_sf);
  const int col = t.n_block * 128 + 64 * wg + 8 * (math_warp % 4) + lane / 4;
  for_each_fragment_col<kChunks>([&](int c, int j) {
    const int token = fc.col(c, j);
    if (token >= valid_rows) return;
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < Cfg::kAmaxSlots; ++w) m = fmaxf(m, amax_exchange[(parity * Cfg::kAmaxSlots + w) * kN + token]);
    const float scale = fmaxf(m, kScaleEps) / kFp8Max;
    const int row = row_base + token;
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      const float v = Cfg::kFastMath ? act[i][c][j] * (1.f / scale) : act[i][c][j] / scale;
      act_out[(int64_t)row * Cfg::kInter + col + 32 * i] =
          static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
    if (math_warp == 0 && lane < 4) act_sf[(int64_t)t.n_block * p.pool_capacity + row] = scale;
  });
}

// L2: rows 64i + r0 (+ 8) of the warpgroup are hidden columns; each token's values go to
// its (source rank, slot) row of the combine buffer, as l2_epilogue.
template <class Cfg>
__device__ __forceinline__ void l2_epilogue_swap(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                                 const Tile& t, int wg, const FragCoord& fc, const float* acc) {
  constexpr int kN = Cfg::kBlockM, kFrag = kN / 2, kChunks = kN / 8;
  const int col_base = t.n_block * Cfg::kBlockN + wg * Cfg::kWgN;
  if (col_base >= Cfg::kHidden) return;  // the last n-block of an H that is an odd multiple of 128
  const int row_base = tables.exp_start[t.expert] + t.m_block * kN;
  const int valid_rows = tables.exp_count[t.expert] - t.m_block * kN;
  const int2* pool_src = reinterpret_cast<const int2*>(base + p.off.pool_src);
  for_each_fragment_col<kChunks>([&](int c, int j) {
    const int token = fc.col(c, j);
    if (token >= valid_rows) return;
    const int2 src = __ldcg(pool_src + row_base + token);  // (source rank, token * K + slot)
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.peer_base[src.x] + p.off.combine) +
                         (int64_t)src.y * Cfg::kHidden + col_base + fc.r0;
#pragma unroll
    for (int i = 0; i < Cfg::kSwapSubTiles; ++i) {
      dst[64 * i] = __float2bfloat16_rn(acc[i * kFrag + 4 * c + j]);
      dst[64 * i + 8] = __float2bfloat16_rn(acc[i * kFrag + 4 * c + 2 + j]);
    }
  });
}

}  // namespace megamoe
