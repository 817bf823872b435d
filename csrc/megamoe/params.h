// Kernel parameters: the one struct the host runtime fills and the kernel reads.
// Shared by host C++ (runtime.cpp) and device code, so it holds only plain types. The numbers Python
// also needs (error codes, signal words, the buffer's regions) are abi.h's.
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "abi.h"

namespace megamoe {

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
  // What the failure saw, for kErrCallMismatch (abi.h kDetail*); not written by the others. Every
  // failing thread stores its own whole word before its compare-and-swap of `error`, so the word
  // read after `error` is complete even if the kernel traps meanwhile; its low byte repeats the
  // code, so a reader can tell a detail of another failure from this one's.
  unsigned long long detail;
};

// TMA descriptors, built once per (buffer, weights) and kept in device memory
// (KernelParams::tmaps points at them).
enum TensorMapIndex : int {
  kTmapPoolX = 0,  // [P, H] fp8, box {128, BLOCK_M}, 128B swizzle
  kTmapW13 = 1,    // [E_l * 2I, H] fp8, box {128, 256}, 128B swizzle (MXFP4: tiles [E_l * 2I/256 * H/128 * 256, 64] uint8, box {64, 256}, 64B swizzle)
  kTmapAct = 2,    // [P, I] fp8, box {128, BLOCK_M}, 128B swizzle
  kTmapW2 = 3,     // [E_l * H, I] fp8, box {128, 256}, 128B swizzle (MXFP4: tiles [E_l * ceil(H/256) * I/128 * 256, 64] uint8, box {64, 256}, 64B swizzle)
  kNumTmaps = 4,
};

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
  // FP8 weights: float block scales; MXFP4 weights: E8M0 codes in the weights' tiles
  // [E_l, n-blocks, k-blocks, 256, 4] (weights.py; pipeline.cuh load_b reads them as bytes).
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
