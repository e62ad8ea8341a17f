// The one synchronisation a shared-memory collective needs between ranks on one host: each rank
// publishes the round it has written its slot for, then waits until every rank has (acquire:
// their slot contents are visible after). Counters are 64-bit words, one per rank, 64 bytes
// apart (no two ranks write one cache line). The wait spins (the ranks own their cores), and
// yields the core after a while so oversubscribed ranks still progress.
#include <torch/extension.h>

#include <sched.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

constexpr int64_t kStride = 8;  // uint64 words between two ranks' counters: 64 bytes
constexpr int64_t kSpinsBeforeYield = 1 << 14;

uint64_t* counters_of(const torch::Tensor& counters, int64_t size) {
  if (counters.scalar_type() != torch::kInt64 || !counters.is_contiguous() ||
      counters.numel() < size * kStride) {
    throw std::invalid_argument("counters: a contiguous int64 tensor of size * 8 words");
  }
  return reinterpret_cast<uint64_t*>(counters.data_ptr<int64_t>());
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Publish `round` for `rank`, then wait until every one of `size` ranks has published it;
// a rank that has not within `timeout_s` (dead or stopped) raises, so no rank waits forever.
void arrive_and_wait(torch::Tensor counters, int64_t rank, int64_t size, int64_t round,
                     double timeout_s) {
  uint64_t* words = counters_of(counters, size);
  __atomic_store_n(&words[rank * kStride], static_cast<uint64_t>(round), __ATOMIC_RELEASE);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s);
  for (int64_t other = 0; other < size; ++other) {
    int64_t spins = 0;
    while (__atomic_load_n(&words[other * kStride], __ATOMIC_ACQUIRE) <
           static_cast<uint64_t>(round)) {
      if (++spins < kSpinsBeforeYield) {
        relax();
        continue;
      }
      spins = 0;
      sched_yield();
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("tensor-parallel rank " + std::to_string(other) +
                                 " did not reach round " + std::to_string(round) + " within " +
                                 std::to_string(timeout_s) + " s");
      }
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The wait lets go of the GIL: the leader's watcher thread must run while its compute thread
  // waits here for a rank that died (services/engine/parallel/followers.py).
  m.def("arrive_and_wait", &arrive_and_wait, "publish a round, wait for every rank's",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
