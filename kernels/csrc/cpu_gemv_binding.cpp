// Python module of the few-row matmuls (cpu_gemv.cpp, cpu_gemv_q8.cpp).
#include <torch/csrc/utils/pybind.h>

#include "cpu_gemv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_q4", &kvrelay::gemv_q4, "out = x @ W^T for a few rows, W as 4-bit tiles (AVX512-BF16)");
  m.def("gemv_q8", &kvrelay::gemv_q8,
        "out = x @ W^T for a few rows, W as 8-bit tiles (AVX-512 float32 FMAs)");
  m.def("gemv_bf16", &kvrelay::gemv_bf16, "out = x @ W^T for a few rows, W as bf16 tiles (AVX512-BF16)");
}
