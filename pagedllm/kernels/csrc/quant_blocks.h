// GGUF's K-quant super-blocks kept as the file stores them (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 256
// columns a block, their 4-, 6- or 8-bit sub-scales, f16 d (and dmin), and the high-bit planes
// all left packed, so a weight costs in RAM what it costs on disk (Q4_K: 4.5 bits). Widening
// them (a float32 scale and offset per 32 columns, a byte per 5- or 6-bit value) cost 1.39x the
// file's bytes for a Q4_K_M file and as much more read per decode step.
//
// A matrix in this layout is uint8 [N, K / 256 * block_bytes], row n's blocks one after another;
// the kernels take it as layout kRawLayout + ggml's type number. Each 32-column step is decoded
// here into 32 small integers u and two (scale, offset) pairs, one per 16 columns:
//     value[k0 + j] = u[j] * scale[j / 16] + offset[j / 16]
// which is how ggml's dequantize_row_* forms each value (d * sc * q - dmin * m), with q's own
// offset (Q3_K's -4, Q6_K's -32) folded into the offset. The byte layouts, per block:
//     Q2_K  scales[16] (low nibble sc, high m), qs[64] (2 bits), d, dmin f16           84 bytes
//     Q3_K  hmask[32] (third bit), qs[64] (2 bits), scales 6-bit x 16 in 12, d f16     110 bytes
//     Q4_K  d, dmin f16, scales 6-bit sc and m x 8 in 12, qs[128] (4 bits)            144 bytes
//     Q5_K  as Q4_K, then qh[32] (fifth bit) before qs                                 176 bytes
//     Q6_K  ql[128] (low 4 bits), qh[64] (high 2 bits), sc int8[16], d f16            210 bytes
//     IQ4_XS d f16, sc_h u16, sc_l[4] (6-bit scales x 8), qs[128] (4-bit codes)        136 bytes
// IQ4_XS's codes index IQ4_NL's grid; u is the grid value plus 128 and the offset -128 x scale, so
// that u * scale + offset is the grid value times the scale, exactly (that product fits a float).
// loading/gguf_quants.py's docstring says which bits go where; tests/test_gguf_quants.py pins
// every type to the gguf package's dequantize, bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm {

constexpr int64_t kRawLayout = 4096;  // layout = kRawLayout + ggml type number
enum RawType : int64_t { kQ2K = 10, kQ3K = 11, kQ4K = 12, kQ5K = 13, kQ6K = 14, kIQ4XS = 23 };
// IQ4_NL's grid (quant.h's kCodebooks[2]) plus 128: IQ4_XS's codes as the unsigned u of this
// file's formula, the 128 taken back out by the offset
alignas(16) inline constexpr uint8_t kIQ4GridPlus128[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                            129, 141, 153, 166, 181, 197, 217, 241};
constexpr int64_t kSuperBlock = 256;

// Bytes of one 256-column block of a raw type, or 0 for a number that is not one.
inline int64_t raw_block_bytes(int64_t type) {
  switch (type) {
    case kQ2K: return 84;
    case kQ3K: return 110;
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    case kIQ4XS: return 136;
    default: return 0;
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise the mantissa
    int e = -1;
    uint32_t m = mant;
    do {
      ++e;
      m <<= 1;
    } while ((m & 1024) == 0);
    bits = sign | uint32_t(112 - e) << 23 | ((m & 1023) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Q4_K/Q5_K's sub-block j (sc, m), 6 bits each, from its 12 scale bytes: bytes 0-3 hold sc[0..3]
// in their low 6 bits and the top 2 bits of sc[4..7]; bytes 4-7 the same for m; bytes 8-11:
// sc[4..7]'s low nibble | m[4..7]'s low nibble << 4.
inline void k4_scale_min(const uint8_t* s, int64_t j, float& sc, float& m) {
  if (j < 4) {
    sc = float(s[j] & 63);
    m = float(s[j + 4] & 63);
  } else {
    sc = float((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    m = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Q3_K's 12 scale bytes -> its 16 six-bit scales (each stands for sc - 32): scale i's low nibble
// is byte i % 8's low (i < 8) or high (i >= 8) nibble; its top 2 bits are bits 2 * (i / 4) of
// byte 8 + i % 4.
inline void k3_scales(const uint8_t* s, uint8_t out[16]) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    out[i] = uint8_t(low | (((s[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4));
  }
}

// Group j's (columns 32j .. 32j + 31 of block b) two (scale, offset) pairs, one per 16 columns.
inline void raw_group_affine(int64_t type, const uint8_t* b, int64_t j, float scale[2], float offset[2]) {
  const int64_t h = j / 4, t = j % 4;
  switch (type) {
    case kQ4K:
    case kQ5K: {
      float sc, m;
      k4_scale_min(b + 4, j, sc, m);
      scale[0] = scale[1] = half_to_float(b) * sc;
      offset[0] = offset[1] = -(half_to_float(b + 2) * m);
      return;
    }
    case kQ6K: {
      const float d = half_to_float(b + 208);
      for (int i = 0; i < 2; ++i) {
        scale[i] = d * float(int8_t(b[192 + 2 * j + i]));
        offset[i] = -32.f * scale[i];
      }
      return;
    }
    case kQ2K: {
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int i = 0; i < 2; ++i) {
        const uint8_t sc = b[8 * h + 2 * t + i];
        scale[i] = d * float(sc & 15);
        offset[i] = -(dmin * float(sc >> 4));
      }
      return;
    }
    case kQ3K: {
      uint8_t sc[16];
      k3_scales(b + 96, sc);
      const float d = half_to_float(b + 108);
      for (int i = 0; i < 2; ++i) {
        scale[i] = d * float(int(sc[8 * h + 2 * t + i]) - 32);
        offset[i] = -4.f * scale[i];
      }
      return;
    }
    case kIQ4XS: {  // 6-bit scale j: low nibble of sc_l[j / 2] (j odd: high), top 2 bits of sc_h
      uint16_t high;
      std::memcpy(&high, b + 2, 2);
      const int ls = ((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((high >> (2 * j)) & 3) << 4);
      scale[0] = scale[1] = half_to_float(b) * float(ls - 32);
      offset[0] = offset[1] = -128.f * scale[0];
      return;
    }
    default: return;
  }
}

// Group j's 32 small integers u (scalar).
inline void raw_group_bits(int64_t type, const uint8_t* b, int64_t j, uint8_t u[32]) {
  const int64_t h = j / 4, t = j % 4;
  switch (type) {
    case kQ4K:
    case kQ5K: {
      const bool five = type == kQ5K;
      const uint8_t* qs = b + (five ? 48 : 16) + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        u[l] = (qs[l] >> (4 * (j & 1))) & 15;
        if (five) u[l] |= ((b[16 + l] >> j) & 1) << 4;
      }
      return;
    }
    case kQ6K: {
      const uint8_t* ql = b + 64 * h + 32 * (t & 1);
      const uint8_t* qh = b + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) u[l] = uint8_t(((ql[l] >> (4 * (t >> 1))) & 15) | (((qh[l] >> (2 * t)) & 3) << 4));
      return;
    }
    case kQ2K: {
      const uint8_t* qs = b + 16 + 32 * h;
      for (int l = 0; l < 32; ++l) u[l] = (qs[l] >> (2 * t)) & 3;
      return;
    }
    case kQ3K: {
      const uint8_t* qs = b + 32 + 32 * h;
      for (int l = 0; l < 32; ++l) u[l] = uint8_t(((qs[l] >> (2 * t)) & 3) | (((b[l] >> j) & 1) << 2));
      return;
    }
    case kIQ4XS: {  // group j's 16 bytes: column l's code in byte l's low nibble, l + 16's in its high
      const uint8_t* qs = b + 8 + 16 * j;
      for (int l = 0; l < 16; ++l) {
        u[l] = kIQ4GridPlus128[qs[l] & 15];
        u[l + 16] = kIQ4GridPlus128[qs[l] >> 4];
      }
      return;
    }
    default: return;
  }
}

// Columns [k0, k0 + 32) of a raw row starting at `row`: u and the two (scale, offset) pairs of
// the header comment.
inline void raw_step_scalar(int64_t type, const uint8_t* row, int64_t k0, uint8_t u[32], float scale[2],
                            float offset[2]) {
  const int64_t j = (k0 % kSuperBlock) / 32;  // the 32-column group within its block (0..7)
  const uint8_t* b = row + k0 / kSuperBlock * raw_block_bytes(type);
  raw_group_bits(type, b, j, u);
  raw_group_affine(type, b, j, scale, offset);
}

}  // namespace pagedllm
