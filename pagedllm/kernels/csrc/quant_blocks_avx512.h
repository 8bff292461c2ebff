// The AVX-512 paths for K-quant blocks kept as stored (quant_blocks.h): a 32-column step
// decoded in registers (raw_dequant_step: the float tile, AMX's bf16 tiles, dequantize), and,
// with AVX512-VNNI, Q4_K, Q5_K and Q6_K against bf16 rows quantized to 8 bits per 32 columns
// (Int8Rows), summed as integers (tile_vnni_raw). Included at the end of quant_avx512.h.
#pragma once

#include <type_traits>

#include "quant_blocks.h"

#if defined(PAGEDLLM_AVX512)

namespace pagedllm::avx512 {

// 32 bytes as 256 bits shifted right by `bits` within each byte's 16-bit pair (the bits that
// cross into a byte from its neighbour are masked off by the caller).
inline __m256i shift_right(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// Group j's 32 u (quant_blocks.h) of block b, in a register: Q4_K, Q5_K and Q6_K decoded in
// vectors, Q2_K and Q3_K by the scalar code. Type is a template argument where the caller knows
// it (the AMX tiles' dequantize: a run-time switch per 32 columns cost them ~1.3x).
template <int64_t Type>
inline __m256i raw_group_bits_of(const uint8_t* b, int j) {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (Type == kQ4K || Type == kQ5K) {
    constexpr bool five = Type == kQ5K;
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (five ? 48 : 16) + 32 * (j / 2)));
    __m256i u = _mm256_and_si256(shift_right(qs, 4 * (j & 1)), low4);
    if (five) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __mmask32 fifth = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << j)));
      u = _mm256_mask_add_epi8(u, fifth, u, _mm256_set1_epi8(16));
    }
    return u;
  }
  if constexpr (Type == kQ6K) {
    const int h = j / 4, t = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i top = _mm256_and_si256(shift_right(qh, 2 * t), _mm256_set1_epi8(3));
    return _mm256_or_si256(_mm256_and_si256(shift_right(ql, 4 * (t >> 1)), low4), _mm256_slli_epi16(top, 4));
  }
  if constexpr (Type == kIQ4XS) {  // the codes' grid values plus 128, columns 0-15 then 16-31
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * j));
    const __m128i grid = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4GridPlus128)), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_shuffle_epi8(grid, _mm_and_si128(qs, nibble));
    const __m128i high = _mm_shuffle_epi8(grid, _mm_and_si128(_mm_srli_epi16(qs, 4), nibble));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
  }
  alignas(32) uint8_t bytes[32];
  raw_group_bits(Type, b, j, bytes);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
}

// The function of a run-time type: the callers' whose per-step work is larger anyway.
template <typename F>
inline decltype(auto) with_raw_type(int64_t type, F f) {
  switch (type) {
    case kQ4K: return f(std::integral_constant<int64_t, kQ4K>{});
    case kQ5K: return f(std::integral_constant<int64_t, kQ5K>{});
    case kQ6K: return f(std::integral_constant<int64_t, kQ6K>{});
    case kQ2K: return f(std::integral_constant<int64_t, kQ2K>{});
    case kIQ4XS: return f(std::integral_constant<int64_t, kIQ4XS>{});
    default: return f(std::integral_constant<int64_t, kQ3K>{});
  }
}
inline __m256i raw_group_bits_avx512(int64_t type, const uint8_t* b, int j) {
  return with_raw_type(type, [&](auto t) { return raw_group_bits_of<decltype(t)::value>(b, j); });
}

// A block's scales as floats: Q4_K/Q5_K lanes 0-7 d x sc[j], 8-15 -(dmin x m[j]); Q6_K d x sc[i]
// for its 16 groups of 16.
template <int64_t Type>
inline __m512 raw_block_scales(const uint8_t* b) {
  if constexpr (Type == kQ6K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), _mm512_set1_ps(half_to_float(b + 208)));
  } else {  // Q4_K/Q5_K's 12 scale bytes unpacked in one register (k4_scale_min's layout), d and dmin
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    // a: scale bytes s0-3, s8-11, s4-7, s8-11 (the six low bits of sc0-3 and m0-3, the nibbles of
    // sc4-7 and m4-7); tops: s0-3 and s4-7 where sc4-7 and m4-7 take their top two bits
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i tops = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i low = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high_nibbles = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F));
    const __m128i top_bits = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(tops, 6), _mm_set1_epi8(3)), 4);
    const __m128i bytes = _mm_or_si128(_mm_or_si128(low, high_nibbles), top_bits);  // sc0-7, m0-7
    const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(v));                    // d, dmin, ...
    __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), both);
    d = _mm512_castsi512_ps(  // -dmin for the offsets: the sign flipped, -0 for +0 as gguf's d x q - dmin x m has it
        _mm512_mask_xor_epi32(_mm512_castps_si512(d), 0xFF00, _mm512_castps_si512(d), _mm512_set1_epi32(INT32_MIN)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), d);
  }
}

// Lane `C` of four channels' unpacked scale bytes times that channel's d (lanes 0-7) and -dmin
// (8-15): raw_block_scales' floats for the channel in 128-bit lane C of k4_block_scales4's vectors.
template <int C>
inline __m512 k4_lane_scales(__m512i bytes, __m512 d_dmin) {
  const __m512 d = _mm512_permutexvar_ps(
      _mm512_setr_epi32(2 * C, 2 * C, 2 * C, 2 * C, 2 * C, 2 * C, 2 * C, 2 * C, 2 * C + 1, 2 * C + 1, 2 * C + 1,
                        2 * C + 1, 2 * C + 1, 2 * C + 1, 2 * C + 1, 2 * C + 1),
      d_dmin);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, C))), d);
}

// Four channels' Q4_K/Q5_K block scales at once, each raw_block_scales' floats bit for bit: one
// channel's 16 leading bytes a 128-bit lane, unpacked by the same byte shuffles and masks (they
// work within lanes), so four blocks take one pass. A one-row product decodes a block's scales
// for every 144 bytes it reads, about a third of its vector work when done one block at a time.
inline void k4_block_scales4(const uint8_t* const b[4], __m512 out[4]) {
  auto lane = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  __m512i v = _mm512_castsi128_si512(lane(b[0]));
  v = _mm512_inserti32x4(v, lane(b[1]), 1);
  v = _mm512_inserti32x4(v, lane(b[2]), 2);
  v = _mm512_inserti32x4(v, lane(b[3]), 3);
  const __m128i pick_a = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i pick_tops = _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
  const __m128i six_or_four = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
  const __m512i a = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(pick_a));
  const __m512i tops = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(pick_tops));
  const __m512i low = _mm512_and_si512(a, _mm512_broadcast_i32x4(six_or_four));
  const __m512i high_nibbles =
      _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0, 0x0F0F0F0F)));
  const __m512i top_bits = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(tops, 6), _mm512_set1_epi8(3)), 4);
  const __m512i bytes = _mm512_or_si512(_mm512_or_si512(low, high_nibbles), top_bits);  // per lane: sc0-7, m0-7
  // each lane's d and dmin (its first two halves) side by side as floats, dmin's sign flipped
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128i halves = _mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, v));
  const __m256i negate = _mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
  const __m512 d_dmin = _mm512_castps256_ps512(
      _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_cvtph_ps(halves)), negate)));
  out[0] = k4_lane_scales<0>(bytes, d_dmin);
  out[1] = k4_lane_scales<1>(bytes, d_dmin);
  out[2] = k4_lane_scales<2>(bytes, d_dmin);
  out[3] = k4_lane_scales<3>(bytes, d_dmin);
}

// Block b's 16 (scale, offset) pairs, one per 16 columns, into scale[16] and offset[16]: for
// Q4_K, Q5_K and Q6_K from one vector of its scales; Q2_K and Q3_K by the scalar code.
inline void raw_block_affine(int64_t type, const uint8_t* b, float* scale, float* offset) {
  if (type == kQ4K || type == kQ5K) {
    const __m512 both = type == kQ4K ? raw_block_scales<kQ4K>(b) : raw_block_scales<kQ5K>(b);
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    _mm512_storeu_ps(scale, _mm512_permutexvar_ps(pairs, both));
    _mm512_storeu_ps(offset, _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), both));
  } else if (type == kQ6K) {
    const __m512 s = raw_block_scales<kQ6K>(b);
    _mm512_storeu_ps(scale, s);
    _mm512_storeu_ps(offset, _mm512_mul_ps(s, _mm512_set1_ps(-32.f)));
  } else {
    for (int64_t g = 0; g < 8; ++g) raw_group_affine(type, b, g, scale + 2 * g, offset + 2 * g);
  }
}

// u as floats, scaled and offset: lo = the first 16 columns, hi = the last 16.
inline void raw_values(__m256i u, const float scale[2], const float offset[2], __m512& lo, __m512& hi) {
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u))), _mm512_set1_ps(scale[0]),
                       _mm512_set1_ps(offset[0]));
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1))),
                       _mm512_set1_ps(scale[1]), _mm512_set1_ps(offset[1]));
}

// Columns [k0, k0 + 32) of raw row n: lo = the first 16, hi = the last 16.
inline void raw_dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m512& lo, __m512& hi) {
  const uint8_t* b = m.q + n * m.row_bytes() + k0 / kSuperBlock * raw_block_bytes(m.raw);
  const int j = int(k0 % kSuperBlock) / 32;
  float scale[2], offset[2];
  raw_group_affine(m.raw, b, j, scale, offset);
  raw_values(raw_group_bits_avx512(m.raw, b, j), scale, offset, lo, hi);
}

// The float tile (quant_avx512.h's tile) for raw rows: each block's scales and offsets decoded
// once per channel, not once per 32 columns (which cost fp32 rows 1.7x the widened layout's time).
template <int NC, int MR, int64_t Type>
void tile_raw_of(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t block_bytes = raw_block_bytes(Type), rb = m.row_bytes();
  for (int64_t blk = 0; blk < m.k / kSuperBlock; ++blk) {
    float scale[NC][8][2], offset[NC][8][2];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* p = m.q + (n0 + c) * rb + blk * block_bytes;
      for (int64_t line = 0; line < block_bytes; line += 64) prefetch_ahead(p + line);
      raw_block_affine(Type, p, scale[c][0], offset[c][0]);
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t k0 = blk * kSuperBlock + 32 * j;
      __m512 xlo[MR], xhi[MR];
      for (int r = 0; r < MR; ++r) {
        xlo[r] = _mm512_loadu_ps(X + r * ldx + k0);
        xhi[r] = _mm512_loadu_ps(X + r * ldx + k0 + 16);
      }
      for (int c = 0; c < NC; ++c) {
        __m512 lo, hi;
        raw_values(raw_group_bits_of<Type>(m.q + (n0 + c) * rb + blk * block_bytes, j), scale[c][j], offset[c][j],
                   lo, hi);
        for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_fmadd_ps(hi, xhi[r], _mm512_fmadd_ps(lo, xlo[r], acc[c][r]));
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

template <int NC, int MR>
void tile_raw(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  with_raw_type(m.raw, [&](auto t) { tile_raw_of<NC, MR, decltype(t)::value>(m, X, ldx, n0, Y, ldy); });
}

#if defined(PAGEDLLM_VNNI)
inline bool vnni_takes_raw(int64_t type) { return type == kQ4K || type == kQ5K || type == kQ6K || type == kIQ4XS; }

// IQ4_XS block b's eight group scales d x (sc - 32) in lanes 0-7 (raw_group_affine's, in
// registers): sc's low nibble j is bits 4j of sc_l read as one little-endian word, its top two
// bits 2j of sc_h.
inline __m512 iq4xs_block_scales(const uint8_t* b) {
  uint16_t high;
  uint32_t low;
  std::memcpy(&high, b + 2, 2);
  std::memcpy(&low, b + 4, 4);
  const __m256i j = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(low)), _mm256_slli_epi32(j, 2)),
                                       _mm256_set1_epi32(15));
  const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_slli_epi32(j, 1)),
                                       _mm256_set1_epi32(3));
  const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(nib, _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
  return _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_set1_ps(half_to_float(b))));
}

// IQ4_XS's blocks against bf16 rows in 8 bits, as tile_vnni sums 4-bit codes: per 128 columns
// (four groups, 64 bytes in the order Int8Rows keeps x: each group's low nibbles its first 16
// columns, high its last 16), the codes looked up in the grid plus 128, two dpbusd per row, one
// scale per group (d x (sc - 32), the block's eight decoded once); the 128 taken back out once a
// block with each group's sum of x.
template <int NC, int MR>
void tile_vnni_iq4xs(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t block_bytes = raw_block_bytes(kIQ4XS), rb = m.row_bytes();
  const __m512i grid = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4GridPlus128)));
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int64_t blk = 0; blk < m.k / kSuperBlock; ++blk) {
    __m512 scales[NC];  // lanes 0-7: the block's eight group scales
    for (int c = 0; c < NC; ++c) {
      const uint8_t* p = m.q + (n0 + c) * rb + blk * block_bytes;
      for (int64_t line = 0; line < block_bytes; line += 64) prefetch_ahead(p + line);
      scales[c] = iq4xs_block_scales(p);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i xlo[MR], xhi[MR];
      __m512 xs[MR];
      load_x_groups<MR>(xr, row0, blk * 8 + 4 * h, xlo, xhi, xs);
      const __m512i spread = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                              _mm512_set1_epi32(4 * h));
      for (int c = 0; c < NC; ++c) {
        const __m512i v = _mm512_loadu_si512(m.q + (n0 + c) * rb + blk * block_bytes + 8 + 64 * h);
        const __m512i lo = _mm512_shuffle_epi8(grid, _mm512_and_si512(v, nibble));
        const __m512i hi = _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        const __m512 s = _mm512_permutexvar_ps(spread, scales[c]);
        for (int r = 0; r < MR; ++r) {
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[r]), hi, xhi[r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, xs[r]), acc[c][r]);
        }
      }
    }
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < MR; ++r) {  // - 128 x each group's scale x its scaled sum of x
        const __m512 sums =
            _mm512_zextps256_ps512(_mm256_loadu_ps(xr.block_sums.data() + (row0 + r) * xr.padded_groups + 8 * blk));
        acc[c][r] = _mm512_fnmadd_ps(_mm512_mul_ps(scales[c], _mm512_set1_ps(128.f)), sums, acc[c][r]);
      }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// 64 weight bytes of a block unpack into two vectors of 64 values, a and b. Q4_K/Q5_K: four
// 32-column groups, in 128-bit lanes as groups 0, 2, 1, 3 of the 128 columns, a their first 16
// columns and b their last 16, so that a lane of a and the same lane of b hold one group and
// their dot products add before one scale multiplies them (as Int8Rows' lo and hi do); Q6_K: a =
// columns 0-63, b = 64-127, four 16-column groups each. x's rows are permuted to match, once per
// row for every channel, from Int8Rows' lo (each group's first 16) and hi (its last 16).
template <int64_t Type>
inline void raw_x(const Int8Rows& xr, int64_t row, int64_t g0, __m512i& a, __m512i& b, __m512& sa, __m512& sb) {
  const int64_t width = xr.padded_groups * 16;
  const __m512i lo = _mm512_loadu_si512(xr.lo.data() + row * width + g0 * 16);
  const __m512i hi = _mm512_loadu_si512(xr.hi.data() + row * width + g0 * 16);
  const __m512 s = _mm512_loadu_ps(xr.scale16.data() + (row * xr.padded_groups + g0) * 4);  // 4 lanes a group
  if constexpr (Type == kQ6K) {
    a = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
    b = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
    sa = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4), s);
    sb = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12), s);
  } else {  // groups in 128-bit lanes as g0, g0 + 2, g0 + 1, g0 + 3: a their first 16 columns, b the last
    a = _mm512_shuffle_i64x2(lo, lo, 0xD8);
    b = _mm512_shuffle_i64x2(hi, hi, 0xD8);
    sa = _mm512_shuffle_f32x4(s, s, 0xD8);
    sb = sa;
  }
}

// Half h (columns 128h .. 128h + 127) of block b's weights as a and b (raw_x's order), unsigned.
template <int64_t Type>
inline void raw_weights(const uint8_t* blk, int h, __m512i& wa, __m512i& wb) {
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (Type == kQ6K) {
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i shift_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i top_a = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_a), three);
    const __m512i top_b = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_b), three);
    wa = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(top_a, 4));
    wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_slli_epi16(top_b, 4));
  } else {
    const __m512i qs = _mm512_loadu_si512(blk + (Type == kQ5K ? 48 : 16) + 64 * h);
    wa = _mm512_and_si512(qs, low4);
    wb = _mm512_and_si512(_mm512_srli_epi16(qs, 4), low4);
    if constexpr (Type == kQ5K) {  // fifth bit of group i of the block: bit i of qh[l]
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
      const int i = 4 * h;
      const __m512i bit_a = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << i)), _mm256_set1_epi8(char(1 << (i + 2))), 1);
      const __m512i bit_b =
          _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (i + 1))), _mm256_set1_epi8(char(1 << (i + 3))), 1);
      const __m512i sixteen = _mm512_set1_epi8(16);
      wa = _mm512_mask_add_epi8(wa, _mm512_test_epi8_mask(qh, bit_a), wa, sixteen);
      wb = _mm512_mask_add_epi8(wb, _mm512_test_epi8_mask(qh, bit_b), wb, sixteen);
    }
    // low nibbles: groups 0 and 2 (columns 0-15, 16-31 each); high: 1 and 3 -> raw_x's order
    const __m512i lows = wa;
    wa = _mm512_shuffle_i64x2(lows, wb, 0x88);
    wb = _mm512_shuffle_i64x2(lows, wb, 0xDD);
  }
}

// Each lane's weight scale for half h's a and b (raw_block_scales' floats, spread to the lanes
// that hold their group's products).
template <int64_t Type>
inline void raw_lane_scales(__m512 scales, int h, __m512& sa, __m512& sb) {
  if constexpr (Type == kQ6K) {  // 4 lanes (16 columns) a scale
    const __m512i a = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                       _mm512_set1_epi32(8 * h));
    sa = _mm512_permutexvar_ps(a, scales);
    sb = _mm512_permutexvar_ps(_mm512_add_epi32(a, _mm512_set1_epi32(4)), scales);
  } else {  // 4 lanes a group, groups 4h, 4h + 2, 4h + 1, 4h + 3 (raw_weights' order); a and b alike
    const __m512i a = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3),
                                       _mm512_set1_epi32(4 * h));
    sa = _mm512_permutexvar_ps(a, scales);
    sb = sa;
  }
}

// What the unsigned integer sums leave out, per block and row: Q4_K/Q5_K's offsets -(dmin x m)
// times each 32 columns' scaled sum of x; Q6_K's -32 x d x sc times each 16 columns' sum.
template <int64_t Type>
inline __m512 raw_offsets(__m512 scales, const Int8Rows& xr, int64_t row, int64_t blk) {
  if constexpr (Type == kQ6K) {
    const __m512 sums = _mm512_loadu_ps(xr.half_sums.data() + row * xr.padded_groups * 2 + 16 * blk);
    return _mm512_mul_ps(_mm512_mul_ps(scales, _mm512_set1_ps(-32.f)), sums);
  } else {
    const __m512 mins = _mm512_maskz_permutexvar_ps(
        0x00FF, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0), scales);
    const __m512 sums = _mm512_zextps256_ps512(_mm256_loadu_ps(xr.block_sums.data() + row * xr.padded_groups + 8 * blk));
    return _mm512_mul_ps(mins, sums);
  }
}

// Y[r][n0 + c] for NC channels of a raw Q4_K/Q5_K/Q6_K matrix and MR rows: per 128 columns, 64
// weight bytes unpacked once into a and b, then two dpbusd per row; each lane's product scaled
// by its weight's and its x's scale, the offsets added once a block.
template <int NC, int MR, int64_t Type>
void tile_vnni_raw(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t block_bytes = raw_block_bytes(Type), blocks = m.k / kSuperBlock, rb = m.row_bytes();
  __m512 next_scales[4];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m512 scales[NC];
    const uint8_t* channel_block[NC];  // each channel's block blk
    for (int c = 0; c < NC; ++c) {
      channel_block[c] = m.q + (n0 + c) * rb + blk * block_bytes;
      for (int64_t line = 0; line < block_bytes; line += 64) prefetch_ahead(channel_block[c] + line);
    }
    if constexpr (NC == 4 && Type != kQ6K) {
      k4_block_scales4(channel_block, scales);
    } else if constexpr (NC == 1 && Type != kQ6K) {  // one channel: its next four blocks' in one pass
      if (blk % 4 == 0 && blk + 4 <= blocks) {
        const uint8_t* const next[4] = {channel_block[0], channel_block[0] + block_bytes,
                                        channel_block[0] + 2 * block_bytes, channel_block[0] + 3 * block_bytes};
        k4_block_scales4(next, next_scales);
      }
      scales[0] = blk / 4 * 4 + 4 <= blocks ? next_scales[blk % 4] : raw_block_scales<Type>(channel_block[0]);
    } else {
      for (int c = 0; c < NC; ++c) scales[c] = raw_block_scales<Type>(channel_block[c]);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i xa[MR], xb[MR];
      __m512 xsa[MR], xsb[MR];
      for (int r = 0; r < MR; ++r) raw_x<Type>(xr, row0 + r, blk * 8 + 4 * h, xa[r], xb[r], xsa[r], xsb[r]);
      for (int c = 0; c < NC; ++c) {
        __m512i wa, wb;
        raw_weights<Type>(m.q + (n0 + c) * rb + blk * block_bytes, h, wa, wb);
        __m512 sa, sb;
        raw_lane_scales<Type>(scales[c], h, sa, sb);
        for (int r = 0; r < MR; ++r) {
          if constexpr (Type != kQ6K) {  // a and b's lanes hold the same groups: one sum, one scale
            const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, xa[r]), wb, xb[r]);
            acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sa, xsa[r]), acc[c][r]);
            continue;
          }
          const __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, xa[r]);
          const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, xb[r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_mul_ps(sa, xsa[r]), acc[c][r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_mul_ps(sb, xsb[r]), acc[c][r]);
        }
      }
    }
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_add_ps(acc[c][r], raw_offsets<Type>(scales[c], xr, row0 + r, blk));
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

template <int NC, int MR>
void tile_any_vnni_raw(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y,
                              int64_t ldy) {
  if constexpr (NC == 4 && MR > 2) {  // 4 x 4 accumulators and the rows' x spill out of 32 registers
    tile_any_vnni_raw<2, MR>(m, xr, row0, n0, Y, ldy);
    tile_any_vnni_raw<2, MR>(m, xr, row0, n0 + 2, Y, ldy);
    return;
  }
  if (m.raw == kIQ4XS)
    tile_vnni_iq4xs<NC, MR>(m, xr, row0, n0, Y, ldy);
  else if (m.raw == kQ4K)
    tile_vnni_raw<NC, MR, kQ4K>(m, xr, row0, n0, Y, ldy);
  else if (m.raw == kQ5K)
    tile_vnni_raw<NC, MR, kQ5K>(m, xr, row0, n0, Y, ldy);
  else
    tile_vnni_raw<NC, MR, kQ6K>(m, xr, row0, n0, Y, ldy);
}
#endif  // PAGEDLLM_VNNI

}  // namespace pagedllm::avx512

#endif  // PAGEDLLM_AVX512
