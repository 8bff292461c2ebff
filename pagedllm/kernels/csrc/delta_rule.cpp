// A Gated DeltaNet layer's decode update (kinds/gated_deltanet): one token per sequence, each
// sequence's state [heads, key_dim, value_dim] updated in place in its slot of the state pool.
//
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
//
// Two passes over each head's state (64 KiB at Qwen3.5's 128 x 128, so the second reads it from
// L2): the first decays each row S_i and sums k_i S_i into S^T k; the second adds k_i u to each
// row and sums q_i S_i into o. The PyTorch path gathers the states out of the pool, makes five
// passes over them and scatters them back; llama.cpp found a quarter of a CPU step copying this
// state (its PR #29121). The state stays float32, as the reference keeps it. Loops are written
// on ATen's Vectorized<float>: the same source builds for AVX2 and AVX-512.
//
// And a Mamba-2 layer's decode update (kinds/mamba2), the same without the correction toward v:
//
//   S <- exp(g) S + k v^T;  o = S^T q
//
// one pass over each head's state [state_size, head_dim] (each row decayed, added to, and read).

#include "common.h"
#include "ops.h"

namespace pagedllm {
namespace {

void check_float(const Tensor& t, at::IntArrayRef shape, const char* what) {
  TORCH_CHECK(t.sizes() == shape && t.is_contiguous() && t.scalar_type() == at::kFloat, what,
              ": expected float32, contiguous, of shape ", shape, ", got ", t.sizes());
}

// One head of one sequence: ``S`` [dk, dv] in place, ``u`` scratch [dv], ``o`` [dv] written.
void update_head(float* __restrict S, const float* __restrict q, const float* __restrict k,
                 const float* __restrict v, float decay, float beta, float* __restrict u, float* __restrict o,
                 int64_t dk, int64_t dv) {
  const VF d(decay);
  std::fill(u, u + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {  // S_i *= decay; u += k_i S_i  (u holds S^T k)
    float* row = S + i * dv;
    const VF ki(k[i]);
    for (int64_t j = 0; j < dv; j += W) {
      const int64_t m = std::min(W, dv - j);
      const VF x = load_w(row + j, m) * d;
      store_w(row + j, x, m);
      store_w(u + j, at::vec::fmadd(x, ki, load_w(u + j, m)), m);
    }
  }
  const VF b(beta);
  for (int64_t j = 0; j < dv; j += W) {  // u = beta (v - S^T k)
    const int64_t m = std::min(W, dv - j);
    store_w(u + j, (load_w(v + j, m) - load_w(u + j, m)) * b, m);
  }
  std::fill(o, o + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {  // S_i += k_i u; o += q_i S_i
    float* row = S + i * dv;
    const VF ki(k[i]), qi(q[i]);
    for (int64_t j = 0; j < dv; j += W) {
      const int64_t m = std::min(W, dv - j);
      const VF x = at::vec::fmadd(load_w(u + j, m), ki, load_w(row + j, m));
      store_w(row + j, x, m);
      store_w(o + j, at::vec::fmadd(x, qi, load_w(o + j, m)), m);
    }
  }
}

// One head of one sequence (Mamba-2): ``S`` [dk, dv] in place, ``o`` [dv] written.
void scan_head(float* __restrict S, const float* __restrict q, const float* __restrict k,
               const float* __restrict v, float decay, float* __restrict o, int64_t dk, int64_t dv) {
  const VF d(decay);
  std::fill(o, o + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {  // S_i = decay S_i + k_i v; o += q_i S_i
    float* row = S + i * dv;
    const VF ki(k[i]), qi(q[i]);
    for (int64_t j = 0; j < dv; j += W) {
      const int64_t m = std::min(W, dv - j);
      const VF x = at::vec::fmadd(load_w(v + j, m), ki, load_w(row + j, m) * d);
      store_w(row + j, x, m);
      store_w(o + j, at::vec::fmadd(x, qi, load_w(o + j, m)), m);
    }
  }
}

// The checks every update makes of the pool and the slots.
void check_pool(const Tensor& state, const Tensor& slots) {
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous() && state.scalar_type() == at::kFloat,
              "state: expected [slots, heads, key_dim, value_dim] float32, contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong, "slots: expected [n] int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots.size(0); ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < state.size(0), "slot ", slot[s], " outside the pool of ", state.size(0));
}

// ... and of the per-token inputs of the delta rule's and Mamba-2's updates.
void check_update(const Tensor& state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& g) {
  check_pool(state, slots);
  const int64_t n = slots.size(0), heads = state.size(1), dk = state.size(2), dv = state.size(3);
  check_float(q, {n, heads, dk}, "q");
  check_float(k, {n, heads, dk}, "k");
  check_float(v, {n, heads, dv}, "v");
  check_float(g, {n, heads}, "g");
}

// One sequence's convolution step: each channel's window (``cs``, its last taps - 1 inputs)
// continued by its input ``x``, silu of the taps' sum written to q, k or v, the window shifted.
void convolve_step(float* cs, const float* x, const float* w, int64_t channels, int64_t taps, int64_t keys,
                   float* q, float* k, float* v) {
  for (int64_t c = 0; c < channels; ++c) {
    float* window = cs + c * (taps - 1);
    const float* wc = w + c * taps;
    float acc = wc[taps - 1] * x[c];
    for (int64_t j = 0; j < taps - 1; ++j) acc += wc[j] * window[j];
    for (int64_t j = 0; j + 1 < taps - 1; ++j) window[j] = window[j + 1];
    if (taps > 1) window[taps - 2] = x[c];
    const float y = acc / (1.f + std::exp(-acc));
    if (c < keys) q[c] = y;
    else if (c < 2 * keys) k[c - keys] = y;
    else v[c - 2 * keys] = y;
  }
}

// ``count`` rows of q and k [count, dk] L2-normalised in place (eps 1e-6 under the root), q
// scaled by dk^-1/2: delta_rule.normalised.
void normalise_heads(float* q, float* k, int64_t count, int64_t dk) {
  const float scale = 1.f / std::sqrt(float(dk));
  for (int64_t i = 0; i < count; ++i) {
    float *qi = q + i * dk, *ki = k + i * dk;
    float sq = 0.f, sk = 0.f;
    for (int64_t j = 0; j < dk; ++j) {
      sq += qi[j] * qi[j];
      sk += ki[j] * ki[j];
    }
    const float fq = scale / std::sqrt(sq + 1e-6f), fk = 1.f / std::sqrt(sk + 1e-6f);
    for (int64_t j = 0; j < dk; ++j) {
      qi[j] *= fq;
      ki[j] *= fk;
    }
  }
}

// One sequence's tokens of a recurrent layer, each input [t, heads, dim] float32 (q and k already
// per value head); beta null for Mamba-2.
struct Tokens {
  const float *q, *k, *v, *g, *beta;
  float* o;
  int64_t t, heads, dk, dv;
};

// Columns [j0, j0 + 2W) (fewer at the edge) of head h's state S [dk, dv] through every token of
// ``x``, in order: the state's columns never mix (u_j and o_j read column j alone), so a block of
// 2W columns stays in L1 (16 KiB at dk 128) for the whole prompt while the per-token inputs
// stream past it. Per column the arithmetic is update_head's (Delta) or scan_head's, in the same
// order: a prompt run here leaves the state a decode step at a time would, bit for bit.
template <bool Delta>
void prefill_columns(float* S, const Tokens& x, int64_t h, int64_t j0) {
  const int64_t dk = x.dk, dv = x.dv, m0 = std::min(W, dv - j0), m1 = std::clamp<int64_t>(dv - j0 - W, 0, W);
  for (int64_t t = 0; t < x.t; ++t) {
    const int64_t at = t * x.heads + h;
    const float *q = x.q + at * dk, *k = x.k + at * dk, *v = x.v + at * dv + j0;
    const VF d(std::exp(x.g[at]));
    VF u0 = load_w(v, m0), u1 = m1 ? load_w(v + W, m1) : VF(0.f);
    if constexpr (Delta) {  // S_i *= decay; u = beta (v - S^T k)
      VF a0(0.f), a1(0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv + j0;
        const VF ki(k[i]), s0 = load_w(row, m0) * d;
        store_w(row, s0, m0);
        a0 = at::vec::fmadd(s0, ki, a0);
        if (m1) {
          const VF s1 = load_w(row + W, m1) * d;
          store_w(row + W, s1, m1);
          a1 = at::vec::fmadd(s1, ki, a1);
        }
      }
      const VF b(x.beta[at]);
      u0 = (u0 - a0) * b;
      u1 = (u1 - a1) * b;
    }
    VF o0(0.f), o1(0.f);
    for (int64_t i = 0; i < dk; ++i) {  // S_i += k_i u (Mamba-2: decay S_i first); o += q_i S_i
      float* row = S + i * dv + j0;
      const VF ki(k[i]), qi(q[i]);
      const VF s0 = at::vec::fmadd(u0, ki, Delta ? load_w(row, m0) : load_w(row, m0) * d);
      store_w(row, s0, m0);
      o0 = at::vec::fmadd(s0, qi, o0);
      if (m1) {
        const VF s1 = at::vec::fmadd(u1, ki, Delta ? load_w(row + W, m1) : load_w(row + W, m1) * d);
        store_w(row + W, s1, m1);
        o1 = at::vec::fmadd(s1, qi, o1);
      }
    }
    store_w(x.o + at * dv + j0, o0, m0);
    if (m1) store_w(x.o + at * dv + j0 + W, o1, m1);
  }
}

// One sequence's prompt tokens through a state [heads, dk, dv] (one slot's, in place): every head's
// blocks of 2W columns in parallel. Returns o [t, heads, dv].
template <bool Delta>
Tensor prefill(Tensor state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor* beta) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.scalar_type() == at::kFloat,
              "state: expected one sequence's [heads, key_dim, value_dim] float32, contiguous");
  const int64_t t = q.size(0), heads = state.size(0), dk = state.size(1), dv = state.size(2);
  check_float(q, {t, heads, dk}, "q");
  check_float(k, {t, heads, dk}, "k");
  check_float(v, {t, heads, dv}, "v");
  check_float(g, {t, heads}, "g");
  if (beta) check_float(*beta, {t, heads}, "beta");
  Tensor out = at::empty({t, heads, dv}, v.options());
  const Tokens x{q.data_ptr<float>(), k.data_ptr<float>(),       v.data_ptr<float>(), g.data_ptr<float>(),
                 beta ? beta->data_ptr<float>() : nullptr, out.data_ptr<float>(), t, heads, dk, dv};
  const int64_t blocks = (dv + 2 * W - 1) / (2 * W);
  float* S = state.data_ptr<float>();
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / blocks;
      prefill_columns<Delta>(S + h * dk * dv, x, h, job % blocks * 2 * W);
    }
  });
  return out;
}

}  // namespace

// A decode step's whole Gated DeltaNet layer between its projections, every row a sequence's one
// token: the gates from b and a (beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)),
// gated_deltanet_decode, then each head's output RMS-normed, scaled and times silu(z)
// (kinds/gated_deltanet/forward.py's _gated_norm), [n, heads x value_dim] float32.
Tensor gated_deltanet_layer_decode(Tensor conv_state, Tensor state, const Tensor& slots, const Tensor& x,
                                   const Tensor& conv_weight, const Tensor& b, const Tensor& a, const Tensor& A_log,
                                   const Tensor& dt_bias, const Tensor& z, const Tensor& norm_weight, double eps,
                                   int64_t key_heads, bool tiled) {
  const int64_t n = slots.size(0), heads = state.size(1), dv = state.size(3);
  check_float(b, {n, heads}, "b");
  check_float(a, {n, heads}, "a");
  check_float(A_log, {heads}, "A_log");
  check_float(dt_bias, {heads}, "dt_bias");
  check_float(z, {n, heads * dv}, "z");
  check_float(norm_weight, {dv}, "norm_weight");
  Tensor g = at::empty({n, heads}, b.options()), beta = at::empty({n, heads}, b.options());
  const float *bp = b.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *lp = A_log.data_ptr<float>(), *dp = dt_bias.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  for (int64_t i = 0; i < n * heads; ++i) {
    const float t = ap[i] + dp[i % heads];
    const float softplus = t > 20.f ? t : std::log1p(std::exp(t));  // torch's threshold
    gp[i] = -std::exp(lp[i % heads]) * softplus;
    betap[i] = 1.f / (1.f + std::exp(-bp[i]));
  }
  Tensor out = gated_deltanet_decode(conv_state, state, slots, x, conv_weight, g, beta, key_heads, tiled);
  float* op = out.data_ptr<float>();
  const float *zp = z.data_ptr<float>(), *wp = norm_weight.data_ptr<float>();
  for (int64_t i = 0; i < n * heads; ++i) {
    float* o = op + i * dv;
    float squares = 0.f;
    for (int64_t j = 0; j < dv; ++j) squares += o[j] * o[j];
    const float r = 1.f / std::sqrt(squares / float(dv) + float(eps));
    for (int64_t j = 0; j < dv; ++j) {
      const float zj = zp[i * dv + j];
      o[j] = o[j] * r * wp[j] * (zj / (1.f + std::exp(-zj)));
    }
  }
  return out.view({n, heads * dv});
}

Tensor mamba2_decode(Tensor state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& g) {
  check_update(state, slots, q, k, v, g);
  const int64_t n = slots.size(0), heads = state.size(1), dk = state.size(2), dv = state.size(3);
  Tensor out = at::empty({n, heads, dv}, v.options());
  float* S = state.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / heads, h = job % heads;
      scan_head(S + (slot[s] * heads + h) * dk * dv, qp + job * dk, kp + job * dk, vp + job * dv, std::exp(gp[job]),
                op + job * dv, dk, dv);
    }
  });
  return out;
}

// The whole of a Gated DeltaNet layer's decode step between its projections, for n sequences:
// each one's convolution continued from its slot (the window's last input is its row of x; the
// state shifted in place), silu, q and k L2-normalised per key head (eps 1e-6 under the root,
// q scaled by key_dim^-1/2, as delta_rule.normalised), and the delta rule on each value head
// with its key head's q and k (value head h: key head h mod key_heads where ``tiled``, else
// h / (value_heads / key_heads)). What kinds/gated_deltanet does in ~25 small ops per layer.
Tensor gated_deltanet_decode(Tensor conv_state, Tensor state, const Tensor& slots, const Tensor& x,
                             const Tensor& conv_weight, const Tensor& g, const Tensor& beta, int64_t key_heads,
                             bool tiled) {
  check_pool(state, slots);
  const int64_t n = slots.size(0), heads = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.scalar_type() == at::kFloat &&
                  conv_state.size(0) == state.size(0),
              "conv_state: expected [slots, channels, taps - 1] float32, contiguous, a slot per state");
  const int64_t channels = conv_state.size(1), taps = conv_state.size(2) + 1, keys = key_heads * dk;
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0 && channels == 2 * keys + heads * dv,
              "gated_deltanet_decode: the channels are q and k of key_heads x key_dim, v of heads x value_dim");
  check_float(x, {n, channels}, "x");
  check_float(conv_weight, {channels, taps}, "conv_weight");
  check_float(g, {n, heads}, "g");
  check_float(beta, {n, heads}, "beta");
  Tensor q = at::empty({n, key_heads, dk}, x.options()), k = at::empty({n, key_heads, dk}, x.options());
  Tensor v = at::empty({n, heads, dv}, x.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s)
    convolve_step(conv_state.data_ptr<float>() + slot[s] * channels * (taps - 1), x.data_ptr<float>() + s * channels,
                  conv_weight.data_ptr<float>(), channels, taps, keys, q.data_ptr<float>() + s * keys,
                  k.data_ptr<float>() + s * keys, v.data_ptr<float>() + s * heads * dv);
  normalise_heads(q.data_ptr<float>(), k.data_ptr<float>(), n * key_heads, dk);
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  Tensor out = at::empty({n, heads, dv}, x.options());
  float* S = state.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_key = heads / key_heads;
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(dv);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / heads, h = job % heads, kh = tiled ? h % key_heads : h / per_key;
      const int64_t at_key = (s * key_heads + kh) * dk;
      update_head(S + (slot[s] * heads + h) * dk * dv, qp + at_key, kp + at_key, vp + job * dv, std::exp(gp[job]),
                  bp[job], u.data(), op + job * dv, dk, dv);
    }
  });
  return out;
}

Tensor delta_rule_decode(Tensor state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& g, const Tensor& beta) {
  check_update(state, slots, q, k, v, g);
  const int64_t n = slots.size(0), heads = state.size(1), dk = state.size(2), dv = state.size(3);
  check_float(beta, {n, heads}, "beta");
  const int64_t* slot = slots.data_ptr<int64_t>();
  Tensor out = at::empty({n, heads, dv}, v.options());
  float* S = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(dv);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / heads, h = job % heads;
      update_head(S + (slot[s] * heads + h) * dk * dv, qp + job * dk, kp + job * dk, vp + job * dv,
                  std::exp(gp[job]), bp[job], u.data(), op + job * dv, dk, dv);
    }
  });
  return out;
}

Tensor delta_rule_prefill(Tensor state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                          const Tensor& beta) {
  return prefill<true>(state, q, k, v, g, &beta);
}

Tensor mamba2_prefill(Tensor state, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g) {
  return prefill<false>(state, q, k, v, g, nullptr);
}

}  // namespace pagedllm
