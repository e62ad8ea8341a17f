// Batched LoRA on CPU (cpu_lora.cpp): every token of a flat batch applies its own adapter slot's
// low-rank matrices. Declared here for the Python module (cpu_lora_binding.cpp). Every check raises
// c10::ValueError (Python's ValueError) with what was wanted and what was given.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

// out [T, R] float32 = x [T, in] @ a[slot]^T per token, a [S, R, in]; rows of slot -1 are 0.
// x and a: bf16, f16 or f32 (the same); x's rows may be strided; token_slots [T] int32.
void lora_shrink_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& token_slots);
// The same into a new [T, R] float32 tensor.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slots);

// y [T, out] = round(y + xa [T, R] @ b_t[slot]) per token in float32, b_t [S, R, out] of y's
// dtype; rows of slot -1 untouched. y's and xa's rows may be strided (column slices).
void lora_expand(const at::Tensor& y, const at::Tensor& xa, const at::Tensor& b_t,
                 const at::Tensor& token_slots);

}  // namespace kvrelay
