// dense_linear: y = x W^T (+ bias) for bf16 x and bf16 weights held in one packed layout that
// both of this CPU's bf16 instructions read directly (pagedllm/backends/cpu_compiled.py packs it):
//
//   packed[b][kk][p][c][j] = W[16 b + c][32 kk + 2 p + j]   ([N/16, K/32, 16, 32] bf16)
//
// i.e. per 16 output channels and 32 columns, 16 column pairs x 16 channels x 2. That is the
// B operand of an AMX tile product (amx.h) as it is, and each 64-byte row of it is one
// AVX512-BF16 dot-product operand: 16 channels' pair of weights.
//
// - Two rows and more, on AMX tiles: 16 channels at a time against every 16 rows
//   (amx::rows_by_blocks), weights read in place. Measured here (2 cores, the default model's
//   30 layers of shapes, benchmarks/dense_gemm.py): at 2-16 rows, as a decode step has them,
//   ~11 ms a step (19 GB/s of weights) where oneDNN's packed GEMM took 18-20 (it reads its weights
//   at ~10-12 GB/s at any row count below 32); 0.87-1.03x of it at 208 rows.
// - One row: AVX512-BF16 dot products, each 64-byte row of weights one operand for 16 channels
//   (a 32-bit pair of x broadcast against it): ~11 ms a step, at the memory's rate.
// The backend packs for this only where amx_tiles() (AMX built, granted, not capped): the dot
// products alone are compute-bound from a few rows (one instruction per 32 multiplies), and
// oneDNN's GEMM beats them at prefill sizes on a CPU without AMX. The op itself runs anywhere
// AVX512-BF16 is compiled in. Both paths sum bf16 products in float32 and round once to bf16
// at the end, as oneDNN does; the bias is added in float32 before that rounding.

#include "amx.h"
#include "common.h"
#include "ops.h"

namespace pagedllm {

#if defined(PAGEDLLM_AVX512_BF16)
namespace {

constexpr int64_t MAX_ROWS_PER_TILE = 8;  // rows of x per pass over a panel of weights
// Rows from which AMX tiles (16-row products) beat the dot products, where AMX is granted.
constexpr int64_t AMX_MIN_ROWS = 2;

struct DenseMatrix {
  const c10::BFloat16* w;  // packed
  const c10::BFloat16* bias;  // nullptr: none
  int64_t n, k;
  const c10::BFloat16* block(int64_t b) const { return w + b * 16 * k; }
};

// Y[r][16 (b0 + j) + c] for MR rows and NB 16-channel blocks from b0: MR x NB accumulators, each
// weight register used by all MR rows.
template <int MR, int NB>
void dot_tile(const DenseMatrix& m, const c10::BFloat16* X, int64_t b0, c10::BFloat16* Y) {
  __m512 acc[NB][MR];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MR; ++r) acc[j][r] = _mm512_setzero_ps();
  const c10::BFloat16* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = m.block(b0 + j);
  for (int64_t kk = 0; kk < m.k; kk += 32) {
    for (int p = 0; p < 16; ++p) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kk * 16 + p * 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, X + r * m.k + kk + 2 * p, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], xv, wv[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (b0 + j) * 16;
    const __m512 bias = m.bias ? avx512::load_bf16(m.bias + n0, 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      _mm256_storeu_si256((__m256i*)(Y + r * m.n + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j][r], bias)));
  }
}

template <int NB>
void dot_rows(const DenseMatrix& m, const c10::BFloat16* X, int64_t rows, int64_t b0, c10::BFloat16* Y) {
  switch (rows) {
    case 1: return dot_tile<1, NB>(m, X, b0, Y);
    case 2: return dot_tile<2, NB>(m, X, b0, Y);
    case 3: return dot_tile<3, NB>(m, X, b0, Y);
    case 4: return dot_tile<4, NB>(m, X, b0, Y);
    case 5: return dot_tile<5, NB>(m, X, b0, Y);
    case 6: return dot_tile<6, NB>(m, X, b0, Y);
    case 7: return dot_tile<7, NB>(m, X, b0, Y);
    case 8: return dot_tile<8, NB>(m, X, b0, Y);
    default: TORCH_CHECK(false, "dot_rows: ", rows, " rows");
  }
}

// Panels of two blocks (32 channels) per task; for each, every eight rows of x in turn, so the
// panel (2 x 16 x K bf16: 36 KiB at K = 576) is read from memory once and from cache after.
void dot_linear(const DenseMatrix& m, const c10::BFloat16* X, int64_t rows, c10::BFloat16* Y) {
  const int64_t blocks = m.n / 16, panels = (blocks + 1) / 2;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = 2 * p;
      for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS_PER_TILE) {
        const int64_t mr = std::min(MAX_ROWS_PER_TILE, rows - r0);
        if (b0 + 1 < blocks)
          dot_rows<2>(m, X + r0 * m.k, mr, b0, Y + r0 * m.n);
        else
          dot_rows<1>(m, X + r0 * m.k, mr, b0, Y + r0 * m.n);
      }
    }
  });
}

#if defined(PAGEDLLM_AMX)
void amx_dense_linear(const DenseMatrix& m, const c10::BFloat16* X, int64_t rows, c10::BFloat16* Y) {
  amx::rows_by_blocks(
      X, rows, m.n, m.k, [&](int64_t b, std::vector<c10::BFloat16>&) { return m.block(b); },
      [&](int64_t r0, int64_t n0, int64_t count, const float* C) {
        const __m512 bias = m.bias ? avx512::load_bf16(m.bias + n0, 16) : _mm512_setzero_ps();
        for (int64_t i = 0; i < 16 && r0 + i < rows; ++i)
          avx512::store_bf16(Y + (r0 + i) * m.n + n0, _mm512_add_ps(_mm512_loadu_ps(C + i * 16), bias), count);
      });
}
#endif

}  // namespace
#endif  // PAGEDLLM_AVX512_BF16

Tensor dense_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias) {
#if defined(PAGEDLLM_AVX512_BF16)
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 32,
              "packed must be contiguous bf16 [N / 16, K / 32, 16, 32]");
  DenseMatrix m;
  m.w = packed.data_ptr<c10::BFloat16>();
  m.n = packed.size(0) * 16;
  m.k = packed.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == m.k && x.scalar_type() == at::kBFloat16, "x must be bf16 [rows, ", m.k,
              "]");
  m.bias = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == m.n && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_contiguous(),
                "bias must be contiguous bf16 [", m.n, "]");
    m.bias = bias->data_ptr<c10::BFloat16>();
  }
  const Tensor X = x.contiguous();
  const int64_t rows = X.size(0);
  Tensor Y = at::empty({rows, m.n}, x.options());
  if (rows == 0) return Y;
  const c10::BFloat16* xp = X.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = Y.data_ptr<c10::BFloat16>();
#if defined(PAGEDLLM_AMX)
  if (rows >= AMX_MIN_ROWS && amx::amx_ready()) {
    amx_dense_linear(m, xp, rows, yp);
    return Y;
  }
#endif
  dot_linear(m, xp, rows, yp);
  return Y;
#else
  TORCH_CHECK(false, "dense_linear needs kernels built for AVX512-BF16");
#endif
}

}  // namespace pagedllm
