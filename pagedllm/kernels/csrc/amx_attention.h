// Prefill attention tiles on AMX (attention.cpp's bf16 path, where the CPU has AMX and the
// oneDNN ISA cap allows it): the two products of a tile, Q @ K^T and P @ V, as tile
// dot-products, the softmax between them unchanged.
//
// Why: a prefill tile's products are small GEMMs (up to 96 query rows x a few hundred keys x
// head_dim), which the AVX-512 fp32 loops ran at ~50 GFLOP/s here, a third of the step's
// prefill time; on tiles they cost less than laying the operands out.
//
// Same arithmetic as the vector path: bf16 products accumulated in float32 (only the order of
// the additions differs), probabilities already rounded to bf16 by the softmax, so holding them
// in bf16 for the tile loses nothing. Every operand is a 16-row x 64-byte tile:
// - scores: A = 16 query rows x 32 dims (bf16), B = 16 dim pairs x 16 keys (a key's dims taken
//   as 32-bit pairs, 16 keys transposed), C = 16 x 16 floats;
// - P @ V: A = 16 rows x 32 keys (bf16 probabilities), B = 16 key pairs x 16 dims (two keys'
//   values interleaved), C = 16 rows x 16 dims.
#pragma once

#include "amx.h"

#if defined(PAGEDLLM_AMX)
namespace pagedllm::amx {

using bf16 = c10::BFloat16;

// One configuration for every tile of both products: 16 rows of 64 bytes. Loaded at the start
// of a work item and released after it, as oneDNN's kernels load their own before each GEMM.
inline void configure_attention_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The B operand of scores for up to 16 keys (rows `keys[0..n)` of D bf16 each; missing keys are
// zero): for each 32 dims, 16 rows of (key 0's pair p, key 1's pair p, ...). Written to
// out[D / 32][16][32].
inline void keys_as_b(const bf16* const* keys, int64_t n, int64_t D, bf16* out) {
  __m512i r[16];
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    for (int64_t c = 0; c < 16; ++c) r[c] = c < n ? _mm512_loadu_si512(keys[c] + d0) : _mm512_setzero_si512();
    avx512::transpose16x16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (d0 / 32 * 16 + p) * 32, r[p]);
  }
}

// S[i][j] (ld floats a row) = Q[i] . key j for row tiles of Q (row_tiles x 16 rows of D bf16,
// contiguous) against up to 16 keys laid out by keys_as_b; writes 16 columns of every row.
inline void score_keys(const bf16* Q, int64_t row_tiles, int64_t D, const bf16* b, float* S, int64_t ld) {
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    _tile_zero(2);
    for (int64_t s = 0; s < D / 32; ++s) {
      _tile_loadd(0, Q + rt * 16 * D + s * 32, D * 2);
      _tile_loadd(1, b + s * 512, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, S + rt * 16 * ld, ld * 4);
  }
}

// The B operand of P @ V for 32 keys (values[0..n) of D bf16 each; missing keys are zero): for
// each 16 dims, 16 rows of (key 2p's dim d, key 2p+1's dim d) for d in the 16. Written to
// out[D / 16][16][32].
inline void values_as_b(const bf16* const* values, int64_t n, int64_t D, bf16* out) {
  // interleaves the 16 bf16 of two keys: element 2d is the first key's d, 2d + 1 the second's
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    for (int p = 0; p < 16; ++p) {
      const __m256i a = 2 * p < n ? _mm256_loadu_si256((const __m256i*)(values[2 * p] + d0)) : _mm256_setzero_si256();
      const __m256i b =
          2 * p + 1 < n ? _mm256_loadu_si256((const __m256i*)(values[2 * p + 1] + d0)) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(out + (d0 / 16 * 16 + p) * 32, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// A[i][d] (row tiles x 16 rows of D floats) = sum over keys of P[i][key] V[key][d]: P is
// row_tiles x 16 rows of `keys` bf16 (ld_p a row, keys a multiple of 32, zero past the real
// ones), V laid out by values_as_b, 32 keys at a time (vb + chunk * D * 32).
inline void weigh_values(const bf16* P, int64_t row_tiles, int64_t ld_p, int64_t keys, const bf16* vb, int64_t D,
                         float* A) {
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // four 16-dim accumulators (tmm4..7) at a time
      const int64_t blocks = std::min<int64_t>(4, (D - d0) / 16);
      _tile_zero(4);
      if (blocks > 1) _tile_zero(5);
      if (blocks > 2) _tile_zero(6);
      if (blocks > 3) _tile_zero(7);
      for (int64_t k0 = 0; k0 < keys; k0 += 32) {
        _tile_loadd(0, P + rt * 16 * ld_p + k0, ld_p * 2);
        const bf16* chunk = vb + k0 * D + d0 / 16 * 512;
        _tile_loadd(1, chunk, 64);
        _tile_dpbf16ps(4, 0, 1);
        if (blocks > 1) {
          _tile_loadd(1, chunk + 512, 64);
          _tile_dpbf16ps(5, 0, 1);
        }
        if (blocks > 2) {
          _tile_loadd(1, chunk + 1024, 64);
          _tile_dpbf16ps(6, 0, 1);
        }
        if (blocks > 3) {
          _tile_loadd(1, chunk + 1536, 64);
          _tile_dpbf16ps(7, 0, 1);
        }
      }
      float* out = A + rt * 16 * D + d0;
      _tile_stored(4, out, D * 4);
      if (blocks > 1) _tile_stored(5, out + 16, D * 4);
      if (blocks > 2) _tile_stored(6, out + 32, D * 4);
      if (blocks > 3) _tile_stored(7, out + 48, D * 4);
    }
}

}  // namespace pagedllm::amx
#endif  // PAGEDLLM_AMX
