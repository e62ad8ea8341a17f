// 4-bit weights times int8-coded activations on AVX512-VNNI (cpu_gemm_q4a8.cpp), shared by the
// Python module (cpu_gemm_q4a8_binding.cpp) and the fused decode stack (decode_stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T, bf16 in and out; split: each 32 activations coded twice.
void gemm_q4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& tiles, bool split);

}  // namespace kvrelay
