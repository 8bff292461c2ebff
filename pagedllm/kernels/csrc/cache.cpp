// write_cache: the step's new K/V rows into their paged-cache slots, as they are or quantized
// to 8 bits on the way in (int8 or fp8 e4m3, one scale per row). paged_attention calls it
// before it attends, so a step's queries see their own keys.

#include "paged_kv.h"

namespace pagedllm {
namespace {

// A token's head_dim values into the cache: as they are, or in 8 bits with one scale (absmax
// over the row mapped to the type's largest value).
template <typename T, typename C>
inline void store_row(C* dst, float* scale, const T* src, int64_t D) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(dst, src, D * sizeof(T));
  } else {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(widen(src[d])));
    constexpr float top = std::is_same_v<C, int8_t> ? 127.f : 448.f;  // e4m3's largest finite value
    const float s = amax / top, inv = amax > 0.f ? top / amax : 0.f;
    *scale = s;
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (std::is_same_v<C, int8_t>)
        dst[d] = int8_t(std::nearbyint(widen(src[d]) * inv));
      else
        dst[d] = C(widen(src[d]) * inv);
    }
  }
}

// Sequence s's new tokens, every KV head. `unused` takes the scale a full-precision cache has none for.
template <typename T, typename C>
void write_sequence(const Geometry& g, const Sequences& seqs, int64_t s, const T* k, const T* v, C* k_cache,
                    C* v_cache, float* k_scales, float* v_scales, float& unused) {
  const int64_t qstart = seqs.query_start[s], qlen = seqs.query_start[s + 1] - qstart;
  const int64_t first_pos = seqs.context_lens[s] - qlen;
  const int32_t* table = seqs.block_tables + s * g.max_blocks;
  for (int64_t r = 0; r < qlen; ++r) {
    const int64_t slot = slot_of(table, first_pos + r, g.block_size);
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const int64_t at = h * g.slots + slot;
      store_row<T, C>(k_cache + at * g.dim, k_scales ? k_scales + at : &unused,
                      k + (qstart + r) * g.k_stride + h * g.dim, g.dim);
      store_row<T, C>(v_cache + at * g.dim, v_scales ? v_scales + at : &unused,
                      v + (qstart + r) * g.v_stride + h * g.dim, g.dim);
    }
  }
}

}  // namespace

void write_cache(const Geometry& g, const Sequences& seqs, const Tensor& k, const Tensor& v, Tensor& k_cache,
                 Tensor& v_cache, float* k_scales, float* v_scales) {
  const int64_t num_seqs = seqs.num_seqs, tokens = seqs.query_start[num_seqs];
  // Sequences per chunk so that a chunk writes ~256 tokens.
  const int64_t grain = std::max<int64_t>(1, num_seqs * 256 / std::max<int64_t>(1, tokens));
  dispatch_kv(k.scalar_type(), k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    C* kc = reinterpret_cast<C*>(k_cache.data_ptr());
    C* vc = reinterpret_cast<C*>(v_cache.data_ptr());
    float unused = 0.f;
    at::parallel_for(0, num_seqs, grain, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) write_sequence<T, C>(g, seqs, s, kp, vp, kc, vc, k_scales, v_scales, unused);
    });
  });
}

}  // namespace pagedllm
