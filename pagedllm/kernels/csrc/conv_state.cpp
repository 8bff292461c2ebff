// A decode step's short causal convolution for several sequences at once (kinds/short_conv,
// kinds/mamba2 through layers/recurrence.py): each sequence's window of its last taps - 1 inputs,
// in its slot of the state pool, continued by its new input, the taps' sum (plus the bias; silu
// of it where the layer applies one) written out, the window shifted in place. The PyTorch path
// gathers the windows, concatenates the new column, writes the shifted windows back and sums:
// five ops and three copies per layer, or (LFM2's) a loop over the sequences in Python.

#include "common.h"
#include "ops.h"

namespace pagedllm {

Tensor conv_state_step(Tensor conv_state, const Tensor& slots, const Tensor& x, const Tensor& weight,
                       const Tensor& bias, bool silu) {
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.is_contiguous() && conv_state.scalar_type() == at::kFloat,
              "conv_state: expected [slots, channels, taps - 1] float32, contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong, "slots: expected [n] int64");
  const int64_t n = slots.size(0), channels = conv_state.size(1), taps = conv_state.size(2) + 1;
  TORCH_CHECK(x.sizes() == at::IntArrayRef({n, channels}) && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x: expected [n, channels] float32, contiguous");
  TORCH_CHECK(weight.sizes() == at::IntArrayRef({channels, taps}) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight: expected [channels, taps] float32, contiguous");
  const bool biased = bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.sizes() == at::IntArrayRef({channels}) && bias.is_contiguous() &&
                          bias.scalar_type() == at::kFloat),
              "bias: expected [channels] float32 or empty");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < conv_state.size(0), "slot ", slot[s], " outside the pool of ",
                conv_state.size(0));
  Tensor out = at::empty({n, channels}, x.options());
  float *cs = conv_state.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>(), *bp = biased ? bias.data_ptr<float>() : nullptr;
  at::parallel_for(0, n * channels, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / channels, c = job % channels;
      float* window = cs + (slot[s] * channels + c) * (taps - 1);
      const float* w = wp + c * taps;
      float acc = 0.f;  // the taps in the reference's order: oldest input first, the new one last
      for (int64_t j = 0; j < taps - 1; ++j) acc += w[j] * window[j];
      acc += w[taps - 1] * xp[job];
      if (bp) acc += bp[c];
      for (int64_t j = 0; j + 1 < taps - 1; ++j) window[j] = window[j + 1];
      if (taps > 1) window[taps - 2] = xp[job];
      op[job] = silu ? acc / (1.f + std::exp(-acc)) : acc;
    }
  });
  return out;
}

}  // namespace pagedllm
