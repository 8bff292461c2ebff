// The torch.ops.pagedllm schema, every op in one place, and the CPU implementations bound to it
// (declared in ops.h, defined in one file per op family). Python calls these names with exactly
// these signatures; the (a!) annotations mark the arguments an op writes in place.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor query_start, "
      "Tensor context_lens, Tensor block_tables, int block_size, float scale, int window, int pairs_budget, "
      "Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None, Tensor? sinks=None) -> Tensor");
  m.def(
      "moe_quant_experts(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up_q, Tensor[] gate_up_scale, "
      "Tensor?[] gate_up_zero, int gate_up_bits, int gate_up_group, Tensor[] down_q, Tensor[] down_scale, "
      "Tensor?[] down_zero, int down_bits, int down_group, Tensor[] gate_up_bias, Tensor[] down_bias, "
      "float swiglu_limit, float swiglu_alpha) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("delta_rule_decode(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
  m.def("mamba2_decode(Tensor(a!) state, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor g) -> Tensor");
  m.def("conv_state_step(Tensor(a!) conv_state, Tensor slots, Tensor x, Tensor weight, Tensor bias, bool silu) -> Tensor");
  m.def("delta_rule_prefill(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor");
  m.def("mamba2_prefill(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g) -> Tensor");
  m.def(
      "gated_deltanet_decode(Tensor(a!) conv_state, Tensor(b!) state, Tensor slots, Tensor x, Tensor conv_weight, "
      "Tensor g, Tensor beta, int key_heads, bool tiled) -> Tensor");
  m.def(
      "gated_deltanet_layer_decode(Tensor(a!) conv_state, Tensor(b!) state, Tensor slots, Tensor x, "
      "Tensor conv_weight, Tensor b, Tensor a, Tensor A_log, Tensor dt_bias, Tensor z, Tensor norm_weight, "
      "float eps, int key_heads, bool tiled) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, int bits, int group) -> Tensor");
  // No tensor argument to dispatch on: registered with its schema, for every backend.
  m.def("amx_tiles() -> bool", &pagedllm::amx_tiles);
  m.def("quant_float_max_rows() -> int", &pagedllm::quant_float_max_rows);
  m.def("w8a8_own_sums() -> bool", &pagedllm::w8a8_own_sums);
  m.def("set_k_quant_row_by_channel(bool on) -> bool", &pagedllm::set_k_quant_row_by_channel);
  m.def(
      "dequantize(Tensor qweight, Tensor scale, Tensor? zero, int bits, int group, Tensor? rows, ScalarType dtype) "
      "-> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("mask_logits(Tensor(a!) logits, Tensor bitmask, int[] rows, int vocab) -> ()");
  m.def("pin_threads(Tensor cpus, bool each) -> int");
  m.def(
      "shm_exchange(Tensor(a!) x, Tensor(b!) region, int rank, int world, int slot_bytes, int seq, float wait_s, "
      "bool published, bool reduce) -> bool");
  m.def("shm_region_bytes(int world, int slot_bytes) -> int", &pagedllm::shm_region_bytes);
  m.def("shm_slot_offset(int world, int slot_bytes, int seq, int rank) -> int", &pagedllm::shm_slot_offset);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention", &pagedllm::paged_attention);
  m.impl("moe_quant_experts", &pagedllm::moe_quant_experts);
  m.impl("rms_norm", &pagedllm::rms_norm);
  m.impl("add_rms_norm", &pagedllm::add_rms_norm);
  m.impl("silu_mul", &pagedllm::silu_mul);
  m.impl("delta_rule_decode", &pagedllm::delta_rule_decode);
  m.impl("mamba2_decode", &pagedllm::mamba2_decode);
  m.impl("conv_state_step", &pagedllm::conv_state_step);
  m.impl("delta_rule_prefill", &pagedllm::delta_rule_prefill);
  m.impl("mamba2_prefill", &pagedllm::mamba2_prefill);
  m.impl("gated_deltanet_decode", &pagedllm::gated_deltanet_decode);
  m.impl("gated_deltanet_layer_decode", &pagedllm::gated_deltanet_layer_decode);
  m.impl("rotary", &pagedllm::rotary);
  m.impl("quant_linear", &pagedllm::quant_linear);
  m.impl("dequantize", &pagedllm::dequantize);
  m.impl("dense_linear", &pagedllm::dense_linear);
  m.impl("w8a8_linear", &pagedllm::w8a8_linear);
  m.impl("mask_logits", &pagedllm::mask_logits);
  m.impl("pin_threads", &pagedllm::pin_threads);
  m.impl("shm_exchange", &pagedllm::shm_exchange);
}
