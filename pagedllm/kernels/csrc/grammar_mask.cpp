// mask_logits: grammar masks on logits, the tokens a row's grammar forbids become -inf.
//
// A structured-output row's mask is one bit per token (xgrammar's layout: token t is allowed
// iff bit t % 32 of word t / 32 is set). Almost every word is all-allowed or all-forbidden, so
// the loop decides a word at a time and looks at single bits only in the rare mixed word.
// xgrammar's own CPU kernel tests every bit: 1.5 ms for 8 rows of a 49k vocabulary here, a
// tenth of a small model's decode step at 64 rows.

#include <algorithm>
#include <cstdint>
#include <limits>

#include "ops.h"

namespace pagedllm {

void mask_logits(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows, int64_t vocab) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "mask_logits: logits must be 2-D float32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "mask_logits: bitmask must be a contiguous 2-D int32 tensor");
  TORCH_CHECK(vocab <= logits.size(1) && (vocab + 31) / 32 <= bitmask.size(1), "mask_logits: vocab too large");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t words = (vocab + 31) / 32;
  for (int64_t row : rows) {
    TORCH_CHECK(row >= 0 && row < logits.size(0) && row < bitmask.size(0), "mask_logits: row out of range");
    float* out = logits.data_ptr<float>() + row * logits.stride(0);
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + row * bitmask.size(1);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = bits[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, end = std::min<int64_t>(32, vocab - base);
      if (word == 0) {
        std::fill(out + base, out + base + end, neg_inf);
        continue;
      }
      for (int64_t b = 0; b < end; ++b) {
        if (!((word >> b) & 1u)) out[base + b] = neg_inf;
      }
    }
  }
}

}  // namespace pagedllm
