// Kernels for weights kept quantized (pagedllm/layers/quantized.py):
//
// - quant_linear: y = x @ dequant(W)^T for a few rows of x, reading each packed weight once. One
//   decode step of one request is exactly this: its time is the bytes of the weights read, so a
//   4-bit weight costs a quarter of a bf16 one. Many rows (prefill, big batches) go to a GEMM on
//   weights dequantized a layer at a time instead (the layer chooses).
//   With bfloat16 activations and 4-bit weights, each row of x is itself quantized to 8 bits per
//   32 columns (as llama.cpp does) and the products are summed as integers, 64 per instruction
//   (AVX512-VNNI): a quarter of the instructions of the float path. float32 activations take the
//   float path, which computes with the exact weight values (its results match a GEMM on the
//   dequantized weights).
// - dequantize: the float rows of a quantized matrix (that GEMM path; embedding lookups).
//
// Layout (what pagedllm/loading/gguf_quants.py produces from GGUF blocks, and the layer from an
// HF checkpoint): value[n][k] = q[n][k] * scale[n][k / group] + zero[n][k / group] (zero may be
// absent: 0), scale and zero float32. 4-bit q (0..15) sit two to a byte, per 32 columns from k0:
// byte k0/2 + j holds column k0 + j in its low nibble and k0 + 16 + j in its high one, as GGUF's
// Q4_0/Q4_1 blocks do. 8-bit q are int8, one per byte.

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define PAGEDLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <string>
#endif

namespace {

using namespace pagedllm;

struct QuantMatrix {
  const uint8_t* q;  // int4: [N, K / 2]; int8: [N, K] (read as int8)
  const float* scale;
  const float* zero;  // nullptr: no offsets
  int64_t n, k, bits, group;
  int64_t G;      // groups per row
  int shift;      // log2(group) when a power of two: the inner loops must not divide (~40 cycles)
  int64_t row_bytes() const { return bits == 4 ? k / 2 : k; }
  int64_t groups() const { return G; }
  int64_t group_of(int64_t k0) const { return shift >= 0 ? k0 >> shift : k0 / group; }
  // Columns handled per step: a 4-bit step unpacks 16 bytes into 32 values, an 8-bit one 16.
  int64_t step() const { return bits == 4 ? 32 : 16; }
};

// The values of columns [k0, k0 + step) of row n, in order, into `out` (scalar; any CPU).
inline void dequant_step_scalar(const QuantMatrix& m, int64_t n, int64_t k0, float* out) {
  const int64_t g = n * m.G + m.group_of(k0);
  const float s = m.scale[g], z = m.zero ? m.zero[g] : 0.f;
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 4) {
    const uint8_t* p = row + k0 / 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = float(p[j] & 15) * s + z;
      out[j + 16] = float(p[j] >> 4) * s + z;
    }
  } else {
    const int8_t* p = reinterpret_cast<const int8_t*>(row) + k0;
    for (int j = 0; j < 16; ++j) out[j] = float(p[j]) * s + z;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The same step in registers: lo = columns k0..k0+15, hi = k0+16..k0+31 (4-bit only).
inline void dequant_step(const QuantMatrix& m, int64_t n, int64_t k0, __m512& lo, __m512& hi) {
  const int64_t g = n * m.G + m.group_of(k0);
  const __m512 s = _mm512_set1_ps(m.scale[g]), z = _mm512_set1_ps(m.zero ? m.zero[g] : 0.f);
  const uint8_t* row = m.q + n * m.row_bytes();
  if (m.bits == 4) {
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
void tile(const QuantMatrix& m, const float* X, int64_t ldx, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const bool four = m.bits == 4;
  for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
    __m512 xlo[MR], xhi[MR];
    for (int r = 0; r < MR; ++r) {
      xlo[r] = _mm512_loadu_ps(X + r * ldx + k0);
      if (four) xhi[r] = _mm512_loadu_ps(X + r * ldx + k0 + 16);
    }
    for (int c = 0; c < NC; ++c) {
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

template <int NC>
void tile_rows(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, float* Y) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile<NC, 4>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n);
  switch (rows - r) {
    case 3: tile<NC, 3>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    case 2: tile<NC, 2>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    case 1: tile<NC, 1>(m, X + r * m.k, m.k, n0, Y + r * m.n, m.n); break;
    default: break;
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VNNI__)
#define PAGEDLLM_VNNI 1
// Rows of x in 8 bits, one scale per 32 columns, in 4-bit weights' nibble order: for group g,
// lo[16g + j] = q[32g + j] and hi[16g + j] = q[32g + 16 + j]. Byte arrays are padded to whole
// 64-byte steps (4 groups) with zeros.
struct Int8Rows {
  int64_t rows = 0, groups = 0, padded_groups = 0;
  std::vector<int8_t> lo, hi;     // [rows, padded_groups * 16]
  std::vector<float> scale16;     // [rows, padded_groups * 4]: each group's scale, once per dpbusd lane
  std::vector<float> block_sums;  // [rows, padded_groups]: scale x sum of the group's q (for offsets)
};

void quantize_rows(const float* X, int64_t rows, int64_t K, Int8Rows& r) {
  r.rows = rows;
  r.groups = K / 32;
  r.padded_groups = (r.groups + 3) / 4 * 4;
  const int64_t width = r.padded_groups * 16;
  r.lo.assign(rows * width, 0);
  r.hi.assign(rows * width, 0);
  r.scale16.assign(rows * r.padded_groups * 4, 0.f);
  r.block_sums.assign(rows * r.padded_groups, 0.f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < r.groups; ++g) {
      const float* x = X + i * K + g * 32;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = int(std::nearbyint(x[j] * inv));
        sum += q;
        (j < 16 ? r.lo : r.hi)[i * width + g * 16 + (j & 15)] = int8_t(q);
      }
      for (int l = 0; l < 4; ++l) r.scale16[(i * r.padded_groups + g) * 4 + l] = scale;
      r.block_sums[i * r.padded_groups + g] = scale * float(sum);
    }
}

// Y[r][n0 + c] for NC channels of 4-bit weights and MR rows: per 4 groups, 64 bytes of weights
// unpacked once into low and high nibbles, then two dpbusd per row.
template <int NC, int MR>
void tile_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t row0, int64_t n0, float* Y, int64_t ldy) {
  __m512 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int64_t width = xr.padded_groups * 16, G = m.groups();
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t n_groups = std::min<int64_t>(4, G - g0);
    const __mmask64 bytes = n_groups == 4 ? ~__mmask64(0) : (__mmask64(1) << (16 * n_groups)) - 1;
    const __mmask16 lanes = __mmask16((1u << n_groups) - 1);
    __m512i xlo[MR], xhi[MR];
    __m512 xs[MR];
    for (int r = 0; r < MR; ++r) {
      xlo[r] = _mm512_loadu_si512(xr.lo.data() + (row0 + r) * width + g0 * 16);
      xhi[r] = _mm512_loadu_si512(xr.hi.data() + (row0 + r) * width + g0 * 16);
      xs[r] = _mm512_loadu_ps(xr.scale16.data() + ((row0 + r) * xr.padded_groups + g0) * 4);
    }
    for (int c = 0; c < NC; ++c) {
      const int64_t n = n0 + c;
      const __m512i v = _mm512_maskz_loadu_epi8(bytes, m.q + n * m.row_bytes() + g0 * 16);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512 s = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(lanes, m.scale + n * G + g0));
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
      float y = _mm512_reduce_add_ps(acc[c][r]);
      if (m.zero) {  // sum over groups of offset x the group's sum of x
        const float* sums = xr.block_sums.data() + (row0 + r) * xr.padded_groups;
        __m512 z = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g += 16) {
          const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
          z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m.zero + n * G + g), _mm512_maskz_loadu_ps(k, sums + g), z);
        }
        y += _mm512_reduce_add_ps(z);
      }
      Y[r * ldy + n] = y;
    }
  }
}

template <int NC>
void tile_rows_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t n0, float* Y) {
  int64_t r = 0;
  for (; r + 4 <= xr.rows; r += 4) tile_vnni<NC, 4>(m, xr, r, n0, Y + r * m.n, m.n);
  switch (xr.rows - r) {
    case 3: tile_vnni<NC, 3>(m, xr, r, n0, Y + r * m.n, m.n); break;
    case 2: tile_vnni<NC, 2>(m, xr, r, n0, Y + r * m.n, m.n); break;
    case 1: tile_vnni<NC, 1>(m, xr, r, n0, Y + r * m.n, m.n); break;
    default: break;
  }
}

void channels_vnni(const QuantMatrix& m, const Int8Rows& xr, int64_t n0, int64_t n1, float* Y) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_rows_vnni<4>(m, xr, n, Y);
  for (; n < n1; ++n) tile_rows_vnni<1>(m, xr, n, Y);
}
#endif

#if defined(PAGEDLLM_AMX)
// Many rows of bf16 activations on AMX tiles. For each 16 output channels, the weights are
// dequantized once into a bf16 block that stays in L1 (16 x K), and every 16 rows of x multiply it
// in tile dot-products that accumulate over all of K in the tile. Where the float GEMM path first
// dequantizes the whole layer to memory and oneDNN then re-lays it out, this reads the packed
// weights once per step and writes nothing but the output. The arithmetic is that of the float
// GEMM on bf16-dequantized weights.

// oneDNN's switch, obeyed here too: ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) set to
// an instruction set below AMX runs the machine as one without it (memory/machine.py reads it the
// same way for the planner).
bool isa_cap_allows_amx() {
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
bool amx_ready() {
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

// Channels [n0, n0 + 16) dequantized to bf16 as the tiles' B operand: per 32 columns, 16 column
// pairs x 16 channels x 2 (channels past the matrix are zero). Each channel's 32 columns are one
// register of 16 pairs; 16 channels' registers transposed give the 16 rows of pairs.
void dequant_channels(const QuantMatrix& m, int64_t n0, c10::BFloat16* out) {
  const int64_t count = std::min<int64_t>(16, m.n - n0);
  __m512i r[16];
  for (int64_t k0 = 0; k0 < m.k; k0 += 32) {
    for (int64_t c = 0; c < 16; ++c) {
      if (c >= count) {
        r[c] = _mm512_setzero_si512();
        continue;
      }
      __m512 lo, hi;
      dequant_step(m, n0 + c, k0, lo, hi);
      if (m.bits == 8) {  // 16 columns a step
        __m512 unused;
        dequant_step(m, n0 + c, k0 + 16, hi, unused);
      }
      r[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    transpose16x16(r);
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

void amx_linear(const QuantMatrix& m, const c10::BFloat16* X, int64_t rows, float* Y) {
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
#endif

// Channels [n0, n1) of Y = X W^T, X float32 [rows, K].
void channels(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, int64_t n1, float* Y) {
#if defined(CPU_CAPABILITY_AVX512)
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile_rows<4>(m, X, rows, n, Y);
  for (; n < n1; ++n) tile_rows<1>(m, X, rows, n, Y);
#else
  float w[32];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) Y[r * m.n + n] = 0.f;
    for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
      dequant_step_scalar(m, n, k0, w);
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = X + r * m.k + k0;
        float s = 0.f;
        for (int64_t j = 0; j < m.step(); ++j) s += w[j] * x[j];
        Y[r * m.n + n] += s;
      }
    }
  }
#endif
}

QuantMatrix check_quant(const Tensor& q, const Tensor& scale, const c10::optional<Tensor>& zero, int64_t bits,
                        int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "qweight must be a contiguous matrix");
  TORCH_CHECK(bits == 4 ? q.scalar_type() == at::kByte : q.scalar_type() == at::kChar,
              "qweight must be uint8 (4-bit) or int8 (8-bit)");
  QuantMatrix m;
  m.q = reinterpret_cast<const uint8_t*>(q.data_ptr());
  m.bits = bits;
  m.group = group;
  m.n = q.size(0);
  m.k = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(group > 0 && group % m.step() == 0 && m.k % group == 0, "group ", group, " must be a multiple of ",
              m.step(), " dividing the ", m.k, " columns");
  m.G = m.k / group;
  m.shift = (group & (group - 1)) == 0 ? __builtin_ctzll(uint64_t(group)) : -1;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == m.n &&
                  scale.size(1) == m.groups(),
              "scale must be contiguous float32 [rows, columns / group]");
  m.scale = scale.data_ptr<float>();
  m.zero = nullptr;
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->sizes() == scale.sizes(),
                "zero must be contiguous float32 shaped like scale");
    m.zero = zero->data_ptr<float>();
  }
  return m;
}

Tensor quant_linear(const Tensor& x, const Tensor& qweight, const Tensor& scale, const c10::optional<Tensor>& zero,
                    int64_t bits, int64_t group) {
  const QuantMatrix m = check_quant(qweight, scale, zero, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == m.k, "x must be [rows, ", m.k, "]");
  const int64_t rows = x.size(0);
  Tensor Y = at::empty({rows, m.n}, x.options().dtype(at::kFloat));
  float* yp = Y.data_ptr<float>();
#if defined(PAGEDLLM_AMX)
  if (x.scalar_type() == at::kBFloat16 && m.k % 32 == 0 && rows > 8 && amx_ready()) {
    const Tensor xb = x.contiguous();
    amx_linear(m, xb.data_ptr<c10::BFloat16>(), rows, yp);
    return Y.to(x.scalar_type());
  }
#endif
  const Tensor X = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = X.data_ptr<float>();
  // Whole 4-channel tiles per thread, about 64 KiB of weights per chunk.
  const int64_t tiles = (m.n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 4 * m.row_bytes()));
#if defined(PAGEDLLM_VNNI)
  if (x.scalar_type() == at::kBFloat16 && m.bits == 4 && m.group == 32) {
    Int8Rows xr;
    quantize_rows(xp, rows, m.k, xr);
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      channels_vnni(m, xr, t0 * 4, std::min(m.n, t1 * 4), yp);
    });
    return Y.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    channels(m, xp, rows, t0 * 4, std::min(m.n, t1 * 4), yp);
  });
  return x.scalar_type() == at::kFloat ? Y : Y.to(x.scalar_type());
}

Tensor dequantize(const Tensor& qweight, const Tensor& scale, const c10::optional<Tensor>& zero, int64_t bits,
                  int64_t group, const c10::optional<Tensor>& rows, at::ScalarType dtype) {
  const QuantMatrix m = check_quant(qweight, scale, zero, bits, group);
  const bool picked = rows.has_value() && rows->defined();
  Tensor index;
  if (picked) {
    index = rows->to(at::kLong).contiguous();
    TORCH_CHECK(index.dim() == 1, "rows must be a vector of row indices");
  }
  const int64_t count = picked ? index.size(0) : m.n;
  const int64_t* ids = picked ? index.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < (picked ? count : 0); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < m.n, "row ", ids[i], " out of range for ", m.n, " rows");
  Tensor out = at::empty({count, m.k}, qweight.options().dtype(dtype));
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    at::parallel_for(0, count, std::max<int64_t>(1, 16384 / m.k), [&](int64_t i0, int64_t i1) {
      alignas(64) float w[32];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = picked ? ids[i] : i;
        T* dst = o + i * m.k;
        for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
#if defined(CPU_CAPABILITY_AVX512)
          __m512 lo, hi;
          dequant_step(m, n, k0, lo, hi);
          store_w(dst + k0, VF(lo));
          if (m.bits == 4) store_w(dst + k0 + 16, VF(hi));
#else
          dequant_step_scalar(m, n, k0, w);
          for (int64_t j = 0; j < m.step(); ++j) dst[k0 + j] = narrow<T>(w[j]);
#endif
        }
      }
      (void)w;
    });
  });
  return out;
}

// Whether quant_linear runs many rows of bf16 activations on AMX tiles.
bool quant_linear_tiles() {
#if defined(PAGEDLLM_AMX)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int bits, int group) -> Tensor");
  m.def("quant_linear_tiles() -> bool", &quant_linear_tiles);
  m.def(
      "dequantize(Tensor qweight, Tensor scale, Tensor? zero, int bits, int group, Tensor? rows, ScalarType dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize", &dequantize);
}
