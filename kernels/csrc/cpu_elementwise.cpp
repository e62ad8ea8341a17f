// Fused elementwise ops of the decoder layer for CPU: RMSNorm, the rotary embedding and the
// MLP's silu(gate) * up. (A scalar std::exp loop lost to torch's vectorized SiLU by ~5x; the
// SiLU here uses fp32_lanes.h's polynomial exp, which gcc vectorizes.)
//
// PyTorch runs each of these as 3-8 separate passes over memory (and for bf16, a dtype copy in
// each), which on a 2048-token prefill costs more than the matmuls around them. One pass per op
// here, OpenMP over rows. Every intermediate is rounded to the tensor's dtype exactly where
// PyTorch's eager ops would round it: rope equals the torch path bit for bit in bf16; RMSNorm
// may differ in the last bit, since its sum of squares runs in another order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <type_traits>

#include "cpu_elementwise.h"
#include "fp32_lanes.h"  // widen / narrow: bf16 <-> fp32 with torch's rounding

namespace {

// Element access in either dtype; `round` applies the dtype's rounding to a float.
struct Bf16 {
  using T = uint16_t;
  static float load(const T* p, int64_t i) { return kvrelay::widen(p[i]); }
  static void store(T* p, int64_t i, float v) { kvrelay::narrow(v, p + i); }
  static float round(float v) {
    uint16_t bits;
    kvrelay::narrow(v, &bits);
    return kvrelay::widen(bits);
  }
};
struct F32 {
  using T = float;
  static float load(const T* p, int64_t i) { return p[i]; }
  static void store(T* p, int64_t i, float v) { p[i] = v; }
  static float round(float v) { return v; }
};

// bf16 lanes rounded to bf16 precision and widened again: where torch rounds an intermediate.
inline kvrelay::Lanes round_bf16(kvrelay::Lanes v) {
  return (kvrelay::Lanes)(kvrelay::narrow_words(v) << 16);
}

// Rows per OpenMP work item: a few thousand elements each, so that a decode step's small
// batches run inline (a team's fork and join costs more than normalizing 64 rows).
inline int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)); }

// The rest of torch's RMSNorm once the sum of squares is known: round(x * inv_rms) to the
// dtype, then times the weight, rounded again.
template <typename D>
void scale_row(typename D::T* dst, const typename D::T* in, const typename D::T* weight,
               float inv_rms, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i)
    D::store(dst, i, D::load(weight, i) * D::round(D::load(in, i) * inv_rms));
}

template <typename D>
float sum_squares(const typename D::T* in, int64_t hidden) {
  float sum = 0.f;
  for (int64_t i = 0; i < hidden; ++i) sum += D::load(in, i) * D::load(in, i);
  return sum;
}

// bf16 rows go 32 elements at a time (even and odd lanes, fp32_lanes.h), the sum of squares
// in 16 partial sums: torch sums in another order too, so the last bit may differ.
template <>
float sum_squares<Bf16>(const uint16_t* in, int64_t hidden) {
  kvrelay::Lanes even_sum = {}, odd_sum = {};
  int64_t i = 0;
  for (; i + 2 * kvrelay::kLanes <= hidden; i += 2 * kvrelay::kLanes) {
    kvrelay::Lanes even, odd;
    kvrelay::load_bf16_pairs(in + i, even, odd);
    even_sum += even * even;
    odd_sum += odd * odd;
  }
  float sum = kvrelay::sum_of(even_sum + odd_sum);
  for (; i < hidden; ++i) sum += kvrelay::widen(in[i]) * kvrelay::widen(in[i]);
  return sum;
}

template <>
void scale_row<Bf16>(uint16_t* dst, const uint16_t* in, const uint16_t* weight, float inv_rms,
                     int64_t hidden) {
  int64_t i = 0;
  for (; i + 2 * kvrelay::kLanes <= hidden; i += 2 * kvrelay::kLanes) {
    kvrelay::Lanes even, odd, weight_even, weight_odd;
    kvrelay::load_bf16_pairs(in + i, even, odd);
    kvrelay::load_bf16_pairs(weight + i, weight_even, weight_odd);
    kvrelay::store_bf16_pairs(weight_even * round_bf16(even * inv_rms),
                              weight_odd * round_bf16(odd * inv_rms), dst + i);
  }
  for (; i < hidden; ++i)
    Bf16::store(dst, i, Bf16::load(weight, i) * Bf16::round(Bf16::load(in, i) * inv_rms));
}

// Gemma's convention, where the checkpoint stores w - 1: x * inv_rms * (1 + w), all in float32
// and rounded once at the end, as transformers computes it.
template <typename D>
void scale_row_offset(typename D::T* dst, const typename D::T* in, const typename D::T* weight,
                      float inv_rms, int64_t hidden) {
  for (int64_t i = 0; i < hidden; ++i)
    D::store(dst, i, (D::load(in, i) * inv_rms) * (1.f + D::load(weight, i)));
}

template <>
void scale_row_offset<Bf16>(uint16_t* dst, const uint16_t* in, const uint16_t* weight,
                            float inv_rms, int64_t hidden) {
  int64_t i = 0;
  for (; i + 2 * kvrelay::kLanes <= hidden; i += 2 * kvrelay::kLanes) {
    kvrelay::Lanes even, odd, weight_even, weight_odd;
    kvrelay::load_bf16_pairs(in + i, even, odd);
    kvrelay::load_bf16_pairs(weight + i, weight_even, weight_odd);
    kvrelay::store_bf16_pairs((even * inv_rms) * (1.f + weight_even),
                              (odd * inv_rms) * (1.f + weight_odd), dst + i);
  }
  for (; i < hidden; ++i)
    Bf16::store(dst, i, (Bf16::load(in, i) * inv_rms) * (1.f + Bf16::load(weight, i)));
}

// The row's scaling in either convention (offset: by 1 + w).
template <typename D>
void scale_row_as(bool offset, typename D::T* dst, const typename D::T* in,
                  const typename D::T* weight, float inv_rms, int64_t hidden) {
  if (offset)
    scale_row_offset<D>(dst, in, weight, inv_rms, hidden);
  else
    scale_row<D>(dst, in, weight, inv_rms, hidden);
}

// torch: x32 * rsqrt(mean(x32^2) + eps), rounded to the dtype, then times the weight.
inline float inverse_rms(float sum_squares, int64_t hidden, float eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(hidden) + eps);
}

template <typename D>
void rms_norm_rows(typename D::T* out, const typename D::T* x, const typename D::T* weight,
                   int64_t rows, int64_t hidden, float eps, bool offset) {
  at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const typename D::T* in = x + row * hidden;
      scale_row_as<D>(offset, out + row * hidden, in, weight,
                      inverse_rms(sum_squares<D>(in, hidden), hidden, eps), hidden);
    }
  });
}

// The decoder's residual add fused into the next RMSNorm (bf16): residual = round(x +
// residual), as torch's bf16 add rounds it, then out = RMSNorm(residual). One pass over x and
// the residual instead of an add's pass, and the normalized row read back from L1.
void add_rms_norm_rows(uint16_t* out, const uint16_t* x, uint16_t* residual, const uint16_t* weight,
                       int64_t rows, int64_t hidden, float eps, bool offset) {
  at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint16_t* in = x + row * hidden;
      uint16_t* sum_row = residual + row * hidden;
      int64_t i = 0;
      for (; i + 2 * kvrelay::kLanes <= hidden; i += 2 * kvrelay::kLanes) {
        kvrelay::Lanes x_even, x_odd, r_even, r_odd;
        kvrelay::load_bf16_pairs(in + i, x_even, x_odd);
        kvrelay::load_bf16_pairs(sum_row + i, r_even, r_odd);
        kvrelay::store_bf16_pairs(x_even + r_even, x_odd + r_odd, sum_row + i);
      }
      for (; i < hidden; ++i) Bf16::store(sum_row, i, Bf16::load(in, i) + Bf16::load(sum_row, i));
      const float inv_rms = inverse_rms(sum_squares<Bf16>(sum_row, hidden), hidden, eps);
      scale_row_as<Bf16>(offset, out + row * hidden, sum_row, weight, inv_rms, hidden);
    }
  });
}

// x [tokens, heads, head_dim] rotated in place of a copy: out = x*cos + rotate_half(x)*sin.
template <typename D>
void rope_head(typename D::T* dst, const typename D::T* in, const typename D::T* c,
               const typename D::T* s, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < head_dim; ++i) {
    float rotated = i < half ? -D::load(in, i + half) : D::load(in, i - half);
    float first = D::round(D::load(in, i) * D::load(c, i));
    float second = D::round(rotated * D::load(s, i));
    D::store(dst, i, first + second);
  }
}

// bf16 heads whose halves are whole vectors of 32: the same roundings, 32 dims at a time (a dim
// and its rotation partner sit at the same lane of the two halves).
void rope_head_bf16_vectors(uint16_t* dst, const uint16_t* in, const uint16_t* c,
                            const uint16_t* s, int64_t head_dim) {
  using kvrelay::Lanes;
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i += 2 * kvrelay::kLanes) {
    Lanes low_even, low_odd, high_even, high_odd, cos_low_even, cos_low_odd, cos_high_even,
        cos_high_odd, sin_low_even, sin_low_odd, sin_high_even, sin_high_odd;
    kvrelay::load_bf16_pairs(in + i, low_even, low_odd);
    kvrelay::load_bf16_pairs(in + half + i, high_even, high_odd);
    kvrelay::load_bf16_pairs(c + i, cos_low_even, cos_low_odd);
    kvrelay::load_bf16_pairs(c + half + i, cos_high_even, cos_high_odd);
    kvrelay::load_bf16_pairs(s + i, sin_low_even, sin_low_odd);
    kvrelay::load_bf16_pairs(s + half + i, sin_high_even, sin_high_odd);
    kvrelay::store_bf16_pairs(round_bf16(low_even * cos_low_even) + round_bf16(-high_even * sin_low_even),
                              round_bf16(low_odd * cos_low_odd) + round_bf16(-high_odd * sin_low_odd), dst + i);
    kvrelay::store_bf16_pairs(round_bf16(high_even * cos_high_even) + round_bf16(low_even * sin_high_even),
                              round_bf16(high_odd * cos_high_odd) + round_bf16(low_odd * sin_high_odd),
                              dst + half + i);
  }
}

template <typename D>
void rope_rows(typename D::T* out, const typename D::T* x, int64_t x_token_stride, const typename D::T* cos,
               const typename D::T* sin, int64_t tokens, int64_t heads, int64_t head_dim) {
  constexpr bool kBf16 = std::is_same_v<D, Bf16>;
  const bool vectors = kBf16 && (head_dim / 2) % (2 * kvrelay::kLanes) == 0;
  at::parallel_for(0, tokens, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const typename D::T* c = cos + token * head_dim;
      const typename D::T* s = sin + token * head_dim;
      for (int64_t head = 0; head < heads; ++head) {
        const typename D::T* in = x + token * x_token_stride + head * head_dim;
        typename D::T* dst = out + (token * heads + head) * head_dim;
        if constexpr (kBf16) {
          if (vectors) {
            rope_head_bf16_vectors(dst, in, c, s, head_dim);
            continue;
          }
        }
        rope_head<D>(dst, in, c, s, head_dim);
      }
    }
  });
}

// Qwen3's and Gemma 3's attention: each q and k head RMS-normalized over head_dim (its own
// weight for q heads and for k heads), then rotated. x [tokens, heads, head_dim] with strided
// rows (a slice of the qkv output), the first num_q_heads heads q; out contiguous. The
// normalized head is rounded to the dtype before the rotation, as the two torch modules round it
// between them.
constexpr int64_t kMaxNormedHeadDim = 1024;

template <typename D>
void qk_norm_rope_rows(typename D::T* out, const typename D::T* x, int64_t x_token_stride,
                       const typename D::T* q_weight, const typename D::T* k_weight,
                       int64_t num_q_heads, float eps, bool offset, const typename D::T* cos,
                       const typename D::T* sin, int64_t tokens, int64_t heads, int64_t head_dim) {
  constexpr bool kBf16 = std::is_same_v<D, Bf16>;
  const bool vectors = kBf16 && (head_dim / 2) % (2 * kvrelay::kLanes) == 0;
  at::parallel_for(0, tokens, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    typename D::T normed[kMaxNormedHeadDim];
    for (int64_t token = begin; token < end; ++token) {
      const typename D::T* c = cos + token * head_dim;
      const typename D::T* s = sin + token * head_dim;
      for (int64_t head = 0; head < heads; ++head) {
        const typename D::T* in = x + token * x_token_stride + head * head_dim;
        const typename D::T* weight = head < num_q_heads ? q_weight : k_weight;
        scale_row_as<D>(offset, normed, in, weight,
                        inverse_rms(sum_squares<D>(in, head_dim), head_dim, eps), head_dim);
        typename D::T* dst = out + (token * heads + head) * head_dim;
        if constexpr (kBf16) {
          if (vectors) {
            rope_head_bf16_vectors(dst, normed, c, s, head_dim);
            continue;
          }
        }
        rope_head<D>(dst, normed, c, s, head_dim);
      }
    }
  });
}

// silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|) <= 1 so that the exp never overflows.
inline kvrelay::Lanes silu_lanes(kvrelay::Lanes x) {
  using kvrelay::Lanes;
  const Lanes zero = {};
  const Lanes e = kvrelay::exp2_lanes((x < zero ? x : -x) * 1.4426950408889634f);
  const Lanes numerator = x >= zero ? zero + 1.0f : e;
  return x * (numerator / (1.0f + e));
}

inline float silu_scalar(float x) {
  const float e = kvrelay::exp2_nonpositive(-std::fabs(x) * 1.4426950408889634f);
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

// gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3), in float32. With
// e = exp(-2 |y|) <= 1 (never overflows), 1 + tanh(y) is 2 / (1 + e) for y >= 0 and 2 e / (1 + e)
// below: no cancellation where x is very negative (torch's 1 + tanh loses digits there, so
// results below ~1e-4 in size may differ from torch's in the last bf16 bit; elsewhere they
// agree but for rare last-bit ties).
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

inline kvrelay::Lanes gelu_tanh_lanes(kvrelay::Lanes x) {
  using kvrelay::Lanes;
  const Lanes inner = kGeluBeta * (x + kGeluKappa * (x * x * x));
  const Lanes magnitude = inner < 0.0f ? -inner : inner;
  const Lanes e = kvrelay::exp2_lanes(magnitude * (-2.0f * 1.4426950408889634f));
  const Lanes numerator = inner < 0.0f ? x * e : x;
  return numerator / (1.0f + e);
}

inline float gelu_tanh_scalar(float x) {
  const float inner = kGeluBeta * (x + kGeluKappa * (x * x * x));
  const float e = kvrelay::exp2_nonpositive(-2.0f * std::fabs(inner) * 1.4426950408889634f);
  return (inner < 0.0f ? x * e : x) / (1.0f + e);
}

struct Silu {
  static kvrelay::Lanes lanes(kvrelay::Lanes x) { return silu_lanes(x); }
  static float scalar(float x) { return silu_scalar(x); }
};
struct GeluTanh {
  static kvrelay::Lanes lanes(kvrelay::Lanes x) { return gelu_tanh_lanes(x); }
  static float scalar(float x) { return gelu_tanh_scalar(x); }
};

// out [rows, inter] = act(gate) * up, gate_up [rows, 2 * inter] = gate | up (SiLU: Llama's
// MLP; GELU-tanh: Gemma's). torch rounds the activation's result to bf16 before the product,
// so this does too; the activation itself runs in fp32 with a polynomial exp (relative error
// ~1e-8), so a result may rarely sit one bf16 step away.
template <typename Act>
void act_and_mul_rows(uint16_t* out, const uint16_t* gate_up, int64_t rows, int64_t inter) {
  constexpr int64_t kPair = 2 * kvrelay::kLanes;  // bf16 elements per vector of words
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint16_t* gate = gate_up + row * 2 * inter;
      const uint16_t* up = gate + inter;
      uint16_t* dst = out + row * inter;
      int64_t i = 0;
      for (; i + kPair <= inter; i += kPair) {
        kvrelay::Lanes gate_even, gate_odd, up_even, up_odd;
        kvrelay::load_bf16_pairs(gate + i, gate_even, gate_odd);
        kvrelay::load_bf16_pairs(up + i, up_even, up_odd);
        kvrelay::store_bf16_pairs(round_bf16(Act::lanes(gate_even)) * up_even,
                                  round_bf16(Act::lanes(gate_odd)) * up_odd, dst + i);
      }
      for (; i < inter; ++i) {
        const float act = Bf16::round(Act::scalar(kvrelay::widen(gate[i])));
        kvrelay::narrow(act * kvrelay::widen(up[i]), dst + i);
      }
    }
  });
}

bool is_bf16(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat,
              "expected float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16;
}

void check_out(const at::Tensor& out, const at::Tensor& like, at::IntArrayRef sizes) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == sizes && out.scalar_type() == like.scalar_type(),
              "out must be contiguous, ", sizes, ", ", like.scalar_type());
}

}  // namespace

namespace kvrelay {

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(), "x [rows, hidden] contiguous");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(), "weight [hidden], x's dtype");
  check_out(out, x, x.sizes());
  if (is_bf16(x))
    rms_norm_rows<Bf16>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                        reinterpret_cast<const uint16_t*>(weight.data_ptr()), x.size(0), x.size(1), eps, offset);
  else
    rms_norm_rows<F32>(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1), eps,
                       offset);
}


void add_rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps, bool offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "x, residual [rows, hidden] contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm takes bfloat16");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual like x");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(), "weight [hidden], x's dtype");
  check_out(out, x, x.sizes());
  add_rms_norm_rows(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                    reinterpret_cast<uint16_t*>(residual.data_ptr()),
                    reinterpret_cast<const uint16_t*>(weight.data_ptr()), x.size(0), x.size(1), eps, offset);
}


void rope(const at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x [tokens, heads, head_dim] with contiguous heads (a row slice of the qkv output is fine).
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x [tokens, heads, head_dim]");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(), "cos, sin [tokens, 1, head_dim] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  check_out(out, x, x.sizes());
  if (is_bf16(x))
    rope_rows<Bf16>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                    x.stride(0), reinterpret_cast<const uint16_t*>(cos.data_ptr()),
                    reinterpret_cast<const uint16_t*>(sin.data_ptr()), x.size(0), x.size(1), x.size(2));
  else
    rope_rows<F32>(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
}


void qk_norm_rope(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, int64_t num_q_heads, double eps, bool offset,
                  const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x [tokens, heads, head_dim]");
  const int64_t head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= kMaxNormedHeadDim, "head_dim must be even and <= ",
              kMaxNormedHeadDim);
  TORCH_CHECK(num_q_heads >= 0 && num_q_heads <= x.size(1), "num_q_heads out of range");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && q_weight.numel() == head_dim &&
                  k_weight.numel() == head_dim && q_weight.scalar_type() == x.scalar_type() &&
                  k_weight.scalar_type() == x.scalar_type(), "q_weight, k_weight [head_dim], x's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * head_dim &&
                  sin.numel() == cos.numel(), "cos, sin [tokens, 1, head_dim] contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  check_out(out, x, x.sizes());
  if (is_bf16(x))
    qk_norm_rope_rows<Bf16>(reinterpret_cast<uint16_t*>(out.data_ptr()),
                            reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                            reinterpret_cast<const uint16_t*>(q_weight.data_ptr()),
                            reinterpret_cast<const uint16_t*>(k_weight.data_ptr()), num_q_heads, eps, offset,
                            reinterpret_cast<const uint16_t*>(cos.data_ptr()),
                            reinterpret_cast<const uint16_t*>(sin.data_ptr()), x.size(0), x.size(1), head_dim);
  else
    qk_norm_rope_rows<F32>(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), q_weight.data_ptr<float>(),
                           k_weight.data_ptr<float>(), num_q_heads, eps, offset, cos.data_ptr<float>(),
                           sin.data_ptr<float>(), x.size(0), x.size(1), head_dim);
}


void gelu_tanh_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up [rows, 2 * inter] contiguous");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "gelu_tanh_and_mul takes bfloat16");
  check_out(out, gate_up, {gate_up.size(0), gate_up.size(1) / 2});
  act_and_mul_rows<GeluTanh>(reinterpret_cast<uint16_t*>(out.data_ptr()),
                         reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gate_up.size(0),
                         gate_up.size(1) / 2);
}


void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up [rows, 2 * inter] contiguous");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul takes bfloat16");
  check_out(out, gate_up, {gate_up.size(0), gate_up.size(1) / 2});
  act_and_mul_rows<Silu>(reinterpret_cast<uint16_t*>(out.data_ptr()),
                    reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gate_up.size(0),
                    gate_up.size(1) / 2);
}


// logits [B, V] float32: in row rows[r], every token whose bit in bitmask[r] is 0 becomes
// -inf (bit i of word w is token 32 * w + i; tokens past the mask's words are disallowed). One
// pass over the words; torch's masked_fill over an unpacked [R, V] bool mask took ~50x longer.
void apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                         const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits [B, V] float32 contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.scalar_type() == at::kInt, "bitmask [R, W] int32 contiguous");
  TORCH_CHECK(rows.dim() == 1 && rows.numel() == bitmask.size(0) &&
                  rows.scalar_type() == at::kLong, "rows [R] int64, one per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = rows.numel();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < logits.size(0), "row out of range");
  float* base = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float negative_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = base + row_ids[r] * vocab;
      const uint32_t* row_bits = bits + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = w < words ? row_bits[w] : 0u;
        if (word == 0xffffffffu) continue;  // all allowed: the common case inside a string
        float* chunk = row + w * 32;
        if (vocab - w * 32 >= 32) {  // a full word: two 16-lane selects
          const kvrelay::Words shifts = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
          const kvrelay::Lanes blocked = kvrelay::Lanes{} + negative_inf;
          for (int half = 0; half < 2; ++half) {
            const kvrelay::Words bit = ((kvrelay::Words{} + (word >> (16 * half))) >> shifts) & 1u;
            const kvrelay::Lanes values = kvrelay::load_lanes(chunk + 16 * half);
            kvrelay::store_lanes(bit != 0u ? values : blocked, chunk + 16 * half);
          }
          continue;
        }
        for (int64_t i = 0; i < vocab - w * 32; ++i)
          if (!((word >> i) & 1u)) chunk[i] = negative_inf;
      }
    }
  });
}

}  // namespace kvrelay

namespace {

// out[r] = the index of row r's largest logit, the first one on ties; a row holding NaN gives
// its first NaN (torch.max's rules). logits [B, V] float32. torch's max over the last dim
// reads ~1 GB/s here (2.5 ms for 64 x 49,152 logits); this pass runs at memory speed.
int64_t argmax_row(const float* row, int64_t vocab) {
  using kvrelay::Lanes;
  using kvrelay::Ints;
  const Ints lane_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Lanes best = Lanes{} - std::numeric_limits<float>::infinity();
  Ints best_index = Ints{} + int32_t(0);
  Ints any_nan = {};
  int64_t i = 0;
  for (; i + kvrelay::kLanes <= vocab; i += kvrelay::kLanes) {
    const Lanes values = kvrelay::load_lanes(row + i);
    const Ints greater = values > best;  // strict: each lane keeps its first maximum
    best = greater ? values : best;
    best_index = greater ? lane_ids + int32_t(i) : best_index;
    any_nan |= values != values;
  }
  float best_value = -std::numeric_limits<float>::infinity();
  int64_t best_at = 0;
  for (int l = 0; l < kvrelay::kLanes && i > 0; ++l)  // the first lane index among the maxima
    if (best[l] > best_value || (best[l] == best_value && best_index[l] < best_at)) {
      best_value = best[l];
      best_at = best_index[l];
    }
  bool nan_seen = false;
  for (int l = 0; l < kvrelay::kLanes; ++l) nan_seen |= any_nan[l] != 0;
  for (int64_t j = i; j < vocab; ++j) {
    nan_seen |= std::isnan(row[j]);
    if (row[j] > best_value) {
      best_value = row[j];
      best_at = j;
    }
  }
  if (nan_seen)
    for (int64_t j = 0; j < vocab; ++j)
      if (std::isnan(row[j])) return j;
  return best_at;
}

}  // namespace

namespace kvrelay {

void argmax_rows(const at::Tensor& out, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.size(1) > 0, "logits [B, V] float32 contiguous, V > 0");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 31), "vocabulary too large");
  TORCH_CHECK(out.dim() == 1 && out.numel() == logits.size(0) && out.scalar_type() == at::kLong &&
                  out.is_contiguous(), "out [B] int64");
  const int64_t vocab = logits.size(1);
  const float* base = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  // Rows of 64k logits and more are worth a thread each; one row of a decode batch is not.
  at::parallel_for(0, logits.size(0), std::max<int64_t>(1, 65536 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(base + r * vocab, vocab);
  });
}

}  // namespace kvrelay

