// AVX-512 building blocks the kernels share: 16-lane bf16 loads and stores, a 16-way horizontal
// sum, a 16 x 16 transpose, and the decode-tile score products of paged attention.
//
// Everything here is behind the compiler's own macros (CPU_CAPABILITY_AVX512 is what build.py
// passes for ATen's 16-float vectors; __AVX512BF16__ and __AVX512VNNI__ come from -march). On
// any other target the header declares nothing and leaves PAGEDLLM_AVX512* undefined, so each
// caller compiles its generic path instead; test_kernel_targets.py builds that path too.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#define PAGEDLLM_AVX512 1
#if defined(__AVX512BF16__)
#define PAGEDLLM_AVX512_BF16 1
#endif
#if defined(__AVX512VNNI__)
#define PAGEDLLM_VNNI 1
#endif

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pagedllm::avx512 {

// The low n (<= 16) lanes of a mask: the tail of a row shorter than a vector.
inline __mmask16 lanes(int64_t n) { return (__mmask16)((1u << n) - 1); }

#if defined(PAGEDLLM_AVX512_BF16)
// n <= 16 bf16 values widened to float (exact: bf16 is float's top half), and back rounded to
// nearest even by the CPU's conversion.
inline __m512 load_bf16(const c10::BFloat16* p, int64_t n) {
  const __m256i raw = n == 16 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store_bf16(c10::BFloat16* p, __m512 v, int64_t n) {
  const __m256i raw = (__m256i)_mm512_cvtneps_pbh(v);
  if (n == 16)
    _mm256_storeu_si256((__m256i*)p, raw);
  else
    _mm256_mask_storeu_epi16(p, lanes(n), raw);
}
#endif

// Sums each of 16 vectors across its lanes: lane c of the result is the sum of a[c].
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int m = 0; m < 8; ++m)
    b[m] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * m], a[2 * m + 1]), _mm512_unpackhi_ps(a[2 * m], a[2 * m + 1]));
  for (int q = 0; q < 4; ++q) {
    const __m512d x = _mm512_castps_pd(b[2 * q]), y = _mm512_castps_pd(b[2 * q + 1]);
    c[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// A 16 x 16 matrix of 32-bit elements in registers, transposed.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Scores of `rows` queries (float, NV vectors each) against n <= 16 keys given as rows of
// floats: 16 dot products per query run side by side, then one 16-way reduction. For decode
// tiles, where transposing the keys would cost more than the products.
template <int NV>
inline void scores_16(const float* Q, int64_t rows, const float* const* keys, int64_t n, float* out, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(Q + i * NV * 16 + v * 16);
    __m512 acc[16];
    for (int c = 0; c < 16; ++c) {
      acc[c] = _mm512_setzero_ps();
      if (c < n)
        for (int v = 0; v < NV; ++v) acc[c] = _mm512_fmadd_ps(q[v], _mm512_loadu_ps(keys[c] + v * 16), acc[c]);
    }
    _mm512_mask_storeu_ps(out + i * stride, lanes(n), reduce16(acc));
  }
}

#if defined(PAGEDLLM_AVX512_BF16)
// scores_16 for bf16 queries and keys read in place: pairs of bf16 products summed in float32
// by the CPU's dot-product instruction, no widening. NP: D / 32.
template <int NP>
inline void scores_16_bf16(const c10::BFloat16* const* queries, int64_t rows, const c10::BFloat16* const* keys,
                           int64_t n, float* out, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    __m512bh q[NP];
    for (int v = 0; v < NP; ++v) q[v] = (__m512bh)_mm512_loadu_si512(queries[i] + v * 32);
    __m512 acc[16];
    for (int c = 0; c < 16; ++c) {
      acc[c] = _mm512_setzero_ps();
      if (c < n)
        for (int v = 0; v < NP; ++v) acc[c] = _mm512_dpbf16_ps(acc[c], q[v], (__m512bh)_mm512_loadu_si512(keys[c] + v * 32));
    }
    _mm512_mask_storeu_ps(out + i * stride, lanes(n), reduce16(acc));
  }
}
#endif

}  // namespace pagedllm::avx512

#endif  // CPU_CAPABILITY_AVX512
