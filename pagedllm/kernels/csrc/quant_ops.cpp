// Kernels for weights kept quantized (pagedllm/layers/quantized.py):
//
// - quant_linear: y = x @ dequant(W)^T for a few rows of x, reading each packed weight once. One
//   decode step of one request is exactly this: its time is the bytes of the weights read, so a
//   4-bit weight costs a quarter of a bf16 one. Many rows (prefill, big batches) go to a GEMM on
//   weights dequantized a layer at a time instead (the layer chooses).
// - dequantize: the float rows of a quantized matrix (that GEMM path; embedding lookups).
//
// Layout (what pagedllm/loading/gguf_quants.py produces from GGUF blocks, and the layer from an
// HF checkpoint): value[n][k] = q[n][k] * scale[n][k / group] + zero[n][k / group] (zero may be
// absent: 0), scale and zero float32. 4-bit q (0..15) sit two to a byte, per 32 columns from k0:
// byte k0/2 + j holds column k0 + j in its low nibble and k0 + 16 + j in its high one, as GGUF's
// Q4_0/Q4_1 blocks do. 8-bit q are int8, one per byte.

#include "common.h"

namespace {

using namespace pagedllm;

struct QuantMatrix {
  const uint8_t* q;  // int4: [N, K / 2]; int8: [N, K] (read as int8)
  const float* scale;
  const float* zero;  // nullptr: no offsets
  int64_t n, k, bits, group;
  int64_t row_bytes() const { return bits == 4 ? k / 2 : k; }
  int64_t groups() const { return k / group; }
  // Columns handled per step: a 4-bit step unpacks 16 bytes into 32 values, an 8-bit one 16.
  int64_t step() const { return bits == 4 ? 32 : 16; }
};

// The values of columns [k0, k0 + step) of row n, in order, into `out` (scalar; any CPU).
inline void dequant_step_scalar(const QuantMatrix& m, int64_t n, int64_t k0, float* out) {
  const int64_t g = n * m.groups() + k0 / m.group;
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
  const int64_t g = n * m.groups() + k0 / m.group;
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
  const Tensor X = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  Tensor Y = at::empty({rows, m.n}, x.options().dtype(at::kFloat));
  // Whole 4-channel tiles per thread, about 64 KiB of weights per chunk.
  const int64_t tiles = (m.n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 4 * m.row_bytes()));
  const float* xp = X.data_ptr<float>();
  float* yp = Y.data_ptr<float>();
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int bits, int group) -> Tensor");
  m.def(
      "dequantize(Tensor qweight, Tensor scale, Tensor? zero, int bits, int group, Tensor? rows, ScalarType dtype) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize", &dequantize);
}
