// The CTA's shared memory, as one struct, laid out as abi.h's smem_plan says: Python reads that plan
// (megamoe_plugin/abi.py) to choose the pipeline depth and the launch size before anything compiles,
// and every compile of the kernel checks the struct against it (SmemPlanCheck below), so the two
// cannot drift. The kernel places it at the 1024-aligned base of the dynamic shared memory
// (kernel.cuh aligned_dynamic_smem); the launch adds kSmemAlignSlack for that alignment.
#pragma once

#include <cstddef>
#include <cstdint>

#include <vector_types.h>

#include "config.cuh"

namespace megamoe {

template <class Cfg>
struct SharedStorage {
  // mbarriers: the TMA pipeline's (pipeline.cuh) and exact L1's two FP16 token buffers'
  // (exact_l1.cuh), within the first 1024 bytes.
  uint64_t full[Cfg::kNumStages];
  uint64_t empty[Cfg::kNumStages];
  uint64_t tok_full[2];
  uint64_t tok_empty[2];
  // The L2 tiles the producer claimed, for the math warpgroups (pipeline.cuh L2TileQueue): per slot
  // a barrier (1 arrival) and the tile.
  uint64_t l2_tile_full[Cfg::kL2TileSlots];
  int l2_tile_ids[Cfg::kL2TileSlots];
  // The L2 tiles the math warpgroups have finished, for the producer warpgroup's warp 1 to signal to
  // the combine (pipeline.cuh L2TileMailbox): per slot a full barrier (one arrival per math thread),
  // an empty barrier (32: the signalling warp's lanes) and the tile's rows (first pool row, valid rows).
  uint64_t l2_done_full[2];
  uint64_t l2_done_empty[2];
  int2 l2_done_rows[2];
  uint32_t rank_rounds_at_start;  // sync.cuh rank_rounds_done when the call started (kernel.cuh)
  // Windowed variants: the pool window the GEMM phases run (dispatch.cuh PoolWindow, which
  // kernel.cuh CtaShared checks fits), set by thread 0 of the CTA for all of its threads.
  int pool_window[3];
  // L1 requant amax exchange across the math warps, [k-block parity][math warp][row] (epilogue.cuh).
  alignas(1024) float amax_exchange[2][Cfg::kAmaxSlots][Cfg::kBlockM];
  // The local experts' pool layout (dispatch.cuh): exp_start[E_l], exp_count[E_l], mblk_prefix[E_l + 1].
  int tables[3 * Cfg::kNumLocalExperts + 1];
  // BLOCK_M 64 and 128 (zero-length below): the epilogues' quad exchange lines, per math warp
  // (epilogue.cuh QuadLines).
  alignas(16) uint8_t quad_lines[Cfg::kQuadLineBytes];
  // Exact L1 only (zero-length in fast numerics): the k-block's token scales and its token tile in
  // FP16 (BLOCK_M x 128 K, two 64-wide K atoms of [BLOCK_M][128 B], 128B swizzle), the B operand of
  // both math warpgroups' WGMMAs, one per k-block parity.
  float l1_token_scales[2][Cfg::kExactL1 ? Cfg::kBlockM : 0];
  alignas(1024) uint8_t l1_tokens[2][Cfg::kL1TokenBytes];
  // MXFP4 weights only (zero-length otherwise): the FP8 tiles the math warpgroups convert a stage's
  // packed codes into (kBlockN x 128 K, 128B swizzle, each warpgroup converting 128 rows; abi.h
  // fp4_tiles says how many).
  alignas(1024) uint8_t fp4_tile[fp4_tile_bytes(Cfg::kBlockM, Cfg::kFp4Weights)];
  // The pipeline's stages, each an A tile (BLOCK_M x 128 K), a B tile (256 x 128 K) and the A rows'
  // token scales (config.cuh kStageScaleFloats), 1024-aligned for the 128B swizzle. The dispatch phases alias them as int scratch (Cfg::kScratchInts).
  alignas(1024) uint8_t stages[Cfg::kNumStages][Cfg::kStageBytes];

  static_assert(sizeof(full) + sizeof(empty) + sizeof(tok_full) + sizeof(tok_empty) + sizeof(l2_tile_full) +
                    sizeof(l2_tile_ids) + sizeof(l2_done_full) + sizeof(l2_done_empty) + sizeof(l2_done_rows) +
                    sizeof(rank_rounds_at_start) + sizeof(pool_window) <= kSmemHeaderBytes,
                "the barriers, the L2 tile queue and mailbox, the rank round and the pool window fit before the amax exchange");
  static_assert(Cfg::kScratchInts * 4 <= sizeof(stages), "dispatch scratch does not fit");
};

// The epilogues' quad lines, addressed from the amax exchange's pointer: a constant offset, so that
// the main loops keep no second shared-memory pointer live (one made exact BLOCK_M 64 spill 40 bytes).
template <class Cfg>
__device__ __forceinline__ uint8_t* quad_lines_of(float* amax_exchange) {
  return reinterpret_cast<uint8_t*>(amax_exchange) +
         (offsetof(SharedStorage<Cfg>, quad_lines) - offsetof(SharedStorage<Cfg>, amax_exchange));
}

// The L2 tile queue's and the L2 tile mailbox's members, addressed from the full barriers' pointer (a constant offset: no
// further shared-memory pointer stays live in the producer's few registers, Cfg::kProducerRegisters).
template <class Cfg>
__device__ __forceinline__ uint64_t* l2_tile_full_of(uint64_t* full) {
  return full + (offsetof(SharedStorage<Cfg>, l2_tile_full) - offsetof(SharedStorage<Cfg>, full)) / 8;
}
template <class Cfg>
__device__ __forceinline__ uint64_t* l2_done_full_of(uint64_t* full) {
  return full + (offsetof(SharedStorage<Cfg>, l2_done_full) - offsetof(SharedStorage<Cfg>, full)) / 8;
}
template <class Cfg>
__device__ __forceinline__ uint64_t* l2_done_empty_of(uint64_t* full) {
  return full + (offsetof(SharedStorage<Cfg>, l2_done_empty) - offsetof(SharedStorage<Cfg>, full)) / 8;
}
template <class Cfg>
__device__ __forceinline__ int2* l2_done_rows_of(uint64_t* full) {
  return reinterpret_cast<int2*>(reinterpret_cast<uint8_t*>(full) +
                                 (offsetof(SharedStorage<Cfg>, l2_done_rows) - offsetof(SharedStorage<Cfg>, full)));
}
template <class Cfg>
__device__ __forceinline__ int* l2_tile_ids_of(uint64_t* full) {
  return reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(full) +
                                (offsetof(SharedStorage<Cfg>, l2_tile_ids) - offsetof(SharedStorage<Cfg>, full)));
}

// SharedStorage<Cfg> lies where abi.h's plan for Cfg says, member by member.
template <class Cfg>
struct SmemPlanCheck {
  using S = SharedStorage<Cfg>;
  static constexpr SmemPlan kPlan =
      smem_plan(Cfg::kBlockM, Cfg::kNumStages, Cfg::kNumLocalExperts, Cfg::kExactL1, Cfg::kFp4Weights);
  static_assert(offsetof(S, amax_exchange) == kPlan.amax_exchange, "abi.h smem_plan: amax_exchange");
  static_assert(offsetof(S, tables) == kPlan.tables, "abi.h smem_plan: tables");
  static_assert(offsetof(S, quad_lines) == kPlan.quad_lines, "abi.h smem_plan: quad_lines");
  static_assert(offsetof(S, l1_token_scales) == kPlan.l1_token_scales, "abi.h smem_plan: l1_token_scales");
  static_assert(offsetof(S, l1_tokens) == kPlan.l1_tokens, "abi.h smem_plan: l1_tokens");
  static_assert(offsetof(S, fp4_tile) == kPlan.fp4_tile, "abi.h smem_plan: fp4_tile");
  static_assert(offsetof(S, stages) == kPlan.stages, "abi.h smem_plan: stages");
  static_assert(sizeof(S::stages[0]) == kPlan.stage, "abi.h smem_plan: stage");
  static_assert(sizeof(S) == kPlan.bytes, "abi.h smem_plan: bytes");
  static constexpr int kBytes = kPlan.bytes;
};

// Bytes of shared memory a variant uses, without kSmemAlignSlack.
template <class Cfg>
constexpr int kSmemBytes = SmemPlanCheck<Cfg>::kBytes;

}  // namespace megamoe
