// The fused SM90 MegaMoE kernel: one persistent CTA per SM, 384 threads.
//
// Roles (roles.cuh names them): warpgroup 0 is the producer warpgroup (warp 0's elected lane
// issues the TMA loads; in exact L1 warps 1-3 convert tokens to FP16), warpgroups 1-2 the math
// warpgroups: warpgroup w takes weight rows [128w, 128w + 128) of each 256-row tile (BLOCK_M 128:
// pool rows [64w, 64w + 64) and all 256 weight rows, with registers moved from warpgroup 0 for
// the GEMM phases; config.cuh). All warps take part in dispatch, pull and combine.
//
// Phases of one call (every wait bounded, see sync.cuh):
//   1 count     this rank's entries per expert                       -> grid_sync (none where CTA 0 holds them all)
//   2 list      send list grouped by expert                          -> rank_sync
//   3 layout    read peers' counts for local experts, pool layout (per CTA, smem)
//   4 pull      copy routed tokens from their ranks into the L1 pool -> rows_arrived[m-block]
//   5 L1        gate/up GEMM, SwiGLU x weight, FP8 requant -> act    -> l1_done[m-block]
//   6 L2        down GEMM, BF16 rows scattered to the token's rank   -> combine_arrived[token] (warp 1)
//   7 combine   sum each token's slots into y once they have come (no barrier before or after)
// A call first zeroes what the last one left counting (combine.cuh clear_last_call), and after its
// cross-rank barrier the send side's other half (dispatch.cuh send_side).
// L1 tiles trail the pull: an L1 tile waits for the rows of its m-block only (rows_arrived,
// scheduler.cuh). In fast numerics at I >= 2048 the grid pulls the first rows before L1 and the
// producer warpgroup's warps 1-3 the rest during it (config.cuh kPullDuringL1). L2 tiles trail
// L1 tiles the same way (l1_done), and a token's combine its L2 rows (combine_arrived). Phases 1-3 are
// separated by barriers.
// Windowed variants (config.cuh kWindowed: pools of fewer rows than the worst routing) run phases
// 3-6 for a window of the call's m-blocks at a time: the first here, the rest in the window kernel
// (mega_moe_windows), which then runs phase 7.
//
// Named barriers: 0 = __syncthreads, 1 = math warpgroups' amax exchange.
// mbarriers: full[s] / empty[s] per pipeline stage, tok_full[b] / tok_empty[b] per L1 token
// buffer (exact_l1.cuh).
#pragma once

#include <cuda/ptx>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "combine.cuh"
#include "config.cuh"
#include "dispatch.cuh"
#include "epilogue.cuh"
#include "exact_l1.cuh"
#include "mma.cuh"
#include "params.h"
#include "pipeline.cuh"
#include "roles.cuh"
#include "scheduler.cuh"
#include "smem.cuh"
#include "sync.cuh"
#include "timeline.cuh"

namespace megamoe {

// One GEMM phase of the math warpgroups (L1: tiles first_tile, first_tile + gridDim.x, ...; L2: the
// tiles the producer claims); false after a pipeline timeout (pipeline.cuh gemm_wait).
template <class Cfg, bool kIsL2>
__device__ __forceinline__ bool math_phase(const KernelParams& p, uint8_t* base, const ExpertTables& tables,
                                           int first_tile, const StageView<Cfg>& sv, uint64_t* full,
                                           uint64_t* empty, uint64_t* tok_full, uint64_t* tok_empty,
                                           PipelineState& ps, float* amax_exchange, int& parity) {
  const TileScheduler<Cfg> sched{tables, kIsL2 ? Cfg::kL2NumNBlocks : Cfg::kL1NumNBlocks};
  const int wg = Role::math_warpgroup();
  const FragCoord fc = FragCoord::of(Role::thread_in_warpgroup());
  float acc[Cfg::kAccFloats];
  const int num_tiles = sched.num_tiles();
  PipelineState tok;  // L1's token buffers (exact_l1.cuh convert_l1_tokens)
  const L2TileQueue<Cfg> queue{full};
  const L2TileMailbox<Cfg> mailbox{full};
  // L1's tiles are dealt round-robin: the loop carries the tile itself (a count of the CTA's tiles
  // and the tile formed from it would be one value more live through L1, which spills at BLOCK_M 64).
  int tile = first_tile;
  for (int tile_of_cta = 0;; ++tile_of_cta, tile += kIsL2 ? 0 : static_cast<int>(gridDim.x)) {
    if constexpr (kIsL2) {
      if (!queue.pop(p, tile_of_cta, tile)) return false;  // L2: as the producer claimed them
    }
    if (tile >= num_tiles) {
      if constexpr (kIsL2) {
        if (!mailbox.open(p, tile_of_cta, 0, L2TileMailbox<Cfg>::kNoMoreRows)) return false;
        mailbox.close(tile_of_cta);
        return true;
      }
      break;
    }
    TileClock clock;
    const Tile t = sched.decode(tile);
    // Where the tile's first pool row lies in the token scales its stages carry (pipeline.cuh load_a).
    const int row_a = tables.exp_start[t.expert] + t.m_block * Cfg::kBlockM;
    const int sf_skew = row_a - staged_scale_row(row_a);
    if constexpr (kIsL2) {
      // Its rows, for the combine (signal_l2_rows), counted once the epilogue has stored them.
      if (!mailbox.open(p, tile_of_cta, row_a, min(Cfg::kBlockM, tables.exp_count[t.expert] - t.m_block * Cfg::kBlockM)))
        return false;
      // An L2 tile reads nothing L1 wrote but through its stages: the producer acquires the
      // m-block's L1 rows before it loads them (pipeline.cuh produce_tiles).
      // w2_scale [E_l, H/128, I/128]: one scale per 128 hidden columns; a column block past H
      // (odd H/128) reads no scale.
      const float* sb = p.w2_scale + ((int64_t)t.expert * (Cfg::kHidden / 128) + t.n_block * 2) * Cfg::kL2NumKBlocks;
      const auto weight_scales = [&](int kb, int block) {
        const float s = t.n_block * 2 + block < Cfg::kHidden / 128 ? __ldg(sb + block * Cfg::kL2NumKBlocks + kb) : 0.f;
        return make_float2(s, s);
      };
      if constexpr (Cfg::kFp8SwapAB) {
        mma_tile_swap<Cfg, Cfg::kL2NumKBlocks>(p, sv, full, empty, ps, wg, fc, sf_skew, acc, weight_scales,
                                               clock.full_wait);
        clock.mainloop_done();
        l2_epilogue_swap<Cfg>(p, base, tables, t, wg, fc, acc);
      } else {
        const auto dests = EpilogueRows<Cfg, true>::at_tile_start(p, base, tables, t, wg, fc);
        if (!mma_tile<Cfg, Cfg::kL2NumKBlocks>(p, sv, full, empty, ps, wg, fc, sf_skew, acc, weight_scales,
                                               clock.full_wait))
          return false;
        clock.mainloop_done();
        l2_epilogue<Cfg>(p, base, tables, t, wg, fc, dests, acc, quad_lines_of<Cfg>(amax_exchange));
      }
      clock.record(p, 1, tile_of_cta, wg);
      mailbox.close(tile_of_cta);
    } else {
      // w13_scale [E_l, I/128, 2 (gate, up), H/128]: the tile's n-block is the requant group.
      const float* sb = p.w13_scale + ((int64_t)t.expert * (Cfg::kInter / 128) + t.n_block) * 2 * Cfg::kL1NumKBlocks;
      const auto weight_scales = [&](int kb, int) { return make_float2(__ldg(sb + kb), __ldg(sb + Cfg::kL1NumKBlocks + kb)); };
      if constexpr (Cfg::kExactL1) {
        mma_tile_l1<Cfg, Cfg::kL1NumKBlocks>(p, sv, full, empty, tok_full, tok_empty, ps, tok, wg, fc, acc,
                                             weight_scales);
        clock.mainloop_done();
        l1_epilogue_swap<Cfg>(p, base, tables, t, wg, fc, acc, amax_exchange, parity);
      } else if constexpr (Cfg::kFp8SwapAB) {
        mma_tile_swap<Cfg, Cfg::kL1NumKBlocks>(p, sv, full, empty, ps, wg, fc, sf_skew, acc, weight_scales,
                                               clock.full_wait);
        clock.mainloop_done();
        l1_epilogue_swap<Cfg>(p, base, tables, t, wg, fc, acc, amax_exchange, parity);
      } else {
        // The routing weights load at the tile's start where Cfg::kEarlyEpilogueRows, so before
        // any of the tile's stages: the rows must have been pulled (elsewhere the stages' full
        // barriers order the epilogue's loads after the producer's wait for them).
        if constexpr (Cfg::kEarlyEpilogueRows) {
          if (!__all_sync(0xffffffffu, wait_pulled_rows<Cfg>(p, base, tables, t))) return false;
        }
        const auto weights = EpilogueRows<Cfg, false>::at_tile_start(p, base, tables, t, wg, fc);
        if (!mma_tile<Cfg, Cfg::kL1NumKBlocks>(p, sv, full, empty, ps, wg, fc, sf_skew, acc, weight_scales,
                                               clock.full_wait))
          return false;
        clock.mainloop_done();
        l1_epilogue<Cfg>(p, base, tables, t, wg, fc, weights, acc, amax_exchange, quad_lines_of<Cfg>(amax_exchange),
                         parity);
      }
      publish_l1_tile<Cfg>(p, tables, t);
      parity ^= 1;
      clock.record(p, 0, tile_of_cta, wg);
    }
  }
  return true;
}

// Runs one GEMM phase's roles: warpgroup 0 `producer_wg()` (its warp 0's elected lane feeds the
// pipeline; warps 1-3 convert exact L1's tokens), the math warpgroups `math()`; each returns
// false after a pipeline timeout it reported. Where the tier needs more registers than a thread
// starts with (Cfg::kRebalanceRegisters), warpgroup 0 gives registers to the math warpgroups
// for the phase (setmaxnreg) and both return to the entry count after it: the code all warps
// run (barriers, dispatch, combine) is compiled at that count, and ptxas allocates each role's
// region at the budget set inside its own branch. A role that timed out traps only once its
// registers are back (pipeline.cuh gemm_wait says why).
//
// setmaxnreg.inc takes registers from the CTA's pool whenever the pool has enough, in no promised
// order. So warpgroup 0 takes its registers back only after both math warpgroups hold theirs
// (named barrier kRegisterHandoverBarrierId): a producer with no tiles in the phase (a CTA past the
// last tile, e.g. on a rank that received few rows) would otherwise race the math warpgroups for
// the registers it had just released, and a math warpgroup that lost would wait for them forever:
// a main loop fed by a producer that does nothing hangs this way (docs/design.md section 9). PTX
// also asks a warpgroup's warps to synchronize between two setmaxnreg; this barrier is
// that for warpgroup 0, whose elected lane runs far longer than warps 1-3.
constexpr int kRegisterHandoverBarrierId = 2;  // sync.cuh lists the barriers

template <class Cfg, class ProducerWarpgroup, class Math>
__device__ __forceinline__ void gemm_roles(ProducerWarpgroup&& producer_wg, Math&& math) {
  bool ok;
  if (threadIdx.x < Role::kProducerWarpgroupThreads) {
    if constexpr (Cfg::kRebalanceRegisters) cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegisters>();
    ok = producer_wg();
    __syncwarp();  // setmaxnreg is warp-aligned: the elected producer lane rejoins its warp first
    if constexpr (Cfg::kRebalanceRegisters) {
      named_barrier_sync(kRegisterHandoverBarrierId, Cfg::kNumThreads);
      cutlass::arch::warpgroup_reg_alloc<Cfg::kEntryRegisters>();
    }
  } else {
    if constexpr (Cfg::kRebalanceRegisters) {
      cutlass::arch::warpgroup_reg_alloc<Cfg::kMathRegisters>();
      named_barrier_arrive(kRegisterHandoverBarrierId, Cfg::kNumThreads);
    }
    ok = math();
    if constexpr (Cfg::kRebalanceRegisters) cutlass::arch::warpgroup_reg_dealloc<Cfg::kEntryRegisters>();
  }
  if constexpr (Cfg::kRebalanceRegisters) {  // elsewhere gemm_wait trapped already
    if (!ok) trap_reported();
  }
}

// The dynamic shared memory, 1024-byte aligned as 128B-swizzled TMA tiles need, where the CTA's
// SharedStorage<Cfg> lies; the launch adds kSmemAlignSlack for the alignment (kSmemBytes<Cfg> does
// not include it). The kernel addresses the members as this base + offsetof: through a
// SharedStorage& ptxas knows the base is 1024-aligned and schedules the address arithmetic
// differently (by nvdisasm, every variant's SASS changes), and the served SASS is the one its
// performance was measured on.
__device__ __forceinline__ uint8_t* aligned_dynamic_smem() {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  return smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
}

// The CTA's shared memory as the phases address it (base + offsetof, see aligned_dynamic_smem).
template <class Cfg>
struct CtaShared {
  using Smem = SharedStorage<Cfg>;
  static_assert(sizeof(PoolWindow) == sizeof(Smem::pool_window), "smem.cuh SharedStorage::pool_window");
  uint8_t* smem = aligned_dynamic_smem();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + offsetof(Smem, full));
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + offsetof(Smem, empty));
  uint64_t* tok_full = reinterpret_cast<uint64_t*>(smem + offsetof(Smem, tok_full));
  uint64_t* tok_empty = reinterpret_cast<uint64_t*>(smem + offsetof(Smem, tok_empty));
  float* amax_exchange = reinterpret_cast<float*>(smem + offsetof(Smem, amax_exchange));
  int* table_base = reinterpret_cast<int*>(smem + offsetof(Smem, tables));
  PoolWindow* window = reinterpret_cast<PoolWindow*>(smem + offsetof(Smem, pool_window));
  ExpertTables tables{table_base, table_base + Cfg::kNumLocalExperts, table_base + 2 * Cfg::kNumLocalExperts, window};
  StageView<Cfg> sv{smem + offsetof(Smem, stages), smem + offsetof(Smem, l1_tokens),
                    reinterpret_cast<float*>(smem + offsetof(Smem, l1_token_scales))};
  int* scratch = reinterpret_cast<int*>(sv.stages);  // dispatch phases only
  // Read before this CTA reaches its first grid barrier, so before CTA 0 can advance it; kept in
  // shared memory, since a register holding it across the GEMM phases makes BLOCK_M 64 spill it.
  volatile uint32_t* rounds_at_start = reinterpret_cast<uint32_t*>(smem + offsetof(Smem, rank_rounds_at_start));

  // The call's half of the send side (dispatch.cuh send_side): its cross-rank barrier's round & 1.
  __device__ int send_half() const { return (*rounds_at_start + 1) & 1; }

  // Thread 0: the mbarriers of the GEMM phases, fresh (phase 0, no arrivals). `reinit`: they were
  // initialized before and are quiescent (a grid barrier after the last GEMM phase that used them).
  __device__ void init_barriers(bool reinit) const {
    const auto init = [&](uint64_t* bar, int arrivals) {
      if (reinit) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
      cuda::ptx::mbarrier_init(bar, arrivals);
    };
    for (int s = 0; s < Cfg::kNumStages; ++s) {
      init(&full[s], 1);
      init(&empty[s], Cfg::kNumMathThreads);
    }
    for (int b = 0; b < 2; ++b) {
      init(&tok_full[b], Role::kNumConverterThreads);
      init(&tok_empty[b], Cfg::kNumMathThreads);
    }
    for (int s = 0; s < Cfg::kL2TileSlots; ++s) init(&l2_tile_full_of<Cfg>(full)[s], 1);
    for (int s = 0; s < 2; ++s) {
      init(&l2_done_full_of<Cfg>(full)[s], Cfg::kNumMathThreads);
      init(&l2_done_empty_of<Cfg>(full)[s], 32);  // every lane of the signalling warp (L2TileMailbox::take)
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
};

// Phases 3-6 for the pool rows of one window (windowed variants: window `w` of the call's m-blocks;
// else all of them): the layout, the pull, both GEMM phases. L1 tiles wait for their own rows, so the
// CTA goes on to L1 after its share of the pull; where the pull goes on during L1
// (Cfg::kPullDuringL1) that share is the first pull_head_rows and the producer warpgroup's warps 1-3
// pull the rest. With the phase stop after the pull every row comes first, then a grid barrier.
// False where a phase stop ended the call.
template <class Cfg>
__device__ __forceinline__ bool run_pool_window(const KernelParams& p, uint8_t* base, uint32_t* signals,
                                                const CtaShared<Cfg>& cta, int w) {
  const ExpertTables& tables = cta.tables;
  const bool pull_all_first = p.stop_after_phase == 4;
  const auto window_rows = [&] {
    if constexpr (Cfg::kWindowed) return pool_window_rows<Cfg>(tables);
    return pool_rows(tables, Cfg::kNumLocalExperts);
  };
  const auto pull_head_rows = [&] {
    const int rows = window_rows();
    return pull_all_first || !Cfg::kPullDuringL1
               ? rows : min(rows, (int)gridDim.x * Cfg::kNumWarps * Cfg::kPullHeadRowsPerWarp);
  };
  {
    constexpr int kPairs = Cfg::kNumLocalExperts * Cfg::kNumRanks;
    int* src_count = cta.scratch;
    int* src_offset = cta.scratch + kPairs;
    int* scan_scratch = cta.scratch + 2 * kPairs;
    dispatch_layout<Cfg>(p, tables, src_count, src_offset, scan_scratch, w == 0, cta.send_half());
    // The call's m-blocks, whose counters the next call zeroes (clear_last_call): before any phase stop.
    if (w == 0 && blockIdx.x == 0 && threadIdx.x == 0) signals[kSigMblocksToClear] = tables.mblk_prefix[Cfg::kNumLocalExperts];
    if constexpr (Cfg::kWindowed) enter_pool_window<Cfg>(p, tables, cta.window, w);
    dispatch_pull<Cfg>(p, base, tables, src_count, src_offset, pull_head_rows());
    record_pull_end(p, 0);
  }
  if (pull_all_first) {
    fence_generic_to_async();
    grid_sync(p, signals);
  } else {
    __syncthreads();  // the scratch becomes the pipeline stages
  }
  if (p.stop_after_phase == 4) return false;

  // 5-6: GEMMs: the L1 tiles, dealt round-robin, then the L2 tiles, which each CTA's producer
  // claims one at a time (pipeline.cuh L2TileQueue). Producer and math warpgroups walk the same
  // tiles, so one pipeline state per role carries over. An L2 tile waits for the L1 tiles of its
  // own m-block only (scheduler.cuh l1_done), so a CTA that ends its L1 share early claims L2 tiles.
  PipelineState ps;
  int parity = 0;
  const TileScheduler<Cfg> l1_sched{tables, Cfg::kL1NumNBlocks}, l2_sched{tables, Cfg::kL2NumNBlocks};
  const StageView<Cfg>& sv = cta.sv;
  gemm_roles<Cfg>(
      [&] {
        if (Role::tma_issuer()) return produce_tiles<Cfg, false>(p, base, l1_sched, blockIdx.x, sv, cta.full, cta.empty, ps);
        if constexpr (Cfg::kExactL1) {
          if (Role::converter()) convert_l1_tokens<Cfg>(p, l1_sched, sv, cta.full, cta.tok_full, cta.tok_empty);
        } else if constexpr (Cfg::kPullDuringL1) {
          if (Role::puller() && !pull_all_first) {
            pull_rows_during_l1<Cfg>(p, base, tables, pull_head_rows(), window_rows(),
                                     blockIdx.x * Role::kNumPullerWarps + Role::puller_warp(),
                                     gridDim.x * Role::kNumPullerWarps, cta.send_half());
            record_pull_end(p, 1);
          }
        }
        return true;
      },
      [&] {
        return math_phase<Cfg, false>(p, base, tables, blockIdx.x, sv, cta.full, cta.empty, cta.tok_full, cta.tok_empty,
                                      ps, cta.amax_exchange, parity);
      });
  if (p.stop_after_phase == 5) return false;  // the next call zeroes what this one left counting (clear_last_call)
  if constexpr (Cfg::kRebalanceRegisters) {
    static_assert(Cfg::kEarlyEpilogueRows, "wait_pool_pulled's reason");
    wait_pool_pulled<Cfg>(p, base, tables);
  }
  gemm_roles<Cfg>(
      [&] {
        if (Role::tma_issuer()) return produce_tiles<Cfg, true>(p, base, l2_sched, 0, sv, cta.full, cta.empty, ps);
        if (Role::l2_signaller()) return signal_l2_rows<Cfg>(p, L2TileMailbox<Cfg>{cta.full});
        return true;
      },
      [&] {
        return math_phase<Cfg, true>(p, base, tables, 0, sv, cta.full, cta.empty, cta.tok_full, cta.tok_empty, ps,
                                     cta.amax_exchange, parity);
      });
  return true;
}

// 7: combine each token once its rows have come (combine.cuh), with no cross-rank barrier before it: a
// CTA starts as soon as its own L2 tiles are done. Until then its warps that finished early wait at a CTA
// barrier (at BLOCK_M < 128 the producer warpgroup's idle warps, in fast numerics from L1 on): polling
// the tokens' counts instead (ld.acquire.sys, an L1 invalidation per poll, for the whole GEMM phases)
// slows fast decode (docs/design.md section 9).
template <class Cfg>
__device__ __forceinline__ void finish_call(const KernelParams& p, uint8_t* base) {
  __syncthreads();
  if (p.stop_after_phase == 6) return combine_tokens<Cfg, false>(p, base);  // the counts, no sum
  combine_tokens<Cfg>(p, base);
}

// The kernel body; the JIT-generated translation unit wraps it in an extern "C" __global__ entry
// with __launch_bounds__(Cfg::kNumThreads, 1) (megamoe_plugin/jit, KernelVariant.source).
template <class Cfg>
__device__ __forceinline__ void mega_moe(const KernelParams& p) {
  static_assert(Cfg::kNumThreads == Role::kProducerWarpgroupThreads + Cfg::kNumMathThreads, "roles.cuh");
  static_assert(kSmemBytes<Cfg> + kSmemAlignSlack <= kSmemLimit, "shared memory over the SM90 per-block limit");
  const CtaShared<Cfg> cta;
  uint8_t* base = p.peer_base[p.rank];
  uint32_t* signals = reinterpret_cast<uint32_t*>(base + p.off.signals);
  if (threadIdx.x == 0) {
    *cta.rounds_at_start = rank_rounds_done(signals);
    cta.init_barriers(false);
  }

  // 1-2: send side, after zeroing what the last call left counting.
  clear_last_call<Cfg>(p, base, signals);
  __syncthreads();  // every thread reads thread 0's rank round from here on (send_half)
  // Entries that fit one CTA's threads are all in CTA 0's share of the count (its grid stride), so
  // CTA 0 counts and lists them alone, from its own counts, with no grid barrier between (decode).
  const bool one_cta = p.num_tokens * Cfg::kTopk <= Cfg::kNumThreads;
  if (!one_cta || blockIdx.x == 0) {
    dispatch_count<Cfg>(p, base, cta.scratch, cta.send_half());
    if (!one_cta) grid_sync(p, signals);
    dispatch_list<Cfg>(p, base, cta.scratch, cta.scratch + Cfg::kNumExperts, cta.send_half(), one_cta);
  }
  rank_sync<Cfg::kNumRanks>(p, signals, *cta.rounds_at_start + 1);
  set_tokens_to_clear(p, signals);
  clear_other_send_half<Cfg>(p, base, cta.send_half());
  if (p.stop_after_phase == 2) return;

  // 3-6: receive side, the GEMMs: the whole pool, or its first window.
  if (!run_pool_window<Cfg>(p, base, signals, cta, 0)) return;
  if constexpr (Cfg::kWindowed) {
    const int windows = num_pool_windows<Cfg>(p, cta.tables);
    if (windows > 1) {  // the window kernel runs the rest and phase 7
      if (blockIdx.x == 0 && threadIdx.x == 0) signals[kSigWindowsPending] = windows;
      return;
    }
  }
  finish_call<Cfg>(p, base);
}

// The window kernel of windowed variants (Cfg::kWindowed), launched after mega_moe on the same
// stream: where the call's m-blocks need more rows than the pools hold, the pool windows after the
// first (mega_moe ran it and left their count in signals[kSigWindowsPending]), then phase 7.
// Otherwise it returns at once. Where Cfg::kWindowLoop its one launch runs them all, each after a
// grid barrier that ends the previous window's reads of the pools; at the rebalanced tier launch k
// runs window k + 1 (the host launches it once per window a call can have; the launches past the
// call's windows return at once, the kernel boundary ends each window), and the last one phase 7.
// A separate kernel: in the fused kernel, a loop around the GEMM roles makes ptxas spill and drop the
// main loops' uniform registers, which slows every call (docs/design.md 4.9); here that costs only
// the calls that need windows. The peers' send side stays valid meanwhile: their
// call's half changes only after this rank has started its next call (dispatch.cuh send_side).
template <class Cfg>
__device__ __forceinline__ void mega_moe_windows(const KernelParams& p) {
  static_assert(Cfg::kWindowed, "only windowed variants have a window kernel");
  uint8_t* base = p.peer_base[p.rank];
  uint32_t* signals = reinterpret_cast<uint32_t*>(base + p.off.signals);
  // The call's windows (0 where it has one: the call's clear_last_call zeroed it), cleared by the next call.
  const int windows = static_cast<int>(*reinterpret_cast<volatile uint32_t*>(signals + kSigWindowsPending));
  if (1 + (Cfg::kWindowLoop ? 0 : p.window_launch) >= windows) return;
  const CtaShared<Cfg> cta;
  // The completed cross-rank barriers count the call's (mega_moe's CTA 0 stored it): the call started
  // from one less, as send_half expects.
  if (threadIdx.x == 0) *cta.rounds_at_start = rank_rounds_done(signals) - 1;
  __syncthreads();  // every thread reads it from here on (send_half, in each window's layout)
  if constexpr (Cfg::kWindowLoop) {
    for (int w = 1;; ++w) {
      if (threadIdx.x == 0) cta.init_barriers(w > 1);
      run_pool_window<Cfg>(p, base, signals, cta, w);
      if (w + 1 >= num_pool_windows<Cfg>(p, cta.tables)) break;
      grid_sync(p, signals);  // every CTA is done with this window's pool rows
    }
  } else {
    if (threadIdx.x == 0) cta.init_barriers(false);
    run_pool_window<Cfg>(p, base, signals, cta, 1 + p.window_launch);
    // The count comes from the tables again: a register holding it through the GEMM phases' register
    // regions made ptxas spill.
    if (2 + p.window_launch < num_pool_windows<Cfg>(p, cta.tables)) return;  // the next launch's window
  }
  finish_call<Cfg>(p, base);  // the next call's clear_last_call clears signals[kSigWindowsPending]
}

}  // namespace megamoe
