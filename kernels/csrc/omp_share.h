// How an OpenMP team splits a matmul's column panels: thread t of T takes [P t / T, P (t+1) / T).
#pragma once

#include <omp.h>

#include <cstdint>

namespace kvrelay {

inline void thread_share(int64_t panels, int64_t* lo, int64_t* hi) {
  const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
  *lo = panels * me / threads;
  *hi = panels * (me + 1) / threads;
}

}  // namespace kvrelay
