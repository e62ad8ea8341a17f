// What the few-row matmul kernels (cpu_gemv.cpp, cpu_gemv_q8.cpp) share: the checks on their
// input and output, the bf16 store and the passes over panels and rows.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "omp_share.h"

namespace kvrelay {

constexpr int kMaxRowsPerPass = 3;  // rows whose accumulators fit the 32 registers

// 16 columns' float32 results -> bf16 at out.
inline void store_bf16(uint16_t* out, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(values));
}

template <typename Fn>
void for_row_passes(int64_t M, Fn&& pass) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsPerPass) {
    const int64_t rows = std::min<int64_t>(kMaxRowsPerPass, M - m0);
    pass(m0, rows);
  }
}

struct Shapes {
  int64_t M, N, K;
};

inline Shapes check_io(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous [M, K] bf16 matrix");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
              out.size(0) == x.size(0), "out must be a contiguous [M, N] bf16 matrix");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  return {M, N, K};
}

// Every (16-column panel, pass of rows) of the [M, N] output, the panels shared among the
// OpenMP team: pass(panel, m0, rows, out + m0 * N + panel * 16).
template <typename Pass>
void for_each_pass(uint16_t* out, const Shapes& p, Pass&& pass) {
#pragma omp parallel
  {
    int64_t lo, hi;
    thread_share(p.N / 16, &lo, &hi);
    for (int64_t panel = lo; panel < hi; ++panel)
      for_row_passes(p.M, [&](int64_t m0, int64_t rows) {
        pass(panel, m0, rows, out + m0 * p.N + panel * 16);
      });
  }
}

}  // namespace kvrelay
