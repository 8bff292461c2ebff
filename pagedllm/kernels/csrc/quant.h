// A quantized weight matrix as quant_gemm.cpp's kernels read it, and its generic (any CPU)
// dequantization step; quant_avx512.h and amx.h hold the same step in AVX-512 registers.
//
// Layout (what pagedllm/loading/gguf_quants.py produces from GGUF blocks, and the layer from an
// HF checkpoint): value[n][k] = q[n][k] * scale[n][k / group] + zero[n][k / group] (zero may be
// absent: 0), scale and zero float32, or float16 as a GGUF block stores its d and m (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, IQ4_NL; groups of 32), or MXFP4's byte e standing for 2^(e - 128): then the
// matrix takes the file's bytes, where float32 cost Q4_0 1.33x them and MXFP4 1.18x.
// 4-bit q (0..15) sit two to a byte, per 32 columns from k0: byte k0/2 + j holds column k0 + j in its low nibble and k0 + 16 + j in its high one, as GGUF's
// Q4_0/Q4_1 blocks do. 8-bit q are int8, one per byte. 5-bit q (0..31; Q5_0 and Q5_1 as the file
// stores them, less d and m) take 20 bytes per 32 columns: 4 bytes qh, read as a little-endian
// uint32 whose bit j is column j's fifth bit, then 16 bytes of the low four bits in 4-bit's order;
// Q5_0's q stand for q - 16 (`centered`).
//
// 4-bit codes: where a matrix has a codebook, its 4-bit q are not values but indices into a
// table of 16 int8 values (MXFP4's e2m1 values doubled; IQ4_NL's non-linear grid; Q4_0's
// q - 8), read as value = table[q] * scale + zero. The kernels take the codebook in their `bits`
// argument: bits + 256 x the codebook's number (layers/codebooks.py's CODEBOOKS, in this order, from 1).
//
// K-quant super-blocks as the file stores them (quant_blocks.h): layout kRawLayout + ggml's type
// number, q the blocks' bytes, no scale or zero (they are in the blocks).
#pragma once

#include <cmath>
#include <cstdint>

#include "quant_blocks.h"

namespace pagedllm {

// The codebooks' tables, by number (0: none, q is the value). A test pins them to the gguf
// package's kvalues and to layers/codebooks.py's.
alignas(16) inline constexpr int8_t kCodebooks[4][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},                       // MXFP4 (e2m1 x 2)
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},   // IQ4_NL, IQ4_XS
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},                      // Q4_0 (q - 8)
};
constexpr int64_t kCodebookCount = 4;
// Q5_0's "codebook" (layers/codebooks.py's q5_0, q - 16): no table, its 5-bit q are centered.
constexpr int64_t kCentered5 = 4;
constexpr int64_t kFiveBitGroupBytes = 20;  // qh (4) and qs (16) of 32 columns

struct QuantMatrix {
  const uint8_t* q;  // int4: [N, K / 2]; int8: [N, K] (read as int8)
  const float* scale;
  const float* zero;  // nullptr: no offsets
  int64_t n, k, bits, group;
  int64_t G;      // groups per row
  int shift;      // log2(group) when a power of two: the inner loops must not divide (~40 cycles)
  const int8_t* codes = nullptr;  // 4-bit q's values (kCodebooks), or nullptr: q itself
  int64_t raw = 0;                // a K-quant's ggml type number (quant_blocks.h), or 0
  bool centered = false;              // 5-bit q stand for q - 16 (Q5_0)
  const uint16_t* scale_h = nullptr;  // float16 scales (scale is then nullptr)
  const uint8_t* scale_e = nullptr;   // MXFP4's scale bytes e: 2^(e - 128) (scale is then nullptr)
  const uint16_t* zero_h = nullptr;   // float16 offsets (zero is then nullptr)
  float scale_at(int64_t g) const {
    if (scale_e) return std::ldexp(1.f, int(scale_e[g]) - 128);
    return scale_h ? half_to_float(reinterpret_cast<const uint8_t*>(scale_h + g)) : scale[g];
  }
  float zero_at(int64_t g) const {
    return zero_h ? half_to_float(reinterpret_cast<const uint8_t*>(zero_h + g)) : zero ? zero[g] : 0.f;
  }
  bool has_zero() const { return zero != nullptr || zero_h != nullptr; }
  int64_t row_bytes() const { return byte_of(k); }
  // column k0's byte in its row (a raw block's first byte; a 5-bit group's qh)
  int64_t byte_of(int64_t k0) const {
    return raw ? k0 / kSuperBlock * raw_block_bytes(raw)
                                    : bits == 4 ? k0 / 2 : bits == 5 ? k0 / 32 * kFiveBitGroupBytes : k0;
  }
  int64_t groups() const { return G; }
  int64_t group_of(int64_t k0) const { return shift >= 0 ? k0 >> shift : k0 / group; }
  // Columns handled per step: a 4-bit step unpacks 16 bytes into 32 values (a 5-bit one 20), an
  // 8-bit one 16; a raw block's step is 32 columns (bits is 4 for them).
  int64_t step() const { return bits == 8 ? 16 : 32; }
};

// How far ahead of the weights a kernel asks for them: its rows are read once, in order, and
// the hardware's prefetcher alone left a one-row product with a Q8_0 head of 262,144 x 640 (178
// MB) at 13.5 GB/s where a float sum streams 21-23; 4 KiB ahead took its VNNI path to 19-20.5
// (2 to 16 KiB measured alike on that Xeon). On a 2-core AMD EPYC (32 MiB L3, 41.8 GB/s read)
// 4 KiB was too near: a decode step's 97 Q8_0 matrices of a Qwen3.5-0.8B (807 MB) one row each
// streamed 21.3-23.4 GB/s at 4 KiB, 24.2-24.6 at 12, 26.1-26.7 at 32, 27.1-27.6 at 64 and
// 24.2-24.9 at 128 KiB; its 270 MB head alone 23.9, 24.4, 30.1, 29.5, 29.1. 32 KiB: the far
// side of the Xeon's flat range, near the EPYC's best. Each kernel asks once per 64-byte line.
constexpr int64_t PREFETCH_BYTES = 32768;

inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + PREFETCH_BYTES, 0, 3); }

// The values of columns [k0, k0 + step) of row n, in order, into `out` (scalar; any CPU).
inline void dequant_step_scalar(const QuantMatrix& m, int64_t n, int64_t k0, float* out) {
  if (m.raw) {
    uint8_t u[32];
    float s[2], z[2];
    raw_step_scalar(m.raw, m.q + n * m.row_bytes(), k0, u, s, z);
    for (int j = 0; j < 32; ++j) out[j] = float(u[j]) * s[j >> 4] + z[j >> 4];
    return;
  }
  const int64_t g = n * m.G + m.group_of(k0);
  const float s = m.scale_at(g), z = m.zero_at(g);
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 5) {
    const uint8_t* p = row + m.byte_of(k0);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const int offset = m.centered ? 16 : 0;
    for (int j = 0; j < 16; ++j) {
      const int low = (p[4 + j] & 15) | int((qh >> j) & 1) << 4, high = (p[4 + j] >> 4) | int((qh >> (j + 16)) & 1) << 4;
      out[j] = float(low - offset) * s + z;
      out[j + 16] = float(high - offset) * s + z;
    }
  } else if (m.bits == 4) {
    const uint8_t* p = row + k0 / 2;
    for (int j = 0; j < 16; ++j) {
      const int low = p[j] & 15, high = p[j] >> 4;
      out[j] = float(m.codes ? m.codes[low] : low) * s + z;
      out[j + 16] = float(m.codes ? m.codes[high] : high) * s + z;
    }
  } else {
    const int8_t* p = reinterpret_cast<const int8_t*>(row) + k0;
    for (int j = 0; j < 16; ++j) out[j] = float(p[j]) * s + z;
  }
}

}  // namespace pagedllm
