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

// Send side, step 1: count this rank's entries per global expert. Each CTA first
// histograms its share of the entries in shared memory (`local_count`, kept for step 2),
// so the global counters take one atomic per (CTA, expert) instead of one per entry.
// An expert id outside [-1, E) is dropped like a masked slot and counted into
// HostWords::bad_expert_ids (the host reports it).
template <class Cfg>
__device__ void dispatch_count(const KernelParams& p, uint8_t* base, int* local_count) {
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(base + p.off.topk_idx);
  int* send_count = reinterpret_cast<int*>(base + p.off.send_count);
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
// `scratch` is shared memory for kNumExperts + 32 ints besides `local_count`.
template <class Cfg>
__device__ void dispatch_list(const KernelParams& p, uint8_t* base, int* local_count, int* scratch) {
  const int64_t* topk_idx = reinterpret_cast<const int64_t*>(base + p.off.topk_idx);
  int* send_count = reinterpret_cast<int*>(base + p.off.send_count);
  int* send_cursor = reinterpret_cast<int*>(base + p.off.send_cursor);
  int* send_offset = reinterpret_cast<int*>(base + p.off.send_offset);
  int* send_list = reinterpret_cast<int*>(base + p.off.send_list);

  int* offsets = scratch;
  for (int e = threadIdx.x; e < Cfg::kNumExperts; e += blockDim.x) offsets[e] = __ldcg(send_count + e);
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

// Tables every CTA keeps in shared memory for the GEMM phases.
struct ExpertTables {
  int* exp_start;    // [E_l] first pool row
  int* exp_count;    // [E_l] rows received
  int* mblk_prefix;  // [E_l + 1] exclusive prefix of ceil(count / BLOCK_M)
};

// Receive side, step 1 (every CTA, redundantly): read how many entries each rank sends
// to each local expert and where they sit in its send list; lay out the pool.
// `src_count` / `src_offset` are [E_l * R] shared-memory scratch.
template <class Cfg>
__device__ void dispatch_layout(const KernelParams& p, const ExpertTables& t, int* src_count, int* src_offset,
                                int* scan_scratch) {
  constexpr int R = Cfg::kNumRanks, EL = Cfg::kNumLocalExperts;
  for (int i = threadIdx.x; i < EL * R; i += blockDim.x) {
    const int el = i / R, s = i % R;
    const uint8_t* peer = p.peer_base[s];
    const int e = p.rank * EL + el;
    src_count[i] = __ldcg(reinterpret_cast<const int*>(peer + p.off.send_count) + e);
    src_offset[i] = __ldcg(reinterpret_cast<const int*>(peer + p.off.send_offset) + e);
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
  if (blockIdx.x == 0 && p.recv_stats != nullptr)
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

// Receive side, step 2: one warp per pool row copies the token (H fp8 bytes), its
// scales, routing weight and origin from the source rank.
template <class Cfg>
__device__ void dispatch_pull(const KernelParams& p, uint8_t* base, const ExpertTables& t, const int* src_count,
                              const int* src_offset) {
  constexpr int R = Cfg::kNumRanks, EL = Cfg::kNumLocalExperts, H = Cfg::kHidden, K = Cfg::kTopk;
  constexpr int kNumSf = H / 128;
  const int total_rows = t.exp_start[EL - 1] + t.exp_count[EL - 1];
  const int lane = threadIdx.x % 32;
  const int num_warps = gridDim.x * Cfg::kNumWarps;
  uint8_t* pool_x = base + p.off.pool_x;
  float* pool_sf = reinterpret_cast<float*>(base + p.off.pool_sf);
  float* pool_weight = reinterpret_cast<float*>(base + p.off.pool_weight);
  int2* pool_src = reinterpret_cast<int2*>(base + p.off.pool_src);

  for (int row = blockIdx.x * Cfg::kNumWarps + threadIdx.x / 32; row < total_rows; row += num_warps) {
    const int el = last_le(t.exp_start, EL, row);
    int j = row - t.exp_start[el], s = 0;
    while (j >= src_count[el * R + s]) j -= src_count[el * R + s++];
    const uint8_t* peer = p.peer_base[s];
    const int entry = __ldcg(reinterpret_cast<const int*>(peer + p.off.send_list) + src_offset[el * R + s] + j);
    const int token = entry / K;

    const uint4* src_x = reinterpret_cast<const uint4*>(peer + p.off.x + (int64_t)token * H);
    uint4* dst_x = reinterpret_cast<uint4*>(pool_x + (int64_t)row * H);
    // Batches of kBatch 16-byte loads per lane are in flight before any store.
    constexpr int kVecs = H / 16, kBatch = 8;
#pragma unroll
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
    for (int g = lane; g < kNumSf; g += 32) pool_sf[(int64_t)g * p.pool_capacity + row] = __ldcg(src_sf + g);
    if (lane == 0) {
      pool_weight[row] = __ldcg(reinterpret_cast<const float*>(peer + p.off.topk_weights) + entry);
      pool_src[row] = make_int2(s, entry);
    }
  }
}

}  // namespace megamoe
