// The AVX-512 paths of quant_gemm.cpp: float activations against weights dequantized in
// registers (tile), and, with AVX512-VNNI, bf16 activations quantized to 8 bits against 4-bit
// weights, summed as integers (tile_vnni). Empty unless the compiler targets AVX-512
// (vec_avx512.h's PAGEDLLM_AVX512 / PAGEDLLM_VNNI).
#pragma once

#include "common.h"
#include "quant.h"

#if defined(PAGEDLLM_AVX512)

namespace pagedllm::avx512 {

// K-quant blocks kept as stored: quant_blocks_avx512.h, included at the end of this file.
inline void raw_dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m512& lo, __m512& hi);

// dequant_step_scalar in registers: lo = columns k0..k0+15, hi = k0+16..k0+31 (4-bit only).
inline void dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m512& lo, __m512& hi) {
  if (m.raw) return raw_dequant_step(m, n, k0, lo, hi);
  const int64_t g = n * m.G + m.group_of(k0);
  const __m512 s = _mm512_set1_ps(m.scale_at(g)), z = _mm512_set1_ps(m.zero_at(g));
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 5) {  // the fifth bits added from qh's 32 bits, read as two lane masks
    const uint8_t* p = row + m.byte_of(k0);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
    const __m512i sixteen = _mm512_set1_epi32(16), centre = _mm512_set1_epi32(m.centered ? 16 : 0);
    __m512i low = _mm512_and_si512(v, _mm512_set1_epi32(15)), high = _mm512_srli_epi32(v, 4);
    low = _mm512_sub_epi32(_mm512_mask_add_epi32(low, __mmask16(qh), low, sixteen), centre);
    high = _mm512_sub_epi32(_mm512_mask_add_epi32(high, __mmask16(qh >> 16), high, sixteen), centre);
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), s, z);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), s, z);
  } else if (m.bits == 4 && m.codes) {  // each nibble looked up in the codebook (one byte shuffle)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(m.codes)), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_shuffle_epi8(table, _mm_and_si128(packed, nibble));
    const __m128i high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)), s, z);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)), s, z);
  } else if (m.bits == 4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2)));
    const __m512i low = _mm512_and_si512(v, _mm512_set1_epi32(15));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), s, z);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, z);
  } else {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0)));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, z);
  }
}

// Y[r][n0 + c] = X[r] . W[n0 + c] for NC channels and MR rows: NC x MR accumulators in
// registers, each step's weights dequantized once and used by every row.
template <int NC, int MR>
void tile_raw(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy);

template <int NC, int MR>
void tile(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  if (m.raw) return tile_raw<NC, MR>(m, X, ldx, n0, Y, ldy);
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const bool four = m.step() == 32;  // 4- and 5-bit: 32 columns a step
  for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
    __m512 xlo[MR], xhi[MR];
    for (int r = 0; r < MR; ++r) {
      xlo[r] = _mm512_loadu_ps(X + r * ldx + k0);
      if (four) xhi[r] = _mm512_loadu_ps(X + r * ldx + k0 + 16);
    }
    const int64_t at = m.byte_of(k0);
    for (int c = 0; c < NC; ++c) {
      if ((at & 63) == 0) prefetch_ahead(m.q + (n0 + c) * m.row_bytes() + at);
      __m512 lo, hi = _mm512_setzero_ps();
      dequant_step(m, n0 + c, k0, lo, hi);
      for (int r = 0; r < MR; ++r) {
        acc[c][r] = _mm512_fmadd_ps(lo, xlo[r], acc[c][r]);
        if (four) acc[c][r] = _mm512_fmadd_ps(hi, xhi[r], acc[c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = _mm512_reduce_add_ps(acc[c][r]);
}

// `flatten`: dequant_step, scale_at and byte_of inlined into the tiles (GCC left them as calls:
// one float32 row of Q4_1 or Q8_0 ran at 6 GB/s in L2, 13-16 with them inlined, issue 52).
template <int NC>
__attribute__((flatten)) void tile_rows(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, float* Y) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile<NC, 4>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n);
  switch (rows - r) {
    case 3: tile<NC, 3>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    case 2: tile<NC, 2>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    case 1: tile<NC, 1>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    default: break;
  }
}

// Channels [n0, n1) of Y = X W^T, X float32 [rows, K]: four channels a tile, then one.
inline void channels(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, int64_t n1, float* Y) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_rows<4>(m, X, rows, n, Y);
  for (; n < n1; ++n) tile_rows<1>(m, X, rows, n, Y);
}

#if defined(PAGEDLLM_VNNI)
// Rows of x in 8 bits, one scale per 32 columns, in 4-bit weights' nibble order: for group g,
// lo[16g + j] = q[32g + j] and hi[16g + j] = q[32g + 16 + j]. Byte arrays are padded to whole
// 64-byte steps (4 groups) with zeros.
struct Int8Rows {
  int64_t rows = 0, groups = 0, padded_groups = 0;
  std::vector<int8_t> lo, hi;     // [rows, padded_groups * 16]
  std::vector<float> scale16;     // [rows, padded_groups * 4]: each group's scale, once per dpbusd lane
  std::vector<float> block_sums;  // [rows, padded_groups]: scale x sum of the group's q (for offsets)
  std::vector<float> half_sums;   // [rows, 2 x padded_groups]: the same per 16 columns (weights in groups of 16)
};

inline void quantize_rows(const float* X, int64_t rows, int64_t K, Int8Rows& r) {
  r.rows = rows;
  r.groups = K / 32;
  r.padded_groups = (r.groups + 3) / 4 * 4;
  const int64_t width = r.padded_groups * 16;
  r.lo.assign(rows * width, 0);
  r.hi.assign(rows * width, 0);
  r.scale16.assign(rows * r.padded_groups * 4, 0.f);
  r.block_sums.assign(rows * r.padded_groups, 0.f);
  r.half_sums.assign(rows * r.padded_groups * 2, 0.f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < r.groups; ++g) {
      const float* x = X + i * K + g * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sums[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        const int q = int(std::nearbyint(x[j] * inv));
        sums[j >> 4] += q;
        (j < 16 ? r.lo : r.hi)[i * width + g * 16 + (j & 15)] = int8_t(q);
      }
      for (int l = 0; l < 4; ++l) r.scale16[(i * r.padded_groups + g) * 4 + l] = scale;
      r.block_sums[i * r.padded_groups + g] = scale * float(sums[0] + sums[1]);
      for (int h = 0; h < 2; ++h) r.half_sums[(i * r.padded_groups + g) * 2 + h] = scale * float(sums[h]);
    }
}

// The 16 x `groups` (1-4) packed bytes of a 4-bit row at p, zero-extended to 64, and their
// `groups` scales in lanes 0-3. Plain loads of the exact size wherever possible: masked loads
// streaming weights from memory ran this kernel ~3x slower on an AMD EPYC (AVX-512, Zen 4).
inline __m512i load_groups(const uint8_t* p, int64_t groups) {
  switch (groups) {
    case 4: return _mm512_loadu_si512(p);
    case 2: return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    case 1: return _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    default: return _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * groups)) - 1, p);
  }
}
inline __m512 load_scales(const float* p, int64_t groups) {
  switch (groups) {
    case 4: return _mm512_castps128_ps512(_mm_loadu_ps(p));
    case 2: return _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))));
    case 1: return _mm512_castps128_ps512(_mm_load_ss(p));
    default: return _mm512_maskz_loadu_ps(__mmask16((1u << groups) - 1), p);
  }
}

// Row n's `groups` (1-4) scales from group g0, in lanes 0-3, float32 or float16 (QuantMatrix).
inline __m512 e8m0_scales(__m128i bytes) {  // 2^(e - 128) of each byte e, subnormals included
  const __m512i e = _mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(128));
  return _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_cvtepi32_ps(e));
}

inline __m512 load_scales(const QuantMatrix& m, int64_t n, int64_t g0, int64_t groups) {
  const int64_t at = n * m.G + g0;
  if (m.scale_e) {
    uint32_t bytes = 0;
    std::memcpy(&bytes, m.scale_e + at, size_t(groups));
    return e8m0_scales(_mm_cvtsi32_si128(int(bytes)));
  }
  if (m.scale_h == nullptr) return load_scales(m.scale + at, groups);
  const uint16_t* p = m.scale_h + at;
  __m128i h;
  switch (groups) {
    case 4: h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); break;
    case 1: h = _mm_cvtsi32_si128(p[0]); break;
    default: h = _mm_maskz_loadu_epi16(__mmask8((1u << groups) - 1), p); break;
  }
  return _mm512_castps256_ps512(_mm256_cvtph_ps(h));
}

// Sum over a row's groups of per-group weights (its scales or offsets) x the groups' scaled sums
// of x; the weights float32 (w), float16 (h) or scale bytes e (e).
inline float group_sums(const float* w, const uint16_t* h, const uint8_t* e, const float* sums, int64_t G) {
  __m512 z = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
    const __m512 v = h   ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + g))
                     : e ? e8m0_scales(_mm_maskz_loadu_epi8(k, e + g))
                         : _mm512_maskz_loadu_ps(k, w + g);
    z = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(k, sums + g), z);  // masked-off sums are 0
  }
  return _mm512_reduce_add_ps(z);
}
inline float scale_sums(const QuantMatrix& m, int64_t n, const float* sums) {
  const int64_t at = n * m.G;
  return group_sums(m.scale ? m.scale + at : nullptr, m.scale_h ? m.scale_h + at : nullptr,
                    m.scale_e ? m.scale_e + at : nullptr, sums, m.G);
}
inline float zero_sums(const QuantMatrix& m, int64_t n, const float* sums) {
  if (!m.has_zero()) return 0.f;
  return group_sums(m.zero ? m.zero + n * m.G : nullptr, m.zero_h ? m.zero_h + n * m.G : nullptr, nullptr, sums, m.G);
}

// Rows row0 .. row0 + MR of x in 8 bits for groups g0 .. g0 + 3: each group's first 16 values
// (lo), its last 16 (hi), and its scale once per dpbusd lane.
template <int MR>
inline void load_x_groups(const Int8Rows& xr, int64_t row0, int64_t g0, __m512i* lo, __m512i* hi, __m512* scales) {
  const int64_t width = xr.padded_groups * 16;
  for (int r = 0; r < MR; ++r) {
    lo[r] = _mm512_loadu_si512(xr.lo.data() + (row0 + r) * width + g0 * 16);
    hi[r] = _mm512_loadu_si512(xr.hi.data() + (row0 + r) * width + g0 * 16);
    scales[r] = _mm512_loadu_ps(xr.scale16.data() + ((row0 + r) * xr.padded_groups + g0) * 4);
  }
}

// A 5-bit row's `groups` (1-4) groups from p: each group's 32 q (0..31) as its first 16 (lo)
// and last 16 (hi), group l in 128-bit lane l, as Int8Rows keeps x.
inline void load_groups5(const uint8_t* p, int64_t groups, __m512i& lo, __m512i& hi) {
  uint64_t low_bits = 0, high_bits = 0;
  for (int64_t l = 0; l < groups; ++l) {
    uint32_t qh;
    std::memcpy(&qh, p + l * kFiveBitGroupBytes, 4);
    low_bits |= uint64_t(qh & 0xFFFF) << (16 * l);
    high_bits |= uint64_t(qh >> 16) << (16 * l);
  }
  __m512i v;
  if (groups == 4) {  // plain loads (see load_groups): qs at bytes 4, 24, 44, 64
    const auto at = [p](int l) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 + 20 * l)); };
    v = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(at(0)), at(1), 1), at(2), 2),
                           at(3), 3);
  } else {  // the row's last groups: through a zeroed copy
    alignas(64) uint8_t qs[64] = {};
    for (int64_t l = 0; l < groups; ++l) std::memcpy(qs + 16 * l, p + l * kFiveBitGroupBytes + 4, 16);
    v = _mm512_load_si512(qs);
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
  lo = _mm512_and_si512(v, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  lo = _mm512_mask_add_epi8(lo, __mmask64(low_bits), lo, sixteen);
  hi = _mm512_mask_add_epi8(hi, __mmask64(high_bits), hi, sixteen);
}

// Y[r][n0 + c] for NC channels of 4-bit weights and MR rows: per 4 groups, 64 bytes of weights
// unpacked once into low and high nibbles, then two dpbusd per row. Codes (Coded) are looked up
// in the codebook plus 128 (unsigned, as dpbusd takes its first operand), which the end takes
// back out with 128 x each group's sum of x, as tile_vnni8 does. Five: 5-bit weights
// (load_groups5), summed unsigned; Q5_0's centre (16) taken back out the same way.
template <int NC, int MR, bool Coded, bool Five = false>
void tile_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512i table = _mm512_setzero_si512();
  if constexpr (Coded)
    table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(m.codes))),
                             _mm512_set1_epi8(char(0x80)));
  const int64_t G = m.groups();
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t n_groups = std::min<int64_t>(4, G - g0);
    __m512i xlo[MR], xhi[MR];
    __m512 xs[MR];
    load_x_groups<MR>(xr, row0, g0, xlo, xhi, xs);
    for (int c = 0; c < NC; ++c) {
      const int64_t n = n0 + c;
      __m512i lo, hi;
      if constexpr (Five) {
        const uint8_t* p = m.q + n * m.row_bytes() + g0 * kFiveBitGroupBytes;
        prefetch_ahead(p);
        prefetch_ahead(p + 64);
        load_groups5(p, n_groups, lo, hi);
      } else {
        const uint8_t* p = m.q + n * m.row_bytes() + g0 * 16;
        prefetch_ahead(p);
        const __m512i v = load_groups(p, n_groups);
        lo = _mm512_and_si512(v, nibble);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      if constexpr (Coded) {
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
      }
      const __m512 s = _mm512_permutexvar_ps(spread, load_scales(m, n, g0, n_groups));
      for (int r = 0; r < MR; ++r) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[r]);
        dot = _mm512_dpbusd_epi32(dot, hi, xhi[r]);
        acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, xs[r]), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t n = n0 + c;
    for (int r = 0; r < MR; ++r) {
      const float* sums = xr.block_sums.data() + (row0 + r) * xr.padded_groups;
      float y = _mm512_reduce_add_ps(acc[c][r]);
      if constexpr (Coded) y -= 128.f * scale_sums(m, n, sums);
      if (Five && m.centered) y -= 16.f * scale_sums(m, n, sums);
      y += zero_sums(m, n, sums);  // sum over groups of offset x the group's sum of x
      Y[r * ldy + n] = y;
    }
  }
}

// The 32 x `groups` (1-4) bytes of an 8-bit row at p as two vectors: each group's first 16
// bytes (lo) and its last 16 (hi), group l in 128-bit lane l, as Int8Rows keeps x; flipped to
// unsigned (+128) for dpbusd, which the caller takes back out with 128 x the group's sum of x.
inline void load_groups8(const uint8_t* p, int64_t groups, __m512i& lo, __m512i& hi) {
  const __m512i a = groups >= 2 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64(1) << 32) - 1, p);
  const __m512i b = groups == 4   ? _mm512_loadu_si512(p + 64)
                    : groups == 3 ? _mm512_maskz_loadu_epi8((__mmask64(1) << 32) - 1, p + 64)
                                  : _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), flip);
  hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)), flip);
}

// The 2 x `groups` (1-4) scales of 8-bit weights in groups of 16 at p, in lanes 0-7.
inline __m512 load_half_scales(const float* p, int64_t groups) {
  if (groups == 4) return _mm512_castps256_ps512(_mm256_loadu_ps(p));
  return _mm512_maskz_loadu_ps(__mmask16((1u << (2 * groups)) - 1), p);
}

// As tile_vnni for 8-bit weights in groups of 32 (Q8_0 as stored): per 4 groups, 128 bytes of
// weights, two dpbusd per row, as llama.cpp's Q8_0 x Q8 dot product sums them. Halves: the
// weights' groups are 16 columns (the layout Q6_K was widened to until December 6; no loader
// makes it now, the kernel tests still do), so each 32 columns' first and last 16 (lo, hi) take
// their own scale; x keeps one scale per 32.
template <int NC, int MR, bool Halves>
void tile_vnni8(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_lo = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i spread_hi = _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1);
  const int64_t G = m.groups(), G32 = m.k / 32;
  for (int64_t g0 = 0; g0 < G32; g0 += 4) {
    const int64_t n_groups = std::min<int64_t>(4, G32 - g0);
    __m512i xlo[MR], xhi[MR];
    __m512 xs[MR];
    load_x_groups<MR>(xr, row0, g0, xlo, xhi, xs);
    for (int c = 0; c < NC; ++c) {
      const int64_t n = n0 + c;
      __m512i lo, hi;
      const uint8_t* p = m.q + n * m.row_bytes() + g0 * 32;
      prefetch_ahead(p);
      prefetch_ahead(p + 64);
      load_groups8(p, n_groups, lo, hi);
      if constexpr (Halves) {
        const __m512 s = load_half_scales(m.scale + n * G + 2 * g0, n_groups);
        const __m512 s_lo = _mm512_permutexvar_ps(spread_lo, s), s_hi = _mm512_permutexvar_ps(spread_hi, s);
        for (int r = 0; r < MR; ++r) {
          const __m512i dot_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[r]);
          const __m512i dot_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, xhi[r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lo), _mm512_mul_ps(s_lo, xs[r]), acc[c][r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi), _mm512_mul_ps(s_hi, xs[r]), acc[c][r]);
        }
      } else {
        const __m512 s = _mm512_permutexvar_ps(spread, load_scales(m, n, g0, n_groups));
        for (int r = 0; r < MR; ++r) {
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[r]);
          dot = _mm512_dpbusd_epi32(dot, hi, xhi[r]);
          acc[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, xs[r]), acc[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t n = n0 + c;
    for (int r = 0; r < MR; ++r) {
      const float* sums = Halves ? xr.half_sums.data() + (row0 + r) * xr.padded_groups * 2
                                 : xr.block_sums.data() + (row0 + r) * xr.padded_groups;
      float y = _mm512_reduce_add_ps(acc[c][r]) - 128.f * scale_sums(m, n, sums) + zero_sums(m, n, sums);
      Y[r * ldy + n] = y;
    }
  }
}

template <int NC, int MR>
void tile_any_vnni_raw(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy);

template <int NC, int MR>
inline void tile_any_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  if (m.raw)
    tile_any_vnni_raw<NC, MR>(m, xr, row0, n0, Y, ldy);
  else if (m.bits == 8 && m.group == 16)
    tile_vnni8<NC, MR, true>(m, xr, row0, n0, Y, ldy);
  else if (m.bits == 8)
    tile_vnni8<NC, MR, false>(m, xr, row0, n0, Y, ldy);
  else if (m.bits == 5)
    tile_vnni<NC, MR, false, true>(m, xr, row0, n0, Y, ldy);
  else if (m.codes)
    tile_vnni<NC, MR, true>(m, xr, row0, n0, Y, ldy);
  else
    tile_vnni<NC, MR, false>(m, xr, row0, n0, Y, ldy);
}

template <int NC>
void tile_rows_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t n0, float* Y) {
  int64_t r = 0;
  for (; r + 4 <= xr.rows; r += 4) tile_any_vnni<NC, 4>(m, xr, r, n0, Y + r * m.n, m.n);
  switch (xr.rows - r) {
    case 3: tile_any_vnni<NC, 3>(m, xr, r, n0, Y + r * m.n, m.n); break;
    case 2: tile_any_vnni<NC, 2>(m, xr, r, n0, Y + r * m.n, m.n); break;
    case 1: tile_any_vnni<NC, 1>(m, xr, r, n0, Y + r * m.n, m.n); break;
    default: break;
  }
}

// One row of x (a decode step of one sequence) reads each channel's weights to their end before
// the next channel's: one address stream per thread. Four channels read in turn (four streams
// 1-2 KiB apart) drew 72-78% of a plain sum's read bandwidth from memory on a Zen 5 (32 MiB L3),
// one channel at a time 85-100% (docs/benchmarks.md, issue 65). `flatten` inlines the helpers
// into the one-channel tile, which GCC otherwise left as calls (half the speed in L2).
__attribute__((flatten)) inline void channels_one_row_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t n0,
                                                           int64_t n1, float* Y) {
  for (int64_t n = n0; n < n1; ++n) tile_any_vnni<1, 1>(m, xr, 0, n, Y, m.n);
}

// by_channel: one row reads one channel at a time (channels_one_row_vnni); else four, as more rows.
inline void channels_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t n0, int64_t n1, float* Y,
                          bool by_channel = true) {
  if (xr.rows == 1 && by_channel) return channels_one_row_vnni(m, xr, n0, n1, Y);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_rows_vnni<4>(m, xr, n, Y);
  for (; n < n1; ++n) tile_rows_vnni<1>(m, xr, n, Y);
}
#endif  // PAGEDLLM_VNNI

}  // namespace pagedllm::avx512

#endif  // PAGEDLLM_AVX512

#include "quant_blocks_avx512.h"
