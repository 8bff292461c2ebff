// A mixture of experts' sparse MLP on experts kept quantized, in one call per layer (kinds/sparse_moe/forward.py
// is the reference). The step's (token, expert) pairs are grouped by expert, so each chosen
// expert's weights are read once for all its tokens and an expert no token chose is never read;
// each runs gate/up, SwiGLU and down through quant_linear, and its rows, weighted by the router,
// are added into the output. What it saves over the Python loop is the dispatch of some ten ops
// per chosen expert, which at one decode token costs more than reading the expert's weights.
// gpt-oss's experts: each projection's bias added to its output, and the SwiGLU clamped
// (swiglu_limit > 0; kinds/dense_mlp/forward.py's clamped_swiglu, op for op).

#include <ATen/ATen.h>

#include <cstring>

#include "common.h"
#include "ops.h"

namespace pagedllm {

// kinds/dense_mlp/forward.py's clamped_swiglu: gate clamped below limit, up within +-limit, then
// (up + 1) * gate * sigmoid(alpha * gate), clamping in place in gate_up (the step's own output).
Tensor clamped_swiglu(const Tensor& gate_up, double alpha, double limit) {
  const int64_t width = gate_up.size(1) / 2;
  Tensor gate = gate_up.narrow(1, 0, width), up = gate_up.narrow(1, width, width);
  gate.clamp_max_(limit);
  up.clamp_(-limit, limit).add_(1);
  return gate.mul(alpha).sigmoid_().mul_(gate).mul_(up);
}

Tensor moe_quant_experts(const Tensor& x, const Tensor& experts, const Tensor& weights, at::TensorList gate_up_q,
                         at::TensorList gate_up_scale, const c10::List<c10::optional<Tensor>>& gate_up_zero,
                         int64_t gate_up_bits, int64_t gate_up_group, at::TensorList down_q,
                         at::TensorList down_scale, const c10::List<c10::optional<Tensor>>& down_zero,
                         int64_t down_bits, int64_t down_group, at::TensorList gate_up_bias, at::TensorList down_bias,
                         double swiglu_limit, double swiglu_alpha) {
  const int64_t num_experts = static_cast<int64_t>(gate_up_q.size());
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && experts.sizes() == weights.sizes() &&
                  experts.size(0) == x.size(0) && experts.scalar_type() == at::kLong,
              "x [T, hidden], experts (int64) and weights [T, top_k]");
  TORCH_CHECK(gate_up_scale.size() == gate_up_q.size() && gate_up_zero.size() == gate_up_q.size() &&
                  down_q.size() == gate_up_q.size() && down_scale.size() == gate_up_q.size() &&
                  down_zero.size() == gate_up_q.size(),
              "one gate/up and one down matrix per expert");
  const bool biased = !gate_up_bias.empty();
  TORCH_CHECK(!biased || (gate_up_bias.size() == gate_up_q.size() && down_bias.size() == gate_up_q.size()),
              "biases: none, or one per expert for each projection");
  const Tensor ids = experts.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t tokens = x.size(0), top_k = experts.size(1);
  std::vector<std::vector<int64_t>> pairs(num_experts);  // expert -> its (token * top_k + slot)s
  for (int64_t p = 0; p < tokens * top_k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "expert index ", id[p], " out of range");
    pairs[id[p]].push_back(p);
  }
  const Tensor flat_weights = weights.reshape({-1});
  Tensor out = at::zeros_like(x);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (pairs[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(pairs[e].size());
    Tensor chosen = at::empty({n}, at::kLong), rows = at::empty({n}, at::kLong);
    std::memcpy(chosen.data_ptr<int64_t>(), pairs[e].data(), n * sizeof(int64_t));
    for (int64_t i = 0; i < n; ++i) rows.data_ptr<int64_t>()[i] = pairs[e][i] / top_k;
    const bool every_row = tokens == 1;  // a decode token: its row as it is, no gather
    const Tensor xe = every_row ? x : x.index_select(0, rows);
    Tensor gate_up = quant_linear(xe, gate_up_q[e], gate_up_scale[e], gate_up_zero.get(e), gate_up_bits, gate_up_group);
    if (biased) gate_up.add_(gate_up_bias[e]);
    const Tensor h = swiglu_limit > 0 ? clamped_swiglu(gate_up, swiglu_alpha, swiglu_limit) : silu_mul(gate_up);
    gate_up.reset();  // freed before down runs, as the loop frees it
    Tensor y = quant_linear(h, down_q[e], down_scale[e], down_zero.get(e), down_bits, down_group);
    if (biased) y.add_(down_bias[e]);
    y.mul_(flat_weights.index_select(0, chosen).unsqueeze(1).to(y.scalar_type()));
    out.index_add_(0, rows, y);
  }
  return out;
}

}  // namespace pagedllm
