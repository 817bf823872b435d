// The TMA pipeline of the GEMM phases: stage views of shared memory, and the producer (one
// elected thread of warp 0) that fills the stage ring with a tile's A (pool rows) and B (weight
// rows) k-blocks. Barriers: full[s] (1 producer arrival + TMA bytes), empty[s] (one arrival per
// math thread; exact L1 also tok_full / tok_empty, exact_l1.cuh).
#pragma once

#include <cuda/ptx>

#include "config.cuh"
#include "params.h"
#include "roles.cuh"
#include "scheduler.cuh"
#include "smem.cuh"
#include "sync.cuh"
#include "timeline.cuh"

namespace megamoe {

// Shared-memory views of one pipeline stage.
template <class Cfg>
struct StageView {
  uint8_t* stages;
  uint8_t* staging;  // L1 token tiles in FP16, [2 k-block parities] (SharedStorage::l1_tokens)
  float* l1_token_scales;  // [2 k-block parities][BLOCK_M]: their token scales (SharedStorage::l1_token_scales)
  __device__ uint8_t* a(int s) const { return stages + s * Cfg::kStageBytes; }
  __device__ uint8_t* b(int s) const { return a(s) + Cfg::kStageA; }
  // The A rows' token scales of stage s (Cfg::kStageScaleFloats).
  __device__ float* a_scales(int s) const { return reinterpret_cast<float*>(b(s) + Cfg::kStageB); }
  // MXFP4 weights: the B rows' E8M0 scales of stage s (one 32-bit word of 4 per row), then each
  // 128-row block's largest (abi.h kFp4BlockCodeBytes; fp4_block_largest reads it).
  __device__ uint32_t* b_scale_codes(int s) const {
    return reinterpret_cast<uint32_t*>(b(s) + Cfg::kStageB + Cfg::kStageScaleBytes);
  }
  // MXFP4 weights: converted FP8 tile `tile` (SharedStorage fp4_tile), at a constant offset from the
  // stages (no further pointer kept live).
  __device__ uint8_t* fp4_tile(int tile = 0) const {
    return stages + (static_cast<int>(offsetof(SharedStorage<Cfg>, fp4_tile)) -
                     static_cast<int>(offsetof(SharedStorage<Cfg>, stages))) + tile * kBlockN * kBlockK;
  }
};

__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* tmap, int x, int y, uint64_t* bar) {
  const int32_t crd[2] = {x, y};
  cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, smem, tmap, crd, bar);
}

// A pipeline wait of the GEMM roles: true once the barrier's phase completed. In a tier that
// rebalances registers (Cfg::kRebalanceRegisters) it reports a timeout and returns false, for
// the role to unwind and trap after its registers are back (kernel.cuh gemm_roles): a trap
// inside the region makes ptxas compile the region at the entry budget (docs/design.md section 9).
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

// The producer's arrival on stage ps's full barrier, with the bytes one k-block of a GEMM phase
// brings (A, B and A's token scales). Loads into the stage may complete before it (the barrier's
// tx-count goes negative meanwhile, which PTX allows): the phase cannot complete while this arrival
// is pending.
template <class Cfg>
__device__ __forceinline__ uint64_t* arm_stage(uint64_t* full, const PipelineState& ps) {
  uint64_t* bar = &full[ps.stage];
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, bar,
                                       Cfg::kStageA + Cfg::kStageB + Cfg::kStageScaleBytes + Cfg::kStageWeightScaleBytes);
  return bar;
}

// Claims the next stage for one k-block: waits until it is empty and arms it (arm_stage); null
// after a timeout (gemm_wait).
template <class Cfg>
__device__ __forceinline__ uint64_t* claim_stage(const KernelParams& p, uint64_t* full, uint64_t* empty,
                                                 const PipelineState& ps) {
  if (!gemm_wait<Cfg>(p, &empty[ps.stage], ps.phase ^ 1, kErrPipelineEmptyTimeout)) return nullptr;
  return arm_stage<Cfg>(full, ps);
}

// The first row of a tile's staged token scales, row_a rounded down to 16 bytes (a bulk copy's
// source alignment; the pool's k-block rows are 16-byte aligned, pool_capacity being a multiple
// of 128): the main loops read row_a at offset row_a - staged_scale_row(row_a).
__device__ __forceinline__ int staged_scale_row(int row_a) { return row_a & ~3; }

// Loads k-block kb of a tile's A rows (first pool row row_a) into stage s: the FP8 tile by TMA and
// the rows' token scales by a bulk copy from the MN-major scale pool `sf_pool` ([k-block][pool row]).
// The copy reads up to 4 floats past the tile's last row; at the last k-block of the pool that is the
// next region of the buffer (buffer.py BufferLayout).
template <class Cfg>
__device__ __forceinline__ void load_a(const KernelParams& p, const StageView<Cfg>& sv, int s, const CUtensorMap* tmap_a,
                                       const float* sf_pool, int kb, int row_a, uint64_t* bar) {
  tma_load_2d(sv.a(s), tmap_a, kb * Cfg::kBlockK, row_a, bar);
  cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.a_scales(s),
                           sf_pool + (int64_t)kb * p.pool_capacity + staged_scale_row(row_a), Cfg::kStageScaleBytes, bar);
}

// The first B row of a tile's weights (FP8), or the index of its first k-block among the weights'
// tiles (MXFP4: weights.py lays them out [E_l][n-block][k-block][256 rows][64 bytes], and their scale
// codes [..][256 rows][4], so that a tile's k-block is one sequential read of each).
template <class Cfg, bool kIsL2>
__device__ __forceinline__ int b_base_of(const Tile& t) {
  if constexpr (Cfg::kFp4Weights) {
    constexpr int kNumKBlocks = kIsL2 ? Cfg::kL2NumKBlocks : Cfg::kL1NumKBlocks;
    constexpr int kNumNBlocks = kIsL2 ? Cfg::kL2NumNBlocks : Cfg::kL1NumNBlocks;
    return (t.expert * kNumNBlocks + t.n_block) * kNumKBlocks;
  } else {
    return t.expert * (kIsL2 ? Cfg::kHidden : 2 * Cfg::kInter) + t.n_block * Cfg::kBlockN;
  }
}

// Loads k-block kb of a tile's B rows (b_base_of the tile) into stage s: FP8 weights by TMA; MXFP4
// weights the tile's k-block of packed codes by TMA and of scale codes by a bulk copy.
template <class Cfg, bool kIsL2>
__device__ __forceinline__ void load_b(const KernelParams& p, const StageView<Cfg>& sv, int s, const CUtensorMap* tmap_b,
                                       int kb, int b_base, uint64_t* bar) {
  if constexpr (Cfg::kFp4Weights) {
    const int tile_k_block = b_base + kb;
    tma_load_2d(sv.b(s), tmap_b, 0, tile_k_block * Cfg::kBlockN, bar);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(kIsL2 ? p.w2_scale : p.w13_scale) +
                           (int64_t)tile_k_block * Cfg::kStageWeightScaleBytes;
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.b_scale_codes(s), codes,
                             Cfg::kStageWeightScaleBytes, bar);
  } else {
    tma_load_2d(sv.b(s), tmap_b, kb * Cfg::kBlockK, b_base, bar);
  }
}

// L2 tiles are claimed, not dealt: the producer takes the next unclaimed one from the call's counter
// (KernelParams::l2_tiles_claimed, zeroed at the next call's start) once it has issued its current tile's loads, and
// hands it to the math warpgroups through shared memory. So a CTA that ends its L1 tiles early runs
// more L2 tiles: with L1 tiles dealt round-robin, up to one L1 tile (3.5 L2 tiles' time at v3) of
// imbalance at the start of L2, which a round-robin L2 kept to the end of the phase. Tiles are
// claimed in index order, so neighbouring claims still share their weight tile in L2 cache. The
// CTA's i-th L2 tile goes to slot i % kL2TileSlots with its barrier (1 arrival): the producer is at
// most kNumStages k-blocks ahead of the math, so it never refills a slot the math has not read.
template <class Cfg>
struct L2TileQueue {
  uint64_t* full;  // SharedStorage::full: the queue's members lie at constant offsets from it
  // Producer: the next unclaimed tile of the call's (windowed: of the window's) L2 tiles (>= the
  // phase's tile count: none left). Each CTA ends a phase with one claim past its tiles, so a window
  // starts at the counter's first_mblock * kL2NumNBlocks + window * gridDim.x (dispatch.cuh enter_pool_window).
  __device__ int claim(const KernelParams& p, const ExpertTables& tables) const {
    const int claimed = static_cast<int>(atomicAdd(p.l2_tiles_claimed, 1u));
    if constexpr (Cfg::kWindowed) return claimed - tables.window->l2_claim_base;
    return claimed;
  }
  // Producer: publishes the CTA's i-th tile.
  __device__ void push(int i, int tile) const {
    const int slot = i % Cfg::kL2TileSlots;
    l2_tile_ids_of<Cfg>(full)[slot] = tile;
    cuda::ptx::mbarrier_arrive(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                               &l2_tile_full_of<Cfg>(full)[slot]);
  }
  // Producer, in L2: the tile it claimed during L1 and pushed as its 0th (produce_tiles).
  __device__ int first() const { return *reinterpret_cast<volatile int*>(&l2_tile_ids_of<Cfg>(full)[0]); }
  // Math warpgroups: the CTA's i-th tile once the producer has published it; false after a timeout
  // (gemm_wait).
  __device__ bool pop(const KernelParams& p, int i, int& tile) const {
    const int slot = i % Cfg::kL2TileSlots;
    if (!gemm_wait<Cfg>(p, &l2_tile_full_of<Cfg>(full)[slot], (i / Cfg::kL2TileSlots) & 1, kErrPipelineFullTimeout))
      return false;
    tile = *reinterpret_cast<volatile int*>(&l2_tile_ids_of<Cfg>(full)[slot]);
    return true;
  }
};

// The L2 tiles the math warpgroups have finished, handed to the producer warpgroup's warp 1, which
// counts their rows into combine_arrived (combine.cuh signal_l2_rows) off the math warps' path. Two
// slots, each a tile's rows (first pool row, valid rows) with a full barrier (every math thread
// arrives after its epilogue's stores: release) and an empty barrier (each lane of the warp, once it
// has read the rows). The CTA's i-th L2 tile takes slot i % 2: its rows go in at the tile's
// start (open), where the tile's decode has them, so that nothing more than the loop's count stays
// live through the main loop and the epilogue (at the math warps' register limit that spilled), and
// its arrivals after the epilogue (close). After the last tile the slot gets kNoMoreRows. The rows,
// not the tile: decoding a tile there spilled in the producer warpgroup (BLOCK_M 128, at 40 registers then).
template <class Cfg>
struct L2TileMailbox {
  static constexpr int kNoMoreRows = -1;
  uint64_t* full;  // SharedStorage::full: the mailbox's members lie at constant offsets from it
  // Math warpgroups, every thread, at the start of the CTA's i-th tile (or after its last, with
  // kNoMoreRows); false after a timeout (gemm_wait).
  __device__ bool open(const KernelParams& p, int i, int first_row, int valid_rows) const {
    const int slot = i & 1;
    if (!gemm_wait<Cfg>(p, &l2_done_empty_of<Cfg>(full)[slot], ((i >> 1) & 1) ^ 1, kErrPipelineEmptyTimeout))
      return false;
    if (Role::first_math_thread()) l2_done_rows_of<Cfg>(full)[slot] = make_int2(first_row, valid_rows);
    return true;
  }
  // Math warpgroups, every thread, after the i-th tile's epilogue (or right after open's kNoMoreRows).
  __device__ void close(int i) const {
    cuda::ptx::mbarrier_arrive(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                               &l2_done_full_of<Cfg>(full)[i & 1]);
  }
  // The signalling warp, every lane: the rows of the math warpgroups' i-th tile; false after a timeout.
  __device__ bool take(const KernelParams& p, int i, int2& rows) const {
    const int slot = i & 1;
    if (!gemm_wait<Cfg>(p, &l2_done_full_of<Cfg>(full)[slot], (i >> 1) & 1, kErrPipelineFullTimeout)) return false;
    const volatile int* posted = reinterpret_cast<volatile int*>(&l2_done_rows_of<Cfg>(full)[slot]);
    rows = make_int2(posted[0], posted[1]);
    // Every lane arrives after its own read (the barrier takes 32): one arrival by lane 0 after a
    // __syncwarp orders the other lanes' reads only through the warp barrier, which racecheck does not
    // follow: it reports hazards at BLOCK_M 8-32, where a CTA reuses a slot (as for `empty`).
    cuda::ptx::mbarrier_arrive(&l2_done_empty_of<Cfg>(full)[slot]);
    return true;
  }
};

// TMA producer for one GEMM phase: L1's tiles first_tile, first_tile + gridDim.x, ..., L2's as it
// claims them (L2TileQueue); false after a pipeline timeout (gemm_wait).
// A rows come from the pool (expert's rows), B rows from the weights (expert's block).
// The A rows' token scales come with them (load_a). A tile whose A rows are not ready yet (L1: not
// yet pulled; L2: act rows not yet stored by L1) first streams the weights of as many k-blocks as
// there are stages, then waits (acquire), and only then arms those stages: the math warps' wait on a stage then orders
// their own reads of what the pull or L1 wrote (the epilogues' routing weights, destinations) after it.
template <class Cfg, bool kIsL2>
__device__ bool produce_tiles(const KernelParams& p, uint8_t* base, const TileScheduler<Cfg>& sched, int first_tile,
                              const StageView<Cfg>& sv, uint64_t* full, uint64_t* empty, PipelineState& ps) {
  constexpr int kNumKBlocks = kIsL2 ? Cfg::kL2NumKBlocks : Cfg::kL1NumKBlocks;
  constexpr int kPrefetch = kNumKBlocks < Cfg::kNumStages ? kNumKBlocks : Cfg::kNumStages;
  const CUtensorMap* tmap_a = p.tmaps + (kIsL2 ? kTmapAct : kTmapPoolX);
  const CUtensorMap* tmap_b = p.tmaps + (kIsL2 ? kTmapW2 : kTmapW13);
  const float* sf_pool = reinterpret_cast<const float*>(base + (kIsL2 ? p.off.act_sf : p.off.pool_sf));
  const int* l1_done = reinterpret_cast<const int*>(base + p.off.l1_done);
  const int num_tiles = sched.num_tiles();
  ProducerClock clock;
  // Each CTA's first L2 tile is claimed when its L1 tiles start and published when they are all
  // issued: claimed after them, its atomic's round trip would come between a CTA's last L1 tile and
  // its first L2 tile, a visible share of a decode call. The rebalanced tier has no register to keep
  // it in through the L1 loop (it spills at the producer's budget): it publishes the claim at once,
  // its round trip before the first L1 load (prefill calls, where a microsecond is far below 0.1%).
  const L2TileQueue<Cfg> queue{full};
  int first_l2_tile = 0;
  if constexpr (!kIsL2) {
    if constexpr (Cfg::kRebalanceRegisters) queue.push(0, queue.claim(p, sched.tables));
    else first_l2_tile = queue.claim(p, sched.tables);
  }
  int tile = kIsL2 ? queue.first() : first_tile;
  for (int i = 0;; ++i, ++clock.tiles) {
    if constexpr (kIsL2) {
      if (i > 0) queue.push(i, tile);
    }
    if (tile >= num_tiles) break;
    const Tile t = sched.decode(tile);
    const int row_a = sched.tables.exp_start[t.expert] + t.m_block * Cfg::kBlockM;
    const int b_base = b_base_of<Cfg, kIsL2>(t);
    int kb = 0;
    const int gm = global_m_block<Cfg>(sched.tables, t);
    const bool ready = kIsL2 ? l1_rows_ready<Cfg>(l1_done, gm) : pulled_rows_ready<Cfg>(p, base, sched.tables, t);
    if (!ready) {
      PipelineState ahead = ps;
      for (int i = 0; i < kPrefetch; ++i) {
        if (!gemm_wait<Cfg>(p, &empty[ahead.stage], ahead.phase ^ 1, kErrPipelineEmptyTimeout)) return false;
        load_b<Cfg, kIsL2>(p, sv, ahead.stage, tmap_b, i, b_base, &full[ahead.stage]);
        ahead.advance<Cfg::kNumStages>();
      }
      const uint64_t arrival_start = timeline_clock();
      if (!(kIsL2 ? wait_l1_rows<Cfg>(p, l1_done, gm) : wait_pulled_rows<Cfg>(p, base, sched.tables, t))) return false;
      if constexpr (kTimeline) clock.arrival_wait += timeline_clock() - arrival_start;
      fence_generic_to_async();
      for (; kb < kPrefetch; ++kb) {
        load_a<Cfg>(p, sv, ps.stage, tmap_a, sf_pool, kb, row_a, arm_stage<Cfg>(full, ps));
        ps.advance<Cfg::kNumStages>();
      }
    } else {
      fence_generic_to_async();
    }
    for (; kb < kNumKBlocks; ++kb) {
      const uint64_t wait_start = timeline_clock();
      uint64_t* bar = claim_stage<Cfg>(p, full, empty, ps);
      if constexpr (kTimeline) clock.empty_wait += timeline_clock() - wait_start;
      if constexpr (Cfg::kRebalanceRegisters) {  // elsewhere claim_stage trapped already
        if (bar == nullptr) return false;
      }
      load_a<Cfg>(p, sv, ps.stage, tmap_a, sf_pool, kb, row_a, bar);
      load_b<Cfg, kIsL2>(p, sv, ps.stage, tmap_b, kb, b_base, bar);
      ps.advance<Cfg::kNumStages>();
    }
    tile = kIsL2 ? queue.claim(p, sched.tables) : tile + static_cast<int>(gridDim.x);
  }
  if constexpr (!kIsL2 && !Cfg::kRebalanceRegisters) queue.push(0, first_l2_tile);
  clock.record(p, kIsL2 ? 1 : 0);
  return true;
}

}  // namespace megamoe
