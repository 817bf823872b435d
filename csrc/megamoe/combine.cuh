// Combine: after every rank has scattered its L2 rows, each token's valid slots are
// summed in float32 in ascending slot order and rounded once to BF16 (docs/design.md s.2).
// A warp sums one token's slots over a run of 256-column stripes (each lane owns 8
// consecutive columns per stripe). With few tokens a token's stripes are split over
// several warps: each stripe is a dependent round trip to memory, so one warp walking
// all H/256 stripes of a single token took ~10-20 us at decode (round 4 phase times).
#pragma once

#include <cuda_bf16.h>

#include "config.cuh"
#include "dispatch.cuh"
#include "params.h"

namespace megamoe {

template <class Cfg>
__device__ void combine_tokens(const KernelParams& p, uint8_t* base) {
  constexpr int H = Cfg::kHidden, K = Cfg::kTopk;
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(base + p.off.topk_idx);
  const __nv_bfloat16* combine = reinterpret_cast<const __nv_bfloat16*>(base + p.off.combine);
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
  constexpr int kStripes = (H + 255) / 256;
  const int lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * Cfg::kNumWarps;
  if (p.num_tokens == 0) return;
  // Split each token into as many stripe runs as there are warps per token (at most one
  // stripe per run); with at least as many tokens as warps, one run is the whole token.
  const int max_runs = max(1, min(kStripes, num_warps / p.num_tokens));
  const int stripes_per_run = (kStripes + max_runs - 1) / max_runs;
  const int runs_per_token = (kStripes + stripes_per_run - 1) / stripes_per_run;  // none empty
  const int num_items = p.num_tokens * runs_per_token;
  for (int item = blockIdx.x * Cfg::kNumWarps + threadIdx.x / 32; item < num_items; item += num_warps) {
    const int token = item / runs_per_token;
    const int first_col = (item % runs_per_token) * stripes_per_run * 256;
    const int end_col = min(H, first_col + stripes_per_run * 256);
    uint32_t valid_mask = 0;
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (is_valid_expert(topk_idx[(int64_t)token * K + k], Cfg::kNumExperts)) valid_mask |= 1u << k;
    for (int col = first_col + lane * 8; col < end_col; col += 256) {
      // All slots' loads are issued before any is used, so K loads per lane are in flight.
      uint4 packed[K];
#pragma unroll
      for (int k = 0; k < K; ++k)
        packed[k] = (valid_mask >> k & 1)
                        ? __ldcg(reinterpret_cast<const uint4*>(combine + ((int64_t)token * K + k) * H + col))
                        : make_uint4(0, 0, 0, 0);
      float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!(valid_mask >> k & 1)) continue;
        const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&packed[k]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(v[i]);
          sum[2 * i] += f.x;
          sum[2 * i + 1] += f.y;
        }
      }
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
      *reinterpret_cast<uint4*>(y + (int64_t)token * H + col) = out;
    }
  }
}

// Zeroes the send-side counters, the m-blocks' arrival counters (L1 tiles, pulled rows) and the
// L2 tile claims for the next call (peers finished reading the former, and this rank's L1 and L2 tiles the
// latter, before the last cross-rank barrier).
template <class Cfg>
__device__ void reset_workspace(const KernelParams& p, uint8_t* base, const ExpertTables& tables) {
  int* send_count = reinterpret_cast<int*>(base + p.off.send_count);
  int* send_cursor = reinterpret_cast<int*>(base + p.off.send_cursor);
  int* l1_done = reinterpret_cast<int*>(base + p.off.l1_done);
  int* rows_arrived = reinterpret_cast<int*>(base + p.off.rows_arrived);
  const int stride = gridDim.x * blockDim.x;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < Cfg::kNumExperts; e += stride)
    send_count[e] = 0, send_cursor[e] = 0;
  for (int gm = blockIdx.x * blockDim.x + threadIdx.x; gm < tables.mblk_prefix[Cfg::kNumLocalExperts]; gm += stride)
    l1_done[gm] = 0, rows_arrived[gm] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *p.l2_tiles_claimed = 0;
    // The window kernel's flag (kernel.cuh mega_moe_windows): every CTA of it read the flag at its
    // start, before the cross-rank barrier that came before this.
    if constexpr (Cfg::kWindowed) reinterpret_cast<uint32_t*>(base + p.off.signals)[kSigWindowsPending] = 0;
  }
}

}  // namespace megamoe
