// Kernels for weights kept quantized (pagedllm/layers/quantized.py); the layout is quant.h's.
//
// - quant_linear: y = x @ dequant(W)^T for a few rows of x, reading each packed weight once. One
//   decode step of one request is exactly this: its time is the bytes of the weights read, so a
//   4-bit weight costs a quarter of a bf16 one. Many rows (prefill, big batches) go to a GEMM on
//   weights dequantized a layer at a time instead (the layer chooses), or, with bf16 activations
//   on a CPU with AMX, to AMX tiles here (amx.h).
//   With bfloat16 activations and 4-, 5- or 8-bit weights in groups of 32 (Q4_0/Q4_1/int4,
//   Q5_0/Q5_1, Q8_0, IQ4_NL, MXFP4) or K-quant blocks (Q4_K, Q5_K, Q6_K, IQ4_XS), each row of x is
//   itself quantized to 8 bits per 32 columns (as llama.cpp does) and the products are summed as
//   integers, 64 per instruction (AVX512-VNNI, quant_avx512.h, quant_blocks_avx512.h): a quarter
//   of the instructions of the float path. float32 activations take the float path, which computes with the exact weight values (its results
//   match a GEMM on the dequantized weights).
// - dequantize: the float rows of a quantized matrix (that GEMM path; embedding lookups).
// - amx_tiles: whether the kernels' bf16 GEMMs run on AMX tiles in this process (quant_linear's
//   many rows; dense_gemm.cpp's dense_linear, for which the backend then packs bf16 weights).

#include <atomic>
#include <limits>

#include "amx.h"
#include "common.h"
#include "ops.h"
#include "quant.h"
#include "quant_avx2.h"
#include "quant_avx512.h"

namespace pagedllm {

// One bf16 row against a K-quant matrix: one channel at a time while the model's weights stream
// from memory (one address stream a thread: 36-41 GB/s against 33 for four channels in turn, the
// Zen 5 EPYC), four while they fit in the L3 (in L3 four channels ran 69-72 GB/s, one 52-55):
// the backend sets it from the weights its models hold (CPUCompiledBackend.hold_weights).
static std::atomic<bool> k_quant_row_by_channel{true};
namespace {

// Channels [n0, n1) of Y = X W^T, X float32 [rows, K].
void channels(const QuantMatrix& m, const float* X, int64_t rows, int64_t n0, int64_t n1, float* Y) {
#if defined(PAGEDLLM_AVX512)
  avx512::channels(m, X, rows, n0, n1, Y);
#elif defined(PAGEDLLM_AVX2)
  avx2::channels(m, X, rows, n0, n1, Y);
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

// K-quant blocks as stored: q uint8 [N, K / 256 x the type's block bytes]; scale holds nothing
// ([N, 0]: the blocks carry their scales), zero none.
QuantMatrix check_raw(const Tensor& q, const Tensor& scale, int64_t type) {
  const int64_t block_bytes = raw_block_bytes(type);
  TORCH_CHECK(block_bytes > 0, "layout ", kRawLayout + type, ": ggml type ", type, " is not a K-quant the kernels read");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(1) % block_bytes == 0,
              "a K-quant's qweight must be contiguous uint8 [rows, blocks x ", block_bytes, "]");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == 0,
              "a K-quant's scale must be empty [rows, 0]: its scales are in its blocks");
  QuantMatrix m;
  m.q = q.data_ptr<uint8_t>();
  m.scale = nullptr;
  m.zero = nullptr;
  m.raw = type;
  m.bits = 4;  // a step is 32 columns, as 4-bit's (quant.h)
  m.n = q.size(0);
  m.k = q.size(1) / block_bytes * kSuperBlock;
  m.group = kSuperBlock;
  m.G = m.k / kSuperBlock;
  m.shift = 8;
  return m;
}

// `bits`: 4 or 8, plus 256 x a codebook's number for 4-bit codes (quant.h); or kRawLayout + a
// K-quant's ggml type number.
QuantMatrix check_quant(const Tensor& q, const Tensor& scale, const c10::optional<Tensor>& zero, int64_t layout,
                        int64_t group) {
  if (layout >= kRawLayout) return check_raw(q, scale, layout - kRawLayout);
  const int64_t bits = layout & 255, codebook = layout >> 8;
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "bits must be 4, 5 or 8, got ", bits);
  if (bits == 5) {
    TORCH_CHECK(codebook == 0 || codebook == kCentered5, "5-bit weights take no codebook but Q5_0's centre");
  } else {
    TORCH_CHECK(codebook >= 0 && codebook < kCodebookCount && (codebook == 0 || bits == 4), "codebook ", codebook,
                " is not one of 4-bit weights' ", kCodebookCount - 1);
  }
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "qweight must be a contiguous matrix");
  TORCH_CHECK(bits == 8 ? q.scalar_type() == at::kChar : q.scalar_type() == at::kByte,
              "qweight must be uint8 (4- and 5-bit) or int8 (8-bit)");
  TORCH_CHECK(bits != 5 || (q.size(1) % kFiveBitGroupBytes == 0 && group == 32),
              "5-bit qweight must be 20 bytes per group of 32 columns");
  QuantMatrix m;
  m.q = reinterpret_cast<const uint8_t*>(q.data_ptr());
  m.bits = bits;
  m.codes = codebook && bits == 4 ? kCodebooks[codebook] : nullptr;
  m.centered = bits == 5 && codebook == kCentered5;
  m.group = group;
  m.n = q.size(0);
  m.k = bits == 4 ? q.size(1) * 2 : bits == 5 ? q.size(1) / kFiveBitGroupBytes * 32 : q.size(1);
  TORCH_CHECK(group > 0 && group % m.step() == 0 && m.k % group == 0, "group ", group, " must be a multiple of ",
              m.step(), " dividing the ", m.k, " columns");
  m.G = m.k / group;
  m.shift = (group & (group - 1)) == 0 ? __builtin_ctzll(uint64_t(group)) : -1;
  const bool half = scale.scalar_type() == at::kHalf, e8m0 = scale.scalar_type() == at::kByte;
  TORCH_CHECK((scale.scalar_type() == at::kFloat || ((half || e8m0) && group == 32)) && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == m.n && scale.size(1) == m.groups(),
              "scale must be contiguous float32 [rows, columns / group] (float16 or uint8 exponents for groups of 32)");
  m.scale = half || e8m0 ? nullptr : scale.data_ptr<float>();
  m.scale_h = half ? reinterpret_cast<const uint16_t*>(scale.data_ptr()) : nullptr;
  m.scale_e = e8m0 ? scale.data_ptr<uint8_t>() : nullptr;
  m.zero = nullptr;
  TORCH_CHECK(!e8m0 || !(zero.has_value() && zero->defined()), "exponent scales (MXFP4) take no offsets");
  if (zero.has_value() && zero->defined()) {
    TORCH_CHECK(zero->scalar_type() == scale.scalar_type() && zero->is_contiguous() && zero->sizes() == scale.sizes(),
                "zero must be contiguous and shaped like scale, of its dtype");
    if (half)
      m.zero_h = reinterpret_cast<const uint16_t*>(zero->data_ptr());
    else
      m.zero = zero->data_ptr<float>();
  }
  return m;
}

// Row n of the matrix, dequantized into dst (m.k values of T).
template <typename T>
inline void dequantize_row(const QuantMatrix& m, int64_t n, T* dst) {
  for (int64_t k0 = 0; k0 < m.k; k0 += m.step()) {
#if defined(PAGEDLLM_AVX512)
    __m512 lo, hi;
    avx512::dequant_step(m, n, k0, lo, hi);
    store_w(dst + k0, VF(lo));
    if (m.step() == 32) store_w(dst + k0 + 16, VF(hi));
#elif defined(PAGEDLLM_AVX2)
    __m256 w[4];
    avx2::dequant_step(m, n, k0, w);
    alignas(32) float values[32];
    for (int v = 0; v < m.step() / 8; ++v) _mm256_store_ps(values + 8 * v, w[v]);
    for (int64_t j = 0; j < m.step(); ++j) dst[k0 + j] = narrow<T>(values[j]);
#else
    alignas(64) float w[32];
    dequant_step_scalar(m, n, k0, w);
    for (int64_t j = 0; j < m.step(); ++j) dst[k0 + j] = narrow<T>(w[j]);
#endif
  }
}

}  // namespace

Tensor quant_linear(const Tensor& x, const Tensor& qweight, const Tensor& scale, const c10::optional<Tensor>& zero,
                    int64_t bits, int64_t group) {
  const QuantMatrix m = check_quant(qweight, scale, zero, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == m.k, "x must be [rows, ", m.k, "]");
  const int64_t rows = x.size(0);
  Tensor Y = at::empty({rows, m.n}, x.options().dtype(at::kFloat));
  float* yp = Y.data_ptr<float>();
#if defined(PAGEDLLM_AMX)
  if (x.scalar_type() == at::kBFloat16 && m.k % 32 == 0 && rows > 8 && amx::amx_ready()) {
    const Tensor xb = x.contiguous();
    amx::amx_linear(m, xb.data_ptr<c10::BFloat16>(), rows, yp);
    return Y.to(x.scalar_type());
  }
#endif
  const Tensor X = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xp = X.data_ptr<float>();
  // Whole 4-channel tiles per thread, about 64 KiB of weights per chunk.
  const int64_t tiles = (m.n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 4 * m.row_bytes()));
#if defined(PAGEDLLM_VNNI)
  const bool vnni_layout =
      m.raw ? avx512::vnni_takes_raw(m.raw) : m.group == 32 || (m.bits == 8 && m.group == 16 && m.k % 32 == 0);
  if (x.scalar_type() == at::kBFloat16 && vnni_layout) {
    avx512::Int8Rows xr;
    avx512::quantize_rows(xp, rows, m.k, xr);
    const bool by_channel = !m.raw || k_quant_row_by_channel.load(std::memory_order_relaxed);
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      avx512::channels_vnni(m, xr, t0 * 4, std::min(m.n, t1 * 4), yp, by_channel);
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
      for (int64_t i = i0; i < i1; ++i) dequantize_row(m, picked ? ids[i] : i, o + i * m.k);
    });
  });
  return out;
}

bool set_k_quant_row_by_channel(bool on) { return k_quant_row_by_channel.exchange(on); }

int64_t quant_float_max_rows() {
#if defined(PAGEDLLM_AVX512)
  return std::numeric_limits<int64_t>::max();  // measured against dequantize + GEMM from 8 to 512 rows
#elif defined(PAGEDLLM_AVX2)
  return 64;  // ahead of dequantize + GEMM up to 48-64 rows, behind at 512 (docs/quantization.md)
#else
  return 8;  // the scalar loop: as few rows as bf16 ones
#endif
}

bool amx_tiles() {
#if defined(PAGEDLLM_AMX)
  return amx::amx_ready();
#else
  return false;
#endif
}

}  // namespace pagedllm
