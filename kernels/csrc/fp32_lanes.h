// Portable vector helpers: a 16-float vector type (GCC/Clang vector extension: one AVX-512
// register, two AVX2 ones, four SSE ones) where gcc's loop vectorizer guessed wrong (it
// vectorized the loop over keys with gathers), plain loops it vectorizes well elsewhere, and
// integer tricks instead of libm calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

namespace kvrelay {

constexpr int kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// memcpy: no alignment assumed; compiles to one unaligned vector load/store.
inline Lanes load_lanes(const float* src) {
  Lanes v;
  std::memcpy(&v, src, sizeof(v));
  return v;
}
inline void store_lanes(Lanes v, float* dst) { std::memcpy(dst, &v, sizeof(v)); }

// bf16 is the high half of an fp32: widening is a shift.
inline float widen(uint16_t bf16_bits) {
  uint32_t bits = uint32_t(bf16_bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline float widen(float value) { return value; }

// Round to nearest even, as torch's own float -> bfloat16; NaN stays a (quiet) NaN.
inline void narrow(float value, uint16_t* dst) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = uint16_t((bits >> 16) | 0x0040u);
    return;
  }
  *dst = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline void narrow(float value, float* dst) { *dst = value; }

// 2^x for x <= 0 without a libm call: x = n + f with n an integer and |f| <= 0.5; 2^n goes
// into the exponent bits, 2^f = e^(f ln 2) is a degree-7 Taylor series (relative error ~1e-8,
// below fp32 rounding). x <= -127 (and -inf) gives exactly 0, so padding lanes weigh nothing.
inline float exp2_nonpositive(float x) {
  x = std::max(x, -127.0f);
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x + round_magic) - round_magic;
  const float g = (x - n) * 0.6931471805599453f;
  float p = 1.0f / 5040;
  p = p * g + 1.0f / 720;
  p = p * g + 1.0f / 120;
  p = p * g + 1.0f / 24;
  p = p * g + 1.0f / 6;
  p = p * g + 0.5f;
  p = p * g + 1.0f;
  p = p * g + 1.0f;
  const int32_t exponent_bits = (int32_t(n) + 127) << 23;  // n = -127 gives +0.0
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return p * scale;
}

// Pairwise halving, spelled out so each step is one fixed-width vector op rather than a chain
// of 16 dependent scalar adds.
inline float sum_lanes(float v[kLanes]) {
  static_assert(kLanes == 16, "the halving steps below assume 16 lanes");
  for (int l = 0; l < 8; ++l) v[l] += v[l + 8];
  for (int l = 0; l < 4; ++l) v[l] += v[l + 4];
  for (int l = 0; l < 2; ++l) v[l] += v[l + 2];
  return v[0] + v[1];
}

inline float max_lanes(float v[kLanes]) {
  for (int l = 0; l < 8; ++l) v[l] = std::max(v[l], v[l + 8]);
  for (int l = 0; l < 4; ++l) v[l] = std::max(v[l], v[l + 4]);
  for (int l = 0; l < 2; ++l) v[l] = std::max(v[l], v[l + 2]);
  return std::max(v[0], v[1]);
}

// a . b as 16 partial sums (lane l holds the terms i = l mod 16), tail terms left out.
inline Lanes dot_lanes(const float* a, const float* b, int64_t n) {
  Lanes sum = {};
  for (int64_t i = 0; i + kLanes <= n; i += kLanes) sum += load_lanes(a + i) * load_lanes(b + i);
  return sum;
}

// The terms dot_lanes leaves out when n is not a multiple of 16.
inline float dot_tail(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = n - n % kLanes; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Two vectors of 16/W groups of W lanes -> one vector of 32/W groups of W/2 lanes, each the sum
// of a group's two halves: the groups of `a` first, then those of `b`. Lane i of the result is
// lanes low(i) + low(i) + W/2 of the concatenation a ++ b. Repeated, it transposes and adds.
template <int W, int... I>
inline Lanes fold_pair(Lanes a, Lanes b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, (I / (W / 2) * W + I % (W / 2))...) +
         __builtin_shufflevector(a, b, (I / (W / 2) * W + I % (W / 2) + W / 2)...);
}
template <int W>
inline Lanes fold_pair(Lanes a, Lanes b) {
  return fold_pair<W>(a, b, std::make_integer_sequence<int, kLanes>{});
}

// Lane j of the result = the sum of all lanes of v[j]: 16 horizontal sums for 15 shuffle pairs,
// where one horizontal sum alone costs 4 shuffles.
inline Lanes sum_each(const Lanes v[kLanes]) {
  static_assert(kLanes == 16, "four folding levels assume 16 lanes");
  Lanes halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) halves[i] = fold_pair<16>(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) quarters[i] = fold_pair<8>(halves[2 * i], halves[2 * i + 1]);
  for (int i = 0; i < 2; ++i) eighths[i] = fold_pair<4>(quarters[2 * i], quarters[2 * i + 1]);
  return fold_pair<2>(eighths[0], eighths[1]);
}

// ---- Whole-vector helpers for the fixed-shape kernel (paged_decode.cpp). ----

typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes max_each(Lanes a, Lanes b) { return a < b ? b : a; }  // std::max lane by lane

// exp2_nonpositive on every lane, with the same steps.
inline Lanes exp2_lanes(Lanes x) {
  const Lanes floor_value = Lanes{} - 127.0f;
  x = max_each(x, floor_value);
  const float round_magic = 12582912.0f;
  const Lanes n = (x + round_magic) - round_magic;
  const Lanes g = (x - n) * 0.6931471805599453f;
  Lanes p = Lanes{} + 1.0f / 5040;
  p = p * g + 1.0f / 720;
  p = p * g + 1.0f / 120;
  p = p * g + 1.0f / 24;
  p = p * g + 1.0f / 6;
  p = p * g + 0.5f;
  p = p * g + 1.0f;
  p = p * g + 1.0f;
  const Ints exponent_bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  return p * (Lanes)exponent_bits;
}

// Logit soft-capping, c tanh(s / c), on scores kept in base 2 (t = s log2 e, as the kernels'
// softmax uses exp2): that is C tanh(t / C) with C = c log2 e, the cap in base 2. tanh(y) is
// sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|) = 2^(-2 |y| log2 e) <= 1, from exp2_lanes.
inline Lanes soft_cap_lanes(Lanes scores, float cap_base2) {
  const Lanes magnitude = scores < 0.0f ? -scores : scores;
  const Lanes e = exp2_lanes(magnitude * (-2.0f * 1.4426950408889634f / cap_base2));
  const Lanes capped = cap_base2 * (1.0f - e) / (1.0f + e);
  return scores < 0.0f ? -capped : capped;
}

// bf16 bits (one per lane, in its low half) of each lane rounded to nearest even, as torch's
// float -> bfloat16; NaN stays a quiet NaN. The whole-vector form of narrow().
inline Words narrow_words(Lanes v) {
  const Words bits = (Words)v;
  const Words rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const Words quiet_nan = (bits >> 16) | 0x40u;
  return (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

// 32 bf16 values read as one vector of words: the even elements widened, then the odd ones (a
// shift and a mask, no cross-lane shuffle). store_bf16_pairs writes them back in that order.
inline void load_bf16_pairs(const uint16_t* src, Lanes& even, Lanes& odd) {
  Words pairs;
  std::memcpy(&pairs, src, sizeof(pairs));
  even = (Lanes)(pairs << 16);
  odd = (Lanes)(pairs & 0xffff0000u);
}
inline void store_bf16_pairs(Lanes even, Lanes odd, uint16_t* dst) {
  const Words pairs = narrow_words(even) | (narrow_words(odd) << 16);
  std::memcpy(dst, &pairs, sizeof(pairs));
}

// Horizontal max and sum, halving as max_lanes and sum_lanes do.
inline float max_of(Lanes v) {
  v = max_each(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max_each(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = max_each(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  return std::max(v[0], v[1]);
}
inline float sum_of(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
}

}  // namespace kvrelay
