// bf16 GEMMs on AMX tiles (rows_by_blocks), and the two conditions for using them at run time
// (Linux grants the tile state; the oneDNN ISA cap allows it). Two users: quant_gemm.cpp (many
// rows against quantized weights) and dense_gemm.cpp (bf16 weights packed in the tiles' own
// layout). Empty, and PAGEDLLM_AMX undefined, unless the compiler targets AMX tiles, AMX-BF16 and
// AVX512-BF16.
//
// For each 16 output channels, a bf16 block of weights (16 x K) sits in L1, and every 16 rows of
// x multiply it in tile dot-products that accumulate over all of K in the tile. Quantized
// weights are dequantized into that block once per step (where the float GEMM path first
// dequantizes the whole layer to memory and oneDNN then re-lays it out); packed bf16 weights
// are that block already. The arithmetic is that of the float GEMM on the bf16 weights.
#pragma once

#include "common.h"
#include "quant.h"
#include "quant_avx512.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PAGEDLLM_AVX512_BF16)
#define PAGEDLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <string>

namespace pagedllm::amx {

// oneDNN's switch, obeyed here too: ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) set to
// an instruction set below AMX runs the machine as one without it (memory/machine.py reads it the
// same way for the planner).
inline bool isa_cap_allows_amx() {
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    std::string cap(value);
    for (char& c : cap) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return cap == "ALL" || cap == "DEFAULT" || cap.find("AMX") != std::string::npos;
  }
  return true;
}

// Linux hands out AMX state only on request, once per process.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return isa_cap_allows_amx() && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};


// Channels [n0, n0 + 16) dequantized to bf16 as the tiles' B operand: per 32 columns, 16 column
// pairs x 16 channels x 2 (channels past the matrix are zero). Each channel's 32 columns are one
// register of 16 pairs; 16 channels' registers transposed give the 16 rows of pairs.
// K-quant blocks as stored (quant_blocks.h): each channel's block scales decoded once a block.
template <int64_t Type>
void dequant_channels_raw(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
  const int64_t count = std::min<int64_t>(16, m.n - n0), rb = m.row_bytes(), block_bytes = raw_block_bytes(Type);
  __m512i r[16];
  alignas(64) float scale[16][8][2], offset[16][8][2];
  for (int64_t blk = 0; blk < m.k / kSuperBlock; ++blk) {
    const uint8_t* first = m.q + n0 * rb + blk * block_bytes;
    for (int64_t c = 0; c < count; ++c) avx512::raw_block_affine(Type, first + c * rb, scale[c][0], offset[c][0]);
    for (int j = 0; j < 8; ++j) {
      for (int64_t c = 0; c < 16; ++c) {
        if (c >= count) {
          r[c] = _mm512_setzero_si512();
          continue;
        }
        __m512 lo, hi;
        avx512::raw_values(avx512::raw_group_bits_of<Type>(first + c * rb, j), scale[c][j], offset[c][j], lo, hi);
        r[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      avx512::transpose16x16(r);
      const int64_t step = blk * 8 + j;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (step * 16 + p) * 32, r[p]);
    }
  }
}

// 16 channels from n0 dequantized as the tiles' B operand (dequant_channels' layout), 32 columns a
// step: `pairs(n, k0, g)` gives channel n's 32 values from column k0 (group g) as one register of
// bf16 pairs; 16 channels' registers transposed give the step's 16 rows of pairs.
template <typename Pairs>
void dequant_channels_by(const QuantMatrix& m, int64_t n0, c10::BFloat16* out, Pairs pairs) {
  const int64_t count = std::min<int64_t>(16, m.n - n0);
  __m512i r[16];
  for (int64_t k0 = 0; k0 < m.k; k0 += 32) {
    const int64_t g = m.group_of(k0);
    for (int64_t c = 0; c < 16; ++c) r[c] = c < count ? pairs(n0 + c, k0, g) : _mm512_setzero_si512();
    avx512::transpose16x16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (k0 / 32 * 16 + p) * 32, r[p]);
  }
}

// 8-bit weights without offsets (Q8_0, per-row int8): each channel's 32 bytes widened and scaled
// in two registers. The general step below reads the scale and offset through their type's
// branches twice per 32 columns. A 16-row product (a decode step of 16 requests) with a Q8_0
// [3584, 1024] took 1.07 ms with it, 0.38 with this (in L3; the dequantization is nearly all of
// it), and with a [248320, 1024] head (270 MB, from memory) 50 ms without the prefetch of the next
// pair of blocks' lines (each thread walks its pairs in order), 30 with it (one row: 15).
inline void dequant_channels_8bit(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
  const int64_t rb = m.row_bytes();
  dequant_channels_by(m, n0, out, [&](int64_t n, int64_t k0, int64_t g) {
    _mm_prefetch(reinterpret_cast<const char*>(m.q + (n + 32) * rb + k0), _MM_HINT_T0);  // the next pair of blocks
    const __m512 s = _mm512_set1_ps(m.scale_h ? _cvtsh_ss(m.scale_h[n * m.G + g]) : m.scale[n * m.G + g]);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.q + n * rb + k0));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), s);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  });
}

// 4-bit weights in groups of 32 (Q4_0, Q4_1, int4 with offsets, IQ4_NL, MXFP4), likewise: each
// channel's 16 bytes split into its 32 nibbles, looked up in the codebook where there is one,
// scaled and offset. The general step took a 16-row product with a Q4_0 or Q4_1 [3584, 1024] to
// 0.70 ms, twice two 8-row products on the integer path (0.33 each); this, 0.43.
inline void dequant_channels_4bit(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
  const int64_t rb = m.row_bytes();
  const __m128i nibble = _mm_set1_epi8(15);
  const __m128i table = m.codes ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(m.codes)) : _mm_setzero_si128();
  dequant_channels_by(m, n0, out, [&](int64_t n, int64_t k0, int64_t g) {
    _mm_prefetch(reinterpret_cast<const char*>(m.q + (n + 32) * rb + k0 / 2), _MM_HINT_T0);
    const __m512 s = _mm512_set1_ps(m.scale_h ? _cvtsh_ss(m.scale_h[n * m.G + g]) : m.scale_at(n * m.G + g));
    const __m512 z = _mm512_set1_ps(m.zero_h ? _cvtsh_ss(m.zero_h[n * m.G + g]) : m.zero_at(n * m.G + g));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m.q + n * rb + k0 / 2));
    const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    const __m512i wide_low = m.codes ? _mm512_cvtepi8_epi32(_mm_shuffle_epi8(table, low)) : _mm512_cvtepu8_epi32(low);
    const __m512i wide_high =
        m.codes ? _mm512_cvtepi8_epi32(_mm_shuffle_epi8(table, high)) : _mm512_cvtepu8_epi32(high);
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide_low), s, z);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide_high), s, z);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  });
}

inline void dequant_channels(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
  if (m.bits == 8 && !m.raw && !m.has_zero() && !m.scale_e && m.group % 32 == 0)
    return dequant_channels_8bit(m, n0, out);
  if (m.bits == 4 && !m.raw && m.group % 32 == 0) return dequant_channels_4bit(m, n0, out);
  if (m.raw) {
    avx512::with_raw_type(m.raw, [&](auto t) { dequant_channels_raw<decltype(t)::value>(m, n0, out); });
    return;
  }
  const int64_t count = std::min<int64_t>(16, m.n - n0);
  __m512i r[16];
  for (int64_t k0 = 0; k0 < m.k; k0 += 32) {
    for (int64_t c = 0; c < 16; ++c) {
      if (c >= count) {
        r[c] = _mm512_setzero_si512();
        continue;
      }
      __m512 lo, hi;
      avx512::dequant_step(m, n0 + c, k0, lo, hi);
      if (m.bits == 8) {  // 16 columns a step
        __m512 unused;
        avx512::dequant_step(m, n0 + c, k0 + 16, hi, unused);
      }
      r[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    avx512::transpose16x16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (k0 / 32 * 16 + p) * 32, r[p]);
  }
}

// NT (1-2) 16-row tiles of x (tmm1, tmm6) against NB (1-2) 16-channel blocks (tmm0, tmm7), over
// all of K, into the accumulators tmm2..tmm5 (tile t x block j: 2 + 2 t + j), stored to C (one
// 16 x 16 float tile after another, in that order). Two by two, each operand loaded serves two
// products, so x's tiles come from L2 half as often as one block at a time would need. The
// blocks' next tiles are prefetched: packed weights stream from memory (a dequantized block is
// in L1 already).
constexpr int64_t PREFETCH_TILES = 4;

template <int NT, int NB>
void amx_tiles(const c10::BFloat16* const* x, int64_t ldx, const c10::BFloat16* const* w, int64_t K, float* C) {
  _tile_zero(2);
  if constexpr (NB > 1) _tile_zero(3);
  if constexpr (NT > 1) _tile_zero(4);
  if constexpr (NT > 1 && NB > 1) _tile_zero(5);
  for (int64_t kk = 0; kk < K / 32; ++kk) {
    for (int j = 0; j < NB; ++j)
      for (int line = 0; line < 16; ++line)
        _mm_prefetch((const char*)(w[j] + (kk + PREFETCH_TILES) * 512 + line * 32), _MM_HINT_T0);
    _tile_loadd(0, w[0] + kk * 512, 64);
    if constexpr (NB > 1) _tile_loadd(7, w[1] + kk * 512, 64);
    _tile_loadd(1, x[0] + kk * 32, ldx * 2);
    _tile_dpbf16ps(2, 1, 0);
    if constexpr (NB > 1) _tile_dpbf16ps(3, 1, 7);
    if constexpr (NT > 1) {
      _tile_loadd(6, x[1] + kk * 32, ldx * 2);
      _tile_dpbf16ps(4, 6, 0);
      if constexpr (NB > 1) _tile_dpbf16ps(5, 6, 7);
    }
  }
  _tile_stored(2, C, 64);
  if constexpr (NB > 1) _tile_stored(3, C + 256, 64);
  if constexpr (NT > 1) _tile_stored(4, C + NB * 256, 64);
  if constexpr (NT > 1 && NB > 1) _tile_stored(5, C + 3 * 256, 64);
}

// Y = X W^T on tiles, W given 16 output channels at a time as a tile B operand (16 x K bf16,
// in dequant_channels' layout). `weights(b, scratch)` returns block b's operand, building it in
// `scratch` (a vector of the thread's, one per block in flight, that it may resize) if it must;
// `emit(r0, n0, count, C)` takes the float results of rows [r0, r0 + 16) (fewer past the last
// row) x channels [n0, n0 + count) from C (16 x 16, row-major). Blocks run two at a time against
// every two tiles of rows while they sit in L1. Outside torch's allocator: a zero-padded copy of
// a partial last tile of rows (16 x K bf16).
template <typename Weights, typename Emit>
void rows_by_blocks(const c10::BFloat16* X, int64_t rows, int64_t n, int64_t k, Weights weights, Emit emit) {
  const int64_t full = rows / 16, tiles = (rows + 15) / 16;
  // The last, partial tile of rows, zero-padded (the tiles read 16 rows).
  std::vector<c10::BFloat16> tail(tiles > full ? 16 * k : 0, c10::BFloat16(0.f));
  if (tiles > full)
    std::memcpy(static_cast<void*>(tail.data()), X + full * 16 * k, (rows - full * 16) * k * sizeof(c10::BFloat16));
  const int64_t blocks16 = (n + 15) / 16;
  at::parallel_for(0, (blocks16 + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    std::vector<c10::BFloat16> scratch[2];
    alignas(64) float C[4][16][16];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = 2 * p, nb = std::min<int64_t>(2, blocks16 - b);
      const c10::BFloat16* w[2] = {weights(b, scratch[0]), nb > 1 ? weights(b + 1, scratch[1]) : nullptr};
      for (int64_t t = 0; t < tiles; t += 2) {
        const int64_t nt = std::min<int64_t>(2, tiles - t);
        const c10::BFloat16* x[2];
        for (int64_t i = 0; i < nt; ++i) x[i] = t + i < full ? X + (t + i) * 16 * k : tail.data();
        if (nt == 2 && nb == 2)
          amx_tiles<2, 2>(x, k, w, k, &C[0][0][0]);
        else if (nt == 2)
          amx_tiles<2, 1>(x, k, w, k, &C[0][0][0]);
        else if (nb == 2)
          amx_tiles<1, 2>(x, k, w, k, &C[0][0][0]);
        else
          amx_tiles<1, 1>(x, k, w, k, &C[0][0][0]);
        for (int64_t i = 0; i < nt; ++i)
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t n0 = (b + j) * 16;
            emit((t + i) * 16, n0, std::min<int64_t>(16, n - n0), &C[i * nb + j][0][0]);
          }
      }
    }
    _tile_release();
  });
}

inline void amx_linear(const QuantMatrix& m, const c10::BFloat16* X, int64_t rows, float* Y) {
  rows_by_blocks(
      X, rows, m.n, m.k,
      [&](int64_t b, std::vector<c10::BFloat16>& scratch) {
        scratch.resize(16 * m.k);
        dequant_channels(m, b * 16, scratch.data());
        return scratch.data();
      },
      [&](int64_t r0, int64_t n0, int64_t count, const float* C) {
        for (int64_t i = 0; i < 16 && r0 + i < rows; ++i)
          std::memcpy(Y + (r0 + i) * m.n + n0, C + i * 16, count * sizeof(float));
      });
}

}  // namespace pagedllm::amx

#endif  // AMX tiles, AMX-BF16, AVX512-BF16
