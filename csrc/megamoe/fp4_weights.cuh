// MXFP4 expert weights on FP8 tensor cores (docs/design.md section 2, "FP4 experts"). A stage carries
// a tile's packed E2M1 codes (kBlockN rows x 64 bytes per k-block, 64B swizzle) and the rows' E8M0
// scales of the k-block (4 bytes per row, group g in byte g); each math warpgroup turns its 128 rows
// (one 128-row block of the weights' kernel layout) into an e4m3 tile in the 128B-swizzled layout its
// WGMMAs read (what TMA writes for FP8 weights) and one float scale for the block, which the promotion
// applies as FP8 weights' block scale: one multiply-add per accumulator, as with FP8 weights (a scale
// per row cost a second multiply per accumulator, about a fifth of prefill's time on an H100).
//
// The fold: a block's k-block has 128 rows x 4 groups of 32 elements with scales 2^(s_g - 127). With m
// the largest s_g of the block, its scale is 2^(m - 133) and group g's codes become code x
// 2^(s_g - m + 6) in e4m3. An E2M1 value times 2^d is exact in e4m3 for d in [-8, 6] (6 x 2^6 = 384 <=
// 448; 0.5 x 2^-8 = 2^-9, e4m3's least subnormal), so a block whose k-block's scales span at most 2^14
// converts exactly. A group whose scale lies further below the block's largest (d < -8) is rounded to
// nearest even among e4m3's subnormals (all zero for d < -12): an error of at most 2^-10 of the block's
// scale, 2^-16 of its largest group's. transform_weights stores each block's largest code beside the
// rows' (abi.h kFp4BlockCodeBytes), so the fold needs no exchange between threads; it refuses E8M0's NaN
// code, which would make the whole block's scale NaN here.
#pragma once

#include <stdint.h>

#include "config.cuh"

namespace megamoe {

constexpr int kFp4FoldShift = 6;  // the block scale is 2^(m - 127 - kFp4FoldShift)

// e4m3 byte, rounded to nearest even, of E2M1 magnitude `magnitude` (0..7: 0, 0.5, 1, 1.5, 2, 3,
// 4, 6) times 2^d, for d <= 6. The slow path of fp4_e4m3_table.
__device__ __forceinline__ uint32_t fp4_e4m3_byte(int magnitude, int d) {
  // Twice the magnitude, an integer: 0, 1, 2, 3, then 4, 6, 8, 12.
  const int twice = magnitude < 4 ? magnitude : static_cast<int>((0x0C080604u >> (8 * (magnitude - 4))) & 0xFFu);
  if (twice == 0) return 0u;
  // The value in units of 2^-9 (e4m3's least subnormal) is twice x 2^(d + 8).
  const int shift = d + 8;
  if (shift >= 0 && (twice << shift) >= 8) {  // a normal e4m3 value: exponent e, one mantissa bit at most
    const int top = 31 - __clz(twice);          // twice = 2^top or 3 x 2^(top - 1)
    const int e = top + d - 1;                  // value = 2^e or 1.5 x 2^e
    const uint32_t half = twice == (1 << top) ? 0u : 4u;
    return static_cast<uint32_t>(e + 7) << 3 | half;
  }
  if (shift >= 0) return static_cast<uint32_t>(twice << shift);  // subnormal, exact (< 8 units)
  // Below: twice / 2^-shift units, rounded to nearest even (0..7, or 8 = 2^-6, e4m3's bits for it).
  if (-shift > 4) return 0u;  // at most 12 / 32 of a unit
  const int down = twice >> -shift, rest = twice & ((1 << -shift) - 1), half_unit = 1 << (-shift - 1);
  return static_cast<uint32_t>(down + (rest > half_unit || (rest == half_unit && (down & 1))));
}

// The e4m3 bytes of the 8 E2M1 magnitudes times 2^d, magnitude i in byte i of {.x, .y}. For d >= -5
// (fp4_e4m3_table_normal, d in [-5, 6]) every result is normal: the d = 0 bytes with d added to their
// exponent fields.
__device__ __forceinline__ uint2 fp4_e4m3_table_normal(int d) {
  // d = 0: 0, 0.5, 1, 1.5 -> 0x00, 0x30, 0x38, 0x3C; 2, 3, 4, 6 -> 0x40, 0x44, 0x48, 0x4C. No byte
  // leaves [0, 0x7C] for d in [-5, 6], so the per-byte sums carry nothing into their neighbours.
  return make_uint2(0x3C383000u + static_cast<uint32_t>(d * 0x08080800), 0x4C484440u + static_cast<uint32_t>(d * 0x08080808));
}

__device__ __forceinline__ uint2 fp4_e4m3_table(int d) {
  if (d >= -5) return fp4_e4m3_table_normal(d);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo |= fp4_e4m3_byte(i, d) << (8 * i);
    hi |= fp4_e4m3_byte(i + 4, d) << (8 * i);
  }
  return make_uint2(lo, hi);
}

// The byte-permute of `table` by `selector`'s low 16 bits. Written out because __byte_perm lets the
// compiler see that only those bits are read: it then masks them apart from the high half's (a
// 16-bit mask of its own, one more integer operation per word).
__device__ __forceinline__ uint32_t fp4_prmt(uint2 table, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(table.x), "r"(table.y), "r"(selector));
  return out;
}

// One 32-bit word of a row's codes, 8 elements in the kernel's order (megamoe_plugin/mxfp4.py
// KERNEL_SIGN_OF_NIBBLE: nibble k holds element k's magnitude; the signs of elements 0-3 are bits 7,
// 15, 23, 31 and those of 4-7 bits 3, 11, 19, 27) -> 8 e4m3 bytes by `table`: elements 0-3 in .x,
// 4-7 in .y. Seven operations: a mask, two byte-permutes of the table and the signs merged by two
// LOP3s on the integer pipe, and two on the FMA pipe, which the conversion leaves idle: the high
// half's selector brought down by a multiply-high by 2^16 (a permute reads only its selector's low
// 16 bits) and the high signs' shift by 4 (a multiply by 16, as the compiler emits it).
__device__ __forceinline__ uint2 fp4_convert_word(uint32_t codes, uint2 table) {
  const uint32_t magnitudes = codes & 0x77777777u;
  uint32_t high_half;
  asm("mul.hi.u32 %0, %1, 65536;" : "=r"(high_half) : "r"(magnitudes));
  return make_uint2(fp4_prmt(table, magnitudes) | (codes & 0x80808080u),
                    fp4_prmt(table, high_half) | ((codes << 4) & 0x80808080u));
}

// The largest E8M0 code of 128-row block `block` (0, 1) of a stage's tile, which transform_weights
// stores after the rows' codes (abi.h kFp4BlockCodeBytes).
__device__ __forceinline__ int fp4_block_largest(const uint32_t* scale_codes, int block) {
  return reinterpret_cast<const uint8_t*>(scale_codes + kBlockN)[block];
}

// The scale of a block whose largest code is m: 2^(m - 133) by its bits (exponent field m - 6; a
// subnormal below m = 7).
__device__ __forceinline__ float fp4_block_scale(int m) {
  const int exponent = m - 127 - kFp4FoldShift;
  return __int_as_float(exponent >= -126 ? (exponent + 127) << 23 : 1 << (exponent + 149));
}

// Converts weight row `row` (0..kBlockN) of a stage's packed tile, whose four E8M0 codes are `codes`,
// into `tile` (kBlockN x 128 e4m3, 128B swizzle), folded by its block's largest code `largest`. One
// thread per row. The row's four 16-byte loads are issued before any store (the compiler cannot move a
// load past a store that may alias it), and the slow table path is one branch per row, taken only where
// a group lies more than 2^11 below the block's largest: so the loads overlap and the 16 word
// conversions are independent of each other.
__device__ __forceinline__ void fp4_convert_row(const uint8_t* __restrict__ packed, uint32_t codes, int largest,
                                                uint8_t* __restrict__ tile, int row) {
  constexpr int kGroups = kBlockK / kFp4GroupSize;
  const uint8_t* src = packed + row * (kBlockK / 2);
  uint4 in[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g)  // 64B swizzle: the row's 16-byte chunk g lies at chunk g ^ ((row >> 1) & 3)
    in[g] = *reinterpret_cast<const uint4*>(src + 16 * (g ^ ((row >> 1) & 3)));
  const int s0 = codes & 0xFF, s1 = (codes >> 8) & 0xFF, s2 = (codes >> 16) & 0xFF, s3 = codes >> 24;
  uint2 table[kGroups];
  const int least = min(min(s0, s1), min(s2, s3)) - largest + kFp4FoldShift;
  if (least >= -5) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) table[g] = fp4_e4m3_table_normal(static_cast<int>((codes >> (8 * g)) & 0xFF) -
                                                                       largest + kFp4FoldShift);
  } else {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) table[g] = fp4_e4m3_table(static_cast<int>((codes >> (8 * g)) & 0xFF) -
                                                                largest + kFp4FoldShift);
  }
  uint8_t* dst = tile + row * kBlockK;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const uint2 a = fp4_convert_word(in[g].x, table[g]), b = fp4_convert_word(in[g].y, table[g]);
    const uint2 c = fp4_convert_word(in[g].z, table[g]), e = fp4_convert_word(in[g].w, table[g]);
    // 128B swizzle: the row's 16-byte chunk j lies at chunk j ^ (row & 7); group g is chunks 2g, 2g + 1.
    *reinterpret_cast<uint4*>(dst + 16 * ((2 * g) ^ (row & 7))) = make_uint4(a.x, a.y, b.x, b.y);
    *reinterpret_cast<uint4*>(dst + 16 * ((2 * g + 1) ^ (row & 7))) = make_uint4(c.x, c.y, e.x, e.y);
  }
}

}  // namespace megamoe
