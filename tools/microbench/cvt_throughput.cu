// How fast can an SM90 SM turn e4m3 pairs into FP16x2? Compares the hardware conversion
// (cvt.rn.f16x2.e4m3x2), a bit-manipulation form (prmt + lop3 + shift, value scaled by
// 2^-8), and both interleaved (different pipes). Prints f16x2 results per clock per SM.
//   nvcc -O3 -arch=sm_90a -o cvt_throughput cvt_throughput.cu && ./cvt_throughput
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <cstdint>

__device__ __forceinline__ uint32_t cvt_hw(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// bytes 0, 1 of w -> FP16x2 of their values times 2^-8 (exact for every finite e4m3)
__device__ __forceinline__ uint32_t cvt_bits(uint32_t w) {
  uint32_t y;
  asm("prmt.b32 %0, %1, 0, 0x1404;" : "=r"(y) : "r"(w));  // [b1, 0, b0, 0]
  return (y & 0x80008000u) | ((y & 0x7F007F00u) >> 1);
}

template <int kMode>
__global__ void bench(uint32_t* out, int iters, long long* clocks) {
  uint32_t v[8];
  for (int i = 0; i < 8; ++i) v[i] = threadIdx.x * 0x01010101u + i * 0x3a5c1e07u;
  uint32_t acc = 0;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t r;
      if (kMode == 0) r = cvt_hw(v[i]);
      else if (kMode == 1) r = cvt_bits(v[i]);
      else r = (i % 2 == 0) ? cvt_hw(v[i]) : cvt_bits(v[i]);
      acc ^= r;
      v[i] = r + it;  // dependency keeps the compiler from hoisting
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Every pair of finite e4m3 codes: the bit form times 2^8 equals the hardware conversion.
__global__ void check(int* mismatches) {
  const uint32_t pair = blockIdx.x * blockDim.x + threadIdx.x;  // 0 .. 65535
  const uint32_t lo = pair & 0xFF, hi = pair >> 8;
  if ((lo & 0x7F) == 0x7F || (hi & 0x7F) == 0x7F) return;  // NaN codes
  const uint32_t hw = cvt_hw(pair), bits = cvt_bits(pair);
  for (int h = 0; h < 2; ++h) {
    const __half_raw a{static_cast<unsigned short>(hw >> (16 * h))}, b{static_cast<unsigned short>(bits >> (16 * h))};
    if (__half2float(__half(a)) != __half2float(__half(b)) * 256.f) atomicAdd(mismatches, 1);
  }
}

template <int kMode>
void run(const char* name) {
  const int blocks = 132, threads = 1024, iters = 4096;
  uint32_t* out;
  long long* clocks;
  cudaMalloc(&out, blocks * threads * 4);
  cudaMalloc(&clocks, blocks * 8);
  bench<kMode><<<blocks, threads>>>(out, 16, clocks);
  bench<kMode><<<blocks, threads>>>(out, iters, clocks);
  long long c[132];
  cudaMemcpy(c, clocks, sizeof(c), cudaMemcpyDeviceToHost);
  const double results = (double)threads * iters * 8;
  printf("%-28s %6.1f f16x2 per clock per SM\n", name, results / c[0]);
  cudaFree(out);
  cudaFree(clocks);
}

int main() {
  int* mismatches;
  cudaMalloc(&mismatches, 4);
  cudaMemset(mismatches, 0, 4);
  check<<<256, 256>>>(mismatches);
  int m = -1;
  cudaMemcpy(&m, mismatches, 4, cudaMemcpyDeviceToHost);
  printf("bit form vs hardware: %d mismatches over all finite e4m3 pairs\n", m);
  run<0>("cvt.rn.f16x2.e4m3x2");
  run<1>("prmt + lop3 + shift");
  run<2>("both, interleaved");
  return 0;
}
