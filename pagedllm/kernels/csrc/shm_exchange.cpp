// shm_exchange: the ranks of a split model on one host sum a tensor (or gather it onto rank 0)
// through a shared memory region (distributed/shm.py maps it into every rank), instead of gloo's
// TCP loopback: an all-reduce of one decode step's hidden states costs a copy, a flag and a sum,
// microseconds. Without `reduce`, every rank publishes its tensor and waits for the others, and
// rank 0 reads the slots itself (the logits rows of every rank, distributed/shm.py).
//
// The region: one 64-byte line of flags per rank (the sequence number of the rank's latest
// published slot), then two banks of one slot per rank. For call `seq` each rank copies its
// tensor into its slot of bank seq % 2, publishes seq, waits until every rank has published seq
// and sums the slots in rank order into its tensor: every rank computes the same bits. Two banks
// make one wait per call enough: a rank writes bank seq % 2 again only at seq + 2, after every
// rank published seq + 1, which each does only once it has finished reading seq.
//
// A call waits at most `wait_s` seconds and then returns false, so the caller can check that
// the other ranks are alive and call again with `published` (the copy is not redone).

#include <sched.h>

#include <atomic>
#include <chrono>

#include "common.h"
#include "ops.h"

namespace pagedllm {

namespace {

constexpr int64_t kFlagBytes = 64;

std::atomic<int64_t>* flag(uint8_t* region, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(region + rank * kFlagBytes);
}

int64_t header_bytes(int64_t world) { return (world * kFlagBytes + 4095) / 4096 * 4096; }

bool everyone_published(uint8_t* region, int64_t world, int64_t seq, double wait_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t spins = 0; flag(region, r)->load(std::memory_order_acquire) < seq; ++spins) {
      if ((spins & 1023) == 1023) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        sched_yield();  // a rank sharing its core with ours gets to run
      }
    }
  }
  return true;
}

template <typename T>
void sum_slots(T* out, uint8_t* bank, int64_t world, int64_t slot_bytes, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += W) {
      const int64_t m = std::min<int64_t>(W, end - i);
      VF acc = load_w(reinterpret_cast<const T*>(bank) + i, m);
      for (int64_t r = 1; r < world; ++r) acc = acc + load_w(reinterpret_cast<const T*>(bank + r * slot_bytes) + i, m);
      store_w(out + i, acc, m);
    }
  });
}

}  // namespace

bool shm_exchange(Tensor x, Tensor region, int64_t rank, int64_t world, int64_t slot_bytes, int64_t seq,
                  double wait_s, bool published, bool reduce) {
  TORCH_CHECK(x.is_contiguous() && region.is_contiguous() && region.scalar_type() == at::kByte,
              "shm_exchange: a contiguous tensor and a uint8 region");
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= slot_bytes, "shm_exchange: ", nbytes, " bytes, more than a slot (", slot_bytes, ")");
  TORCH_CHECK(region.numel() >= header_bytes(world) + 2 * world * slot_bytes, "shm_exchange: region too small");
  TORCH_CHECK(seq >= 1 && rank >= 0 && rank < world, "shm_exchange: bad rank or sequence number");
  uint8_t* base = region.data_ptr<uint8_t>();
  uint8_t* bank = base + shm_slot_offset(world, slot_bytes, seq, 0);
  if (!published) {
    std::memcpy(bank + rank * slot_bytes, x.data_ptr(), nbytes);
    flag(base, rank)->store(seq, std::memory_order_release);
  }
  if (!everyone_published(base, world, seq, wait_s)) return false;
  if (!reduce) return true;
  dispatch(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    sum_slots(x.data_ptr<T>(), bank, world, slot_bytes, x.numel());
  });
  return true;
}

int64_t shm_region_bytes(int64_t world, int64_t slot_bytes) { return header_bytes(world) + 2 * world * slot_bytes; }

int64_t shm_slot_offset(int64_t world, int64_t slot_bytes, int64_t seq, int64_t rank) {
  return header_bytes(world) + ((seq & 1) * world + rank) * slot_bytes;
}

}  // namespace pagedllm
