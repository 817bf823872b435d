// Dispatch: every rank groups its own (token, slot) entries by expert (send side), then
// every rank pulls the entries of its local experts from all ranks over NVLink into its
// L1 pool (receive side). Pulling keeps each rank's NVLink egress busy with useful
// reads only, and lets the receiver lay its pool out compactly without a handshake.
//
// Pool layout: local expert el owns rows [exp_start[el], exp_start[el] + exp_count[el]),
// filled source rank by source rank. Rows are independent through both GEMMs, so tiles
// may overhang into the next expert's rows; epilogues only store rows < exp_count.
#pragma once

#include "config.cuh"
#include "params.h"
#include "sync.cuh"

namespace megamoe {

// Exclusive prefix sum of `data[0, n)` in place by the whole CTA; returns the total.
// `scratch` holds one int per warp plus one.
template <int kNumThreads>
__device__ int block_exclusive_scan(int* data, int n, int* scratch) {
  constexpr int kNumWarps = kNumThreads / 32;
  const int per_thread = (n + kNumThreads - 1) / kNumThreads;
  const int begin = min(n, (int)threadIdx.x * per_thread), end = min(n, begin + per_thread);
  int local = 0;
  for (int i = begin; i < end; ++i) local += data[i];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = local;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int w = 0; w < kNumWarps; ++w) {
      const int v = scratch[w];
      scratch[w] = acc;
      acc += v;
    }
    scratch[kNumWarps] = acc;
  }
  __syncthreads();
  int running = scratch[warp] + incl - local;
  for (int i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = running;
    running += v;
  }
  const int total = scratch[kNumWarps];
  __syncthreads();
  return total;
}

__device__ __forceinline__ bool is_valid_expert(int64_t e, int num_experts) { return e >= 0 && e < num_experts; }

// The send side's counts, cursors and offsets are [2, E] (abi.h BufferOffsets): a call uses half
// `half` (kernel.cuh CtaShared::send_half). A peer reads a call's half until it ends that call. The
// next call fills the other half, and zeroes this one's counts and cursors only after its cross-rank
// barrier, which no rank passes before it has ended this call (combine.cuh clear_other_send_half).
template <class Cfg>
__device__ __forceinline__ int* send_side(const uint8_t* rank_base, int64_t region, int half) {
  return const_cast<int*>(reinterpret_cast<const int*>(rank_base + region)) + half * Cfg::kNumExperts;
}

// Send side, step 1: count this rank's entries per global expert. Each CTA first
// histograms its share of the entries in shared memory (`local_count`, kept for step 2),
// so the global counters take one atomic per (CTA, expert) instead of one per entry.
// An expert id outside [-1, E) is dropped like a masked slot and counted into
// HostWords::bad_expert_ids (the host reports it).
template <class Cfg>
__device__ void dispatch_count(const KernelParams& p, uint8_t* base, int* local_count, int half) {
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(base + p.off.topk_idx);
  int* send_count = send_side<Cfg>(base, p.off.send_count, half);
  for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x) local_count[e] = 0;
  __syncthreads();
  const int num_entries = p.num_tokens * Cfg::kTopk;
  uint32_t bad = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_entries; i += gridDim.x * blockDim.x) {
    const int64_t e = topk_idx[i];
    if (is_valid_expert(e, Cfg::kNumExperts)) {
      atomicAdd(local_count + e, 1);
    } else {
      bad += e != -1;
    }
  }
  // The barrier the histogram needs anyway tells whether this CTA met a bad id. Only then
  // (never in a valid call) the CTA sums its threads' counts a bit at a time with barrier
  // counts, needing no shared memory, and adds the sum with one system atomic.
  if (__syncthreads_or(bad != 0)) {
    unsigned long long total = 0;
    for (int b = 0; __syncthreads_or((bad >> b) != 0); ++b)
      total += static_cast<unsigned long long>(__syncthreads_count((bad >> b) & 1u)) << b;
    if (threadIdx.x == 0) atomicAdd_system(&p.host->bad_expert_ids, total);
  }
  for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x)
    if (local_count[e] != 0) atomicAdd(send_count + e, local_count[e]);
}

// Send side, step 2: list entries (token * K + slot) grouped by expert. Each CTA
// reserves one range per expert for the entries it counted in step 1 (the same
// grid-stride share), then fills it through shared-memory cursors.
// `scratch` is shared memory for kNumExperts + 32 ints besides `local_count`. `counts_in_cta`: this
// CTA alone counted every entry (kernel.cuh mega_moe), so its `local_count` is the rank's count and
// the list takes its offsets from it instead of reading `send_count` back.
template <class Cfg>
__device__ void dispatch_list(const KernelParams& p, uint8_t* base, int* local_count, int* scratch, int half,
                              bool counts_in_cta) {
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(base + p.off.topk_idx);
  int* send_count = send_side<Cfg>(base, p.off.send_count, half);
  int* send_cursor = send_side<Cfg>(base, p.off.send_cursor, half);
  int* send_offset = send_side<Cfg>(base, p.off.send_offset, half);
  int* send_list = reinterpret_cast<int*>(base + p.off.send_list);

  int* offsets = scratch;
  for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x)
    offsets[e] = counts_in_cta ? local_count[e] : __ldcg(send_count + e);
  __syncthreads();
  block_exclusive_scan<Cfg::kNumThreads>(offsets, Cfg::kNumExperts, scratch + Cfg::kNumExperts);
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x) send_offset[e] = offsets[e];

  // local_count[e] becomes this CTA's next free position in expert e's list.
  for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x)
    if (local_count[e] != 0) local_count[e] = offsets[e] + atomicAdd(send_cursor + e, local_count[e]);
  __syncthreads();
  const int num_entries = p.num_tokens * Cfg::kTopk;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_entries; i += gridDim.x * blockDim.x) {
    const int64_t e = topk_idx[i];
    if (is_valid_expert(e, Cfg::kNumExperts)) send_list[atomicAdd(local_count + e, 1)] = i;
  }
}

// Windowed variants (Cfg::kWindowed): the part of the pool the GEMM phases run, the global m-blocks
// [first_mblock, end_mblock) (a window of consecutive m-blocks, at most pool_capacity / BLOCK_M of
// them); their rows lie in the pool from row 0 on, where exp_start has been shifted by the window's
// first row (enter_pool_window below). l2_claim_base: the call's L2 claim counter when the window's
// L2 tiles start (pipeline.cuh L2TileQueue).
struct PoolWindow {
  int first_mblock, end_mblock, l2_claim_base;
};

// Tables every CTA keeps in shared memory for the GEMM phases.
struct ExpertTables {
  int* exp_start;    // [E_l] first pool row (windowed: shifted by the window's first row, may be negative)
  int* exp_count;    // [E_l] rows received
  int* mblk_prefix;  // [E_l + 1] exclusive prefix of ceil(count / BLOCK_M), over the whole call
  const PoolWindow* window;  // windowed variants only
};

// Receive side, step 1 (every CTA, redundantly): read how many entries each rank sends
// to each local expert and where they sit in its send list; lay out the pool.
// `src_count` / `src_offset` are [E_l * R] shared-memory scratch. `count_stats`: add the counts to
// recv_stats (once per call: the window kernel lays the pool out again for each window).
template <class Cfg>
__device__ void dispatch_layout(const KernelParams& p, const ExpertTables& t, int* src_count, int* src_offset,
                                int* scan_scratch, bool count_stats, int half) {
  constexpr int R = Cfg::kNumRanks, EL = Cfg::kNumLocalExperts;
  for (int i = threadIdx.x; i < EL * R; i += blockDim.x) {
    const int el = i / R, s = i % R;
    const uint8_t* peer = p.peer_base[s];
    const int e = p.rank * EL + el;
    src_count[i] = __ldcg(send_side<Cfg>(peer, p.off.send_count, half) + e);
    src_offset[i] = __ldcg(send_side<Cfg>(peer, p.off.send_offset, half) + e);
  }
  __syncthreads();
  for (int el = threadIdx.x; el < EL; el += blockDim.x) {
    int total = 0;
    for (int s = 0; s < R; ++s) total += src_count[el * R + s];
    t.exp_count[el] = total;
    t.exp_start[el] = total;
    t.mblk_prefix[el] = (total + Cfg::kBlockM - 1) / Cfg::kBlockM;
  }
  __syncthreads();
  block_exclusive_scan<Cfg::kNumThreads>(t.exp_start, EL, scan_scratch);
  const int total_mblocks = block_exclusive_scan<Cfg::kNumThreads>(t.mblk_prefix, EL, scan_scratch);
  if (threadIdx.x == 0) t.mblk_prefix[EL] = total_mblocks;
  __syncthreads();
  if (count_stats && blockIdx.x == 0 && p.recv_stats != nullptr)
    for (int el = threadIdx.x; el < EL; el += blockDim.x) p.recv_stats[el] += t.exp_count[el];
}

// Last index i in [0, n) with sorted[i] <= value (sorted is non-decreasing, sorted[0] <= value).
__device__ __forceinline__ int last_le(const int* sorted, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (sorted[mid] <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Receive side, step 2: one warp copies pool row `row` (the `list_pos`-th entry of
// `src_rank`'s send list): the token (H fp8 bytes), its scales, routing weight and origin.
// kBatch 16-byte loads per lane are in flight before any store; kUnrolled: the batches too (more
// loads in flight, more registers).
template <class Cfg, int kBatch, bool kUnrolled>
__device__ __forceinline__ void pull_row(const KernelParams& p, uint8_t* base, int row, int src_rank, int list_pos) {
  constexpr int H = Cfg::kHidden, K = Cfg::kTopk, kNumSf = H / 128, kVecs = H / 16;
  const int lane = threadIdx.x % 32;
  const uint8_t* peer = p.peer_base[src_rank];
  const int entry = __ldcg(reinterpret_cast<const int*>(peer + p.off.send_list) + list_pos);
  const int token = entry / K;
  const uint4* src_x = reinterpret_cast<const uint4*>(peer + p.off.x + (int64_t)token * H);
  uint4* dst_x = reinterpret_cast<uint4*>(base + p.off.pool_x + (int64_t)row * H);
#pragma unroll(kUnrolled ? 64 : 1)
  for (int v0 = 0; v0 < kVecs; v0 += 32 * kBatch) {
    uint4 chunk[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (v0 + 32 * b + lane < kVecs) chunk[b] = __ldcg(src_x + v0 + 32 * b + lane);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (v0 + 32 * b + lane < kVecs) dst_x[v0 + 32 * b + lane] = chunk[b];
  }
  const float* src_sf = reinterpret_cast<const float*>(peer + p.off.x_sf) + (int64_t)token * kNumSf;
  float* pool_sf = reinterpret_cast<float*>(base + p.off.pool_sf);
  for (int g = lane; g < kNumSf; g += 32) pool_sf[(int64_t)g * p.pool_capacity + row] = __ldcg(src_sf + g);
  if (lane == 0) {
    reinterpret_cast<float*>(base + p.off.pool_weight)[row] =
        __ldcg(reinterpret_cast<const float*>(peer + p.off.topk_weights) + entry);
    reinterpret_cast<int2*>(base + p.off.pool_src)[row] = make_int2(src_rank, entry);
  }
}

// The global m-block (the call's numbering: rows_arrived, l1_done) of pool row `row`, one of local
// expert el's rows in the tables' current row frame; mblock_first_row below is its inverse.
template <class Cfg>
__device__ __forceinline__ int row_mblock(const ExpertTables& t, int el, int row) {
  return t.mblk_prefix[el] + (row - t.exp_start[el]) / Cfg::kBlockM;
}

// After a warp's pull_row: counts the row into rows_arrived[its m-block] for the L1 tiles that
// wait on it (scheduler.cuh pulled_rows_ready). Each lane fences its stores for the tiles' TMA
// and at GPU scope; the warp barrier orders them before lane 0's release.
template <class Cfg>
__device__ __forceinline__ void publish_pulled_row(const KernelParams& p, uint8_t* base, const ExpertTables& t,
                                                   int el, int row) {
  fence_generic_to_async();
  __threadfence();
  __syncwarp();
  if (threadIdx.x % 32 == 0) {
    red_add_release_gpu(reinterpret_cast<int*>(base + p.off.rows_arrived) + row_mblock<Cfg>(t, el, row), 1);
  }
}

// The pool's rows, all experts' (pool row order; tiles overhang into the next expert's rows).
__device__ __forceinline__ int pool_rows(const ExpertTables& t, int num_local_experts) {
  return t.exp_start[num_local_experts - 1] + t.exp_count[num_local_experts - 1];
}

// Pool windows (Cfg::kWindowed). The layout above is the call's, as if the pool held every row:
// experts back to back from row 0, global m-blocks numbered by mblk_prefix. The pool holds
// pool_capacity rows, so a window is up to pool_capacity / BLOCK_M consecutive global m-blocks
// (their rows span at most that many BLOCK_M): window w starts at m-block w * that. The per-m-block
// counters (rows_arrived, l1_done) keep the call's numbering; only the rows move.
template <class Cfg>
__device__ __forceinline__ int mblocks_per_window(const KernelParams& p) { return p.pool_capacity / Cfg::kBlockM; }

template <class Cfg>
__device__ __forceinline__ int num_pool_windows(const KernelParams& p, const ExpertTables& t) {
  const int per = mblocks_per_window<Cfg>(p);
  return max(1, (t.mblk_prefix[Cfg::kNumLocalExperts] + per - 1) / per);
}

// The first row of global m-block gm (< the call's m-blocks) in the tables' current row frame.
template <class Cfg>
__device__ __forceinline__ int mblock_first_row(const ExpertTables& t, int gm) {
  const int el = last_le(t.mblk_prefix, Cfg::kNumLocalExperts, gm);
  return t.exp_start[el] + (gm - t.mblk_prefix[el]) * Cfg::kBlockM;
}

// Every thread, after dispatch_layout: makes window w current. Thread 0 writes its bounds and L2
// claim base (pipeline.cuh L2TileQueue: each CTA ends a window's L2 tiles with one claim past them)
// and every thread shifts exp_start by the window's first row, so that the window's rows are pool
// rows [0, pool_window_rows) wherever the phases compute a row from the tables.
template <class Cfg>
__device__ void enter_pool_window(const KernelParams& p, const ExpertTables& t, PoolWindow* window, int w) {
  const int per = mblocks_per_window<Cfg>(p);
  const int first = w * per, end = min(t.mblk_prefix[Cfg::kNumLocalExperts], first + per);
  const int shift = w == 0 ? 0 : mblock_first_row<Cfg>(t, first);
  __syncthreads();  // every thread has read the unshifted rows
  for (int el = threadIdx.x; el < Cfg::kNumLocalExperts; el += blockDim.x) t.exp_start[el] -= shift;
  if (threadIdx.x == 0) *window = {first, end, first * Cfg::kL2NumNBlocks + w * static_cast<int>(gridDim.x)};
  __syncthreads();
}

// The current window's rows: from pool row 0 to where its end m-block starts (or the last row).
template <class Cfg>
__device__ __forceinline__ int pool_window_rows(const ExpertTables& t) {
  const int end = t.window->end_mblock;
  return end < t.mblk_prefix[Cfg::kNumLocalExperts] ? mblock_first_row<Cfg>(t, end)
                                                     : pool_rows(t, Cfg::kNumLocalExperts);
}

// The rows [first_row, row_end) with stride `stride` that this warp pulled, counted into
// rows_arrived behind one fence: each lane fences its stores for the tiles' TMA, the warp barrier
// orders them before every lane's GPU-scope fence, and lane i then counts the warp's rows i, i + 32, ...
template <class Cfg>
__device__ __forceinline__ void publish_pulled_rows(int* rows_arrived, const ExpertTables& t, int first_row,
                                                    int row_end, int stride) {
  fence_generic_to_async();
  __syncwarp();
  __threadfence();
  for (int row = first_row + threadIdx.x % 32 * stride; row < row_end; row += 32 * stride) {
    const int el = last_le(t.exp_start, Cfg::kNumLocalExperts, row);
    red_add_relaxed_gpu(rows_arrived + row_mblock<Cfg>(t, el, row), 1);
  }
}

// Pool rows [0, row_end) by every warp of the grid, before the GEMM phases, with the layout's
// per-(expert, source rank) counts and offsets from shared memory. The rows are published for the
// L1 tiles that wait for them once the warp has pulled its share, behind one fence
// (publish_pulled_rows): a fence per row makes each row's stores land before the next row's loads
// go out, which serializes the pull (docs/design.md section 9). The CTA goes on to L1
// after its share anyway, so other CTAs' tiles see the rows that much later at most. At BLOCK_M 128
// (rebalanced registers) each row is published as it lands (publish_pulled_row): without a fence
// in this loop ptxas spills a kernel-wide value there.
template <class Cfg>
__device__ void dispatch_pull(const KernelParams& p, uint8_t* base, const ExpertTables& t, const int* src_count,
                              const int* src_offset, int row_end) {
  constexpr int R = Cfg::kNumRanks, EL = Cfg::kNumLocalExperts;
  constexpr bool kPublishEachRow = Cfg::kRebalanceRegisters;
  const int num_warps = gridDim.x * Cfg::kNumWarps;
  const int first_row = blockIdx.x * Cfg::kNumWarps + threadIdx.x / 32;
  for (int row = first_row; row < row_end; row += num_warps) {
    const int el = last_le(t.exp_start, EL, row);
    int j = row - t.exp_start[el], s = 0;
    while (j >= src_count[el * R + s]) j -= src_count[el * R + s++];
    pull_row<Cfg, 8, true>(p, base, row, s, src_offset[el * R + s] + j);
    if constexpr (kPublishEachRow) publish_pulled_row<Cfg>(p, base, t, el, row);
  }
  if constexpr (!kPublishEachRow)
    publish_pulled_rows<Cfg>(reinterpret_cast<int*>(base + p.off.rows_arrived), t, first_row, row_end, num_warps);
}

// Pool rows [first_row, row_end) while the L1 tiles run (Cfg::kPullDuringL1): warp `worker` of
// `num_workers` over the grid. The layout's scratch is the pipeline stages by now, so the
// source ranks' counts and offsets come from their send side (the call's half, send_side). Two
// loads in flight per lane, one batch at a time: these warps run at the
// producer warpgroup's register budget (Cfg::kProducerRegisters at BLOCK_M 128), where four
// spilled.
template <class Cfg>
__device__ void pull_rows_during_l1(const KernelParams& p, uint8_t* base, const ExpertTables& t, int first_row,
                                    int row_end, int worker, int num_workers, int half) {
  constexpr int EL = Cfg::kNumLocalExperts;
  for (int row = first_row + worker; row < row_end; row += num_workers) {
    // The regions' addresses are formed anew in each row: hoisted out of the loop they would be a
    // dozen 64-bit values live through it, which spill at the producer's register budget.
    asm volatile("" : "+l"(base));
    const int el = last_le(t.exp_start, EL, row);
    const int e = p.rank * EL + el;  // global expert
    int j = row - t.exp_start[el], s = 0;
    for (;; ++s) {  // the expert's rows come source rank by source rank
      const int count = __ldcg(send_side<Cfg>(p.peer_base[s], p.off.send_count, half) + e);
      if (j < count) break;
      j -= count;
    }
    pull_row<Cfg, 2, false>(p, base, row, s, __ldcg(send_side<Cfg>(p.peer_base[s], p.off.send_offset, half) + e) + j);
    publish_pulled_row<Cfg>(p, base, t, el, row);
  }
}

}  // namespace megamoe
