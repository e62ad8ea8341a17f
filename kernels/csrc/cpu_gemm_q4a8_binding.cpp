// Python module of the VNNI 4-bit matmul (cpu_gemm_q4a8.cpp).
#include <torch/csrc/utils/pybind.h>

#include "cpu_gemm_q4a8.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_q4a8", &kvrelay::gemm_q4a8,
        "out = x @ W^T, W as 4-bit tiles, x coded as int8 per 32 values, split: twice "
        "(AVX512-VNNI)", pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("tiles"),
        pybind11::arg("split"));
}
