// Kernel parameters: the one struct the host runtime fills and the kernel reads.
// Shared by host C++ (runtime.cpp) and device code, so it holds only plain types.
#pragma once

#include <cuda.h>
#include <stdint.h>

namespace megamoe {

constexpr int kMaxRanks = 8;

// Error codes written to the host-mapped error word before the kernel traps.
// Low 8 bits: which wait timed out; the host names it (runtime.cpp kErrorNames).
enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrGridBarrierTimeout = 1,
  kErrRankBarrierTimeout = 2,
  kErrPipelineFullTimeout = 3,
  kErrPipelineEmptyTimeout = 4,
  kErrL1RowsTimeout = 5,
};

// Input errors the kernel survives (it drops the offending entry and goes on), written to
// the second host-mapped word; the op layer raises them at the next call (ops.py).
enum InputError : uint32_t {
  kInputErrExpertIndex = 1,  // a topk_idx value outside [-1, num_experts)
};

// Byte offsets of the symmetric-buffer regions (megamoe_plugin/buffer.py defines them).
struct BufferOffsets {
  int64_t x, x_sf, topk_idx, topk_weights;
  int64_t send_count, send_cursor, send_offset, send_list, signals, l1_done;
  int64_t pool_x, pool_sf, pool_weight, pool_src;
  int64_t act, act_sf, combine;
};

// Indices into the uint32 `signals` region (megamoe_plugin/buffer.py SIGNAL_WORDS names the
// same indices; the JIT-generated source static_asserts that they agree). sync.cuh says
// why none of them can overflow.
enum SignalWord : int {
  kSigGridArrivals = 0,     // this rank's CTAs at the current grid barrier (back to 0 after each)
  kSigGridGeneration = 1,   // grid barriers completed (mod 2^32)
  kSigRankBarrier = 2,      // arrivals of all ranks at this rank (peers add remotely), mod 2^32
  kSigRankBarrierDone = 3,  // cross-rank barriers this rank has completed, mod 2^32
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

struct KernelParams {
  const CUtensorMap* tmaps;  // device memory, kNumTmaps entries

  uint8_t* peer_base[kMaxRanks];  // every rank's symmetric buffer, mapped into this process
  BufferOffsets off;
  const float* w13_scale;  // [E_l, I/128, 2, H/128]  (transformed: gate, up per 128 outputs)
  const float* w2_scale;   // [E_l, H/128, I/128]

  // Per call.
  void* y;                 // bf16 [num_tokens, H]
  int* recv_stats;         // int32 [E_l] or null
  float activation_clamp;  // +inf when off
  int num_tokens;
  int stop_after_phase;    // debugging: 0 runs every phase; k returns after phase k (kernel.cuh)

  int rank;
  int pool_capacity;
  uint32_t* host_error;    // host-mapped word: first failure's code, then the kernel traps
  uint32_t* host_input_error;  // host-mapped word: InputError seen (sticky until the host clears it)
  uint64_t timeout_ns;     // bound of every wait
};

}  // namespace megamoe
