// paged_attention: attends every query row of the step to its sequence's context, read in place
// through the block table (no gathered copy), once write_cache (cache.cpp) has stored the step's
// own K/V.
//
// Arithmetic follows HF transformers' eager order (float32 softmax, the scale applied after the
// dot product, probabilities rounded to the activation dtype before @ V), so fp32 greedy output
// matches it. The generic loops are written for the compiler to vectorize (-O3, omp simd) and
// build for any CPU; decode tiles' dot products have AVX-512 kernels (vec_avx512.h) where the
// compiler targets AVX-512. Prefill tiles of a bf16 model over a bf16 cache run their two
// products on AMX tiles where the CPU has them (amx_attention.h).

#include "amx_attention.h"
#include "ops.h"
#include "paged_kv.h"

namespace pagedllm {
namespace {

// One unit of attention work: query rows [row0, row1) of sequence `seq`, KV head `head`.
struct WorkItem {
  int64_t seq, head, row0, row1, cost;
  int64_t h0 = 0, hn = 0;  // of the KV head's group, query heads h0 .. h0 + hn (hn 0: all of them)
};

// A thread's scratch, kept across items and calls: it grows to the largest tile seen, which the
// pairs budget bounds (scores) or one sequence's context does (a single decode row).
struct Scratch {
  std::vector<float> queries, scores, acc, keys;
  std::vector<c10::BFloat16> tile_q, tile_k, tile_p, tile_v;  // the AMX path's operands
  void fit(int64_t rows, int64_t dim, int64_t span) {
    grow(queries, rows * dim);
    grow(acc, rows * dim);
    grow(scores, rows * span);
    grow(keys, W * dim);
  }
  // The AMX path's operands for `rows` (whole tiles) x `width` keys (whole 32s).
  void fit_tiles(int64_t rows, int64_t dim, int64_t width) {
    grow(tile_q, rows * dim);
    grow(tile_k, 16 * dim);
    grow(tile_p, rows * width);
    grow(tile_v, width * dim);
    grow(scores, rows * width);
    grow(acc, rows * dim);
  }
  template <typename V>
  static void grow(std::vector<V>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
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

// acc[rows][D] += P[rows][keys] @ V[keys][D] for one run of keys, rows in register blocks of R,
// over NV vectors of W floats from column `col` (D wider than NV * W takes several calls), the
// value rows given as float pointers.
template <int R, int NV>
inline void pv_block(const float* P, int64_t stride, const float* const* values, int64_t n, float* A, int64_t D,
                     int64_t col) {
  VF acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = VF::loadu(A + r * D + col + v * W);
  for (int64_t c = 0; c < n; ++c) {
    VF val[NV];
    for (int v = 0; v < NV; ++v) val[v] = VF::loadu(values[c] + col + v * W);
    for (int r = 0; r < R; ++r) {
      const VF p(P[r * stride + c]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(p, val[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(A + r * D + col + v * W);
}

// pv_block over every row, for D a multiple of NV * W (Gemma's 256 on AVX-512: two passes of 8
// vectors, which with 4 rows' accumulators fill the registers without spilling).
template <int NV>
inline void pv_rows(const float* P, int64_t rows, int64_t stride, const float* const* values, int64_t n, float* A,
                    int64_t D) {
  for (int64_t col = 0; col < D; col += NV * W) {
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) pv_block<4, NV>(P + i * stride, stride, values, n, A + i * D, D, col);
    switch (rows - i) {
      case 3: pv_block<3, NV>(P + i * stride, stride, values, n, A + i * D, D, col); break;
      case 2: pv_block<2, NV>(P + i * stride, stride, values, n, A + i * D, D, col); break;
      case 1: pv_block<1, NV>(P + i * stride, stride, values, n, A + i * D, D, col); break;
      default: break;
    }
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

// The two caches of one call, typed; the scales are nullptr unless the cache is 8-bit.
template <typename C>
struct Caches {
  const C* k;
  const C* v;
  const float* k_scales;
  const float* v_scales;
  // One KV head's rows of either cache.
  CacheRows<C> head(const C* values, const float* scales, int64_t h, const Geometry& g) const {
    const int64_t head_slots = h * g.slots;
    return {values + head_slots * g.dim, scales ? scales + head_slots : nullptr, g.dim};
  }
};

// What one work item attends. Tile row i is (query row row0 + i / per_row, query head
// head0 + i % per_row): the query heads that share this KV head (all of its group, or the
// item's share of them), side by side. Its keys are lo..hi, the union of what its rows see.
struct Tile {
  int64_t row0, head, head0, per_row;
  int64_t qstart;     // the sequence's first token in q and out
  int64_t first_pos;  // the position of the sequence's first query row
  int64_t rows, lo, hi, span;
  const int32_t* table;  // the sequence's block table
  int64_t pos(int64_t i) const { return first_pos + row0 + i / per_row; }
  int64_t token(int64_t i) const { return qstart + row0 + i / per_row; }
  int64_t q_head(int64_t i) const { return head0 + i % per_row; }
};

inline float sink_of(const Geometry& g, const Tile& t, int64_t i) {
  return g.sinks ? g.sinks[t.q_head(i)] : -std::numeric_limits<float>::infinity();
}

Tile tile_of(const WorkItem& w, const Geometry& g, const Sequences& seqs) {
  Tile t;
  t.row0 = w.row0;
  t.head = w.head;
  t.head0 = w.head * g.group + w.h0;
  t.per_row = w.hn > 0 ? w.hn : g.group;
  t.qstart = seqs.query_start[w.seq];
  t.first_pos = seqs.context_lens[w.seq] - (seqs.query_start[w.seq + 1] - t.qstart);
  t.rows = (w.row1 - w.row0) * t.per_row;
  t.lo = first_visible(t.first_pos + w.row0, g.window);
  t.hi = t.first_pos + w.row1 - 1;  // the last key any row of the tile sees
  t.span = t.hi - t.lo + 1;
  t.table = seqs.block_tables + w.seq * g.max_blocks;
  return t;
}

template <typename T>
inline const T* query_row(const Tile& t, const Geometry& g, const T* q, int64_t i) {
  return q + t.token(i) * g.q_stride + t.q_head(i) * g.dim;
}

// Decode tiles (under 8 rows) on AVX-512: 16 keys' dot products side by side (vec_avx512.h), a
// bf16 cache read in place where the CPU multiplies bf16 pairs. Returns false where none fits
// (another head size, another CPU) and the caller goes dot by dot.
template <typename T, typename C>
bool scores_avx512(const Tile& t, const Geometry& g, const T* q, const CacheRows<C>& keys, int64_t slot, int64_t n,
                   const float* Q, float* kv, float* out) {
#if defined(PAGEDLLM_AVX512)
  static_assert(W == 16, "ATen's vectors hold 16 floats on AVX-512");
  const int64_t D = g.dim;
  if (D != 64 && D != 128 && D != 256) return false;
#if defined(PAGEDLLM_AVX512_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    const T* query_rows[8];
    const T* bf16_keys[16];
    for (int64_t i = 0; i < t.rows; ++i) query_rows[i] = query_row(t, g, q, i);
    for (int64_t c = 0; c < n; ++c) bf16_keys[c] = keys.values + (slot + c) * D;
    if (D == 64)
      avx512::scores_16_bf16<2>(query_rows, t.rows, bf16_keys, n, out, t.span);
    else if (D == 128)
      avx512::scores_16_bf16<4>(query_rows, t.rows, bf16_keys, n, out, t.span);
    else
      avx512::scores_16_bf16<8>(query_rows, t.rows, bf16_keys, n, out, t.span);
    return true;
  }
#endif
  const float* key_rows[16];
  for (int64_t c = 0; c < n; ++c) key_rows[c] = keys.row(slot + c, kv + c * D);
  if (D == 64)
    avx512::scores_16<4>(Q, t.rows, key_rows, n, out, t.span);
  else if (D == 128)
    avx512::scores_16<8>(Q, t.rows, key_rows, n, out, t.span);
  else
    avx512::scores_16<16>(Q, t.rows, key_rows, n, out, t.span);
  return true;
#else
  return false;  // no AVX-512 on this target
#endif
}

// Scores of every tile row against n keys in consecutive slots from `slot`, into out (a row
// every t.span floats).
template <typename T, typename C>
void score_run(const Tile& t, const Geometry& g, const T* q, const CacheRows<C>& keys, int64_t slot, int64_t n,
               Scratch& s, float* out) {
  const int64_t D = g.dim;
  const float* Q = s.queries.data();
  float* kv = s.keys.data();
  if (t.rows >= 8) {  // prefill tiles: keys transposed once, then four query rows at a time
    for (int64_t c = 0; c < n; ++c)
      for (int64_t d = 0; d < D; ++d) kv[d * W + c] = keys.at(slot + c, d);
    scores_transposed(Q, t.rows, D, kv, n, out, t.span);
  } else if (!scores_avx512<T, C>(t, g, q, keys, slot, n, Q, kv, out)) {
    for (int64_t c = 0; c < n; ++c) scores_by_dot(Q, t.rows, D, keys.row(slot + c, kv), out + c, t.span);
  }
}

// The tile's queries as float rows (Q[i * D]), and its scores for keys lo..hi (S[i * span]),
// key runs of up to W keys that are consecutive in one block.
template <typename T, typename C>
void score_tile(const Tile& t, const Geometry& g, const T* q, const CacheRows<C>& keys, Scratch& s) {
  for (int64_t i = 0; i < t.rows; ++i) widen_row(s.queries.data() + i * g.dim, query_row(t, g, q, i), g.dim);
  for (int64_t j = t.lo; j <= t.hi;) {
    const int64_t n = std::min({W, t.hi - j + 1, g.block_size - j % g.block_size});
    score_run<T, C>(t, g, q, keys, slot_of(t.table, j, g.block_size), n, s, s.scores.data() + (j - t.lo));
    j += n;
  }
}

// One row of scores: scaled, masked outside [first, last] (causal, window), then softmax exactly
// (max, exp, sum, normalise) as HF's float32 softmax; the probabilities are then held in T, as
// HF casts them back before @ V. A sink (gpt-oss; -inf: none) is one more logit in the max and
// the sum whose probability is dropped.
template <typename T>
void softmax_row(float* p, int64_t span, int64_t first, int64_t last, float scale, float sink) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < first; ++j) p[j] = neg_inf;
  for (int64_t j = last + 1; j < span; ++j) p[j] = neg_inf;
  // the largest scaled score: scale > 0, so it is the scaled largest score, to the bit
  VF mx_w(neg_inf);
  int64_t k = first;
  for (; k + W <= last + 1; k += W) mx_w = at::vec::maximum(mx_w, VF::loadu(p + k));
  float mx = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return at::vec::maximum(x, y); }, mx_w);
  for (; k <= last; ++k) mx = std::max(mx, p[k]);
  mx = std::max(mx * scale, sink);
  VF sum_v(0.f);
  const VF scale_v(scale), mx_v(mx);
  int64_t j = 0;
  for (; j + W <= span; j += W) {
    const VF e = (VF::loadu(p + j) * scale_v - mx_v).exp();
    e.store(p + j);
    sum_v = sum_v + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](VF& x, VF& y) { return x + y; }, sum_v);
  for (; j < span; ++j) {
    p[j] = std::exp(p[j] * scale - mx);
    sum += p[j];
  }
  if (sink != -std::numeric_limits<float>::infinity()) sum += std::exp(sink - mx);
  const float inv = 1.f / sum;
  const VF inv_v(inv);
  for (j = 0; j + W <= span; j += W) round_w<T>(VF::loadu(p + j) * inv_v).store(p + j);
  for (; j < span; ++j) p[j] = round_to<T>(p[j] * inv);
}

template <typename T>
void softmax_tile(const Tile& t, const Geometry& g, float* S) {
  for (int64_t i = 0; i < t.rows; ++i) {
    const int64_t pos = t.pos(i);
    softmax_row<T>(S + i * t.span, t.span, first_visible(pos, g.window) - t.lo, pos - t.lo, g.scale, sink_of(g, t, i));
  }
}

// acc[rows][D] += P @ V for one key run, at any head_dim (the register-blocked pv_rows take the
// usual ones).
inline void pv_any(const float* P, int64_t rows, int64_t stride, const float* const* values, int64_t n, int64_t D,
                   float* A) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < n; ++c) {
      const float p = P[i * stride + c];
      float* a = A + i * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * values[c][d];
    }
}

// probs @ V into the tile's accumulators, key run by key run: value rows read in place (fp32)
// or widened once (bf16, 8-bit), then accumulated into register blocks of query rows.
template <typename C>
void pv_tile(const Tile& t, const Geometry& g, const CacheRows<C>& vals, Scratch& s) {
  const int64_t D = g.dim;
  float* A = s.acc.data();
  float* kv = s.keys.data();
  std::fill(A, A + t.rows * D, 0.f);
  const float* value_rows[16];
  for (int64_t j = t.lo; j <= t.hi;) {
    const int64_t n = std::min({W, t.hi - j + 1, g.block_size - j % g.block_size});
    const int64_t slot = slot_of(t.table, j, g.block_size);
    for (int64_t c = 0; c < n; ++c) value_rows[c] = vals.row(slot + c, kv + c * D);
    const float* P = s.scores.data() + (j - t.lo);
    if (D == 4 * W)
      pv_rows<4>(P, t.rows, t.span, value_rows, n, A, D);
    else if (D % (8 * W) == 0)
      pv_rows<8>(P, t.rows, t.span, value_rows, n, A, D);
    else
      pv_any(P, t.rows, t.span, value_rows, n, D, A);
    j += n;
  }
}

// The accumulators, rounded to T, into each row's place in out [tokens, heads, D].
template <typename T>
void store_tile(const Tile& t, const Geometry& g, const float* A, T* out) {
  for (int64_t i = 0; i < t.rows; ++i) {
    T* o = out + (t.token(i) * g.heads + t.q_head(i)) * g.dim;
    for (int64_t d = 0; d < g.dim; ++d) o[d] = narrow<T>(A[i * g.dim + d]);
  }
}

#if defined(PAGEDLLM_AMX)
inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// A prefill tile of bf16 queries over a bf16 cache on AMX tiles: queries copied into whole
// 16-row tiles, scores 16 keys at a time, the softmax as on the vector path, then P @ V 32 keys
// at a time. Keys past the tile's are zero (in K, in V, and in the probabilities' padding
// columns); query rows past it hold an earlier tile's finite values, and their results are
// never read, so nothing else is cleared.
void attend_on_tiles(const Tile& t, const Geometry& g, const c10::BFloat16* q, c10::BFloat16* out,
                     const CacheRows<c10::BFloat16>& keys, const CacheRows<c10::BFloat16>& vals, Scratch& s) {
  using bf16 = c10::BFloat16;
  const int64_t D = g.dim, rows = round_up(t.rows, 16), width = round_up(t.span, 32);
  s.fit_tiles(rows, D, width);
  for (int64_t i = 0; i < t.rows; ++i) std::memcpy(&s.tile_q[i * D], query_row(t, g, q, i), D * sizeof(bf16));
  float* S = s.scores.data();
  const bf16* run[32];
  amx::configure_attention_tiles();
  for (int64_t j0 = 0; j0 < t.span; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, t.span - j0);
    for (int64_t c = 0; c < n; ++c) run[c] = keys.values + slot_of(t.table, t.lo + j0 + c, g.block_size) * D;
    amx::keys_as_b(run, n, D, s.tile_k.data());
    amx::score_keys(s.tile_q.data(), rows / 16, D, s.tile_k.data(), S + j0, width);
  }
  for (int64_t i = 0; i < t.rows; ++i) {
    const int64_t pos = t.pos(i);
    float* p = S + i * width;
    softmax_row<bf16>(p, t.span, first_visible(pos, g.window) - t.lo, pos - t.lo, g.scale, sink_of(g, t, i));
    for (int64_t j = 0; j < width; j += W) {  // exact: already rounded to bf16; zero past the keys
      const int64_t n = std::clamp<int64_t>(t.span - j, 0, W);
      store_w(&s.tile_p[i * width + j], n == W ? VF::loadu(p + j) : VF::loadu(p + j, n));
    }
  }
  for (int64_t j0 = 0; j0 < width; j0 += 32) {
    const int64_t n = std::clamp<int64_t>(t.span - j0, 0, 32);
    for (int64_t c = 0; c < n; ++c) run[c] = vals.values + slot_of(t.table, t.lo + j0 + c, g.block_size) * D;
    amx::values_as_b(run, n, D, s.tile_v.data() + j0 * D);
  }
  amx::weigh_values(s.tile_p.data(), rows / 16, width, width, s.tile_v.data(), D, s.acc.data());
  _tile_release();
  store_tile<bf16>(t, g, s.acc.data(), out);
}
#endif

// One work item: score its keys, softmax, probabilities @ V, store.
template <typename T, typename C>
void attend(const WorkItem& w, const Geometry& g, const Sequences& seqs, const T* q, T* out, const Caches<C>& caches,
            Scratch& s) {
  const Tile t = tile_of(w, g, seqs);
#if defined(PAGEDLLM_AMX)
  // prefill-sized tiles (decode rows go dot by dot, each key read once), whole 32-dim steps
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
    if (t.rows >= 8 && g.dim % 32 == 0 && amx::amx_ready()) {
      attend_on_tiles(t, g, q, out, caches.head(caches.k, caches.k_scales, w.head, g),
                      caches.head(caches.v, caches.v_scales, w.head, g), s);
      return;
    }
  }
#endif
  s.fit(t.rows, g.dim, t.span);
  score_tile<T, C>(t, g, q, caches.head(caches.k, caches.k_scales, w.head, g), s);
  softmax_tile<T>(t, g, s.scores.data());
  pv_tile<C>(t, g, caches.head(caches.v, caches.v_scales, w.head, g), s);
  store_tile<T>(t, g, s.acc.data(), out);
}

// Cuts every sequence into items (KV head x query-row tile, a tile scoring at most pairs_budget
// pairs) and deals them to threads costliest first, each to the least loaded: prefill tiles and
// decode rows of very different cost balance across cores. A row's result never depends on
// which tile or thread computed it.
std::vector<std::vector<WorkItem>> deal(const Geometry& g, const Sequences& seqs, int64_t pairs_budget,
                                        int64_t threads) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < seqs.num_seqs; ++s) {
    const int64_t qlen = seqs.query_start[s + 1] - seqs.query_start[s];
    if (qlen == 0) continue;
    const int64_t ctx = seqs.context_lens[s];
    const int64_t keys = g.window > 0 ? std::min(ctx, g.window + qlen) : ctx;
    const int64_t tile =
        std::clamp<int64_t>(pairs_budget / std::max<int64_t>(1, g.group * keys), 1, std::min<int64_t>(qlen, 32));
    for (int64_t r0 = 0; r0 < qlen; r0 += tile) {
      const int64_t r1 = std::min(qlen, r0 + tile);
      for (int64_t h = 0; h < g.kv_heads; ++h) items.push_back({s, h, r0, r1, (r1 - r0) * keys + 64});
    }
  }
  // Fewer items than threads (one request decoding over few KV heads: Gemma 3 270M has one):
  // a decode row's query heads are split among the threads, each reading the KV head's keys.
  // Under 8 heads only: a row's arithmetic must not depend on what else is in the step, and a
  // tile of 8 rows or more takes other paths (score_run, attend's AMX tiles).
  const int64_t n_items = int64_t(items.size());
  const int64_t parts = n_items > 0 && g.group < 8 ? std::min(g.group, (threads + n_items - 1) / n_items) : 1;
  if (parts > 1) {
    std::vector<WorkItem> split;
    for (const auto& it : items) {
      if (it.row1 - it.row0 > 1) {  // a prefill tile's rows interleave its heads: kept whole
        split.push_back(it);
        continue;
      }
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t h0 = g.group * p / parts, h1 = g.group * (p + 1) / parts;
        split.push_back({it.seq, it.head, it.row0, it.row1, it.cost * (h1 - h0) / g.group + 1, h0, h1 - h0});
      }
    }
    items = std::move(split);
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

// Metadata comes from the engine, but a wrong table must raise, never read or write out of bounds.
void check_metadata(const Geometry& g, int64_t tokens, const Sequences& seqs) {
  const int64_t num_seqs = seqs.num_seqs;
  const int32_t *query_start = seqs.query_start, *context_lens = seqs.context_lens, *block_tables = seqs.block_tables;
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

// q, k, v and the caches: shapes, layouts and dtypes the kernels read. Returns whether the
// cache is 8-bit (then with float32 scales [kv_heads, slots]).
bool check_tensors(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
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
  return eight_bit;
}

Geometry geometry_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache,
                     const Tensor& block_tables, int64_t block_size, double scale, int64_t window) {
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
  g.sinks = nullptr;
  g.q_stride = q.stride(0);
  g.k_stride = k.stride(0);
  g.v_stride = v.stride(0);
  return g;
}

}  // namespace

Tensor paged_attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                       const Tensor& query_start, const Tensor& context_lens, const Tensor& block_tables,
                       int64_t block_size, double scale, int64_t window, int64_t pairs_budget,
                       const c10::optional<Tensor>& k_scales, const c10::optional<Tensor>& v_scales,
                       const c10::optional<Tensor>& sinks) {
  const bool eight_bit = check_tensors(q, k, v, k_cache, v_cache, k_scales, v_scales);
  Geometry g = geometry_of(q, k, v, k_cache, block_tables, block_size, scale, window);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == g.heads,
                "sinks: float32 [heads]");
    g.sinks = sinks->data_ptr<float>();
  }
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "one row per sequence");
  const Sequences seqs{query_start.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
                       block_tables.data_ptr<int32_t>(), num_seqs};
  check_metadata(g, q.size(0), seqs);
  Tensor out = at::empty(q.sizes(), q.options());
  const int64_t threads = at::get_num_threads();
  const auto buckets = deal(g, seqs, pairs_budget, threads);
  float* ks = eight_bit ? k_scales->data_ptr<float>() : nullptr;
  float* vs = eight_bit ? v_scales->data_ptr<float>() : nullptr;
  write_cache(g, seqs, k, v, k_cache, v_cache, ks, vs);
  dispatch_kv(q.scalar_type(), k_cache.scalar_type(), [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    const Caches<C> caches{reinterpret_cast<const C*>(k_cache.data_ptr()),
                           reinterpret_cast<const C*>(v_cache.data_ptr()), ks, vs};
    const T* qp = q.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      static thread_local Scratch scratch;
      for (int64_t t = t0; t < t1; ++t)
        for (const auto& item : buckets[t]) attend<T, C>(item, g, seqs, qp, op, caches, scratch);
    });
  });
  return out;
}

}  // namespace pagedllm
