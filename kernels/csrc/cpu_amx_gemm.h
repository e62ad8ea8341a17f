// Small-M matmuls on AMX tiles (cpu_amx_gemm.cpp), shared by the Python module
// (cpu_amx_gemm_binding.cpp) and the fused decode stack (decode_stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T, bf16 in and out; W as B tiles (native_amx.pack_bf16).
void amx_gemm_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed);
// The same with W as 4-bit GGUF tiles (native_amx.pack_q4), widened to bf16 in L1.
void amx_gemm_q4(at::Tensor out, const at::Tensor& x, const at::Tensor& q4_tiles);

}  // namespace kvrelay
