// The AVX2 path of quant_gemm.cpp's float kernel, for CPUs without AVX-512 (AMD Zen 2/3, most
// laptops): float activations against weights dequantized in 8-lane registers, the same tiles
// as quant_avx512.h. Without it such a CPU took the scalar loop: its float sums do not
// vectorise (their order is fixed), ~30x slower, so a 512-token prefill of the default model
// took minutes. Empty unless the compiler targets AVX2 with FMA and not AVX-512.
#pragma once

#include "common.h"
#include "quant.h"

#if !defined(PAGEDLLM_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_AVX2 1

#include <immintrin.h>

namespace pagedllm::avx2 {

// dequant_step_scalar in registers: w[v] = columns k0 + 8v .. k0 + 8v + 7 (v < 4 for 4 bits,
// v < 2 for 8 bits).
inline void dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m256 w[4]) {
  const int64_t g = n * m.G + m.group_of(k0);
  const __m256 s = _mm256_set1_ps(m.scale[g]), z = _mm256_set1_ps(m.zero ? m.zero[g] : 0.f);
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
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

// Y[r][n0 + c] = X[r] . W[n0 + c] for NC channels and MR rows: NC x MR accumulators, each
// step's weights (V vectors: 4 for 4 bits, 2 for 8) dequantized once per channel and used by
// every row (x read from L1).
template <int NC, int MR, int V>
void tile_of(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  __m256 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
    for (int c = 0; c < NC; ++c) {
      __m256 w[4];
      dequant_step(m, n0 + c, k0, w);
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v)
          acc[c][r] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(X + r * ldx + k0 + 8 * v), acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) Y[r * ldy + n0 + c] = sum(acc[c][r]);
}

template <int NC, int MR>
void tile(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  if (m.bits == 4)
    tile_of<NC, MR, 4>(m, X, ldx, n0, Y, ldy);
  else
    tile_of<NC, MR, 2>(m, X, ldx, n0, Y, ldy);
}

// Rows in blocks of MR (then one block of the rest), NC channels at a time.
template <int NC, int MR>
void tile_rows(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, float* Y) {
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) tile<NC, MR>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n);
  const float* x = X + r * m.k;
  float* y = Y + r * m.n;
  switch (rows - r) {
    case 4: tile<NC, 4>(m, x, m.k, n0, y, m.n); break;
    case 3: tile<NC, 3>(m, x, m.k, n0, y, m.n); break;
    case 2: tile<NC, 2>(m, x, m.k, n0, y, m.n); break;
    case 1: tile<NC, 1>(m, x, m.k, n0, y, m.n); break;
    default: break;
  }
}

template <int NC, int MR>
void channel_tiles(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, int64_t n1, float* Y) {
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) tile_rows<NC, MR>(m, X, rows, n, Y);
  for (; n < n1; ++n) tile_rows<1, MR>(m, X, rows, n, Y);
}

// Channels [n0, n1) of Y = X W^T, X float32 [rows, K]. AVX2 has 16 vector registers: NC x MR
// accumulators and a step's 4 weight vectors must fit. 3 to 5 rows (a decode step with
// speculative guesses) go through the weights once, two channels at a time; other counts four
// channels and two rows at a time (measured faster from 6 rows on a Zen 2 EPYC).
inline void channels(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, int64_t n1, float* Y) {
  if (rows >= 3 && rows <= 5)
    channel_tiles<2, 5>(m, X, rows, n0, n1, Y);
  else
    channel_tiles<4, 2>(m, X, rows, n0, n1, Y);
}

}  // namespace pagedllm::avx2

#endif  // AVX2 and FMA, not AVX-512
