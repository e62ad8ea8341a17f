// 8-bit KV cache rows, read by the attention kernels. A row (one token's one kv head) is
// head_dim codes followed by the row's float32 scale (4 bytes, in the row so that a block's
// bytes are all a KV transfer moves): (H x)[d] = decode(code[d]) * scale, H the normalized
// Hadamard rotation (`rotate`). kernels/kv_quant.py says why; its torch reference and the
// native store code rows bit for bit alike. The kernels rotate each query on the way in and
// each output on the way out (H is its own inverse), and read the rotated rows as they are.
//
// Decoding is a shift of the code's bits into an fp32's: an fp8 code's exponent and mantissa
// land in the fp32 exponent's low bits and the mantissa's high ones, which reads as the code's
// value times 2^(its bias - 127); one multiply by 2^(127 - bias) restores it (exact: a power of
// two, and every fp8 value is an fp32 one). int8 codes convert.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fp32_lanes.h"
#include "paged_decode.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvrelay {

struct Int8Code { int8_t bits; };
struct E4M3Code { uint8_t bits; };  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa
struct E5M2Code { uint8_t bits; };  // float8_e5m2: sign, 5 exponent bits (bias 15), 2 mantissa

template <typename KT>
constexpr bool kFp8 = std::is_same_v<KT, E4M3Code> || std::is_same_v<KT, E5M2Code>;
template <typename KT>
constexpr bool kCoded = std::is_same_v<KT, Int8Code> || kFp8<KT>;

// visit(element) with a value of the C++ element type of a cache of `dtype` (bf16: its bits),
// so that each kernel picks its instantiation in one place.
template <typename Visit>
auto with_cache_element(Dtype dtype, Visit&& visit) {
  switch (dtype) {
    case Dtype::kFloat32: return visit(float{});
    case Dtype::kInt8: return visit(Int8Code{});
    case Dtype::kFp8E4M3: return visit(E4M3Code{});
    case Dtype::kFp8E5M2: return visit(E5M2Code{});
    default: return visit(uint16_t{});
  }
}

constexpr int64_t kScaleBytes = 4;

// Elements of KT from one row's start to the next's.
template <typename KT>
constexpr int64_t row_stride(int64_t head_dim) {
  return kCoded<KT> ? head_dim + kScaleBytes : head_dim;
}

template <typename KT>
inline float row_scale(const KT* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, reinterpret_cast<const char*>(row) + head_dim, sizeof(scale));
  return scale;
}

// The fp32 bits of a code's magnitude and sign, before the multiply by kRebias.
template <typename KT>
constexpr float kRebias = std::is_same_v<KT, E4M3Code> ? 0x1p120f : std::is_same_v<KT, E5M2Code> ? 0x1p112f : 1.0f;
template <typename KT>
constexpr int kMantissaShift = std::is_same_v<KT, E4M3Code> ? 20 : 21;

inline float decode(Int8Code code) { return float(code.bits); }
template <typename KT, std::enable_if_t<kFp8<KT>, int> = 0>
inline float decode(KT code) {
  const uint32_t bits = (uint32_t(code.bits & 0x7f) << kMantissaShift<KT>) | (uint32_t(code.bits & 0x80) << 24);
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value * kRebias<KT>;
}

// An fp32 value within the code's range (|value| <= 448 for e4m3, 57344 for e5m2; the store
// clamps) as its fp8 code, rounded to nearest even as torch's casts round. Below the smallest
// normal (2^-6, 2^-14) codes are multiples of 2^-9 (2^-16): the magnitude in those units,
// rounded. Above, the fp32's mantissa is rounded to the code's bits (adding half a unit less one,
// plus the kept bit's parity, carries into the exponent where it must), its exponent rebiased.
template <typename KT>
inline uint8_t encode(float value) {
  constexpr int kDropped = kMantissaShift<KT>;  // fp32 mantissa bits cut
  constexpr uint32_t kRebiasedExponent = std::is_same_v<KT, E4M3Code> ? (127 - 7) << 3 : (127 - 15) << 2;
  constexpr float kSmallestNormal = std::is_same_v<KT, E4M3Code> ? 0x1p-6f : 0x1p-14f;
  constexpr float kSubnormalUnits = std::is_same_v<KT, E4M3Code> ? 0x1p9f : 0x1p16f;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  float magnitude;
  std::memcpy(&magnitude, &bits, sizeof(magnitude));
  if (magnitude < kSmallestNormal) return uint8_t(uint32_t(std::nearbyint(magnitude * kSubnormalUnits)) | sign);
  const uint32_t rounded = bits + ((1u << (kDropped - 1)) - 1) + ((bits >> kDropped) & 1u);
  return uint8_t(((rounded >> kDropped) - kRebiasedExponent) | sign);
}

// The largest power of two dividing head_dim: H is block diagonal in blocks of this size.
inline int64_t rotation_block(int64_t head_dim) { return head_dim & -head_dim; }

// x <- H x, by the same butterflies in the same order as kv_quant.rotate (so the same bits):
// within each block, for half = 1, 2, 4, ...: (low, high) -> (low + high, low - high) for the
// element pairs half apart in each group of 2 half; then times block^-1/2.
inline void rotate(float* x, int64_t head_dim) {
  const int64_t block = rotation_block(head_dim);
  const float norm = static_cast<float>(1.0 / std::sqrt(double(block)));
  for (int64_t start = 0; start < head_dim; start += block) {
    float* y = x + start;
    for (int64_t half = 1; half < block; half *= 2)
      for (int64_t group = 0; group < block; group += 2 * half)
        for (int64_t t = group; t < group + half; ++t) {
          const float low = y[t], high = y[t + half];
          y[t] = low + high;
          y[t + half] = low - high;
        }
    for (int64_t i = 0; i < block; ++i) y[i] *= norm;
  }
}

// 16 bytes widened to 16 32-bit lanes, sign- or zero-extended. Intrinsics, not
// __builtin_convertvector: gcc 12 turns that conversion into 16 scalar converts (measured: an
// int8 cache's decode steps 1.4x slower than bf16's, where they should be faster).
template <bool kSigned>
inline Words widen_bytes(const void* src) {
  Words words;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(src));
  const __m512i wide = kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  std::memcpy(&words, &wide, sizeof(words));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(src));
  const __m128i high = _mm_srli_si128(bytes, 8);
  const __m256i low_words = kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const __m256i high_words = kSigned ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high);
  std::memcpy(&words, &low_words, sizeof(low_words));
  std::memcpy(reinterpret_cast<char*>(&words) + sizeof(low_words), &high_words, sizeof(high_words));
#else
  for (int l = 0; l < kLanes; ++l)
    words[l] = kSigned ? uint32_t(int32_t(static_cast<const int8_t*>(src)[l]))
                       : uint32_t(static_cast<const uint8_t*>(src)[l]);
#endif
  return words;
}

// 16 codes as 16 fp32 values (the scale not applied).
inline Lanes decode_lanes(const Int8Code* src) {
  const Ints values = (Ints)widen_bytes<true>(src);
#if defined(__AVX512F__)
  __m512i packed;
  std::memcpy(&packed, &values, sizeof(packed));
  const __m512 converted = _mm512_cvtepi32_ps(packed);
  Lanes lanes;
  std::memcpy(&lanes, &converted, sizeof(lanes));
  return lanes;
#elif defined(__AVX2__)
  __m256i halves[2];
  std::memcpy(halves, &values, sizeof(halves));
  const __m256 converted[2] = {_mm256_cvtepi32_ps(halves[0]), _mm256_cvtepi32_ps(halves[1])};
  Lanes lanes;
  std::memcpy(&lanes, converted, sizeof(lanes));
  return lanes;
#else
  Lanes lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = float(values[l]);
  return lanes;
#endif
}
template <typename KT, std::enable_if_t<kFp8<KT>, int> = 0>
inline Lanes decode_lanes(const KT* src) {
  const Words words = widen_bytes<false>(src);
  const Words bits = ((words & 0x7fu) << kMantissaShift<KT>) | ((words & 0x80u) << 24);
  return (Lanes)bits * kRebias<KT>;
}

}  // namespace kvrelay
