// The pointwise work between the GEMMs: rms_norm, add_rms_norm, silu_mul and rotary, one pass
// each where eager PyTorch takes three to six ops and as many temporaries.
//
// Arithmetic follows HF transformers' eager order (float32 norms, bf16 results rounded where HF
// rounds them), so fp32 greedy output matches it. Loops are written for the compiler to
// vectorize on ATen's Vectorized<float>, no intrinsics: the same source builds for any CPU.

#include "common.h"
#include "ops.h"

namespace pagedllm {
namespace {

// Rows per parallel chunk so that a chunk holds ~16k elements: small batches stay on one thread.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

template <typename T>
void rms_norm_row(T* __restrict y, const T* __restrict x, const T* __restrict w, float eps, int64_t n) {
  VF ss(0.f);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t m = std::min(W, n - i);
    const VF v = load_w(x + i, m);
    ss = at::vec::fmadd(v, v, ss);
  }
  const float sum = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return a + b; }, ss);
  const VF r(1.f / std::sqrt(sum / float(n) + eps));
  // HF: (x * rsqrt(var + eps)).to(dtype) * weight, the product in the activation dtype.
  for (int64_t i = 0; i < n; i += W) {
    const int64_t m = std::min(W, n - i);
    store_w(y + i, round_w<T>(load_w(x + i, m) * r) * load_w(w + i, m), m);
  }
}

void check_rows(const Tensor& x, const Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "expected x [rows, n] and weight [n], contiguous, one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
}

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x, weight);
  Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row(y.data_ptr<scalar_t>() + r * n, x.data_ptr<scalar_t>() + r * n, weight.data_ptr<scalar_t>(),
                     float(eps), n);
    });
  });
  return y;
}

// residual += x (in place, in the activation dtype, as HF's `residual + hidden`), then returns
// the RMSNorm of the sum: the residual add and the next sub-layer's norm in one pass.
Tensor add_rms_norm(Tensor residual, const Tensor& x, const Tensor& weight, double eps) {
  check_rows(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() && x.scalar_type() == residual.scalar_type(),
              "x must match the residual");
  Tensor y = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = scalar_t;
    at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T* h = residual.data_ptr<T>() + r * n;
        const T* a = x.data_ptr<T>() + r * n;
        for (int64_t i = 0; i < n; i += W) {
          const int64_t m = std::min(W, n - i);
          store_w(h + i, load_w(h + i, m) + load_w(a + i, m), m);
        }
        rms_norm_row(y.data_ptr<T>() + r * n, h, weight.data_ptr<T>(), float(eps), n);
      }
    });
  });
  return y;
}

// gate_up: [rows, 2I], gate then up (one fused GEMM's output). Returns silu(gate) * up, [rows, I],
// rounded to the activation dtype after the silu and after the product, as HF's two ops do.
Tensor silu_mul(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "expected [rows, 2I]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  Tensor out = at::empty({rows, inner}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = scalar_t;
    at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* gu = gate_up.data_ptr<T>() + r * 2 * inner;
        T* o = out.data_ptr<T>() + r * inner;
        for (int64_t i = 0; i < inner; i += W) {
          const int64_t n = std::min(W, inner - i);
          const VF g = load_w(gu + i, n);
          const VF act = round_w<T>(g / (VF(1.f) + g.neg().exp()));
          store_w(o + i, act * load_w(gu + inner + i, n), n);
        }
      }
    });
  });
  return out;
}

// In place on q [T, H, D] and k [T, KVH, D] (rows may be strided: views into a fused qkv output):
// x = x * cos + rotate_half(x) * sin, cos/sin [T, D] in the activation dtype, as HF applies it.
void rotary(Tensor q, Tensor k, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "bad q/k");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "q and k heads must be contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos/sin must be [tokens, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share one dtype");
  const int64_t D = q.size(2), half = D / 2;
  dispatch(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = scalar_t;
    auto rotate = [&](T* x, const T* c, const T* s) {
      for (int64_t d = 0; d < half; d += W) {
        const int64_t n = std::min(W, half - d);
        const VF lo = load_w(x + d, n), hi = load_w(x + half + d, n);
        const VF lo_out = round_w<T>(lo * load_w(c + d, n)) + round_w<T>(hi.neg() * load_w(s + d, n));
        const VF hi_out = round_w<T>(hi * load_w(c + half + d, n)) + round_w<T>(lo * load_w(s + half + d, n));
        store_w(x + d, lo_out, n);
        store_w(x + half + d, hi_out, n);
      }
    };
    at::parallel_for(0, q.size(0), row_grain((q.size(1) + k.size(1)) * D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const T* c = cos.data_ptr<T>() + t * D;
        const T* s = sin.data_ptr<T>() + t * D;
        for (int64_t h = 0; h < q.size(1); ++h) rotate(q.data_ptr<T>() + t * q.stride(0) + h * D, c, s);
        for (int64_t h = 0; h < k.size(1); ++h) rotate(k.data_ptr<T>() + t * k.stride(0) + h * D, c, s);
      }
    });
  });
}

}  // namespace pagedllm
