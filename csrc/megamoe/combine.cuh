// Combine: once a token's rows have come (combine_arrived, counted by the L2 tiles of every rank
// that computes one: signal_l2_rows below), its valid slots are summed in float32 in ascending slot
// order and rounded once to BF16 (docs/design.md s.2). No cross-rank barrier comes before it: a CTA
// combines as soon as its own L2 tiles are done, while other CTAs and ranks run their last ones.
// A warp sums one token's slots over a run of 256-column stripes (each lane owns 8
// consecutive columns per stripe). With few tokens a token's stripes are split over
// several warps: each stripe is a dependent round trip to memory, so one warp walking
// all H/256 stripes of a single token would put H/256 round trips in a row at decode.
#pragma once

#include <cuda_bf16.h>

#include "config.cuh"
#include "dispatch.cuh"
#include "params.h"
#include "pipeline.cuh"
#include "roles.cuh"
#include "scheduler.cuh"
#include "sync.cuh"

namespace megamoe {

// The count a token's combine_arrived reaches: one per L2 tile (n-block) of each valid slot's row.
template <class Cfg>
__device__ __forceinline__ int combine_rows_expected(uint32_t valid_mask) {
  return __popc(valid_mask) * Cfg::kL2NumNBlocks;
}

// Producer warpgroup's warp 1 during L2 (idle there otherwise): for each L2 tile the math warpgroups
// finish (pipeline.cuh L2TileMailbox), one system-scope fence for the warp, then one relaxed add per
// valid row to the combine_arrived counter of the row's token on its owner rank. The fence is
// cumulative over the tile's stores, which the math threads' mailbox arrival (release) ordered before
// this warp's wait (acquire): the pattern of publish_l1_tile, off the math warps' path (a system
// fence waits for the NVLink stores to land). False after a timeout (reported).
template <class Cfg>
__device__ bool signal_l2_rows(const KernelParams& p, const L2TileMailbox<Cfg>& mailbox) {
  for (int i = 0;; ++i) {
    int2 rows;  // (first pool row, valid rows)
    if (!mailbox.take(p, i, rows)) return false;
    if (rows.y == L2TileMailbox<Cfg>::kNoMoreRows) return true;
    __threadfence_system();
    // This rank's base from the parameters, not a register kept through L1: at the producer
    // warpgroup's registers (BLOCK_M 128, 40 then) one more live value spilled there.
    const int2* pool_src = reinterpret_cast<const int2*>(p.peer_base[p.rank] + p.off.pool_src) + rows.x;
    for (int r = threadIdx.x % 32; r < rows.y; r += 32) {
      const int2 src = __ldcg(pool_src + r);  // (source rank, token * K + slot)
      red_add_relaxed_sys(reinterpret_cast<uint32_t*>(p.peer_base[src.x] + p.off.combine_arrived) + src.y / Cfg::kTopk, 1);
    }
  }
}

// kSum false (the phase stop after L2, stop_after_phase 6): only the waits for each token's count.
// A call may end only once every count into its combine_arrived has landed: the next call zeroes them
// first, before its cross-rank barrier, and a peer's late add would then count into that call.
template <class Cfg, bool kSum = true>
__device__ void combine_tokens(const KernelParams& p, uint8_t* base) {
  const uint32_t* combine_arrived = reinterpret_cast<const uint32_t*>(base + p.off.combine_arrived);
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
    // Every lane acquires the count itself, so its own loads below come after the rows' stores.
    const uint32_t expected = combine_rows_expected<Cfg>(valid_mask);
    bounded_wait(p, kErrCombineRowsTimeout, [&] { return ld_acquire_sys(combine_arrived + token) >= expected; }, 2);
    if constexpr (!kSum) continue;
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

// Every CTA at the start of a call, before its first grid barrier: zeroes what the last call on this
// buffer left counting (its m-blocks' arrival counters, its tokens' combine_arrived, the L2 tile
// claims, the window count), so that a call leaves them as they are for the combine, with no barrier
// after it. The last call has ended on this rank (the kernels run in stream order); peers add to
// combine_arrived again only after this call's cross-rank barrier. CTA 0 records this call's tokens
// once every CTA has read the last call's (after the cross-rank barrier: set_tokens_to_clear).
template <class Cfg>
__device__ void clear_last_call(const KernelParams& p, uint8_t* base, const uint32_t* signals) {
  int* l1_done = reinterpret_cast<int*>(base + p.off.l1_done);
  int* rows_arrived = reinterpret_cast<int*>(base + p.off.rows_arrived);
  uint32_t* combine_arrived = reinterpret_cast<uint32_t*>(base + p.off.combine_arrived);
  const int mblocks = static_cast<int>(*reinterpret_cast<const volatile uint32_t*>(signals + kSigMblocksToClear));
  const int tokens = static_cast<int>(*reinterpret_cast<const volatile uint32_t*>(signals + kSigTokensToClear));
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < max(mblocks, tokens); i += stride) {
    if (i < mblocks) l1_done[i] = 0, rows_arrived[i] = 0;
    if (i < tokens) combine_arrived[i] = 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *p.l2_tiles_claimed = 0;
    if constexpr (Cfg::kWindowed) reinterpret_cast<uint32_t*>(base + p.off.signals)[kSigWindowsPending] = 0;
  }
}

// CTA 0, after the call's cross-rank barrier (every CTA has read the last call's count): the tokens
// whose combine_arrived the next call zeroes.
__device__ __forceinline__ void set_tokens_to_clear(const KernelParams& p, uint32_t* signals) {
  if (blockIdx.x == 0 && threadIdx.x == 0) signals[kSigTokensToClear] = p.num_tokens;
}

// After the call's cross-rank barrier (every rank has ended the last call, whose half of the send side
// is this call's other half): zero that half's counts and cursors for the next call.
template <class Cfg>
__device__ void clear_other_send_half(const KernelParams& p, uint8_t* base, int half) {
  int* send_count = send_side<Cfg>(base, p.off.send_count, half ^ 1);
  int* send_cursor = send_side<Cfg>(base, p.off.send_cursor, half ^ 1);
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < Cfg::kNumExperts; e += gridDim.x * blockDim.x)
    send_count[e] = 0, send_cursor[e] = 0;
}

}  // namespace megamoe
