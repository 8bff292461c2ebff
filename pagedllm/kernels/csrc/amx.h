// The AMX path of quant_gemm.cpp: many rows of bf16 activations against quantized weights on
// AMX tiles, and the two conditions for using it at run time (Linux grants the tile state; the
// oneDNN ISA cap allows it). Empty, and PAGEDLLM_AMX undefined, unless the compiler targets AMX
// tiles, AMX-BF16 and AVX512-BF16.
//
// For each 16 output channels, the weights are dequantized once into a bf16 block that stays in
// L1 (16 x K), and every 16 rows of x multiply it in tile dot-products that accumulate over all
// of K in the tile. Where the float GEMM path first dequantizes the whole layer to memory and
// oneDNN then re-lays it out, this reads the packed weights once per step and writes nothing but
// the output. The arithmetic is that of the float GEMM on bf16-dequantized weights.
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
inline void dequant_channels(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
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

// Up to four 16-row tiles of x (tmm1, tmm6 in turn) against one 16-channel block (tmm0), into
// the accumulators tmm2..tmm5, stored to Y (stride ldy floats) or, for a ragged edge, to C.
template <int NT>
void amx_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, float* const* out,
               const int64_t* ld) {
  if constexpr (NT > 0) _tile_zero(2);
  if constexpr (NT > 1) _tile_zero(3);
  if constexpr (NT > 2) _tile_zero(4);
  if constexpr (NT > 3) _tile_zero(5);
  for (int64_t kk = 0; kk < K / 32; ++kk) {
    _tile_loadd(0, w + kk * 512, 64);
    const c10::BFloat16* xk = x + kk * 32;
    _tile_loadd(1, xk, ldx * 2);
    _tile_dpbf16ps(2, 1, 0);
    if constexpr (NT > 1) {
      _tile_loadd(6, xk + 16 * ldx, ldx * 2);
      _tile_dpbf16ps(3, 6, 0);
    }
    if constexpr (NT > 2) {
      _tile_loadd(1, xk + 32 * ldx, ldx * 2);
      _tile_dpbf16ps(4, 1, 0);
    }
    if constexpr (NT > 3) {
      _tile_loadd(6, xk + 48 * ldx, ldx * 2);
      _tile_dpbf16ps(5, 6, 0);
    }
  }
  if constexpr (NT > 0) _tile_stored(2, out[0], ld[0] * 4);
  if constexpr (NT > 1) _tile_stored(3, out[1], ld[1] * 4);
  if constexpr (NT > 2) _tile_stored(4, out[2], ld[2] * 4);
  if constexpr (NT > 3) _tile_stored(5, out[3], ld[3] * 4);
}

inline void amx_linear(const QuantMatrix& m, const c10::BFloat16* X, int64_t rows, float* Y) {
  const int64_t full = rows / 16, tiles = (rows + 15) / 16;
  // The last, partial tile of rows, zero-padded (the tiles read 16 rows).
  std::vector<c10::BFloat16> tail(16 * m.k, c10::BFloat16(0.f));
  if (tiles > full)
    std::memcpy(static_cast<void*>(tail.data()), X + full * 16 * m.k, (rows - full * 16) * m.k * sizeof(c10::BFloat16));
  const int64_t blocks16 = (m.n + 15) / 16;
  at::parallel_for(0, blocks16, 1, [&](int64_t b0, int64_t b1) {
    TileConfig cfg;
    for (int t : {0, 1, 2, 3, 4, 5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    std::vector<c10::BFloat16> w(16 * m.k);
    alignas(64) float C[4][16][16];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 16, count = std::min<int64_t>(16, m.n - n0);
      dequant_channels(m, n0, w.data());
      for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
        const int64_t nt = std::min<int64_t>(4, tiles - t0);
        // Rows of x: in place, but the partial last tile from its padded copy; results straight
        // into Y, but a ragged tile (last rows, last channels) through C.
        const bool ragged_tail = t0 + nt > full;
        const c10::BFloat16* x = X + t0 * 16 * m.k;
        float* out[4];
        int64_t ld[4];
        for (int64_t r = 0; r < nt; ++r) {
          const bool ragged = count < 16 || t0 + r >= full;
          out[r] = ragged ? &C[r][0][0] : Y + (t0 + r) * 16 * m.n + n0;
          ld[r] = ragged ? 16 : m.n;
        }
        if (ragged_tail && nt == 1) {
          amx_block<1>(tail.data(), m.k, w.data(), m.k, out, ld);
        } else {
          // all but a partial last tile run from x in place; that one runs alone below
          const int64_t in_place = ragged_tail ? nt - 1 : nt;
          switch (in_place) {
            case 4: amx_block<4>(x, m.k, w.data(), m.k, out, ld); break;
            case 3: amx_block<3>(x, m.k, w.data(), m.k, out, ld); break;
            case 2: amx_block<2>(x, m.k, w.data(), m.k, out, ld); break;
            case 1: amx_block<1>(x, m.k, w.data(), m.k, out, ld); break;
            default: break;
          }
          if (ragged_tail) amx_block<1>(tail.data(), m.k, w.data(), m.k, out + in_place, ld + in_place);
        }
        for (int64_t r = 0; r < nt; ++r) {
          if (out[r] != &C[r][0][0]) continue;
          for (int64_t i = 0; i < 16 && (t0 + r) * 16 + i < rows; ++i)
            std::memcpy(Y + ((t0 + r) * 16 + i) * m.n + n0, C[r][i], count * sizeof(float));
        }
      }
    }
    _tile_release();
  });
}

}  // namespace pagedllm::amx

#endif  // AMX tiles, AMX-BF16, AVX512-BF16
