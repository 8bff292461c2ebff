// pin_threads: binds torch's intra-op worker threads to CPUs (Linux sched_setaffinity).

#include <sched.h>

#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"

namespace pagedllm {

// each: binds intra-op worker thread i (i >= 1) to cpus[i % len]; else lets every worker run on
// any of cpus. Thread 0 is the caller's own thread: the engine binds it around each step only
// (engine/threads.py), so what the caller starts between steps keeps every CPU.
// Returns how many threads were bound.
int64_t pin_threads(const Tensor& cpus, bool each) {
  TORCH_CHECK(cpus.dim() == 1 && cpus.scalar_type() == at::kLong && cpus.numel() > 0, "cpus: a 1-d int64 tensor");
  const int64_t* ids = cpus.data_ptr<int64_t>();
  const int64_t n = cpus.numel(), threads = at::get_num_threads();
  std::vector<int> ok(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t == 0) continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      if (each)
        CPU_SET(int(ids[t % n]), &set);
      else
        for (int64_t i = 0; i < n; ++i) CPU_SET(int(ids[i]), &set);
      ok[t] = sched_setaffinity(0, sizeof set, &set) == 0;
    }
  });
  int64_t bound = 0;
  for (int v : ok) bound += v;
  return bound;
}

}  // namespace pagedllm
