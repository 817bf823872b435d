// What holds the BLOCK_M 128 FP8 main loop at about two-thirds of the tensor pipe? (issue 12;
// docs/results round 12: v3's L1 ran 1551 cycles per k-block against the 1024 of its WGMMAs,
// and waited for loaded stages only 5-8% of the time.) This times the served main loop
// (mma.cuh mma_tile, instantiated for v3's BLOCK_M 128 config) outside the kernel, under
// producers of decreasing realism, beside the bare WGMMA stream of each instruction width:
//   stream nN xW     W math warpgroups issue m64nNk32 WGMMAs over resident stages: no barrier,
//                    no promotion, at most two batches in flight per warpgroup: what the
//                    instruction shape allows;
//   served/arrive    mma_tile; the producer arrives on each full barrier with no bytes: the
//                    full/empty handshake and the promotion, no shared-memory writes;
//   served/bulk      the producer copies each stage's 48 KB with cp.async.bulk from a small,
//                    L2-resident source: the shared-memory writes of the loads;
//   served/tma       it loads the stages as the kernel does (pipeline.cuh tma_load_2d, 128B
//                    swizzle), walking v3's L1 tiles (expert, n-block, m-block) over a v3-sized
//                    expert set in HBM;
//   rows128/...      mma_tile with 128-row batches in one part, each waited for in full, as one
//                    m64n128k32 per K step (MmaBatching<Cfg, false>, the exact-numerics form).
//                    In the kernel (round 16) this form ran L1 19% slower than the served
//                    pipelined 64-row batches; L2 now runs those too.
// Per variant: cycles per k-block (one 128 x 256 x 128 step of the CTA's tile; 1024 at the tensor
// peak with both warpgroups, 512 per warpgroup), the share of the tensor pipe that is, TFLOP/s,
// and the SM clock the run saw. The served rows are comparable with tools/tile_timeline.py's.
//
// Build with the kernel's flags (megamoe_plugin.jit.nvcc_flags; tools/gpu_check.sh MICROBENCH=1 does):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I csrc \
//        -I $CUTLASS_INCLUDE tools/microbench/mainloop.cu -o /tmp/mainloop && /tmp/mainloop [tiles per CTA, 8] [name | --list]
// A name runs only the variants whose names contain it; --list prints the names. tools/gpu_check.sh
// runs each variant in its
// own process under its own timeout, so that one that hangs names itself (round 14: the first run of
// all variants in one process printed nothing within 60 s).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "megamoe/kernel.cuh"

using namespace megamoe;

// v3 (H 7168, I 2048, top-8, 32 local experts), BLOCK_M 128, 4 stages, fast numerics: the
// variant the heuristics pick for v3 prefill (configs/H200.json).
using V3L1 = KernelConfig<7168, 2048, 8, 32, 1, 128, 4, true, false>;
struct V3L1Rows128N128 : V3L1 {};

namespace megamoe {
// 128-row batches waited for in full, one m64n128k32 per K step.
template <>
struct MmaBatching<V3L1Rows128N128> : MmaBatching<V3L1, false> {};
}  // namespace megamoe

constexpr int kKBlocks = V3L1::kL1NumKBlocks;     // per tile (56)
constexpr int kMBlocksPerExpert = 16;             // 2048 rows per expert: v3 at 8192 tokens
constexpr int kWeightRowsPerExpert = 2 * V3L1::kInter;
constexpr int kNBlocks = V3L1::kL1NumNBlocks;     // 16
constexpr int kExperts = V3L1::kNumLocalExperts;  // 32
constexpr int kPoolRows = kExperts * kMBlocksPerExpert * V3L1::kBlockM;
constexpr int kSmemLaunch = kSmemBytes<V3L1> + 1024;  // 1 KiB of slack for the 1024-byte alignment

enum class Producer { kArrive, kBulk, kTma };

struct BenchArgs {
  KernelParams p;             // timeouts, failure word, pool_capacity (the sfa stride)
  const CUtensorMap* tmaps;   // [0] the pool rows, [1] the weights (Producer::kTma)
  const float* sfa;           // [kKBlocks][128] token scales, + 4 floats (Producer::kTma copies the stage's 132)
  const float* sb;            // [2][kKBlocks] weight scales
  const uint8_t* bulk_src;    // [grid][stages][stage bytes] (Producer::kBulk; also fills resident stages)
  float* out;                 // [grid][256]: keeps the accumulators alive
  long long* cycles;          // [grid]: the first math thread's loop
  int tiles;                  // per CTA
};

// Stages that no producer writes (stream, served/arrive) hold this CTA's bulk_src bytes, finite
// FP8 values, as loaded ones would.
template <class Cfg>
__device__ void fill_stages(const StageView<Cfg>& sv, const BenchArgs& a) {
  for (int i = threadIdx.x * 16; i < Cfg::kNumStages * Cfg::kStageBytes; i += blockDim.x * 16)
    *reinterpret_cast<int4*>(sv.stages + i) =
        *reinterpret_cast<const int4*>(a.bulk_src + (size_t)blockIdx.x * Cfg::kNumStages * Cfg::kStageBytes + i);
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // generic writes, read by the WGMMAs' async proxy
}

template <class Cfg, Producer kProducer>
__global__ void __launch_bounds__(Cfg::kNumThreads, 1) served(const __grid_constant__ BenchArgs a) {
  uint8_t* smem = aligned_dynamic_smem();  // as the kernel addresses its SharedStorage
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + offsetof(SharedStorage<Cfg>, full));
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + offsetof(SharedStorage<Cfg>, empty));
  const StageView<Cfg> sv{smem + offsetof(SharedStorage<Cfg>, stages), nullptr, nullptr};
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kNumStages; ++s) {
      cuda::ptx::mbarrier_init(&full[s], 1);
      cuda::ptx::mbarrier_init(&empty[s], Cfg::kNumMathThreads / 32);
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  if constexpr (kProducer == Producer::kArrive) fill_stages(sv, a);
  __syncthreads();
  PipelineState ps;
  const bool is_producer = Role::tma_issuer();
  gemm_roles<Cfg>(
      [&] {
        if (!is_producer) return true;
        for (int i = 0; i < a.tiles; ++i) {
          // The kernel's tile order (scheduler.cuh): m-blocks of one n-block side by side.
          const int tile = blockIdx.x + i * gridDim.x;
          const int m = tile % kMBlocksPerExpert, n = tile / kMBlocksPerExpert % kNBlocks;
          const int e = tile / (kMBlocksPerExpert * kNBlocks) % kExperts;
          for (int kb = 0; kb < kKBlocks; ++kb) {
            if constexpr (kProducer == Producer::kArrive) {
              if (!gemm_wait<Cfg>(a.p, &empty[ps.stage], ps.phase ^ 1, kErrPipelineEmptyTimeout)) return false;
              cuda::ptx::mbarrier_arrive(&full[ps.stage]);
            } else {
              uint64_t* bar = claim_stage<Cfg>(a.p, full, empty, ps);
              if (bar == nullptr) return false;
              if constexpr (kProducer == Producer::kBulk) {
                const uint8_t* src = a.bulk_src + ((size_t)blockIdx.x * Cfg::kNumStages + ps.stage) * Cfg::kStageBytes;
                cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.a(ps.stage), src,
                                         Cfg::kStageA, bar);
                cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.b(ps.stage),
                                         src + Cfg::kStageA, Cfg::kStageB, bar);
                cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.a_scales(ps.stage),
                                         src + Cfg::kStageA + Cfg::kStageB, Cfg::kStageScaleBytes, bar);
              } else {
                tma_load_2d(sv.a(ps.stage), a.tmaps, kb * Cfg::kBlockK, (e * kMBlocksPerExpert + m) * Cfg::kBlockM, bar);
                tma_load_2d(sv.b(ps.stage), a.tmaps + 1, kb * Cfg::kBlockK, e * kWeightRowsPerExpert + n * Cfg::kBlockN,
                            bar);
                cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, sv.a_scales(ps.stage),
                                         a.sfa + kb * a.p.pool_capacity, Cfg::kStageScaleBytes, bar);
              }
            }
            ps.advance<Cfg::kNumStages>();
          }
        }
        return true;
      },
      [&] {
        const int wg = Role::math_warpgroup();
        const FragCoord fc = FragCoord::of(Role::thread_in_warpgroup());
        const auto weight_scales = [&](int kb, int) { return make_float2(__ldg(a.sb + kb), __ldg(a.sb + kKBlocks + kb)); };
        float acc[Cfg::kAccFloats];
        float keep = 0.f;
        uint32_t full_wait = 0;
        const long long start = clock64();
        for (int i = 0; i < a.tiles; ++i) {
          if (!mma_tile<Cfg, kKBlocks>(a.p, sv, full, empty, ps, wg, fc, 0, acc, weight_scales, full_wait))
            return false;
#pragma unroll
          for (int j = 0; j < Cfg::kAccFloats; ++j) keep += acc[j];
        }
        const long long stop = clock64();
        if (Role::first_math_thread()) a.cycles[blockIdx.x] = stop - start;
        a.out[blockIdx.x * Cfg::kNumMathThreads + threadIdx.x - Role::kProducerWarpgroupThreads] = keep;
        return true;
      });
}

template <int kN> struct StreamOp;
template <> struct StreamOp<64> { using Op = cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>; };
template <> struct StreamOp<128> { using Op = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>; };
template <> struct StreamOp<256> { using Op = cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>; };

// kWgs math warpgroups stream m64nNk32 WGMMAs over the resident stages (warpgroup w reads pool
// rows [64w, 64w + 64)), batches of N weight rows x 128 K alternating between two parts where
// the registers allow (one at N 256), at most two batches in flight per warpgroup.
template <int kN, int kWgs>
__global__ void __launch_bounds__(V3L1::kNumThreads, 1) stream(const __grid_constant__ BenchArgs a) {
  using Cfg = V3L1;
  const StageView<Cfg> sv{aligned_dynamic_smem() + offsetof(SharedStorage<Cfg>, stages), nullptr, nullptr};
  fill_stages(sv, a);
  __syncthreads();
  gemm_roles<Cfg>(
      [&] { return true; },
      [&] {
        const int wg = Role::math_warpgroup();
        if (wg >= kWgs) return true;
        using Op = typename StreamOp<kN>::Op;
        constexpr int kParts = kN == 256 ? 1 : 2, kFloats = kN / 2, kBatches = Cfg::kBlockN / kN;
        float parts[kParts * kFloats];
#pragma unroll
        for (int i = 0; i < kParts * kFloats; ++i) parts[i] = 0.f;
        const long long start = clock64();
        for (int kb = 0; kb < a.tiles * kKBlocks; ++kb) {
          const int stage = kb % Cfg::kNumStages;
          const uint64_t desc_a = make_smem_desc(sv.a(stage) + wg * 64 * Cfg::kBlockK);
#pragma unroll
          for (int b = 0; b < kBatches; ++b) {
            float* mine = parts + (b % kParts) * kFloats;
            const uint64_t desc_b = make_smem_desc(sv.b(stage) + b * kN * Cfg::kBlockK);
            fence_operands<kFloats>(mine);
            cute::warpgroup_arrive();
#pragma unroll
            for (int k = 0; k < Cfg::kBlockK / 32; ++k)
              wgmma_call<Op>(desc_a + 2 * k, desc_b + 2 * k, mine, true, std::make_integer_sequence<int, kFloats>{});
            cute::warpgroup_commit_batch();
            cute::warpgroup_wait<1>();
          }
        }
        cute::warpgroup_wait<0>();
        fence_operands<kParts * kFloats>(parts);
        const long long stop = clock64();
        float keep = 0.f;
#pragma unroll
        for (int i = 0; i < kParts * kFloats; ++i) keep += parts[i];
        if (Role::first_math_thread()) a.cycles[blockIdx.x] = stop - start;
        a.out[blockIdx.x * Cfg::kNumMathThreads + threadIdx.x - Role::kProducerWarpgroupThreads] = keep;
        return true;
      });
}

// Finite e4m3 bytes (mantissa bit 2 cleared: never the NaN code S.1111.111), hashed from the index.
__global__ void fill_fp8(uint8_t* dst, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    dst[i] = static_cast<uint8_t>(h & 0xFB);
  }
}

#define CHECK(call)                                                                           \
  do {                                                                                        \
    cudaError_t err_ = (call);                                                                \
    if (err_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

// cuTensorMapEncodeTiled through the runtime's driver entry point: no -lcuda to link.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static CUtensorMap tensor_map(void* base, uint64_t rows, uint32_t box_rows) {
  static EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess) {
      std::fprintf(stderr, "the driver has no cuTensorMapEncodeTiled\n");
      std::exit(1);
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {V3L1::kHidden, rows};
  const cuuint64_t strides[1] = {V3L1::kHidden};  // bytes between rows
  const cuuint32_t box[2] = {V3L1::kBlockK, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, elem_strides,
                                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

// Polls `done` for up to `seconds`: a variant that hangs names itself instead of stalling the run.
constexpr int kHostDeadlineS = 10;
static bool finished_within(cudaEvent_t done, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  for (;;) {
    const cudaError_t state = cudaEventQuery(done);
    if (state == cudaSuccess) return true;
    if (state != cudaErrorNotReady) CHECK(state);
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

struct Variant {
  const char* name;
  void (*kernel)(BenchArgs);
  int math_warpgroups;  // the ideal cycles per k-block are 512 per warpgroup's half of the tile
};

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 8;
  const char* only = argc > 2 ? argv[2] : "";
  const Variant variants[] = {
      {"stream n64 x2", stream<64, 2>, 2},
      {"stream n128 x2", stream<128, 2>, 2},
      {"stream n256 x2", stream<256, 2>, 2},
      {"stream n64 x1", stream<64, 1>, 1},
      {"stream n128 x1", stream<128, 1>, 1},
      {"stream n256 x1", stream<256, 1>, 1},
      {"served/arrive", served<V3L1, Producer::kArrive>, 2},
      {"served/bulk", served<V3L1, Producer::kBulk>, 2},
      {"served/tma", served<V3L1, Producer::kTma>, 2},
      {"rows128/arrive", served<V3L1Rows128N128, Producer::kArrive>, 2},
      {"rows128/bulk", served<V3L1Rows128N128, Producer::kBulk>, 2},
      {"rows128/tma", served<V3L1Rows128N128, Producer::kTma>, 2},
  };
  if (std::strcmp(only, "--list") == 0) {
    for (const Variant& v : variants) std::printf("%s\n", v.name);
    return 0;
  }
  int device = 0, num_sms = 0;
  CHECK(cudaSetDevice(device));
  CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("%s, %d SMs; %d tiles of %d k-blocks per CTA\n", prop.name, num_sms, tiles, kKBlocks);

  const size_t bulk_bytes = (size_t)num_sms * V3L1::kNumStages * V3L1::kStageBytes;
  const size_t pool_bytes = (size_t)kPoolRows * V3L1::kHidden;
  const size_t weight_bytes = (size_t)kExperts * kWeightRowsPerExpert * V3L1::kHidden;
  uint8_t *bulk_src, *pool, *weights;
  CHECK(cudaMalloc(&bulk_src, bulk_bytes));
  CHECK(cudaMalloc(&pool, pool_bytes));
  CHECK(cudaMalloc(&weights, weight_bytes));
  fill_fp8<<<1024, 256>>>(bulk_src, bulk_bytes, 1);
  fill_fp8<<<1024, 256>>>(pool, pool_bytes, 2);
  fill_fp8<<<1024, 256>>>(weights, weight_bytes, 3);
  std::vector<float> sfa_host(kKBlocks * V3L1::kBlockM + 4), sb_host(2 * kKBlocks);
  for (size_t i = 0; i < sfa_host.size(); ++i) sfa_host[i] = 1.f / 448.f * (1 + i % 7);
  for (size_t i = 0; i < sb_host.size(); ++i) sb_host[i] = 1.f / 1024.f * (1 + i % 5);
  float *sfa, *sb, *out;
  long long* cycles;
  CUtensorMap* tmaps;
  HostWords* host_words;
  CHECK(cudaMalloc(&sfa, sfa_host.size() * 4));
  CHECK(cudaMalloc(&sb, sb_host.size() * 4));
  CHECK(cudaMalloc(&out, (size_t)num_sms * V3L1::kNumMathThreads * 4));
  CHECK(cudaMalloc(&cycles, num_sms * sizeof(long long)));
  CHECK(cudaMalloc(&tmaps, 2 * sizeof(CUtensorMap)));
  CHECK(cudaMalloc(&host_words, sizeof(HostWords)));
  CHECK(cudaMemset(host_words, 0, sizeof(HostWords)));
  CHECK(cudaMemcpy(sfa, sfa_host.data(), sfa_host.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(sb, sb_host.data(), sb_host.size() * 4, cudaMemcpyHostToDevice));
  const CUtensorMap maps[2] = {tensor_map(pool, kPoolRows, V3L1::kBlockM),
                               tensor_map(weights, (uint64_t)kExperts * kWeightRowsPerExpert, V3L1::kBlockN)};
  CHECK(cudaMemcpy(tmaps, maps, sizeof(maps), cudaMemcpyHostToDevice));

  BenchArgs args{};
  args.p.timeout_ns = 5ull * 1000 * 1000 * 1000;  // the served variants' waits trap first
  args.p.host = host_words;
  args.p.pool_capacity = V3L1::kBlockM;
  args.tmaps = tmaps;
  args.sfa = sfa;
  args.sb = sb;
  args.bulk_src = bulk_src;
  args.out = out;
  args.cycles = cycles;
  args.tiles = tiles;

  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  std::printf("%-18s %12s %10s %10s %8s\n", "variant", "cycles/kblk", "pipe", "TFLOP/s", "GHz");
  std::vector<long long> cyc(num_sms);
  for (const Variant& v : variants) {
    if (std::strstr(v.name, only) == nullptr) continue;
    CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLaunch));
    std::vector<float> ms_runs;
    std::vector<double> cycle_runs;
    for (int run = 0; run < 6; ++run) {  // run 0 warms up
      CHECK(cudaEventRecord(begin));
      v.kernel<<<num_sms, V3L1::kNumThreads, kSmemLaunch>>>(args);
      CHECK(cudaEventRecord(end));
      if (!finished_within(end, kHostDeadlineS)) {  // the stream variants have no timed waits
        std::fprintf(stderr, "%s: run %d did not finish in %d s\n", v.name, run, kHostDeadlineS);
        return 2;
      }
      CHECK(cudaGetLastError());
      HostWords words;
      CHECK(cudaMemcpy(&words, host_words, sizeof(words), cudaMemcpyDeviceToHost));
      if (words.error != 0) {
        std::fprintf(stderr, "%s: a wait timed out (error word %#x)\n", v.name, words.error);
        return 1;
      }
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, begin, end));
      CHECK(cudaMemcpy(cyc.data(), cycles, num_sms * sizeof(long long), cudaMemcpyDeviceToHost));
      double mean = 0;
      for (long long c : cyc) mean += static_cast<double>(c) / num_sms;
      if (run > 0) ms_runs.push_back(ms), cycle_runs.push_back(mean);
    }
    std::sort(ms_runs.begin(), ms_runs.end());
    std::sort(cycle_runs.begin(), cycle_runs.end());
    const double ms = ms_runs[ms_runs.size() / 2], loop_cycles = cycle_runs[cycle_runs.size() / 2];
    const double kblocks = static_cast<double>(tiles) * kKBlocks;
    const double per_kblock = loop_cycles / kblocks;
    const double flop = 2.0 * num_sms * kblocks * (64.0 * v.math_warpgroups) * V3L1::kBlockN * V3L1::kBlockK;
    std::printf("%-18s %12.0f %9.1f%% %10.0f %8.2f\n", v.name, per_kblock, 100.0 * 512 * v.math_warpgroups / per_kblock,
                flop / (ms * 1e-3) / 1e12, loop_cycles / (ms * 1e6));
  }
  return 0;
}
