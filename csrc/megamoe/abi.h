// The host/device ABI: every number that the kernel, the host runtime and Python must agree on.
// Plain C++17 with no CUDA header, so that three compilers read this one file: nvcc for the kernel,
// the host compiler for the runtime extension (runtime.cpp), and for the ABI extension
// (csrc/abi/abi_module.cpp), through which megamoe_plugin/abi.py hands these same values to Python.
// Nothing here is written a second time anywhere.
#pragma once

#include <stdint.h>

namespace megamoe {

constexpr int kMaxRanks = 8;

// The tile: BLOCK_M pool rows x kBlockN weight rows x kBlockK, the 128-wide FP8 scale block of both
// activations and weights. Warpgroup 0 produces (TMA, and in exact L1 converts tokens), warpgroups
// 1-2 do the math, each on 128 of the kBlockN rows.
constexpr int kBlockN = 256;
constexpr int kBlockK = 128;
constexpr int kNumThreads = 384;
constexpr int kNumMathThreads = 256;

// ---------------------------------------------------------------- failures reported to the host
// Which wait timed out: the low 8 bits of HostWords::error (params.h; megamoe_plugin/ops.py names them).
enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrGridBarrierTimeout = 1,
  kErrPipelineFullTimeout = 3,
  kErrPipelineEmptyTimeout = 4,
  kErrL1RowsTimeout = 5,
  kErrPulledRowsTimeout = 6,
  kErrCombineRowsTimeout = 7,
  kErrCallMismatch = 8,  // the ranks' calls disagree (CallTag): another layer, numerics, or a refused call
  kErrRankNotArrived = 16,  // + r: rank r never arrived at the cross-rank barrier (16 .. 16 + kMaxRanks - 1)
};
// HostWords::error = ErrorCode | KernelParams::rank << kErrorRankShift | KernelParams::kernel_tag << kErrorTagShift.
constexpr int kErrorRankShift = 8;
constexpr int kErrorTagShift = 16;
constexpr uint32_t kMaxKernelTag = 0xFFFF;

// HostWords::detail of kErrCallMismatch:
//   code | the other rank << 8 | this rank's CallTag << 16 | the other's CallTag << 40
constexpr int kDetailPeerShift = 8;
constexpr int kDetailOwnTagShift = 16;
constexpr int kDetailPeerTagShift = 40;

// What a call is, compared by every rank at the cross-rank barrier (sync.cuh rank_sync): two ranks
// whose calls of the same number differ stop with kErrCallMismatch instead of pairing different
// layers. 24 bits: the layer (the buffer's ordinal of the weights, ops.py), the numerics mode,
// fast_math, and whether the rank refused its call (invalid arguments: it takes part only to stop
// every rank at once).
constexpr uint32_t kCallTagLayerMask = (1u << 20) - 1;
constexpr uint32_t kCallTagExact = 1u << 20;
constexpr uint32_t kCallTagFastMath = 1u << 21;
constexpr uint32_t kCallTagRefused = 1u << 22;
constexpr uint32_t kCallTagBits = 24;

// ---------------------------------------------------------------- the symmetric buffer
// Its regions, each at a byte offset that megamoe_plugin/buffer.py lays out and the kernel reads
// from BufferOffsets (the field of each name). send_count, send_cursor and send_offset hold two
// halves of [E] ints: a call uses half (its cross-rank barrier's round) & 1 (kernel.cuh send_half).
#define MEGAMOE_BUFFER_REGIONS(X)                                                                        \
  X(x) X(x_sf) X(topk_idx) X(topk_weights) X(send_count) X(send_cursor) X(send_offset) X(send_list)      \
  X(signals) X(l1_done) X(rows_arrived) X(pool_x) X(pool_sf) X(pool_weight) X(pool_src) X(act) X(act_sf) \
  X(combine) X(combine_arrived)

struct BufferOffsets {
#define MEGAMOE_OFFSET_FIELD(region) int64_t region;
  MEGAMOE_BUFFER_REGIONS(MEGAMOE_OFFSET_FIELD)
#undef MEGAMOE_OFFSET_FIELD
};

// The uint32 words of the `signals` region, and their indices. sync.cuh says why none of them can
// overflow.
constexpr int kNumSignalWords = 64;
enum SignalWord : int {
  kSigGridArrivals = 0,     // this rank's CTAs at the current grid barrier (back to 0 after each)
  kSigGridGeneration = 1,   // grid barriers completed (mod 2^32)
  kSigRankBarrierDone = 3,  // this rank's calls (cross-rank barriers completed) on the buffer, mod 2^32
  kSigL2TilesClaimed = 4,   // L2 tiles claimed in this call (pipeline.cuh L2TileQueue); zeroed at the next call's start
  kSigWindowsPending = 5,   // the call's pool windows while the later ones wait for the window kernel
  kSigMblocksToClear = 6,   // the last call's m-blocks, whose counters the next call zeroes first
  kSigTokensToClear = 7,    // the last call's tokens, whose combine_arrived the next call zeroes first
  // kMaxRanks 64-bit slots, one per source rank: {the number of its latest call to arrive here (low 32
  // bits), that call's CallTag (high 32)}, stored by the peer (sync.cuh rank_sync). Words 8..23.
  kSigRankArrivals = 8,
};
static_assert(kSigRankArrivals % 2 == 0 && kSigRankArrivals + 2 * kMaxRanks <= kNumSignalWords,
              "the rank arrival slots are 64-bit aligned and fit in the signals region");

// ---------------------------------------------------------------- debugging: the tile timeline
// The per-tile clock records that variants built with MEGAMOE_TIMELINE write (timeline.cuh;
// megamoe_plugin/timeline.py reads them), laid out as
// uint64 [CTA][slot: 0 = L1, 1 = L2, 2 = pull][kTimelineRecords][kTimelineWords]. In the GEMM slots:
//   record 0, the producer:        {empty-wait cycles, tiles, clock at start, clock at end,
//                                   globaltimer at start, globaltimer at end, arrival-wait cycles
//                                   (its tiles' waits for pulled rows or L1 rows, scheduler.cuh)};
//   record 1 + 2 i + w, math warpgroup w's i-th tile (i < kTimelineMaxTiles):
//                                  {clock at start, clock at main-loop end, clock at epilogue end,
//                                   full-wait cycles (all four 32-bit), globaltimer at end, 0, 0}.
// In the pull slot, record w is the CTA's warp w: {globaltimer when its share of the rows pulled
// before L1 ended, globaltimer when its share of those pulled during L1 ended (0 where it had none),
// 0, ...} (windowed calls: their last window's).
constexpr int kTimelineMaxTiles = 128;
constexpr int kTimelineSlots = 3;
constexpr int kTimelinePullSlot = 2;
constexpr int kTimelineRecords = 1 + 2 * kTimelineMaxTiles;
constexpr int kTimelineWords = 7;

// ---------------------------------------------------------------- the shared-memory plan
// Where each member of the CTA's SharedStorage (smem.cuh) lies, computed from a variant's numbers, so
// that Python chooses the pipeline depth and launches with the size the kernel uses before anything
// compiles. SharedStorage static_asserts every offset below and its size against this plan.
constexpr int kSmemLimit = 232448;     // SM90's opt-in dynamic shared memory per block (227 KiB)
constexpr int kSmemAlignSlack = 1024;  // launched on top: the kernel aligns its base to 1024 (kernel.cuh)
constexpr int kSmemHeaderBytes = 1024;  // the barriers, the L2 tile queue and mailbox, the rank round, the pool window
constexpr int kAmaxSlots = kNumMathThreads / 32;  // L1 requant amax exchange, per math warp

constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }

// A pipeline stage: an A tile (BLOCK_M x kBlockK fp8), a B tile (kBlockN x kBlockK fp8) and the A rows'
// token scales, 1024-aligned for the 128B swizzle. The scales ride in the stage, in both GEMM phases and
// both numerics modes: loaded by the producer with the tile (pipeline.cuh load_a), read by LDS after the
// full barrier instead of from L2 in the k-block's critical path. BLOCK_M + 4 floats: the bulk copy
// starts at the tile's first row rounded down to 16 bytes.
// MXFP4 weights (fp4 below; fp4_weights.cuh): the B tile holds the packed E2M1 codes (kBlockN x
// kBlockK / 2 bytes, 64B swizzle) and, after the token scales, the rows' E8M0 scales of the k-block
// (kBlockN x 4 bytes) and the largest of them in each 128-row block (kFp4BlockCodeBytes); the math
// warpgroups convert it into an FP8 tile outside the ring (SmemPlan fp4_tile), so a stage carries half
// the weight bytes and more stages fit.
constexpr int kFp4GroupSize = 32;  // input elements per E8M0 scale
constexpr int kFp4ScaleBytesPerRow = kBlockK / kFp4GroupSize;  // a weight row's scales of one k-block
// After a tile's rows' scales of a k-block, the largest E8M0 code of each of its 128-row blocks (byte b:
// block b; transform_weights computes them), by which the kernel folds the block (fp4_weights.cuh):
// 16 bytes, the bulk copy's unit.
constexpr int kFp4BlockCodeBytes = 16;
constexpr int stage_scale_floats(int block_m) { return block_m + 4; }
constexpr int stage_b_bytes(bool fp4) { return fp4 ? kBlockN * kBlockK / 2 : kBlockN * kBlockK; }
constexpr int stage_weight_scale_bytes(bool fp4) {
  return fp4 ? kBlockN * kFp4ScaleBytesPerRow + kFp4BlockCodeBytes : 0;
}
constexpr int stage_bytes(int block_m, bool fp4) {
  return align_up(block_m * kBlockK + stage_b_bytes(fp4) + 4 * stage_scale_floats(block_m) +
                      stage_weight_scale_bytes(fp4), 1024);
}
// MXFP4 weights: the converted FP8 tiles (kBlockN x kBlockK, 128B swizzle). Two at BLOCK_M 64 and 128, whose main loop converts the next k-block into one while the
// WGMMAs of the current k-block read the other; one in swap-AB (BLOCK_M 8-32), whose loop is bound
// by the conversion itself, so that the shared memory goes to stages (bytes in flight) instead.
constexpr int fp4_tiles(int block_m, bool fp4) { return fp4 ? (block_m >= 64 ? 2 : 1) : 0; }
constexpr int fp4_tile_bytes(int block_m, bool fp4) { return fp4_tiles(block_m, fp4) * kBlockN * kBlockK; }
// The fewest pipeline stages a variant runs with: 3 where the main loop converts MXFP4 weights into
// two tiles, since it waits for the next k-block's stage while holding the current one and the one
// before (whose last WGMMAs are still in flight); else 2, so that the producer fills one stage while
// the math warpgroups read the other.
constexpr int min_stages(int block_m, bool fp4) { return fp4_tiles(block_m, fp4) == 2 ? 3 : 2; }
// The BLOCK_M 64 / 128 epilogues' quad exchange in fast numerics (epilogue.cuh QuadLines): per math
// warp, one 64-byte line for each of its 8 fragment rows. The swap-AB tiers (below 64) have none, and
// exact numerics' L2 at BLOCK_M 64 exchanges in registers (quad_transpose): with the lines every exact
// BLOCK_M 64 variant spilled 28-40 bytes (its L1 main loop among the places), at the same 168 registers.
constexpr int quad_line_bytes(int block_m, bool exact) { return (block_m < 64 || exact) ? 0 : kAmaxSlots * 8 * 64; }
// Exact L1's FP16 token tile (BLOCK_M x kBlockK), per k-block parity.
constexpr int l1_token_bytes(int block_m, bool exact) { return exact ? block_m * kBlockK * 2 : 0; }

struct SmemPlan {
  int amax_exchange, tables, quad_lines, l1_token_scales, l1_tokens, fp4_tile, stages;
  int stage;  // bytes of one pipeline stage
  int bytes;  // sizeof(SharedStorage), without kSmemAlignSlack
  int min_stages;  // min_stages(block_m, fp4)
};

constexpr SmemPlan smem_plan(int block_m, int num_stages, int num_local_experts, bool exact, bool fp4) {
  SmemPlan s{};
  s.amax_exchange = kSmemHeaderBytes;
  s.tables = s.amax_exchange + 2 * kAmaxSlots * block_m * 4;         // float [2][kAmaxSlots][BLOCK_M]
  s.quad_lines = align_up(s.tables + (3 * num_local_experts + 1) * 4, 16);  // int [3 E_l + 1]
  s.l1_token_scales = s.quad_lines + quad_line_bytes(block_m, exact);
  s.l1_tokens = align_up(s.l1_token_scales + (exact ? 2 * block_m * 4 : 0), 1024);  // float [2][BLOCK_M]
  s.fp4_tile = align_up(s.l1_tokens + 2 * l1_token_bytes(block_m, exact), 1024);
  s.stages = s.fp4_tile + fp4_tile_bytes(block_m, fp4);
  s.stage = stage_bytes(block_m, fp4);
  s.bytes = s.stages + num_stages * s.stage;
  s.min_stages = min_stages(block_m, fp4);
  return s;
}

}  // namespace megamoe
