// w8a8_linear: y = x @ W^T with x rounded to int8 per row at run time and W int8 per output row
// (quantization="w8a8", pagedllm/layers/quantized.py). One op where the PyTorch path
// (backends/cpu_torch.int8_matmul) takes seven: each row of x rounded in one pass (its step: the
// row's absmax / 127, the division and round-half-to-even of torch.round, so both paths give the
// same integers), the integer GEMM (int32 sums), and the sums scaled by the row's and the
// channel's step in one pass straight into the float output.
//
// The integer GEMM: on a CPU with VNNI dot products (AVX512-VNNI, AVX-VNNI) oneDNN's
// (at::_int_mm). Without them oneDNN multiplies unsigned by signed bytes in 16-bit pairs
// (vpmaddubsw), which saturate, so its sums are not exact, and on an AVX2-only EPYC w8a8 ran 18x
// slower than vLLM's float32 (issue 52): there the sums are ours (int8_channels_avx2), exact: each
// 16 columns of a weight row widened to 16 bits once for 4 rows of x, vpmaddwd per row.

#include <ATen/ops/_int_mm.h>

#include "common.h"
#include "ops.h"

#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
#define PAGEDLLM_INT8_SUMS_AVX2 1
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

template <typename T>
float round_row(const T* __restrict x, int64_t k, int8_t* __restrict q) {
  VF top(0.f);
  for (int64_t i = 0; i < k; i += W) top = at::vec::maximum(top, load_w(x + i, std::min(W, k - i)).abs());
  const float amax = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return at::vec::maximum(a, b); }, top);
  const float step = std::max(amax, 1e-30f) / 127.f;
  const VF s(step);
  alignas(64) float rounded[W];
  for (int64_t i = 0; i < k; i += W) {
    const int64_t m = std::min(W, k - i);
    (load_w(x + i, m) / s).round().store(rounded, m);
    for (int64_t j = 0; j < m; ++j) q[i + j] = int8_t(rounded[j]);
  }
  return step;
}

#if defined(PAGEDLLM_INT8_SUMS_AVX2)
constexpr int kRowTile = 4, kChannelTile = 3;  // 12 accumulators, 3 widened weight vectors: 15 of 16 registers
constexpr int64_t kPanelBytes = 256 * 1024;    // the weight rows one thread keeps in L2 while every row of x passes

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// MR rows of x (int16, row stride kp, columns past k zero) against NC weight rows (int8, stride
// k): out[r][c] the exact int32 sums. The columns past the last whole 16 are summed in scalar.
template <int MR, int NC>
void int8_tile(const int16_t* x, int64_t kp, const int8_t* w, int64_t k, int32_t out[kRowTile][kChannelTile]) {
  __m256i acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_si256();
  const int64_t whole = k / 16 * 16;
  for (int64_t j = 0; j < whole; j += 16) {
    __m256i wc[NC];
    for (int c = 0; c < NC; ++c)
      wc[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * k + j)));
    for (int r = 0; r < MR; ++r) {
      const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * kp + j));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(wc[c], xr));
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) {
      int32_t total = sum_lanes(acc[r][c]);
      for (int64_t j = whole; j < k; ++j) total += int32_t(x[r * kp + j]) * int32_t(w[c * k + j]);
      out[r][c] = total;
    }
}

template <int MR>
void int8_tile_rows(int nc, const int16_t* x, int64_t kp, const int8_t* w, int64_t k,
                    int32_t out[kRowTile][kChannelTile]) {
  if (nc == 3)
    int8_tile<MR, 3>(x, kp, w, k, out);
  else if (nc == 2)
    int8_tile<MR, 2>(x, kp, w, k, out);
  else
    int8_tile<MR, 1>(x, kp, w, k, out);
}

// y[r][c] = sums(q[r], w[c]) * steps[r] * scale[c] for channels [c0, c1): per panel of weight
// rows (L2), each 4 rows of q widened to 16 bits into a buffer of this thread (L1), then every
// 3 channels of the panel against them.
void int8_channels_avx2(const int8_t* q, const float* steps, int64_t rows, int64_t k, const int8_t* w,
                        const float* scale, int64_t n, int64_t c0, int64_t c1, float* y) {
  const int64_t kp = (k + 15) / 16 * 16;
  std::vector<int16_t> xs(kRowTile * kp, 0);
  const int64_t panel =
      std::max<int64_t>(kChannelTile, kPanelBytes / std::max<int64_t>(1, k) / kChannelTile * kChannelTile);
  int32_t sums[kRowTile][kChannelTile];
  for (int64_t p0 = c0; p0 < c1; p0 += panel) {
    const int64_t p1 = std::min(c1, p0 + panel);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int mr = int(std::min<int64_t>(kRowTile, rows - r0));
      for (int r = 0; r < mr; ++r)
        for (int64_t j = 0; j < k; ++j) xs[r * kp + j] = q[(r0 + r) * k + j];
      for (int64_t c = p0; c < p1; c += kChannelTile) {
        const int nc = int(std::min<int64_t>(kChannelTile, p1 - c));
        const int8_t* wc = w + c * k;
        switch (mr) {
          case 4: int8_tile_rows<4>(nc, xs.data(), kp, wc, k, sums); break;
          case 3: int8_tile_rows<3>(nc, xs.data(), kp, wc, k, sums); break;
          case 2: int8_tile_rows<2>(nc, xs.data(), kp, wc, k, sums); break;
          default: int8_tile_rows<1>(nc, xs.data(), kp, wc, k, sums); break;
        }
        for (int r = 0; r < mr; ++r)
          for (int i = 0; i < nc; ++i) y[(r0 + r) * n + c + i] = float(sums[r][i]) * steps[r0 + r] * scale[c + i];
      }
    }
  }
}
#endif

}  // namespace

Tensor w8a8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scale) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, k]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous() &&
                  qweight.size(1) == x.size(1),
              "qweight must be contiguous int8 [n, k]");
  const int64_t rows = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "scale must be n contiguous float32 values");
  const Tensor X = x.contiguous();
  Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  std::vector<float> steps(rows);
  int8_t* qp = q.data_ptr<int8_t>();
  dispatch(X.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = X.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) steps[r] = round_row(xp + r * k, k, qp + r * k);
    });
  });
  const float* wp = scale.data_ptr<float>();
#if defined(PAGEDLLM_INT8_SUMS_AVX2)
  {
    Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
    const int8_t* wq = qweight.data_ptr<int8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t tiles = (n + kChannelTile - 1) / kChannelTile;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kChannelTile * k));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      int8_channels_avx2(qp, steps.data(), rows, k, wq, wp, n, t0 * kChannelTile, std::min(n, t1 * kChannelTile), yp);
    });
    q.reset();  // before a bf16 copy of the result is made
    return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  }
#endif
  Tensor sums = at::_int_mm(q, qweight.t());
  q.reset();
  Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const int32_t* sp = sums.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float row_step = steps[r];
      for (int64_t c = 0; c < n; ++c) yp[r * n + c] = float(sp[r * n + c]) * row_step * wp[c];
    }
  });
  sums.reset();  // before a bf16 copy of the result is made
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

bool w8a8_own_sums() {
#if defined(PAGEDLLM_INT8_SUMS_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace pagedllm
