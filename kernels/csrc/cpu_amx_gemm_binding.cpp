// The Python module of the AMX matmuls (kernels/native_amx.py).
#include <torch/csrc/utils/pybind.h>

#include "cpu_amx_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_bf16", &kvrelay::amx_gemm_bf16, "out = x @ W^T on AMX, W in B-tile layout (bf16)");
  m.def("gemm_q4", &kvrelay::amx_gemm_q4, "out = x @ W^T on AMX, W as 4-bit GGUF tiles widened in L1");
}
