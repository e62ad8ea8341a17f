// Batched LoRA on CPU, Punica's BGMV/SGMV shape: each token of a flat batch goes through its own
// adapter slot's low-rank pair, A [R, in] then B^T [R, out], added to the base layer's output.
//
//   shrink: out [T, R] float32 = x [T, in] @ a[slot]^T         (R dot products of length in)
//   expand: y [T, out] = round(y + xa [T, R] @ b_t[slot])      (R scaled rows of B^T summed)
//
// Both are small (R is 8 to 64) and bound by reading the slot's weights and the activations, so
// the loops are arranged for loads: tokens are taken in groups of up to 4 consecutive tokens of
// one slot (a prefill's tokens come in long runs of one sequence, hence one adapter), and each
// load of A or B, widened to float32 once, serves every token of the group. A decode step's
// tokens mostly form groups of one; there the slot's weights (tens of KB) stay in L1/L2 for the
// next token of the slot. Everything accumulates in float32; a 16-bit y is rounded once, to
// nearest even as torch rounds.
//
// Vectors are fp32_lanes.h's 16-float GCC vectors (one AVX-512 register, or two AVX2 ones): the
// same source builds on any x86-64 g++. Intrinsics, each guarded by its ISA's macro with a
// portable fallback, only where gcc's own code is poor: the 16-bit conversions (gcc converts
// a vector of _Float16 one element at a time, and splits bf16's in halves), and bf16 shrinks on
// AVX512-BF16, whose pair dot products need no widening and do twice the multiplies an FMA does.
//
// Threads: torch's thread count (at::get_num_threads, what torch.set_num_threads sets), shared
// as omp_share.h splits panels; small calls (a decode step's, ~200 a step) run on the calling
// thread alone, since an OpenMP fork and join costs more than their few thousand multiply-adds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_lora.h"
#include "fp32_lanes.h"
#include "omp_share.h"

namespace {

using kvrelay::kLanes;
using kvrelay::Lanes;
using kvrelay::Words;

typedef uint16_t Shorts __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// ---- Element types: 16 elements to and from float32 lanes, and one at a time for tails. ----

struct F32 {
  using T = float;
  static Lanes load(const T* src) { return kvrelay::load_lanes(src); }
  static void store(Lanes v, T* dst) { kvrelay::store_lanes(v, dst); }
  static float load1(const T* src) { return *src; }
  static void store1(float v, T* dst) { *dst = v; }
};

// bf16 is float32's high half: widening is a zero extension and a shift; narrowing rounds to
// nearest even as torch does (fp32_lanes.h). With AVX-512 the extension and the truncation are
// one instruction each (gcc 12 splits __builtin_convertvector's into halves and reassembles).
struct Bf16 {
  using T = c10::BFloat16;
  static Lanes load(const T* src) {
#if defined(__AVX512F__)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return (Lanes)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
#else
    Shorts bits;
    std::memcpy(&bits, src, sizeof(bits));
    return (Lanes)(__builtin_convertvector(bits, Words) << 16);
#endif
  }
  static void store(Lanes v, T* dst) {
#if defined(__AVX512BF16__)
    // one instruction instead of narrow_words' ten, which cost an expand of rank 16 a third of
    // its time; the same rounding but that it flushes float32 subnormals (below 1.2e-38) to 0
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#elif defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtepi32_epi16((__m512i)kvrelay::narrow_words(v)));
#else
    const Shorts bits = __builtin_convertvector(kvrelay::narrow_words(v), Shorts);
    std::memcpy(dst, &bits, sizeof(bits));
#endif
  }
  static float load1(const T* src) { return kvrelay::widen(src->x); }
  static void store1(float v, T* dst) { kvrelay::narrow(v, &dst->x); }
};

struct F16 {
  using T = c10::Half;
  static Lanes load(const T* src) {
#if defined(__AVX512F__)
    return (Lanes)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif defined(__F16C__)
    const __m256 halves[2] = {
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8)))};
    Lanes v;
    std::memcpy(&v, halves, sizeof(v));
    return v;
#else
    Lanes v;
    for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(src[i]);
    return v;
#endif
  }
  static void store(Lanes v, T* dst) {
    // round to nearest even, as c10::Half(float)
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    __m256 halves[2];
    std::memcpy(halves, &v, sizeof(v));
    for (int half = 0; half < 2; ++half)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * half),
                       _mm256_cvtps_ph(halves[half], _MM_FROUND_TO_NEAREST_INT));
#else
    for (int i = 0; i < kLanes; ++i) dst[i] = c10::Half(v[i]);
#endif
  }
  static float load1(const T* src) { return static_cast<float>(*src); }
  static void store1(float v, T* dst) { *dst = c10::Half(v); }
};

// fn(E{}) with E the element type of `dtype`.
template <typename Fn>
void with_element_type(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(F32{});
    case at::kBFloat16: return fn(Bf16{});
    case at::kHalf: return fn(F16{});
    default: TORCH_CHECK_VALUE(false, "LoRA kernels take bfloat16, float16 or float32, not ",
                               dtype);
  }
}

// ---- Token groups and threads. ----

constexpr int kGroupTokens = 4;  // 4 tokens x 4 ranks (or vectors) of accumulators: 16 registers

struct TokenGroup {
  int32_t tokens[kGroupTokens];  // tokens of one slot, in batch order (not always adjacent)
  int count;                     // 1 .. kGroupTokens
  int32_t slot;                  // their slot; -1: no adapter
};

// The batch's tokens grouped by slot, up to kGroupTokens a group, in a buffer of the calling
// thread (kept between calls: no allocation a call). A decode step's tokens of one adapter are
// scattered through the batch; grouping them lets each load of the adapter's weights serve up
// to 4 of them, as a prefill's runs do. Checks each slot is -1 or a real slot, so that no
// kernel reads outside `a` or `b_t`.
const std::vector<TokenGroup>& group_tokens(const at::Tensor& token_slots, int64_t num_slots) {
  thread_local std::vector<TokenGroup> groups;
  thread_local std::vector<int64_t> filling;  // per slot + 1: its group still filling, or -1
  groups.clear();
  filling.assign(num_slots + 1, -1);
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < token_slots.numel(); ++t) {
    const int32_t slot = slots[t];
    TORCH_CHECK_VALUE(slot >= -1 && slot < num_slots, "token ", t, " has slot ", slot,
                      ": a slot is -1 (no adapter) or below the weights' ", num_slots, " slots");
    int64_t& group = filling[slot + 1];
    if (group < 0 || groups[group].count == kGroupTokens) {
      group = int64_t(groups.size());
      groups.push_back({{int32_t(t)}, 1, slot});
    } else {
      TokenGroup& g = groups[group];
      g.tokens[g.count++] = int32_t(t);
    }
  }
  return groups;
}

// Below this many multiply-adds per thread a call stays on the calling thread: ~3 us of float32
// FMAs (half that in bf16 dot products), where an OpenMP fork and join costs about one.
constexpr int64_t kMinMacsPerThread = 1 << 17;

int team_size(int64_t macs, int64_t items) {
  const int64_t wanted =
      std::min<int64_t>({at::get_num_threads(), items, macs / kMinMacsPerThread});
  return int(std::max<int64_t>(1, wanted));
}

// body() on `threads` OpenMP threads, each taking its share with kvrelay::thread_share; on the
// calling thread alone (no fork) where threads is 1.
template <typename Body>
void run_team(int threads, const Body& body) {
  if (threads <= 1) {
    body();
    return;
  }
#pragma omp parallel num_threads(threads)
  body();
}

// ---- Shrink. ----

constexpr int64_t kRankBlock = 4;  // ranks per work item: each x load serves 4 dot products

struct ShrinkArgs {
  float* out;     // [T, R] contiguous
  const void* x;  // [T, in], rows x_stride apart
  const void* a;  // [S, R, in] contiguous
  int64_t ranks, in, x_stride;
};

// How the dot products read x: in place where its elements are the multiply's operands (float32;
// bf16 with AVX512-BF16's pair dot products), else widened to float32 once a group (XRow<E>).
#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;
#else
constexpr bool kBf16Dots = false;
#endif
template <typename E>
constexpr bool kReadsXInPlace = std::is_same_v<E, F32> || (kBf16Dots && std::is_same_v<E, Bf16>);
template <typename E>
using XRow = std::conditional_t<kReadsXInPlace<E>, typename E::T, float>;

// out_rows[t][r] = x_rows[t] . a_rows[r] for TB tokens and RB ranks: each load (and widening) of
// A serves TB tokens, each load of x RB ranks.
template <typename E, int TB, int RB>
void dot_block(float* const* out_rows, const float* const* x_rows, const typename E::T* a_rows,
               int64_t in) {
  Lanes acc[TB][RB] = {};
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    Lanes w[RB];
    for (int r = 0; r < RB; ++r) w[r] = E::load(a_rows + r * in + k);
    for (int t = 0; t < TB; ++t) {
      const Lanes xv = kvrelay::load_lanes(x_rows[t] + k);
      for (int r = 0; r < RB; ++r) acc[t][r] += xv * w[r];
    }
  }
  // unrolled, so that the accumulators stay in registers (else gcc keeps them in memory)
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      float sum = kvrelay::sum_of(acc[t][r]);
      for (int64_t j = k; j < in; ++j) sum += x_rows[t][j] * E::load1(a_rows + r * in + j);
      out_rows[t][r] = sum;
    }
}

#if defined(__AVX512BF16__)
// dot_block for bf16 x and A on AVX512-BF16: one instruction multiplies 32 pairs (exactly: a
// bf16 product fits a float32) and adds them into 16 float32 sums, with no widening at all; the
// float32 path's arithmetic but for the order of the sums (and subnormal bf16 inputs, below
// 1e-38, read as zero).
template <int TB, int RB>
void dot_block_bf16(float* const* out_rows, const c10::BFloat16* const* x_rows,
                    const c10::BFloat16* a_rows, int64_t in) {
  __m512 acc[TB][RB];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * kLanes <= in; k += 2 * kLanes) {
    __m512bh w[RB];
    for (int r = 0; r < RB; ++r) w[r] = (__m512bh)_mm512_loadu_si512(a_rows + r * in + k);
    for (int t = 0; t < TB; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x_rows[t] + k);
      for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, w[r]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      float sum = kvrelay::sum_of((Lanes)acc[t][r]);
      for (int64_t j = k; j < in; ++j)
        sum += Bf16::load1(x_rows[t] + j) * Bf16::load1(a_rows + r * in + j);
      out_rows[t][r] = sum;
    }
}
#endif

template <typename E, int TB, int RB>
void dot(float* const* out_rows, const XRow<E>* const* x_rows, const typename E::T* a_rows,
         int64_t in) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<E, Bf16>)
    dot_block_bf16<TB, RB>(out_rows, x_rows, a_rows, in);
  else
#endif
    dot_block<E, TB, RB>(out_rows, x_rows, a_rows, in);
}

// Ranks [r0, r1) of a group of TB tokens: blocks of kRankBlock, then one at a time.
template <typename E, int TB>
void shrink_ranks(float* const* out_rows, const XRow<E>* const* x_rows,
                  const typename E::T* a_slot, int64_t r0, int64_t r1, int64_t in) {
  float* outs[TB];
  int64_t r = r0;
  for (; r + kRankBlock <= r1; r += kRankBlock) {
    for (int t = 0; t < TB; ++t) outs[t] = out_rows[t] + r;
    dot<E, TB, kRankBlock>(outs, x_rows, a_slot + r * in, in);
  }
  for (; r < r1; ++r) {
    for (int t = 0; t < TB; ++t) outs[t] = out_rows[t] + r;
    dot<E, TB, 1>(outs, x_rows, a_slot + r * in, in);
  }
}

// A group's x rows as the dot products read them: in place (kReadsXInPlace), or widened into
// `buffer` (the thread's), once for all R of their dot products.
template <typename E>
void group_rows(const ShrinkArgs& p, const TokenGroup& g, std::vector<float>& buffer,
                const XRow<E>** x_rows) {
  const auto* x = static_cast<const typename E::T*>(p.x);
  if constexpr (kReadsXInPlace<E>) {
    for (int t = 0; t < g.count; ++t) x_rows[t] = x + g.tokens[t] * p.x_stride;
  } else {
    buffer.resize(kGroupTokens * p.in);
    for (int t = 0; t < g.count; ++t) {
      const typename E::T* src = x + g.tokens[t] * p.x_stride;
      float* dst = buffer.data() + t * p.in;
      int64_t k = 0;
      for (; k + kLanes <= p.in; k += kLanes) kvrelay::store_lanes(E::load(src + k), dst + k);
      for (; k < p.in; ++k) dst[k] = E::load1(src + k);
      x_rows[t] = dst;
    }
  }
}

template <typename E>
void shrink_group(const ShrinkArgs& p, const TokenGroup& g, const XRow<E>* const* x_rows,
                  int64_t r0, int64_t r1) {
  float* out_rows[kGroupTokens];
  for (int t = 0; t < g.count; ++t) out_rows[t] = p.out + g.tokens[t] * p.ranks;
  if (g.slot < 0) {  // no adapter: zeros
    for (int t = 0; t < g.count; ++t) std::fill(out_rows[t] + r0, out_rows[t] + r1, 0.f);
    return;
  }
  const auto* a_slot = static_cast<const typename E::T*>(p.a) + g.slot * p.ranks * p.in;
  switch (g.count) {
    case 4: return shrink_ranks<E, 4>(out_rows, x_rows, a_slot, r0, r1, p.in);
    case 3: return shrink_ranks<E, 3>(out_rows, x_rows, a_slot, r0, r1, p.in);
    case 2: return shrink_ranks<E, 2>(out_rows, x_rows, a_slot, r0, r1, p.in);
    default: return shrink_ranks<E, 1>(out_rows, x_rows, a_slot, r0, r1, p.in);
  }
}

// Work items: (token group, block of kRankBlock ranks), group-major, so that a thread's
// contiguous share widens each group's rows once, where they need widening (and a single
// token's ranks still split among threads when it is the whole call).
template <typename E>
void shrink_all(const ShrinkArgs& p, const std::vector<TokenGroup>& groups, int64_t tokens) {
  const int64_t rank_blocks = (p.ranks + kRankBlock - 1) / kRankBlock;
  const int64_t items = int64_t(groups.size()) * rank_blocks;
  run_team(team_size(tokens * p.ranks * p.in, items), [&] {
    thread_local std::vector<float> buffer;
    const XRow<E>* x_rows[kGroupTokens];
    int64_t lo, hi, widened = -1;  // widened: the group whose rows x_rows holds
    kvrelay::thread_share(items, &lo, &hi);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t group = item / rank_blocks, r0 = (item % rank_blocks) * kRankBlock;
      const TokenGroup& g = groups[group];
      if (g.slot >= 0 && group != widened) {
        group_rows<E>(p, g, buffer, x_rows);
        widened = group;
      }
      shrink_group<E>(p, g, x_rows, r0, std::min(p.ranks, r0 + kRankBlock));
    }
  });
}

// ---- Expand. ----

constexpr int64_t kColumnVectors = 4;  // vectors of accumulators per token: 64 columns an item
constexpr int64_t kColumnBlock = kColumnVectors * kLanes;

struct ExpandArgs {
  void* y;         // [T, out], rows y_stride apart
  const float* xa; // [T, R], rows xa_stride apart
  const void* b;   // [S, R, out] contiguous
  int64_t ranks, out, y_stride, xa_stride;
};

// y_rows[t][0, 64) += sum over r of xa_rows[t][r] * b_cols[r * out + (0, 64)], in float32 and
// rounded once, for TB tokens: each load (and widening) of B serves TB tokens.
template <typename E, int TB>
void expand_block(typename E::T* const* y_rows, const float* const* xa_rows,
                  const typename E::T* b_cols, int64_t ranks, int64_t out) {
  Lanes acc[TB][kColumnVectors] = {};
  for (int64_t r = 0; r < ranks; ++r) {
    Lanes w[kColumnVectors];
    for (int v = 0; v < kColumnVectors; ++v) w[v] = E::load(b_cols + r * out + v * kLanes);
    for (int t = 0; t < TB; ++t) {
      const float coef = xa_rows[t][r];
      for (int v = 0; v < kColumnVectors; ++v) acc[t][v] += coef * w[v];
    }
  }
  // unrolled, so that the accumulators stay in registers (as in dot_block)
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t)
#pragma GCC unroll 4
    for (int v = 0; v < kColumnVectors; ++v) {
      typename E::T* dst = y_rows[t] + v * kLanes;
      E::store(E::load(dst) + acc[t][v], dst);
    }
}

// The last block when out is not a multiple of 64: `width` columns, one at a time.
template <typename E>
void expand_tail(typename E::T* y_row, const float* xa_row, const typename E::T* b_cols,
                 int64_t ranks, int64_t out, int64_t width) {
  for (int64_t c = 0; c < width; ++c) {
    float sum = 0.f;
    for (int64_t r = 0; r < ranks; ++r) sum += xa_row[r] * E::load1(b_cols + r * out + c);
    E::store1(E::load1(y_row + c) + sum, y_row + c);
  }
}

template <typename E>
void expand_group(const ExpandArgs& p, const TokenGroup& g, int64_t c0) {
  using T = typename E::T;
  T* y_rows[kGroupTokens];
  const float* xa_rows[kGroupTokens];
  for (int t = 0; t < g.count; ++t) {
    y_rows[t] = static_cast<T*>(p.y) + g.tokens[t] * p.y_stride + c0;
    xa_rows[t] = p.xa + g.tokens[t] * p.xa_stride;
  }
  const T* b_cols = static_cast<const T*>(p.b) + g.slot * p.ranks * p.out + c0;
  const int64_t width = std::min(kColumnBlock, p.out - c0);
  if (width < kColumnBlock) {
    for (int t = 0; t < g.count; ++t)
      expand_tail<E>(y_rows[t], xa_rows[t], b_cols, p.ranks, p.out, width);
    return;
  }
  switch (g.count) {
    case 4: return expand_block<E, 4>(y_rows, xa_rows, b_cols, p.ranks, p.out);
    case 3: return expand_block<E, 3>(y_rows, xa_rows, b_cols, p.ranks, p.out);
    case 2: return expand_block<E, 2>(y_rows, xa_rows, b_cols, p.ranks, p.out);
    default: return expand_block<E, 1>(y_rows, xa_rows, b_cols, p.ranks, p.out);
  }
}

// Work items: (token group, block of 64 columns), group-major; groups without an adapter are
// left as they are.
template <typename E>
void expand_all(const ExpandArgs& p, const std::vector<TokenGroup>& groups, int64_t tokens) {
  const int64_t column_blocks = (p.out + kColumnBlock - 1) / kColumnBlock;
  const int64_t items = int64_t(groups.size()) * column_blocks;
  run_team(team_size(tokens * p.ranks * p.out, items), [&] {
    int64_t lo, hi;
    kvrelay::thread_share(items, &lo, &hi);
    for (int64_t item = lo; item < hi; ++item) {
      const TokenGroup& g = groups[item / column_blocks];
      if (g.slot >= 0) expand_group<E>(p, g, (item % column_blocks) * kColumnBlock);
    }
  });
}

// ---- Checks: the whole validation of the native path (the dispatcher leaves it to these, to
// keep its ~200 calls a decode step cheap), so each says what it wanted and what it got. ----

bool supported(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

// rows [T, width] (x or y) and weights [S, R, width] (a or b_t): one supported dtype, on the CPU,
// in the layouts the loops read; token_slots a contiguous [T] int32 there too.
void check_operands(const char* rows_name, const at::Tensor& rows, const char* weights_name,
                    const at::Tensor& weights, const at::Tensor& token_slots,
                    const char* width_name) {
  TORCH_CHECK_VALUE(rows.dim() == 2 && weights.dim() == 3 && weights.size(2) == rows.size(1),
                    rows_name, " must be [T, ", width_name, "] and ", weights_name, " [S, R, ",
                    width_name, "], got ", rows.sizes(), " and ", weights.sizes());
  TORCH_CHECK_VALUE(supported(rows.scalar_type()) && weights.scalar_type() == rows.scalar_type(),
                    rows_name, " and ", weights_name, " must share one of bfloat16, float16, "
                    "float32, got ", rows.scalar_type(), " and ", weights.scalar_type());
  TORCH_CHECK_VALUE(rows.size(1) <= 1 || rows.stride(1) == 1, rows_name,
                    " needs unit column stride, got strides ", rows.strides());
  TORCH_CHECK_VALUE(weights.is_contiguous(), weights_name, " must be contiguous");
  TORCH_CHECK_VALUE(token_slots.scalar_type() == at::kInt && token_slots.dim() == 1 &&
                        token_slots.size(0) == rows.size(0) && token_slots.is_contiguous(),
                    "token_slots must be a contiguous [T] = [", rows.size(0),
                    "] int32 tensor, got ", token_slots.scalar_type(), " ", token_slots.sizes());
  TORCH_CHECK_VALUE(rows.is_cpu() && weights.is_cpu() && token_slots.is_cpu(), rows_name, ", ",
                    weights_name, " and token_slots must be on one device, the CPU");
}

// shrink, its operands checked (but not yet the slots' values)
void shrink_checked(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                    const at::Tensor& token_slots) {
  const auto& groups = group_tokens(token_slots, a.size(0));
  const ShrinkArgs args{out.data_ptr<float>(), x.data_ptr(), a.data_ptr(), a.size(1), x.size(1),
                        x.stride(0)};
  with_element_type(x.scalar_type(), [&](auto element) {
    shrink_all<decltype(element)>(args, groups, x.size(0));
  });
}

}  // namespace

namespace kvrelay {

void lora_shrink_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& token_slots) {
  check_operands("x", x, "a", a, token_slots, "in");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat &&
                        out.is_cpu() && out.size(0) == x.size(0) && out.size(1) == a.size(1),
                    "out must be a contiguous [T, R] float32 CPU tensor");
  shrink_checked(out, x, a, token_slots);
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_slots) {
  check_operands("x", x, "a", a, token_slots, "in");
  // allocated here: at::empty costs a fraction of a torch.empty call from Python
  at::Tensor out = at::empty({x.size(0), a.size(1)}, at::TensorOptions().dtype(at::kFloat));
  shrink_checked(out, x, a, token_slots);
  return out;
}

void lora_expand(const at::Tensor& y, const at::Tensor& xa, const at::Tensor& b_t,
                 const at::Tensor& token_slots) {
  check_operands("y", y, "b_t", b_t, token_slots, "out");
  TORCH_CHECK_VALUE(xa.scalar_type() == at::kFloat && xa.dim() == 2 && xa.is_cpu() &&
                        xa.size(0) == y.size(0) && xa.size(1) == b_t.size(1) &&
                        (xa.size(1) <= 1 || xa.stride(1) == 1),
                    "xa must be [T, R] = [", y.size(0), ", ", b_t.size(1),
                    "] float32 with unit column stride on the CPU, got ", xa.scalar_type(), " ",
                    xa.sizes(), " strides ", xa.strides());
  const auto& groups = group_tokens(token_slots, b_t.size(0));
  const ExpandArgs args{y.data_ptr(), xa.data_ptr<float>(), b_t.data_ptr(), b_t.size(1),
                        b_t.size(2), y.stride(0), xa.stride(0)};
  with_element_type(y.scalar_type(), [&](auto element) {
    expand_all<decltype(element)>(args, groups, y.size(0));
  });
}

}  // namespace kvrelay
