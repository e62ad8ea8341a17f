// Matmuls of a few rows on AVX512-BF16 (cpu_gemv.cpp, cpu_gemv_q8.cpp): out [M, N] = x [M, K] @ W^T,
// bf16 in and out, W in one of the packed layouts those files describe. Declared here so that
// the Python module (cpu_gemv_binding.cpp) and the fused decode stack (decode_stack.cpp) share them.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

void gemv_q4(at::Tensor out, const at::Tensor& x, const at::Tensor& q4_tiles);
void gemv_q8(at::Tensor out, const at::Tensor& x, const at::Tensor& q8_tiles);
void gemv_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed);

}  // namespace kvrelay
