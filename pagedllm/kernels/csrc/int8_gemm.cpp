// w8a8_linear: y = x @ W^T with x rounded to int8 per row at run time and W int8 per output row
// (quantization="w8a8", pagedllm/layers/quantized.py). One op where the PyTorch path
// (backends/cpu_torch.int8_matmul) takes seven: each row of x rounded in one pass (its step: the
// row's absmax / 127, the division and round-half-to-even of torch.round, so both paths give the
// same integers), oneDNN's int8 GEMM (at::_int_mm: VNNI dot products, int32 sums), and the sums
// scaled by the row's and the channel's step in one pass straight into the float output.

#include <ATen/ops/_int_mm.h>

#include "common.h"
#include "ops.h"

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
  Tensor sums = at::_int_mm(q, qweight.t());
  q.reset();
  Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const int32_t* sp = sums.data_ptr<int32_t>();
  const float* wp = scale.data_ptr<float>();
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

}  // namespace pagedllm
