// Helpers every pagedllm kernel source shares: float32/bfloat16 loads and stores one vector at a
// time, rounding as HF's eager code rounds, and the dtype dispatch. The AVX-512 bf16 conversions
// come from vec_avx512.h; elsewhere the same calls run a scalar loop.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_avx512.h"

namespace pagedllm {

using at::Tensor;
using VF = at::vec::Vectorized<float>;
constexpr int64_t W = VF::size();

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
inline T narrow(float x) {
  return T(x);  // c10::BFloat16(float) rounds to nearest even
}
// x rounded to T and back: where HF's eager code holds an intermediate in the activation dtype.
template <typename T>
inline float round_to(float x) {
  return widen(narrow<T>(x));
}

template <typename T>
inline void widen_row(float* __restrict dst, const T* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

// W elements (n <= W) of T as one vector of floats, and back (bf16 rounded to nearest even).
inline VF load_w(const float* p, int64_t n = W) { return n == W ? VF::loadu(p) : VF::loadu(p, n); }
inline void store_w(float* p, const VF& v, int64_t n = W) {
  if (n == W)
    v.store(p);
  else
    v.store(p, n);
}
#if defined(PAGEDLLM_AVX512_BF16)
inline VF load_w(const c10::BFloat16* p, int64_t n = W) { return VF(avx512::load_bf16(p, n)); }
inline void store_w(c10::BFloat16* p, const VF& v, int64_t n = W) { avx512::store_bf16(p, __m512(v), n); }
#else
inline VF load_w(const c10::BFloat16* p, int64_t n = W) {
  alignas(64) float f[W] = {};
  for (int64_t i = 0; i < n; ++i) f[i] = widen(p[i]);
  return VF::loadu(f);
}
inline void store_w(c10::BFloat16* p, const VF& v, int64_t n = W) {
  alignas(64) float f[W];
  v.store(f);
  for (int64_t i = 0; i < n; ++i) p[i] = narrow<c10::BFloat16>(f[i]);
}
#endif
// v rounded to T and back, as where HF's eager code holds an intermediate in the activation dtype.
template <typename T>
inline VF round_w(const VF& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T t[W];
    store_w(t, v);
    return load_w(t);
  }
}

// Runs f(T{}) for T = float or c10::BFloat16, the dtypes the engine runs.
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat)
    f(float{});
  else if (dtype == at::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, "float32 or bfloat16 only, got ", dtype);
}

}  // namespace pagedllm
