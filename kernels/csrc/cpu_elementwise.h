// The decoder layer's fused elementwise ops on CPU (cpu_elementwise.cpp), shared by the Python
// module (cpu_elementwise_binding.cpp) and the fused decode stack (decode_stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

// out = RMSNorm(x) * weight (offset: * (1 + weight), in float32 as Gemma's norms); x, out
// [rows, hidden] contiguous, float32 or bf16.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool offset);
// residual += x (bf16, in place), then out = RMSNorm(residual) * weight (or 1 + weight).
void add_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps, bool offset);
// out = rope(RMSNorm(head)) per head of x [tokens, heads, head_dim] (rows may be strided): the
// first num_q_heads heads with q_weight, the rest with k_weight [head_dim].
void qk_norm_rope(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, int64_t num_q_heads, double eps, bool offset,
                  const at::Tensor& cos, const at::Tensor& sin);
// out [rows, inter] = gelu_tanh(gate) * up, gate_up [rows, 2 * inter] = gate | up, bf16.
void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& gate_up);
// out = x * cos + rotate_half(x) * sin; x [tokens, heads, head_dim], rows may be strided.
void rope(const at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] = gate | up, bf16.
void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up);
// -inf in logits[rows[r]] wherever bitmask[r]'s bit is 0.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
// out [B] int64 = the first index of each row's maximum (NaN first).
void argmax_rows(const at::Tensor& out, const at::Tensor& logits);

}  // namespace kvrelay
