// pagedllm's CPU kernels, registered as torch ops in the `pagedllm` namespace.
//
// - paged_attention: writes the step's K/V into the paged cache, then attends every query row to
//   its sequence's context, read in place through the block table (no gathered copy).
// - add_rms_norm, rms_norm, silu_mul, rotary: the pointwise work between the GEMMs, one pass
//   each where eager PyTorch takes three to six ops and as many temporaries.
// - pin_threads: binds torch's intra-op threads one per CPU.
//
// Arithmetic follows HF transformers' eager order (float32 softmax and norms, the scale applied
// after the dot product, bf16 results rounded where HF rounds them), so fp32 greedy output
// matches it. Loops are written for the compiler to vectorize (-O3, omp simd), no intrinsics:
// the same source builds for any CPU a compiler targets.

#include <sched.h>

#include <c10/util/Float8_e4m3fn.h>

#include "common.h"

namespace {

using namespace pagedllm;

// Rows per parallel chunk so that a chunk holds ~16k elements: small batches stay on one thread.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// ---- paged attention ------------------------------------------------------------------------

struct Geometry {
  int64_t heads, kv_heads, group, dim, block_size, slots, max_blocks, window;
  int64_t q_stride, k_stride, v_stride;  // between tokens: q, k, v may be views of one fused qkv row
  float scale;
};

// One unit of attention work: query rows [row0, row1) of sequence `seq`, KV head `head`.
struct WorkItem {
  int64_t seq, head, row0, row1, cost;
};

// A thread's scratch, kept across items and calls: it grows to the largest tile seen, which the
// pairs budget bounds (scores) or one sequence's context does (a single decode row).
struct Scratch {
  std::vector<float> queries, scores, acc, keys;
  void fit(int64_t rows, int64_t dim, int64_t span) {
    if ((int64_t)queries.size() < rows * dim) queries.resize(rows * dim);
    if ((int64_t)acc.size() < rows * dim) acc.resize(rows * dim);
    if ((int64_t)scores.size() < rows * span) scores.resize(rows * span);
    if ((int64_t)keys.size() < W * dim) keys.resize(W * dim);
  }
};

// The first key a query at `pos` may see (HF masks keys at or before pos - window).
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Scores of `rows` queries against `n` keys, dot by dot: for decode tiles (a few query rows), where
// transposing keys would cost more than the products themselves.
inline void scores_by_dot(const float* Q, int64_t rows, int64_t D, const float* key, float* out, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* qi = Q + i * D;
    VF a0(0.f), a1(0.f);
    int64_t d = 0;
    for (; d + 2 * W <= D; d += 2 * W) {
      a0 = at::vec::fmadd(VF::loadu(qi + d), VF::loadu(key + d), a0);
      a1 = at::vec::fmadd(VF::loadu(qi + d + W), VF::loadu(key + d + W), a1);
    }
    for (; d + W <= D; d += W) a0 = at::vec::fmadd(VF::loadu(qi + d), VF::loadu(key + d), a0);
    float s = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return x + y; }, a0 + a1);
    for (; d < D; ++d) s += qi[d] * key[d];
    out[i * stride] = s;
  }
}

// Scores of `rows` queries against up to W keys held transposed (Kt[d * W + key]): one vector
// of W scores per query row, four rows at a time, no horizontal sums. For prefill tiles.
inline void scores_transposed(const float* Q, int64_t rows, int64_t D, const float* Kt, int64_t n, float* out,
                              int64_t stride) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    VF a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    const float *q0 = Q + i * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
    for (int64_t d = 0; d < D; ++d) {
      const VF k = VF::loadu(Kt + d * W);
      a0 = at::vec::fmadd(VF(q0[d]), k, a0);
      a1 = at::vec::fmadd(VF(q1[d]), k, a1);
      a2 = at::vec::fmadd(VF(q2[d]), k, a2);
      a3 = at::vec::fmadd(VF(q3[d]), k, a3);
    }
    a0.store(out + i * stride, n);
    a1.store(out + (i + 1) * stride, n);
    a2.store(out + (i + 2) * stride, n);
    a3.store(out + (i + 3) * stride, n);
  }
  for (; i < rows; ++i) {
    VF a(0.f);
    const float* qi = Q + i * D;
    for (int64_t d = 0; d < D; ++d) a = at::vec::fmadd(VF(qi[d]), VF::loadu(Kt + d * W), a);
    a.store(out + i * stride, n);
  }
}


#if defined(CPU_CAPABILITY_AVX512)
// Sums each of 16 vectors across its lanes: lane c of the result is the sum of a[c].
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4];
  for (int m = 0; m < 8; ++m)
    b[m] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * m], a[2 * m + 1]), _mm512_unpackhi_ps(a[2 * m], a[2 * m + 1]));
  for (int q = 0; q < 4; ++q) {
    const __m512d x = _mm512_castps_pd(b[2 * q]), y = _mm512_castps_pd(b[2 * q + 1]);
    c[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Scores of `rows` queries (float, NV vectors each) against n <= 16 keys given as rows of
// floats: 16 dot products per query run side by side, then one 16-way reduction. For decode
// tiles, where transposing the keys would cost more than the products.
template <int NV>
inline void scores_16(const float* Q, int64_t rows, const float* const* keys, int64_t n, float* out, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    __m512 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(Q + i * NV * 16 + v * 16);
    __m512 acc[16];
    for (int c = 0; c < 16; ++c) {
      acc[c] = _mm512_setzero_ps();
      if (c < n)
        for (int v = 0; v < NV; ++v) acc[c] = _mm512_fmadd_ps(q[v], _mm512_loadu_ps(keys[c] + v * 16), acc[c]);
    }
    _mm512_mask_storeu_ps(out + i * stride, (__mmask16)((1u << n) - 1), reduce16(acc));
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// scores_16 for bf16 queries and keys read in place: pairs of bf16 products summed in float32
// by the CPU's dot-product instruction, no widening. NP: D / 32.
template <int NP>
inline void scores_16_bf16(const c10::BFloat16* const* queries, int64_t rows, const c10::BFloat16* const* keys,
                           int64_t n, float* out, int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    __m512bh q[NP];
    for (int v = 0; v < NP; ++v) q[v] = (__m512bh)_mm512_loadu_si512(queries[i] + v * 32);
    __m512 acc[16];
    for (int c = 0; c < 16; ++c) {
      acc[c] = _mm512_setzero_ps();
      if (c < n)
        for (int v = 0; v < NP; ++v) acc[c] = _mm512_dpbf16_ps(acc[c], q[v], (__m512bh)_mm512_loadu_si512(keys[c] + v * 32));
    }
    _mm512_mask_storeu_ps(out + i * stride, (__mmask16)((1u << n) - 1), reduce16(acc));
  }
}
#endif

// acc[rows][D] += P[rows][keys] @ V[keys][D] for one run of keys, rows in register blocks of R
// (NV vectors of W floats per row: D = NV * W), the value rows given as float pointers.
template <int R, int NV>
inline void pv_block(const float* P, int64_t stride, const float* const* values, int64_t n, float* A) {
  VF acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = VF::loadu(A + (r * NV + v) * W);
  for (int64_t c = 0; c < n; ++c) {
    VF val[NV];
    for (int v = 0; v < NV; ++v) val[v] = VF::loadu(values[c] + v * W);
    for (int r = 0; r < R; ++r) {
      const VF p(P[r * stride + c]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(p, val[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(A + (r * NV + v) * W);
}

template <int NV>
inline void pv_rows(const float* P, int64_t rows, int64_t stride, const float* const* values, int64_t n, float* A) {
  constexpr int64_t D = NV * W;
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) pv_block<4, NV>(P + i * stride, stride, values, n, A + i * D);
  switch (rows - i) {
    case 3: pv_block<3, NV>(P + i * stride, stride, values, n, A + i * D); break;
    case 2: pv_block<2, NV>(P + i * stride, stride, values, n, A + i * D); break;
    case 1: pv_block<1, NV>(P + i * stride, stride, values, n, A + i * D); break;
    default: break;
  }
}

// One KV head's cache, read a row (a token's head_dim values) at a time as floats: fp32 rows in
// place; bf16 rows widened into a buffer; 8-bit rows (int8, or fp8 e4m3) times their scale.
template <typename C>
struct CacheRows {
  const C* values;      // [slots, D] of this head
  const float* scales;  // [slots] of this head (8-bit caches only)
  int64_t D;
  const float* row(int64_t slot, float* buffer) const {
    const C* src = values + slot * D;
    if constexpr (std::is_same_v<C, float>) {
      return src;
    } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
      widen_row(buffer, src, D);
      return buffer;
    } else {
      const float s = scales[slot];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) buffer[d] = float(src[d]) * s;
      return buffer;
    }
  }
  float at(int64_t slot, int64_t d) const {
    if constexpr (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>)
      return widen(values[slot * D + d]);
    else
      return float(values[slot * D + d]) * scales[slot];
  }
};

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

template <typename T, typename C>
void attend(const WorkItem& w, const Geometry& g, const T* q, T* out, const C* k_cache, const C* v_cache,
            const float* k_scales, const float* v_scales,
            const int32_t* query_start, const int32_t* context_lens, const int32_t* block_tables, Scratch& s) {
  const int64_t D = g.dim, G = g.group, bs = g.block_size;
  const int64_t qstart = query_start[w.seq];
  const int64_t first_pos = context_lens[w.seq] - (query_start[w.seq + 1] - qstart);  // of query row 0
  const int32_t* table = block_tables + w.seq * g.max_blocks;
  const int64_t rows = (w.row1 - w.row0) * G;  // (query row, query head of this KV head)
  const int64_t lo = first_visible(first_pos + w.row0, g.window);
  const int64_t hi = first_pos + w.row1 - 1;  // the last key any row of the tile sees
  const int64_t span = hi - lo + 1;
  s.fit(rows, D, span);
  float* Q = s.queries.data();
  float* S = s.scores.data();
  float* A = s.acc.data();
  float* kv = s.keys.data();
  const int64_t head_slots = w.head * g.slots;
  const CacheRows<C> keys{k_cache + head_slots * D, k_scales ? k_scales + head_slots : nullptr, D};
  const CacheRows<C> vals{v_cache + head_slots * D, v_scales ? v_scales + head_slots : nullptr, D};
  auto slot_of = [&](int64_t j) { return int64_t(table[j / bs]) * bs + j % bs; };

  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = w.row0 + i / G, h = w.head * G + i % G;
    widen_row(Q + i * D, q + (qstart + r) * g.q_stride + h * D, D);
  }
  // Scores for keys lo..hi: runs of up to W keys that are consecutive in one block.
  const float* key_rows[16];
  for (int64_t j = lo; j <= hi;) {
    const int64_t n = std::min({W, hi - j + 1, bs - j % bs});
    const int64_t slot = slot_of(j);
    const C* src = keys.values + slot * D;
    if (rows >= 8) {  // prefill tiles: keys transposed once, then four query rows at a time
      for (int64_t c = 0; c < n; ++c)
        for (int64_t d = 0; d < D; ++d) kv[d * W + c] = keys.at(slot + c, d);
      scores_transposed(Q, rows, D, kv, n, S + (j - lo), span);
    } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
        if (D == 64 || D == 128) {
          const T* query_rows[8];
          const T* bf16_keys[16];
          for (int64_t i = 0; i < rows; ++i)
            query_rows[i] = q + (qstart + w.row0 + i / G) * g.q_stride + (w.head * G + i % G) * D;
          for (int64_t c = 0; c < n; ++c) bf16_keys[c] = src + c * D;
          if (D == 64)
            scores_16_bf16<2>(query_rows, rows, bf16_keys, n, S + (j - lo), span);
          else
            scores_16_bf16<4>(query_rows, rows, bf16_keys, n, S + (j - lo), span);
          j += n;
          continue;
        }
      }
#endif
#if defined(CPU_CAPABILITY_AVX512)
      if (W == 16 && (D == 64 || D == 128)) {
        for (int64_t c = 0; c < n; ++c) key_rows[c] = keys.row(slot + c, kv + c * D);
        if (D == 64)
          scores_16<4>(Q, rows, key_rows, n, S + (j - lo), span);
        else
          scores_16<8>(Q, rows, key_rows, n, S + (j - lo), span);
        j += n;
        continue;
      }
#endif
      for (int64_t c = 0; c < n; ++c) scores_by_dot(Q, rows, D, keys.row(slot + c, kv), S + (j - lo + c), span);
    }
    j += n;
  }
  // Scale, mask (causal, window), then softmax per row exactly (max, exp, sum, normalise) as HF's
  // float32 softmax; probabilities are then held in T, as HF casts them back before @ V.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows; ++i) {
    float* p = S + i * span;
    const int64_t pos = first_pos + w.row0 + i / G;
    const int64_t first = first_visible(pos, g.window) - lo, last = pos - lo;
    for (int64_t j = 0; j < first; ++j) p[j] = neg_inf;
    for (int64_t j = last + 1; j < span; ++j) p[j] = neg_inf;
    float mx = neg_inf;
    for (int64_t j = first; j <= last; ++j) mx = std::max(mx, p[j] * g.scale);
    VF sum_v(0.f);
    const VF scale_v(g.scale), mx_v(mx);
    int64_t j = 0;
    for (; j + W <= span; j += W) {
      const VF e = (VF::loadu(p + j) * scale_v - mx_v).exp();
      e.store(p + j);
      sum_v = sum_v + e;
    }
    float sum = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return x + y; }, sum_v);
    for (; j < span; ++j) {
      p[j] = std::exp(p[j] * g.scale - mx);
      sum += p[j];
    }
    const float inv = 1.f / sum;
    for (j = 0; j < span; ++j) p[j] = round_to<T>(p[j] * inv);
  }
  // probs @ V, key run by key run: value rows read in place (fp32) or widened once (bf16), then
  // accumulated into register blocks of query rows.
  std::fill(A, A + rows * D, 0.f);
  const float* value_rows[16];
  for (int64_t j = lo; j <= hi;) {
    const int64_t n = std::min({W, hi - j + 1, bs - j % bs});
    const int64_t slot = slot_of(j);
    for (int64_t c = 0; c < n; ++c) value_rows[c] = vals.row(slot + c, kv + c * D);
    const float* P = S + (j - lo);
    if (D == 4 * W) {
      pv_rows<4>(P, rows, span, value_rows, n, A);
    } else if (D == 8 * W) {
      pv_rows<8>(P, rows, span, value_rows, n, A);
    } else {
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < n; ++c) {
          const float p = P[i * span + c];
          float* a = A + i * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * value_rows[c][d];
        }
    }
    j += n;
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = w.row0 + i / G, h = w.head * G + i % G;
    T* o = out + ((qstart + r) * g.heads + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = narrow<T>(A[i * D + d]);
  }
}

// Cuts every sequence into items (KV head x query-row tile, a tile scoring at most pairs_budget
// pairs) and deals them to threads costliest first, each to the least loaded: prefill tiles and
// decode rows of very different cost balance across cores. A row's result never depends on
// which tile or thread computed it.
std::vector<std::vector<WorkItem>> deal(const Geometry& g, const int32_t* query_start, const int32_t* context_lens,
                                        int64_t num_seqs, int64_t pairs_budget, int64_t threads) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = query_start[s + 1] - query_start[s];
    if (qlen == 0) continue;
    const int64_t ctx = context_lens[s];
    const int64_t keys = g.window > 0 ? std::min(ctx, g.window + qlen) : ctx;
    const int64_t tile =
        std::clamp<int64_t>(pairs_budget / std::max<int64_t>(1, g.group * keys), 1, std::min<int64_t>(qlen, 32));
    for (int64_t r0 = 0; r0 < qlen; r0 += tile) {
      const int64_t r1 = std::min(qlen, r0 + tile);
      for (int64_t h = 0; h < g.kv_heads; ++h) items.push_back({s, h, r0, r1, (r1 - r0) * keys + 64});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::vector<std::vector<WorkItem>> buckets(threads);
  std::vector<int64_t> load(threads, 0);
  for (const auto& it : items) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    buckets[t].push_back(it);
    load[t] += it.cost;
  }
  return buckets;
}

template <typename T, typename C>
void write_cache(const Geometry& g, const T* k, const T* v, C* k_cache, C* v_cache, float* k_scales, float* v_scales,
                 const int32_t* query_start, const int32_t* context_lens, const int32_t* block_tables,
                 int64_t num_seqs) {
  const int64_t tokens = query_start[num_seqs];
  float unused = 0.f;
  at::parallel_for(0, num_seqs, std::max<int64_t>(1, num_seqs * 256 / std::max<int64_t>(1, tokens)),
                   [&](int64_t s0, int64_t s1) {
                     for (int64_t s = s0; s < s1; ++s) {
                       const int64_t qstart = query_start[s], qlen = query_start[s + 1] - qstart;
                       const int64_t first_pos = context_lens[s] - qlen;
                       const int32_t* table = block_tables + s * g.max_blocks;
                       for (int64_t r = 0; r < qlen; ++r) {
                         const int64_t pos = first_pos + r;
                         const int64_t slot = int64_t(table[pos / g.block_size]) * g.block_size + pos % g.block_size;
                         for (int64_t h = 0; h < g.kv_heads; ++h) {
                           const int64_t at = h * g.slots + slot;
                           store_row<T, C>(k_cache + at * g.dim, k_scales ? k_scales + at : &unused,
                                           k + (qstart + r) * g.k_stride + h * g.dim, g.dim);
                           store_row<T, C>(v_cache + at * g.dim, v_scales ? v_scales + at : &unused,
                                           v + (qstart + r) * g.v_stride + h * g.dim, g.dim);
                         }
                       }
                     }
                   });
}

// Metadata comes from the engine, but a wrong table must raise, never read or write out of bounds.
void check_metadata(const Geometry& g, int64_t tokens, const int32_t* query_start, const int32_t* context_lens,
                    const int32_t* block_tables, int64_t num_seqs) {
  TORCH_CHECK(query_start[0] == 0 && query_start[num_seqs] == tokens, "query_start must run from 0 to the token count");
  const int64_t num_blocks = g.slots / g.block_size;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = query_start[s + 1] - query_start[s];
    TORCH_CHECK(qlen >= 0 && context_lens[s] >= qlen, "sequence ", s, ": context shorter than its queries");
    const int64_t used = (int64_t(context_lens[s]) + g.block_size - 1) / g.block_size;
    TORCH_CHECK(used <= g.max_blocks, "sequence ", s, ": block table too short for its context");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = block_tables[s * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block, " is not in the cache");
    }
  }
}

Tensor paged_attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                       const Tensor& query_start, const Tensor& context_lens, const Tensor& block_tables,
                       int64_t block_size, double scale, int64_t window, int64_t pairs_budget,
                       const c10::optional<Tensor>& k_scales, const c10::optional<Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "caches must be [kv_heads, slots, head_dim]");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q, k, v: each token's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const auto dtype = q.scalar_type(), cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && v_cache.scalar_type() == cache_dtype,
              "q, k and v share one dtype, and the two caches another");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention supports float32 and bfloat16");
  const bool eight_bit = cache_dtype == at::kChar || cache_dtype == at::kFloat8_e4m3fn;
  TORCH_CHECK(cache_dtype == dtype || eight_bit, "the cache is in q's dtype, int8 or float8_e4m3fn");
  if (eight_bit)
    for (const auto* t : {&k_scales, &v_scales})
      TORCH_CHECK(t->has_value() && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                      (*t)->dim() == 2 && (*t)->size(0) == k_cache.size(0) && (*t)->size(1) == k_cache.size(1),
                  "an 8-bit cache needs float32 scales [kv_heads, slots]");
  Geometry g;
  g.heads = q.size(1);
  g.kv_heads = k.size(1);
  g.dim = q.size(2);
  TORCH_CHECK(g.kv_heads == k_cache.size(0) && g.dim == k_cache.size(2) && g.dim == k.size(2) && k.sizes() == v.sizes() &&
                  g.heads % g.kv_heads == 0 && k.size(0) == q.size(0),
              "q, k, v do not match each other or the cache");
  TORCH_CHECK(block_size > 0 && k_cache.size(1) % block_size == 0, "the cache holds whole blocks");
  g.group = g.heads / g.kv_heads;
  g.block_size = block_size;
  g.slots = k_cache.size(1);
  g.max_blocks = block_tables.size(1);
  g.window = window;
  g.scale = float(scale);
  g.q_stride = q.stride(0);
  g.k_stride = k.stride(0);
  g.v_stride = v.stride(0);
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "one row per sequence");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  check_metadata(g, q.size(0), qs, cl, bt, num_seqs);
  Tensor out = at::empty(q.sizes(), q.options());
  const int64_t threads = at::get_num_threads();
  const auto buckets = deal(g, qs, cl, num_seqs, pairs_budget, threads);
  float* ks = eight_bit ? k_scales->data_ptr<float>() : nullptr;
  float* vs = eight_bit ? v_scales->data_ptr<float>() : nullptr;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto cache_tag) {
      using C = decltype(cache_tag);
      C* kc = reinterpret_cast<C*>(k_cache.data_ptr());
      C* vc = reinterpret_cast<C*>(v_cache.data_ptr());
      write_cache<T, C>(g, k.data_ptr<T>(), v.data_ptr<T>(), kc, vc, ks, vs, qs, cl, bt, num_seqs);
      at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
        static thread_local Scratch scratch;
        for (int64_t t = t0; t < t1; ++t)
          for (const auto& item : buckets[t])
            attend<T, C>(item, g, q.data_ptr<T>(), out.data_ptr<T>(), kc, vc, ks, vs, qs, cl, bt, scratch);
      });
    };
    if (cache_dtype == at::kChar)
      run(int8_t{});
    else if (cache_dtype == at::kFloat8_e4m3fn)
      run(c10::Float8_e4m3fn{});
    else
      run(T{});
  });
  return out;
}

// ---- pointwise ------------------------------------------------------------------------------

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

// ---- threads --------------------------------------------------------------------------------

// each: binds intra-op worker thread i (i >= 1) to cpus[i % len]; else lets every worker run on
// any of cpus. Thread 0 is the caller's own thread: the engine binds it around each step only
// (engine/threads.py), so what the caller starts between steps keeps every CPU.
// Returns how many threads were bound.
int64_t pin_threads(const Tensor& cpus, bool each) {
  TORCH_CHECK(cpus.dim() == 1 && cpus.scalar_type() == at::kLong && cpus.numel() > 0, "cpus: a 1-d int64 tensor");
  const int64_t* ids = cpus.data_ptr<int64_t>();
  const int64_t n = cpus.numel(), threads = at::get_num_threads();
  std::vector<int> ok(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t == 0) continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      if (each)
        CPU_SET(int(ids[t % n]), &set);
      else
        for (int64_t i = 0; i < n; ++i) CPU_SET(int(ids[i]), &set);
      ok[t] = sched_setaffinity(0, sizeof set, &set) == 0;
    }
  });
  int64_t bound = 0;
  for (int v : ok) bound += v;
  return bound;
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor query_start, "
      "Tensor context_lens, Tensor block_tables, int block_size, float scale, int window, int pairs_budget, "
      "Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("pin_threads(Tensor cpus, bool each) -> int");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("pin_threads", &pin_threads);
}
