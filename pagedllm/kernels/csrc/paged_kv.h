// What attention.cpp and cache.cpp share about the paged KV cache: one call's geometry, the
// step's per-sequence metadata, the cache element types, and the writer of the step's K/V.
//
// Cache layout: k_cache and v_cache are [kv_heads, slots, head_dim], slots = blocks x
// block_size; token position p of a sequence lives in slot table[p / block_size] * block_size +
// p % block_size. An 8-bit cache (int8, or fp8 e4m3) keeps one float32 scale per (head, slot).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include "common.h"

namespace pagedllm {

struct Geometry {
  int64_t heads, kv_heads, group, dim, block_size, slots, max_blocks, window;
  int64_t q_stride, k_stride, v_stride;  // between tokens: q, k, v may be views of one fused qkv row
  float scale;
  const float* sinks;  // [heads]: a logit per query head in every softmax's denominator (gpt-oss), or nullptr
};

// The step's sequences as the engine sends them (int32): sequence s owns query tokens
// [query_start[s], query_start[s + 1]), has context_lens[s] tokens including them, and its
// block table is row s of block_tables [num_seqs, max_blocks].
struct Sequences {
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int64_t num_seqs;
};

// The slot of sequence position `pos` through one sequence's block table.
inline int64_t slot_of(const int32_t* table, int64_t pos, int64_t block_size) {
  return int64_t(table[pos / block_size]) * block_size + pos % block_size;
}

// Runs f(T{}, C{}) for activations T (float or bf16) and cache elements C: T itself, int8 or
// float8_e4m3fn. The one place that maps the cache's dtype to its element type.
template <typename F>
void dispatch_kv(at::ScalarType dtype, at::ScalarType cache_dtype, F&& f) {
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (cache_dtype == at::kChar)
      f(tag, int8_t{});
    else if (cache_dtype == at::kFloat8_e4m3fn)
      f(tag, c10::Float8_e4m3fn{});
    else
      f(tag, T{});
  });
}

// Writes every sequence's new tokens' K and V (the last query_start[s + 1] - query_start[s]
// positions of its context) into their slots; k_scales/v_scales: the 8-bit caches' scales, else
// nullptr. Arguments already checked by paged_attention.
void write_cache(const Geometry& g, const Sequences& seqs, const Tensor& k, const Tensor& v, Tensor& k_cache,
                 Tensor& v_cache, float* k_scales, float* v_scales);

}  // namespace pagedllm
