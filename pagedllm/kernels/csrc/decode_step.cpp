// DecodeStep: every decoder layer of a step in one call, so no Python runs between the ops of a
// decode step (at one request a token took ~12.5 ms, ~4 of them in the interpreter between
// ~10 ops x 30 layers). The program holds each layer's weights as the Python layers hold them
// and calls the same kernels they call (quant_linear, w8a8_linear, dense_linear, oneDNN's
// packed GEMM, the pointwise ops, paged_attention), in models/decoder.py's order, so its
// arithmetic is the Python path's. models/decode_program.py builds it and says when it runs.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>

#include "common.h"
#include "ops.h"

namespace pagedllm {
namespace {

// How one linear layer multiplies (the backend's choice at load, layers/linear.py, quantized.py).
enum LinearKind : int64_t {
  kPlain = 0,   // float weights as they are: F.linear
  kOneDNN = 1,  // float weights in oneDNN's packed layout
  kTiles = 2,   // bf16 weights in dense_gemm.cpp's layout
  kQuant = 3,   // 4- or 8-bit weights, one or more stacked segments (quant_linear each)
  kInt8 = 4,    // int8 per output row, int8 activations (w8a8_linear each)
};

struct Segment {
  Tensor qweight, scale;
  c10::optional<Tensor> zero;
  int64_t bits = 0, group = 0;
};

struct LinearW {
  int64_t kind = kPlain;
  Tensor weight;  // kPlain, kOneDNN, kTiles
  std::vector<Segment> segments;  // kQuant, kInt8
  c10::optional<Tensor> bias;
};

// A sparse MLP (kinds/sparse_moe/forward.py) whose experts moe_quant_experts runs: a float32 router, its
// top_k experts renormalised or not, every expert's gate/up and down one quantized matrix each,
// in one format per projection. gpt-oss: the router biased and its top_k logits softmaxed among
// themselves, each projection biased, the SwiGLU clamped.
struct ExpertsW {
  Tensor router;  // float32 [experts, hidden]
  c10::optional<Tensor> router_bias;  // float32 [experts]
  int64_t top_k = 0;
  bool normalize = false, softmax_after_topk = false;
  std::vector<Tensor> gate_up_q, gate_up_scale, down_q, down_scale, gate_up_bias, down_bias;
  c10::List<c10::optional<Tensor>> gate_up_zero, down_zero;
  int64_t gate_up_bits = 0, gate_up_group = 0, down_bits = 0, down_group = 0;
  double swiglu_limit = 0, swiglu_alpha = 1;  // limit 0: plain SwiGLU
};

// A Gated DeltaNet layer (kinds/gated_deltanet): its in_proj (the qkv slot: [q/k/v | z | b | a]
// rows) and out_proj (the o slot) around gated_deltanet_layer_decode, the state updated in place
// in its slot. Its float32 parameters are widened once here, where the Python path widens them
// per call (compiled_backend.gated_deltanet_layer_decode).
struct DeltaRuleW {
  Tensor conv_taps, A_log, dt_bias, norm;  // float32: [channels, taps], [heads], [heads], [value_dim]
  int64_t channels = 0, values = 0, heads = 0, key_heads = 0;
  bool tiled = false;  // value head j is key head j mod key_heads's (llama.cpp's regrouping)
};

// Which rotary tables a layer's q and k take (ModelConfig.rope_of_layer).
enum RopeKind : int64_t { kNoRope = 0, kGlobalRope = 1, kLocalRope = 2 };

struct LayerW {
  Tensor input_norm, mlp_norm;  // the attention's input norm, the MLP's
  c10::optional<Tensor> q_norm, k_norm;  // Qwen3's and Gemma's per-head norms
  c10::optional<Tensor> attn_out_norm, mlp_out_norm;  // Gemma: each sub-layer's output normed before its add
  c10::optional<Tensor> sinks;  // gpt-oss: a logit per head in every softmax's denominator (float32)
  int64_t window = 0;  // sliding window (Mistral, Gemma's sliding layers), 0: none
  int64_t rope = kGlobalRope;
  LinearW qkv, o, gate_up, down;  // where experts is set: its shared expert's, if it has one
  LinearW shared_gate;  // Qwen2-MoE: the shared expert's sigmoid gate [1, hidden]
  c10::optional<ExpertsW> experts;
  bool shared_expert = false;
  c10::optional<DeltaRuleW> delta_rule;  // set: the mixer is a Gated DeltaNet, not attention
};

// layers/pointwise.py's rms_norm, op for op: in float32, then cast, the weight multiplied in place.
Tensor float32_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const Tensor xf = x.to(at::kFloat);
  return xf.mul(xf.pow(2).mean(-1, true).add(eps).rsqrt()).to(x.scalar_type()).mul_(weight);
}

// Rows a prepacked oneDNN GEMM runs on (layers/workspace.py padded_rows: one kernel per bucket).
int64_t padded_rows(int64_t rows) {
  if (rows <= 4) return rows;
  const int64_t step = rows <= 512 ? 16 : 64;
  return (rows + step - 1) / step * step;
}

Tensor onednn_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = padded_rows(rows);
  Tensor input = x;
  if (padded != rows) input = at::cat({x, at::zeros({padded - rows, x.size(1)}, x.options())});
  std::vector<c10::IValue> stack{input, packed, bias, std::string("none"),
                                 c10::List<c10::optional<c10::Scalar>>(), c10::optional<std::string>("")};
  op.callBoxed(&stack);
  Tensor y = stack[0].toTensor();
  return padded != rows ? y.narrow(0, 0, rows) : y;
}

Tensor apply(const LinearW& l, const Tensor& x) {
  switch (l.kind) {
    case kPlain: return at::linear(x, l.weight, l.bias);
    case kOneDNN: return onednn_linear(x, l.weight, l.bias);
    case kTiles: return dense_linear(x, l.weight, l.bias);
    default: break;
  }
  std::vector<Tensor> outs;
  outs.reserve(l.segments.size());
  const Tensor xc = x.contiguous();
  for (const Segment& s : l.segments)
    outs.push_back(l.kind == kInt8 ? w8a8_linear(xc, s.qweight, s.scale)
                                   : quant_linear(xc, s.qweight, s.scale, s.zero, s.bits, s.group));
  Tensor y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  if (l.bias.has_value()) y.add_(*l.bias);
  return y;
}

// Python passes an empty tensor for "none".
c10::optional<Tensor> maybe(const Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<Tensor>(t) : c10::nullopt;
}

}  // namespace

struct DecodeStep : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  bool gelu;  // the MLP's gate through GELU (tanh; Gemma), else SiLU
  bool output_gate = false;  // Qwen3.5: each head's q rows followed by its output gate's
  int64_t rotary_dim;  // the first dims of each head that rotate (Qwen3.5: a quarter)
  std::vector<LayerW> layers;
  Tensor final_norm;

  // scale: the attention's (the model's own, as Python computes it)
  DecodeStep(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool gelu)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), scale(scale), gelu(gelu),
        rotary_dim(head_dim) {}

  // Qwen3.5's attention: an output gate per head (sigmoid, times the attention's output) and
  // rotary on the first rotary_dim dims of each head.
  void set_attention_gate(bool gated, int64_t rotary) {
    TORCH_CHECK(rotary > 0 && rotary <= head_dim && rotary % 2 == 0,
                "set_attention_gate: 0 < rotary_dim <= head_dim, even");
    output_gate = gated;
    rotary_dim = rotary;
  }

  // The last layer added is a Gated DeltaNet: params [conv taps [channels, taps], A_log, dt_bias,
  // the gated norm's weight], widened to float32 here; sizes [channels, values, heads, key_heads].
  void add_delta_rule(std::vector<Tensor> params, std::vector<int64_t> sizes, bool tiled) {
    TORCH_CHECK(!layers.empty() && params.size() == 4 && sizes.size() == 4,
                "add_delta_rule: add a layer first; four tensors, four sizes");
    DeltaRuleW d;
    d.conv_taps = params[0].to(at::kFloat).contiguous();
    d.A_log = params[1].to(at::kFloat).contiguous();
    d.dt_bias = params[2].to(at::kFloat).contiguous();
    d.norm = params[3].to(at::kFloat).contiguous();
    d.channels = sizes[0];
    d.values = sizes[1];
    d.heads = sizes[2];
    d.key_heads = sizes[3];
    d.tiled = tiled;
    TORCH_CHECK(d.conv_taps.dim() == 2 && d.conv_taps.size(0) == d.channels, "add_delta_rule: taps [channels, taps]");
    layers.back().delta_rule = std::move(d);
  }

  // norms: [input, mlp, q_norm, k_norm, attn_out_norm, mlp_out_norm, sinks (gpt-oss's, float32
  // [heads])], an empty tensor for one the layer lacks; rope: a RopeKind. Then the layer gets its linears.
  void add_layer(std::vector<Tensor> norms, int64_t window, int64_t rope) {
    TORCH_CHECK(norms.size() == 7, "add_layer: six norm weights and the sinks (all but the first two may be empty)");
    TORCH_CHECK(rope >= kNoRope && rope <= kLocalRope, "add_layer: rope kind 0..2");
    LayerW l;
    l.input_norm = norms[0];
    l.mlp_norm = norms[1];
    l.q_norm = maybe(norms[2]);
    l.k_norm = maybe(norms[3]);
    l.attn_out_norm = maybe(norms[4]);
    l.mlp_out_norm = maybe(norms[5]);
    l.sinks = maybe(norms[6]);
    l.window = window;
    l.rope = rope;
    layers.push_back(std::move(l));
  }

  // which: 0 qkv, 1 o, 2 gate_up, 3 down of the last layer added (a sparse one's shared expert's),
  // 4 the shared expert's gate (the layer has one from then on). tensors: the weight (float
  // kinds), or per segment qweight, scale, zero (an empty tensor: none); ints: bits, group per segment.
  void add_linear(int64_t which, int64_t kind, std::vector<Tensor> tensors, std::vector<int64_t> ints, Tensor bias) {
    TORCH_CHECK(!layers.empty() && which >= 0 && which < 5, "add_linear: add a layer first; which in 0..4");
    LayerW& layer = layers.back();
    layer.shared_expert |= which == 4;
    LinearW& l = which == 0   ? layer.qkv
                 : which == 1 ? layer.o
                 : which == 2 ? layer.gate_up
                 : which == 3 ? layer.down
                              : layer.shared_gate;
    l.kind = kind;
    l.bias = maybe(bias);
    if (kind == kQuant || kind == kInt8) {
      TORCH_CHECK(tensors.size() % 3 == 0 && ints.size() == tensors.size() / 3 * 2, "add_linear: segments");
      for (size_t i = 0; i < tensors.size() / 3; ++i) {
        l.segments.push_back({tensors[3 * i], tensors[3 * i + 1], maybe(tensors[3 * i + 2]), ints[2 * i], ints[2 * i + 1]});
      }
    } else {
      TORCH_CHECK(kind >= kPlain && kind <= kTiles && tensors.size() == 1, "add_linear: one float weight");
      l.weight = tensors[0];
    }
  }

  // The last layer added is sparse: its router (and bias: empty, none), and per expert
  // [qweight, scale, zero (empty: none)] of gate/up then of down; formats: gate/up's bits and
  // group, down's; biases: none, or one per expert for each projection; swiglu: limit (0: not
  // clamped) and alpha.
  void add_experts(Tensor router, Tensor router_bias, int64_t top_k, bool normalize, bool softmax_after_topk,
                   std::vector<Tensor> gate_up, std::vector<Tensor> down, std::vector<int64_t> formats,
                   std::vector<Tensor> gate_up_bias, std::vector<Tensor> down_bias, std::vector<double> swiglu) {
    TORCH_CHECK(!layers.empty() && router.scalar_type() == at::kFloat, "add_experts: add a layer first; a float32 router");
    const size_t experts = size_t(router.size(0));
    TORCH_CHECK(gate_up.size() == 3 * experts && down.size() == 3 * experts && formats.size() == 4,
                "add_experts: three tensors per expert for each projection, four formats");
    TORCH_CHECK(swiglu.size() == 2 && gate_up_bias.size() == down_bias.size() &&
                    (gate_up_bias.empty() || gate_up_bias.size() == experts),
                "add_experts: a limit and an alpha; no biases, or one per expert for each projection");
    ExpertsW m;
    m.router = router;
    m.router_bias = maybe(router_bias);
    m.top_k = top_k;
    m.normalize = normalize;
    m.softmax_after_topk = softmax_after_topk;
    m.gate_up_bias = std::move(gate_up_bias);
    m.down_bias = std::move(down_bias);
    m.swiglu_limit = swiglu[0];
    m.swiglu_alpha = swiglu[1];
    for (size_t e = 0; e < experts; ++e) {
      m.gate_up_q.push_back(gate_up[3 * e]);
      m.gate_up_scale.push_back(gate_up[3 * e + 1]);
      m.gate_up_zero.push_back(maybe(gate_up[3 * e + 2]));
      m.down_q.push_back(down[3 * e]);
      m.down_scale.push_back(down[3 * e + 1]);
      m.down_zero.push_back(maybe(down[3 * e + 2]));
    }
    m.gate_up_bits = formats[0];
    m.gate_up_group = formats[1];
    m.down_bits = formats[2];
    m.down_group = formats[3];
    layers.back().experts = std::move(m);
  }

  void set_final_norm(Tensor w) { final_norm = w; }

  struct Ropes {
    const Tensor &cos, &sin, &local_cos, &local_sin;  // local: empty unless sliding layers have their own
  };

  struct Cache {
    const std::vector<Tensor>&k, &v, &k_scales, &v_scales;  // per layer; scales empty unless 8-bit
    const Tensor &query_start, &context_lens;
    const std::vector<Tensor>& block_tables;  // per layer: its KV pool's (engine/block_pools.py)
    int64_t block_size, pairs_budget;
    const std::vector<Tensor>&conv_states, &recurrent_states;  // per layer; empty but for delta-rule layers
    const Tensor& state_slots;  // each sequence's state slot (every row a decode row)
  };

  // Layer i's attention of x [T, hidden]: q/k/v, Qwen3's norms, rotary, the paged cache; its
  // output [T, heads * head_dim] in x's dtype (the q/k/v rows are freed before o_proj runs).
  Tensor attention(int64_t i, const Tensor& x, const Ropes& r, const Cache& c) const {
    const LayerW& l = layers[i];
    const int64_t t = x.size(0), dq = heads * head_dim, dk = kv_heads * head_dim;
    const int64_t q_rows = output_gate ? 2 * dq : dq;
    const Tensor qkv = apply(l.qkv, x);
    Tensor q, gate;
    if (output_gate) {  // [q of head 0, gate of head 0, q of head 1, ...]
      const Tensor q_and_gate = qkv.narrow(1, 0, q_rows).view({t, heads, 2, head_dim});
      q = q_and_gate.select(2, 0).contiguous();
      gate = q_and_gate.select(2, 1).reshape({t, dq});
    } else {
      q = qkv.narrow(1, 0, dq).view({t, heads, head_dim});
    }
    Tensor k = qkv.narrow(1, q_rows, dk).view({t, kv_heads, head_dim});
    Tensor v = qkv.narrow(1, q_rows + dk, dk).view({t, kv_heads, head_dim});
    if (l.q_norm.has_value() && l.q_norm->size(0) == dq) {  // OLMoE: over the whole projection,
      // in float32 as the Python layer runs it (its rows are strided views, which the kernel does not take)
      q = float32_rms_norm(q.reshape({t, dq}), *l.q_norm, eps).view({t, heads, head_dim});
      k = float32_rms_norm(k.reshape({t, dk}), *l.k_norm, eps).view({t, kv_heads, head_dim});
    } else if (l.q_norm.has_value()) {  // on contiguous copies: the kernel's norm takes [rows, D]
      q = rms_norm(q.contiguous().view({t * heads, head_dim}), *l.q_norm, eps).view({t, heads, head_dim});
      k = rms_norm(k.contiguous().view({t * kv_heads, head_dim}), *l.k_norm, eps).view({t, kv_heads, head_dim});
    }
    if (l.rope != kNoRope) {
      const Tensor& cos = l.rope == kGlobalRope ? r.cos : r.local_cos;
      const Tensor& sin = l.rope == kGlobalRope ? r.sin : r.local_sin;
      if (rotary_dim < head_dim) {  // the first dims only, on contiguous copies put back (this step's own tensors)
        Tensor q_part = q.narrow(2, 0, rotary_dim).contiguous(), k_part = k.narrow(2, 0, rotary_dim).contiguous();
        rotary(q_part, k_part, cos, sin);
        q.narrow(2, 0, rotary_dim).copy_(q_part);
        k.narrow(2, 0, rotary_dim).copy_(k_part);
      } else {
        rotary(q, k, cos, sin);
      }
    }
    const bool eight_bit = !c.k_scales.empty();
    const auto cache_dtype = c.k[i].scalar_type();
    if (!eight_bit && cache_dtype != x.scalar_type()) {  // the kernel computes in the cache's dtype
      q = q.to(cache_dtype);
      k = k.to(cache_dtype);
      v = v.to(cache_dtype);
    }
    const Tensor out = paged_attention(q, k, v, c.k[i], c.v[i], c.query_start, c.context_lens, c.block_tables[i],
                                       c.block_size, scale, l.window, c.pairs_budget,
                                       eight_bit ? c10::optional<Tensor>(c.k_scales[i]) : c10::nullopt,
                                       eight_bit ? c10::optional<Tensor>(c.v_scales[i]) : c10::nullopt, l.sinks);
    if (output_gate) return out.to(x.scalar_type()).view({t, dq}).mul(at::sigmoid(gate));
    return out.to(x.scalar_type()).view({t, dq});
  }

  // Layer i's Gated DeltaNet of x [T, hidden], every row a decode row: in_proj, then the
  // convolution step, gates, rule and gated norm in one kernel on each sequence's state slot (in
  // place), as GatedDeltaNet.forward's decode branch; [T, values] in x's dtype, before out_proj.
  Tensor delta_rule(int64_t i, const Tensor& x, const Cache& c) const {
    const DeltaRuleW& d = *layers[i].delta_rule;
    const Tensor proj = apply(layers[i].qkv, x);
    auto part = [&](int64_t start, int64_t width) { return proj.narrow(1, start, width).to(at::kFloat).contiguous(); };
    const int64_t cv = d.channels + d.values;
    const Tensor out = gated_deltanet_layer_decode(c.conv_states[i], c.recurrent_states[i], c.state_slots,
                                                   part(0, d.channels), d.conv_taps, part(cv, d.heads),
                                                   part(cv + d.heads, d.heads), d.A_log, d.dt_bias,
                                                   part(d.channels, d.values), d.norm, eps, d.key_heads, d.tiled);
    return out.to(x.scalar_type());
  }

  // h: the step's embeddings [T, hidden], the residual stream (added to in place). Returns the
  // final norm of the last layer's output, [T, hidden]. k_scales/v_scales: empty lists unless the
  // cache is 8-bit.
  Tensor run(Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& local_cos, const Tensor& local_sin,
             std::vector<Tensor> k_cache, std::vector<Tensor> v_cache,
             std::vector<Tensor> k_scales, std::vector<Tensor> v_scales, const Tensor& query_start,
             const Tensor& context_lens, std::vector<Tensor> block_tables, int64_t block_size, int64_t pairs_budget,
             std::vector<Tensor> conv_states, std::vector<Tensor> recurrent_states, const Tensor& state_slots) {
    const int64_t n = int64_t(layers.size());
    TORCH_CHECK(final_norm.defined() && int64_t(k_cache.size()) == n && int64_t(v_cache.size()) == n &&
                    int64_t(block_tables.size()) == n && int64_t(conv_states.size()) == n &&
                    int64_t(recurrent_states.size()) == n,
                "run: per layer one K and one V cache, one block table and two states (empty where none), "
                "and the final norm set");
    const Cache cache{k_cache,    v_cache,      k_scales,    v_scales,        query_start,      context_lens,
                      block_tables, block_size, pairs_budget, conv_states, recurrent_states, state_slots};
    const Ropes ropes{cos, sin, local_cos, local_sin};
    Tensor x = rms_norm(h, layers[0].input_norm, eps);
    for (int64_t i = 0; i < n; ++i) {
      const LayerW& l = layers[i];
      {  // the attention's output goes before the MLP runs
        Tensor attended = apply(l.o, l.delta_rule.has_value() ? delta_rule(i, x, cache) : attention(i, x, ropes, cache));
        if (l.attn_out_norm.has_value()) attended = rms_norm(attended, *l.attn_out_norm, eps);
        x = add_rms_norm(h, attended, l.mlp_norm, eps);
      }
      const Tensor following = i + 1 < n ? layers[i + 1].input_norm : final_norm;
      Tensor out;
      if (l.experts.has_value()) {
        out = sparse(*l.experts, x);
        if (l.shared_expert) {  // SparseMoE.forward: sigmoid(gate(x)) * shared(x), added
          const Tensor gate = at::sigmoid(apply(l.shared_gate, x));
          Tensor act = activation(apply(l.gate_up, x));
          out.add_(gate.mul(apply(l.down, act)));
        }
      } else {
        Tensor act = activation(apply(l.gate_up, x));  // gate/up freed here, before down runs
        out = apply(l.down, act);
      }
      if (l.mlp_out_norm.has_value()) out = rms_norm(out, *l.mlp_out_norm, eps);
      x = add_rms_norm(h, out, following, eps);
    }
    return x;
  }

  // SparseMoE.route's arithmetic in its order (float32 logits, softmax, top_k, renormalised
  // where the model does, then x's dtype), and the backend's sparse_experts kernel.
  static Tensor sparse(const ExpertsW& m, const Tensor& x) {
    const Tensor logits = at::linear(x.to(at::kFloat), m.router, m.router_bias);
    Tensor weights, experts;
    if (m.softmax_after_topk) {  // gpt-oss: the top_k logits, softmaxed among themselves
      auto [top, chosen] = at::topk(logits, m.top_k, -1);
      weights = at::softmax(top, -1);
      experts = chosen;
    } else {
      std::tie(weights, experts) = at::topk(at::softmax(logits, -1), m.top_k, -1);
      if (m.normalize) weights.div_(weights.sum(-1, true));
    }
    return moe_quant_experts(x.contiguous(), experts, weights.to(x.scalar_type()), m.gate_up_q, m.gate_up_scale,
                             m.gate_up_zero, m.gate_up_bits, m.gate_up_group, m.down_q, m.down_scale, m.down_zero,
                             m.down_bits, m.down_group, m.gate_up_bias, m.down_bias, m.swiglu_limit, m.swiglu_alpha);
  }

  // gate_up = [gate | up]: silu(gate) * up (the kernel), or Gemma's gelu(gate, tanh) * up in
  // ATen's ops, as layers/pointwise.py computes it.
  Tensor activation(const Tensor& gate_up) const {
    if (!gelu) return silu_mul(gate_up);
    const int64_t inner = gate_up.size(1) / 2;
    return at::gelu(gate_up.narrow(1, 0, inner), "tanh").mul_(gate_up.narrow(1, inner, inner));
  }
};

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.class_<pagedllm::DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, bool>())
      .def("add_layer", &pagedllm::DecodeStep::add_layer)
      .def("add_linear", &pagedllm::DecodeStep::add_linear)
      .def("add_experts", &pagedllm::DecodeStep::add_experts)
      .def("add_delta_rule", &pagedllm::DecodeStep::add_delta_rule)
      .def("set_attention_gate", &pagedllm::DecodeStep::set_attention_gate)
      .def("set_final_norm", &pagedllm::DecodeStep::set_final_norm)
      .def("run", &pagedllm::DecodeStep::run);
}
