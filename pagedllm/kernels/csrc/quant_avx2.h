// The AVX2 path of quant_gemm.cpp's float kernel, for CPUs without AVX-512 (AMD Zen 2/3, most
// laptops): float activations against weights dequantized in 8-lane registers, in tiles sized
// for AVX2's 16 registers (``channels``). Without it such a CPU took the scalar loop: its float sums do not
// vectorise (their order is fixed), ~30x slower, so a 512-token prefill of the default model
// took minutes. Empty unless the compiler targets AVX2 with FMA and not AVX-512.
#pragma once

#include "common.h"
#include "quant.h"

#if !defined(PAGEDLLM_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_AVX2 1

#include <immintrin.h>

namespace pagedllm::avx2 {

// Group j's 32 small integers u of a Q4_K, Q5_K or Q6_K block b (raw_group_bits in registers:
// the types of a Q4_K_M file; the scalar loop made its one-row products run at 3 GB/s).
inline __m256i raw_group_bits_avx2(int64_t type, const uint8_t* b, int64_t j) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  // bytes shifted right in 16-bit lanes: the masks drop what crossed from the next byte
  const auto shifted = [&](const uint8_t* p, int64_t bits) {
    return _mm256_srl_epi16(load(p), _mm_cvtsi32_si128(int(bits)));
  };
  if (type == kQ6K) {
    const int64_t h = j / 4, t = j % 4;
    const __m256i low = _mm256_and_si256(shifted(b + 64 * h + 32 * (t & 1), 4 * (t >> 1)), low4);
    const __m256i top = _mm256_and_si256(shifted(b + 128 + 32 * h, 2 * t), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(top, 4));  // top <= 3: stays within its byte
  }
  const __m256i u = _mm256_and_si256(shifted(b + (type == kQ5K ? 48 : 16) + 32 * (j / 2), 4 * (j & 1)), low4);
  if (type != kQ5K) return u;
  const __m256i bit = _mm256_set1_epi8(char(1 << j));  // the fifth bit: bit j of qh[l]
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load(b + 16), bit), bit);
  return _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// A K-quant block's 32 columns k0.. of row n: Q4_K-Q6_K's bits in registers, the rest scalar.
// (always_inline: as a call, Q6_K's one-row products ran 10% slower)
__attribute__((always_inline)) inline void raw_dequant_step(const QuantMatrix& m, int64_t n, int64_t k0,
                                                            __m256 w[4]) {
  alignas(32) uint8_t u[32];
  float s[2], z[2];
  const int64_t j = (k0 % kSuperBlock) / 32;
  const uint8_t* b = m.q + n * m.row_bytes() + k0 / kSuperBlock * raw_block_bytes(m.raw);
  raw_group_affine(m.raw, b, j, s, z);
  __m256i q;
  if (m.raw == kQ4K || m.raw == kQ5K || m.raw == kQ6K) {
    q = raw_group_bits_avx2(m.raw, b, j);
  } else {
    raw_group_bits(m.raw, b, j, u);
    q = _mm256_load_si256(reinterpret_cast<const __m256i*>(u));
  }
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i bytes[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int v = 0; v < 4; ++v)
    w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes[v])), _mm256_set1_ps(s[v / 2]),
                           _mm256_set1_ps(z[v / 2]));
}

// dequant_step_scalar in registers: w[v] = columns k0 + 8v .. k0 + 8v + 7 (v < 4 for 4 bits,
// v < 2 for 8 bits).
inline void dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m256 w[4]) {
  if (m.raw) return raw_dequant_step(m, n, k0, w);
  const int64_t g = n * m.G + m.group_of(k0);
  const __m256 s = _mm256_set1_ps(m.scale_at(g)), z = _mm256_set1_ps(m.zero_at(g));
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 5) {  // nibbles as 4-bit's, each fifth bit (qh's bit j) spread to its byte
    const uint8_t* p = row + m.byte_of(k0);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)), nibble = _mm_set1_epi8(15);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const auto fifth = [&](uint32_t bits16) {  // 16 bytes of 16 where the bit is set, else 0
      const __m128i b = _mm_and_si128(_mm_shuffle_epi8(_mm_set1_epi16(short(bits16)), spread), bit);
      return _mm_and_si128(_mm_cmpeq_epi8(b, bit), _mm_set1_epi8(16));
    };
    const __m128i centre = _mm_set1_epi8(m.centered ? 16 : 0);
    const __m128i low = _mm_sub_epi8(_mm_add_epi8(_mm_and_si128(packed, nibble), fifth(qh & 0xFFFF)), centre);
    const __m128i high =
        _mm_sub_epi8(_mm_add_epi8(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), fifth(qh >> 16)), centre);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8))), s, z);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high)), s, z);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8))), s, z);
    return;
  }
  if (m.bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    if (m.codes) {  // each nibble looked up in the codebook: signed bytes from here
      const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(m.codes));
      low = _mm_shuffle_epi8(table, low);
      high = _mm_shuffle_epi8(table, high);
      w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low)), s, z);
      w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8))), s, z);
      w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high)), s, z);
      w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8))), s, z);
      return;
    }
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), s, z);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), s, z);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), s, z);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s, z);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))), s, z);
  }
}

inline float sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// Vector v (columns k0 + 8v ..) of a step whose bytes are loaded: 4 bits, `low`/`high` the
// low and high nibbles (columns 0-15, 16-31), or their codes' signed values (Coded); 8 bits,
// `low` the 16 bytes.
template <int V, bool Coded>
inline __m256 weights(int v, __m128i low, __m128i high, __m256 s, __m256 z) {
  __m256i i;
  if (V == 4 && Coded)
    i = _mm256_cvtepi8_epi32(v == 0 ? low : v == 1 ? _mm_srli_si128(low, 8) : v == 2 ? high : _mm_srli_si128(high, 8));
  else if (V == 4)
    i = _mm256_cvtepu8_epi32(v == 0 ? low : v == 1 ? _mm_srli_si128(low, 8) : v == 2 ? high : _mm_srli_si128(high, 8));
  else
    i = _mm256_cvtepi8_epi32(v == 0 ? low : _mm_srli_si128(low, 8));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), s, z);
}

// Y[r][n0 + c] = X[r] . W[n0 + c] for NC channels and MR rows, each weight dequantized once for
// every row (x read from L1). One row: a step's vectors dequantized together, NC channels' sums
// in flight. Several rows: one channel, each vector used by every row then dropped; up to 5
// rows, two accumulators per row (even and odd vectors) so that enough FMA chains hide the FMA
// latency, 6-8 rows one each (two would not fit the registers). Holding a step's 4 vectors and 2
// channels of 5 rows made GCC keep accumulators on the stack (measured on a Zen 2 EPYC, one
// thread, a 3072 x 576 4-bit layer: 4 rows 0.43 -> 0.29 ms, 5 rows 0.49 -> 0.36, 8 rows 1.07 ->
// 0.53).
template <int NC, int MR, int V, bool Coded>
void tile_of(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  constexpr int S = MR > 1 && MR <= 5 ? 2 : 1;
  __m256 acc[S][NC][MR];
  for (int a = 0; a < S; ++a)
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < MR; ++r) acc[a][c][r] = _mm256_setzero_ps();
  const int64_t bytes = m.row_bytes();
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t k0 = 0; k0 < m.k; k0 += 8 * V) {  // m.step()
    const int64_t group = m.group_of(k0), at = m.byte_of(k0);
    for (int c = 0; c < NC; ++c) {
      if ((at & 63) == 0) prefetch_ahead(m.q + (n0 + c) * bytes + at);
      if constexpr (MR == 1) {
        __m256 w[4];
        dequant_step(m, n0 + c, k0, w);
        for (int v = 0; v < V; ++v) acc[0][c][0] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(X + k0 + 8 * v), acc[0][c][0]);
        continue;
      }
      const int64_t n = n0 + c, g = n * m.G + group;
      const __m256 s = _mm256_set1_ps(m.scale_at(g)), z = _mm256_set1_ps(m.zero_at(g));
      const uint8_t* row = m.q + n * bytes;
      __m128i low, high;
      if (V == 4) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
        low = _mm_and_si128(packed, nibble);
        high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        if constexpr (Coded) {
          const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(m.codes));
          low = _mm_shuffle_epi8(table, low);
          high = _mm_shuffle_epi8(table, high);
        }
      } else {
        low = high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0));
      }
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        const __m256 w = weights<V, Coded>(v, low, high, s, z);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[v % S][c][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(X + r * ldx + k0 + 8 * v), acc[v % S][c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r)
      Y[r * ldy + n0 + c] = sum(S > 1 ? _mm256_add_ps(acc[0][c][r], acc[S - 1][c][r]) : acc[0][c][r]);
}

// tile_of for K-quant blocks kept as stored and 5-bit weights: each 32 columns decoded once
// (dequant_step) for every row.
template <int NC, int MR>
void tile_raw(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  __m256 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < m.k; k0 += 32) {
    for (int c = 0; c < NC; ++c) {
      if (!m.raw || k0 % kSuperBlock == 0) prefetch_ahead(m.q + (n0 + c) * m.row_bytes() + m.byte_of(k0));
      __m256 w[4];
      dequant_step(m, n0 + c, k0, w);
      for (int v = 0; v < 4; ++v)
        for (int r = 0; r < MR; ++r)
          acc[c][r] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(X + r * ldx + k0 + 8 * v), acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = sum(acc[c][r]);
}

template <int NC, int MR>
void tile(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  if (m.raw || m.bits == 5)
    tile_raw<NC, MR>(m, X, ldx, n0, Y, ldy);
  else if (m.bits == 4 && m.codes)
    tile_of<NC, MR, 4, true>(m, X, ldx, n0, Y, ldy);
  else if (m.bits == 4)
    tile_of<NC, MR, 4, false>(m, X, ldx, n0, Y, ldy);
  else
    tile_of<NC, MR, 2, false>(m, X, ldx, n0, Y, ldy);
}

// One channel of several rows: blocks of 8, the rest in one tile; nine left go as 5 + 4 (a lone
// last row would dequantize every weight for itself).
inline void rows_of_channel(const QuantMatrix& m, const float* X, int64_t rows, int64_t n, float* Y) {
  int64_t r = 0;
  for (; rows - r >= 8 && rows - r != 9; r += 8) tile<1, 8>(m, X + r * m.k, m.k, n, Y + r * m.n, m.n);
  const float* x = X + r * m.k;
  float* y = Y + r * m.n;
  switch (rows - r) {
    case 9:
      tile<1, 5>(m, x, m.k, n, y, m.n);
      tile<1, 4>(m, x + 5 * m.k, m.k, n, y + 5 * m.n, m.n);
      break;
    case 7: tile<1, 7>(m, x, m.k, n, y, m.n); break;
    case 6: tile<1, 6>(m, x, m.k, n, y, m.n); break;
    case 5: tile<1, 5>(m, x, m.k, n, y, m.n); break;
    case 4: tile<1, 4>(m, x, m.k, n, y, m.n); break;
    case 3: tile<1, 3>(m, x, m.k, n, y, m.n); break;
    case 2: tile<1, 2>(m, x, m.k, n, y, m.n); break;
    case 1: tile<1, 1>(m, x, m.k, n, y, m.n); break;
    default: break;
  }
}

// Channels [n0, n1) of Y = X W^T, X float32 [rows, K]. AVX2 has 16 vector registers: a tile's
// accumulators and its weight vectors must fit. One row: four channels at a time; more (a
// decode step with speculative guesses, a few sequences decoding): one channel at a time, its
// rows in blocks (measured faster than two channels or two rows at a time, from 2 to 12 rows).
// `flatten`: the tiles' helpers inlined (GCC left dequant_step and scale_at as calls: half the
// speed of one float32 row of Q4_1 or Q8_0, issue 52).
__attribute__((flatten)) inline void channels(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0,
                                              int64_t n1, float* Y) {
  if (rows != 1) {  // (none: nothing to write)
    for (int64_t n = n0; n < n1; ++n) rows_of_channel(m, X, rows, n, Y);
    return;
  }
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile<4, 1>(m, X, m.k, n, Y, m.n);
  for (; n < n1; ++n) tile<1, 1>(m, X, m.k, n, Y, m.n);
}

}  // namespace pagedllm::avx2

#endif  // AVX2 and FMA, not AVX-512
