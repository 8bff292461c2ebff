// The ops pagedllm registers as torch.ops.pagedllm.*: one declaration per op, defined in its
// family's file and bound to its schema in bindings.cpp. The types here are the schema's, so a
// declaration that drifts from its definition fails to link rather than to dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace pagedllm {

using at::Tensor;

// attention.cpp: writes the step's K/V into the paged cache, then attends every query row to its
// sequence's context, read in place through the block table.
Tensor paged_attention(const Tensor& q, const Tensor& k, const Tensor& v, Tensor k_cache, Tensor v_cache,
                       const Tensor& query_start, const Tensor& context_lens, const Tensor& block_tables,
                       int64_t block_size, double scale, int64_t window, int64_t pairs_budget,
                       const c10::optional<Tensor>& k_scales, const c10::optional<Tensor>& v_scales,
                       const c10::optional<Tensor>& sinks = c10::nullopt);

// pointwise.cpp: the work between the GEMMs, one pass each.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
Tensor add_rms_norm(Tensor residual, const Tensor& x, const Tensor& weight, double eps);
Tensor silu_mul(const Tensor& gate_up);
void rotary(Tensor q, Tensor k, const Tensor& cos, const Tensor& sin);

// delta_rule.cpp: a Gated DeltaNet layer's decode update, each sequence's state in place in its slot
// (kinds/gated_deltanet/delta_rule.py's recurrent_step without the gather and the scatter).
Tensor delta_rule_decode(Tensor state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& g, const Tensor& beta);
// ... and a Mamba-2 layer's (kinds/mamba2/scan.py's recurrent_step, likewise in place).
Tensor mamba2_decode(Tensor state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& g);
// ... and one sequence's prompt tokens through its state (one slot's [heads, key_dim, value_dim], in
// place), token after token as those updates run them (delta_rule.chunked's and scan.chunked's result).
Tensor delta_rule_prefill(Tensor state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                          const Tensor& beta);
Tensor mamba2_prefill(Tensor state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g);
// conv_state.cpp: a decode step's short causal convolution, each sequence's window in place in its
// slot (layers/recurrence.py's CausalConv.last on the gathered windows, kinds/short_conv's step).
Tensor conv_state_step(Tensor conv_state, const Tensor& slots, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, bool silu);
// ... and a Gated DeltaNet layer's whole decode step between its projections: the convolution's
// step (its state shifted in place), q/k normalised, the delta rule (kinds/gated_deltanet/forward.py).
Tensor gated_deltanet_decode(Tensor conv_state, Tensor state, const Tensor& slots, const Tensor& x,
                             const Tensor& conv_weight, const Tensor& g, const Tensor& beta, int64_t key_heads,
                             bool tiled);
// ... with its gates computed from b and a first and its gated norm after (a decode step's layer).
Tensor gated_deltanet_layer_decode(Tensor conv_state, Tensor state, const Tensor& slots, const Tensor& x,
                                   const Tensor& conv_weight, const Tensor& b, const Tensor& a, const Tensor& A_log,
                                   const Tensor& dt_bias, const Tensor& z, const Tensor& norm_weight, double eps,
                                   int64_t key_heads, bool tiled);

// quant_gemm.cpp: products with weights kept quantized, and their float rows.
Tensor quant_linear(const Tensor& x, const Tensor& qweight, const Tensor& scale, const c10::optional<Tensor>& zero,
                    int64_t bits, int64_t group);
bool amx_tiles();  // AMX tiles usable here: built for them, granted, not capped
int64_t quant_float_max_rows();  // the most float32 rows quant_linear beats dequantize + GEMM at
// Whether one bf16 row against a K-quant matrix reads one channel at a time (weights streaming
// from memory) or four (weights in the caches); returns the setting it replaces.
bool set_k_quant_row_by_channel(bool on);
bool w8a8_own_sums();  // w8a8_linear sums in its own AVX2 GEMM (no VNNI here), not oneDNN's
Tensor dequantize(const Tensor& qweight, const Tensor& scale, const c10::optional<Tensor>& zero, int64_t bits,
                  int64_t group, const c10::optional<Tensor>& rows, at::ScalarType dtype);

// moe.cpp: a sparse MLP's chosen experts (quantized, one format a layer) on their tokens, weighted
// by the router and summed: kinds/sparse_moe/forward.py's loop in one call.
Tensor moe_quant_experts(const Tensor& x, const Tensor& experts, const Tensor& weights, at::TensorList gate_up_q,
                         at::TensorList gate_up_scale, const c10::List<c10::optional<Tensor>>& gate_up_zero,
                         int64_t gate_up_bits, int64_t gate_up_group, at::TensorList down_q,
                         at::TensorList down_scale, const c10::List<c10::optional<Tensor>>& down_zero,
                         int64_t down_bits, int64_t down_group, at::TensorList gate_up_bias,
                         at::TensorList down_bias, double swiglu_limit, double swiglu_alpha);
Tensor clamped_swiglu(const Tensor& gate_up, double alpha, double limit);

// int8_gemm.cpp: x rounded to int8 per row, times int8 weights per output row, in integers (w8a8).
Tensor w8a8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scale);

// dense_gemm.cpp: bf16 products with bf16 weights in the layout both AMX tiles and AVX512-BF16 dot
// products read (the backend packs for it where amx_tiles()).
Tensor dense_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias);

// grammar_mask.cpp: the tokens a row's grammar forbids become -inf.
void mask_logits(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows, int64_t vocab);

// shm_exchange.cpp: the ranks of a split model on one host sum (or gather) a tensor through shared memory.
bool shm_exchange(Tensor x, Tensor region, int64_t rank, int64_t world, int64_t slot_bytes, int64_t seq,
                  double wait_s, bool published, bool reduce);
int64_t shm_region_bytes(int64_t world, int64_t slot_bytes);
int64_t shm_slot_offset(int64_t world, int64_t slot_bytes, int64_t seq, int64_t rank);

// threads.cpp: binds torch's intra-op threads to CPUs.
int64_t pin_threads(const Tensor& cpus, bool each);

}  // namespace pagedllm
