// The warp roles of the persistent CTA (Cfg::kNumThreads = 384 threads), named once. Every warp
// takes part in dispatch, pull and combine. In the GEMM phases:
//   warpgroup 0 (threads 0-127)    the producer warpgroup: thread 0 issues the TMA
//                                  loads (pipeline.cuh produce_tiles); in exact L1 warps 1-3
//                                  convert each stage's tokens to FP16 (exact_l1.cuh
//                                  convert_l1_tokens), in fast L1 they pull the pool's later rows
//                                  (dispatch.cuh pull_rows_during_l1), in L2 warp 1 counts the finished
//                                  tiles' rows for the combine (combine.cuh signal_l2_rows); at BLOCK_M 128 it lends its registers to
//                                  the math warpgroups (kernel.cuh gemm_roles);
//   warpgroups 1-2 (threads 128-383) the math warpgroups: main loops and epilogues.
#pragma once

namespace megamoe {

struct Role {
  static constexpr int kProducerWarpgroupThreads = 128;
  static constexpr int kNumConverterThreads = 96;  // warps 1-3

  // The one thread that issues the TMA loads. A test of threadIdx, not an elected lane: each GEMM
  // phase recomputes it, since a value kept from the first phase to the second is spilled
  // (BLOCK_M 64, H 4096, I 1536).
  __device__ __forceinline__ static bool tma_issuer() { return threadIdx.x == 0; }
  // In the producer warpgroup: a token converter (any warp but the producer's).
  __device__ __forceinline__ static bool converter() { return threadIdx.x >= 32; }
  __device__ __forceinline__ static int converter_thread() { return threadIdx.x - 32; }
  // The same warps in fast L1: pullers, one pool row per warp at a time.
  static constexpr int kNumPullerWarps = kNumConverterThreads / 32;
  __device__ __forceinline__ static bool puller() { return converter(); }
  __device__ __forceinline__ static int puller_warp() { return converter_thread() / 32; }
  // In L2: the warp that counts the math warpgroups' finished tiles into the tokens' combine_arrived
  // (combine.cuh signal_l2_rows).
  __device__ __forceinline__ static bool l2_signaller() { return threadIdx.x / 32 == 1; }
  __device__ __forceinline__ static bool producer_warpgroup() { return threadIdx.x < kProducerWarpgroupThreads; }
  // Math warpgroups only (unsigned arithmetic: the divisions stay shifts).
  __device__ __forceinline__ static int math_warpgroup() { return (threadIdx.x - kProducerWarpgroupThreads) / 128; }
  __device__ __forceinline__ static int math_thread() { return threadIdx.x - kProducerWarpgroupThreads; }
  __device__ __forceinline__ static int math_warp() { return (threadIdx.x - kProducerWarpgroupThreads) / 32; }
  __device__ __forceinline__ static int thread_in_warpgroup() { return threadIdx.x % 128; }
  __device__ __forceinline__ static bool first_math_thread() { return threadIdx.x == kProducerWarpgroupThreads; }
};

}  // namespace megamoe
