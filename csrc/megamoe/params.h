// Kernel parameters: the one struct the host runtime fills and the kernel reads.
// Shared by host C++ (runtime.cpp) and device code, so it holds only plain types.
#pragma once

#include <cuda.h>
#include <stdint.h>

namespace megamoe {

constexpr int kMaxRanks = 8;

// Which wait timed out: the low 8 bits of HostWords::error (ops.py names them).
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

// What kernels report to the host, in host-mapped memory (one per process, runtime.cpp).
// The host reads it with plain loads and no CUDA call, so a report arrives while a CUDA
// graph replays and after a trap has killed the context (megamoe_plugin/watchdog.py polls it).
struct HostWords {
  // The first failure of any kernel in the process, written once (compare-and-swap from 0)
  // before that kernel traps: ErrorCode | KernelParams::rank << kErrorRankShift |
  // KernelParams::kernel_tag << kErrorTagShift.
  uint32_t error;
  uint32_t unused;
  // topk_idx entries outside [-1, num_experts) that calls dropped, since the process began
  // (64-bit: never wraps). Each CTA adds its own count once; nobody clears it: each reader
  // remembers how far it has reported.
  unsigned long long bad_expert_ids;
  // What the failure saw, for kErrCallMismatch (below); not written by the others. Every
  // failing thread stores its own whole word before its compare-and-swap of `error`, so the word
  // read after `error` is complete even if the kernel traps meanwhile; its low byte repeats the
  // code, so a reader can tell a detail of another failure from this one's.
  unsigned long long detail;
};
constexpr int kErrorRankShift = 8;
constexpr int kErrorTagShift = 16;
constexpr uint32_t kMaxKernelTag = 0xFFFF;

// HostWords::detail of kErrCallMismatch (ops.py decodes it):
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

// Byte offsets of the symmetric-buffer regions (megamoe_plugin/buffer.py defines them).
// send_count, send_cursor and send_offset hold two halves of [E] ints: a call uses half
// (its cross-rank barrier's round) & 1 (kernel.cuh send_half).
struct BufferOffsets {
  int64_t x, x_sf, topk_idx, topk_weights;
  int64_t send_count, send_cursor, send_offset, send_list, signals, l1_done, rows_arrived;
  int64_t pool_x, pool_sf, pool_weight, pool_src;
  int64_t act, act_sf, combine, combine_arrived;
};

// Indices into the uint32 `signals` region (megamoe_plugin/buffer.py SIGNAL_WORDS names the
// same indices; the JIT-generated source static_asserts that they agree). sync.cuh says
// why none of them can overflow.
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

// TMA descriptors, built once per (buffer, weights) and kept in device memory
// (KernelParams::tmaps points at them).
enum TensorMapIndex : int {
  kTmapPoolX = 0,  // [P, H] fp8, box {128, BLOCK_M}, 128B swizzle
  kTmapW13 = 1,    // [E_l * 2I, H] fp8, box {128, 256}, 128B swizzle
  kTmapAct = 2,    // [P, I] fp8, box {128, BLOCK_M}, 128B swizzle
  kTmapW2 = 3,     // [E_l * H, I] fp8, box {128, 256}, 128B swizzle
  kNumTmaps = 4,
};

// Debugging (tools/tile_timeline.py): the per-tile clock records that variants built with
// MEGAMOE_TIMELINE write (timeline.cuh), laid out as
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
// megamoe_plugin/timeline.py holds the same numbers; the JIT source static_asserts them.
constexpr int kTimelineMaxTiles = 128;
constexpr int kTimelineSlots = 3;
constexpr int kTimelinePullSlot = 2;
constexpr int kTimelineRecords = 1 + 2 * kTimelineMaxTiles;
constexpr int kTimelineWords = 7;

struct KernelParams {
  const CUtensorMap* tmaps;  // device memory, kNumTmaps entries

  uint8_t* peer_base[kMaxRanks];  // every rank's symmetric buffer, mapped into this process
  BufferOffsets off;
  // This rank's l1_done region (peer_base[rank] + off.l1_done), in a constant-bank slot of its own:
  // publish_l1_tile (epilogue.cuh) computed from the buffer's base kept that 64-bit base live through
  // the L1 epilogue, where fast BLOCK_M 64 at H 7168 spilled it (8 B).
  int* l1_done;
  // This rank's signals[kSigL2TilesClaimed], in a slot of its own for the producer's few registers (Cfg::kProducerRegisters).
  uint32_t* l2_tiles_claimed;
  const float* w13_scale;  // [E_l, I/128, 2, H/128]  (transformed: gate, up per 128 outputs)
  const float* w2_scale;   // [E_l, H/128, I/128]

  // Per call.
  void* y;                 // bf16 [num_tokens, H]
  int* recv_stats;         // int32 [E_l] or null
  float activation_clamp;  // +inf when off
  int num_tokens;
  int stop_after_phase;    // debugging: 0 runs every phase; k returns after phase k (kernel.cuh)
  int window_launch;       // the window kernel's launch of the call, from 0 (kernel.cuh mega_moe_windows)
  uint32_t kernel_tag;     // the launch's kernel handle (<= kMaxKernelTag), so a failure names its variant
  uint32_t call_tag;       // what the call is (CallTag), for the ranks to compare

  int rank;
  int pool_capacity;
  HostWords* host;         // host-mapped reports (see HostWords)
  unsigned long long* timeline;  // debugging: the timeline above, or null (written by MEGAMOE_TIMELINE builds only)
  uint64_t timeout_ns;     // bound of every wait
};

}  // namespace megamoe
