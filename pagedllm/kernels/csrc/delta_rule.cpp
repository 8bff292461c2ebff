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

// The checks both updates make of the pool, the slots and the per-token inputs.
void check_update(const Tensor& state, const Tensor& slots, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& g) {
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous() && state.scalar_type() == at::kFloat,
              "state: expected [slots, heads, key_dim, value_dim] float32, contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong, "slots: expected [n] int64");
  const int64_t n = slots.size(0), heads = state.size(1), dk = state.size(2), dv = state.size(3);
  check_float(q, {n, heads, dk}, "q");
  check_float(k, {n, heads, dk}, "k");
  check_float(v, {n, heads, dv}, "v");
  check_float(g, {n, heads}, "g");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < state.size(0), "slot ", slot[s], " outside the pool of ", state.size(0));
}

}  // namespace

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

}  // namespace pagedllm
