// Matmuls over the checkpoint's 4-bit blocks with 8-bit activations, on AVX512-VNNI integer dot
// products (vpdpbusd): out [M, N] = x [M, K] @ W^T, bf16 in and out, any M.
//
// Why: on CPUs without AMX every bf16 dot product (vdpbf16ps) does 32 multiply-adds, and the
// 4-bit weights must first be widened to bf16 (kernels/csrc/cpu_gemv.cpp); vpdpbusd does 64
// multiply-adds of unsigned bytes by signed bytes, and a nibble becomes its byte with one AND
// (or a shift and an AND). So each instruction does twice the work and the weights need a third
// of the preparation. The price is the activations' rounding: each 32 values of a row share one
// float scale and become int8 (as llama.cpp's Q8 activations do), so an activation carries ~8
// significant bits instead of bf16's 8 per value; tests/test_q4a8.py bounds the error and the
// engine's greedy agreement with the float32 reference.
//
// Per 32-weight block of column n and row x:  sum_k x_k w_k  with  w_k = d q_k + m  and
// x_k ~= s xq_k  is  d s sum_k q_k xq_k + m sum_k x_k:  the integer dot product is exact, d s
// scales it once per block, and the offset term uses the block's exact float sum of x.
//
// Weight tiles [N/16, K/32, 320 bytes]: 256 bytes of nibbles in four 64-byte chunks; in chunk c,
// byte 4 n + j (column n of the tile's 16, j in 0..3) holds q[n, 8c + j] in its low nibble and
// q[n, 8c + 4 + j] in its high one, so a chunk's low nibbles are one K quad per 32-bit lane (what
// vpdpbusd reads) and its high nibbles the next; then the 16 columns' d and m as float16
// (kernels/native_q4a8.py packs them).
#include <ATen/core/Tensor.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gemm_q4a8.h"
#include "gemv_io.h"

namespace {

using kvrelay::Shapes;
using kvrelay::store_bf16;
using kvrelay::thread_share;

constexpr int64_t kTileBytes = 256 + 32 + 32;
constexpr int kMaxRows = 8;          // rows per pass: 8 weight operands + 8 sums + a few constants
constexpr int64_t kRowBlock = 64;    // rows whose int8 activations stay in L2 across panels
constexpr int kPrefetchTiles = 16;   // into L2, tiles ahead in the panel
constexpr int64_t kParallelQuantRows = 16;

// One call's activations, quantized per 32 values of a row. Split: x ~= step (q + r / 128),
// the rounding error of the first code coded again (|r| <= 64), so ~15 significant bits
// against the block's largest value (bf16 has 8 per value); otherwise x ~= step q.
struct Quantized {
  std::vector<int8_t> q;      // [M, K]
  std::vector<int8_t> r;      // [M, K], split only
  std::vector<float> scale;   // [M, K/32]: step, divided by 128 when split
  std::vector<float> sum;     // [M, K/32]: the block's exact float sum of x
  bool split = false;
};

inline __m512 load_bf16x16(const uint16_t* src) {  // 16 bf16 -> float32, exactly
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_halves(const uint8_t* src) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

inline void store_codes(int8_t* dst, __m512i codes) {  // 16 int32 in -128..127 -> int8
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(codes));
}

// codes = round(x / step); with rest, rest = round((x / step - codes) * 128).
inline void quantize_half(__m512 scaled, int8_t* q, int8_t* rest) {
  const __m512i codes = _mm512_cvtps_epi32(scaled);  // round to nearest, the default mode
  store_codes(q, codes);
  if (rest != nullptr) {
    const __m512 error = _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(codes));  // exact, |.| <= 1/2
    store_codes(rest, _mm512_cvtps_epi32(_mm512_mul_ps(error, _mm512_set1_ps(128.f))));
  }
}

void quantize_row(const uint16_t* x, int64_t K, int8_t* q, int8_t* rest, float* scale,
                  float* sum) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = load_bf16x16(x + 32 * b), hi = load_bf16x16(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off),
                                                          _mm512_and_ps(hi, sign_off)));
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    scale[b] = rest != nullptr ? amax / 127.f / 128.f : amax / 127.f;
    // |x| * 127 / amax <= 127, so the codes need no saturation
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    quantize_half(_mm512_mul_ps(lo, inverse), q + 32 * b, rest ? rest + 32 * b : nullptr);
    quantize_half(_mm512_mul_ps(hi, inverse), q + 32 * b + 16, rest ? rest + 32 * b + 16 : nullptr);
  }
}

void quantize(Quantized& acts, const uint16_t* x, int64_t M, int64_t K, bool split) {
  acts.split = split;
  acts.q.resize(M * K);
  acts.r.resize(split ? M * K : 0);
  acts.scale.resize(M * (K / 32));
  acts.sum.resize(M * (K / 32));
#pragma omp parallel for schedule(static) if (M >= kParallelQuantRows)
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, acts.q.data() + m * K, split ? acts.r.data() + m * K : nullptr,
                 acts.scale.data() + m * (K / 32), acts.sum.data() + m * (K / 32));
}

inline int32_t quad(const int8_t* src) {
  int32_t value;
  std::memcpy(&value, src, sizeof(value));
  return value;
}

// The dot products of 16 columns with one row's 32 codes, over the K quads c = Half, Half + 2,
// Half + 4, Half + 6: a chain of four, so two such chains per row run side by side.
template <int Half>
inline __m512i dot_half(const __m512i* w, const int8_t* x) {
  __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[Half], _mm512_set1_epi32(quad(x + 4 * Half)));
#pragma GCC unroll 4
  for (int c = Half + 2; c < 8; c += 2)
    dots = _mm512_dpbusd_epi32(dots, w[c], _mm512_set1_epi32(quad(x + 4 * c)));
  return dots;
}

// Rows m0 .. m0 + R of one 16-column panel.
template <int R, bool Split>
void panel_rows(uint16_t* out, int64_t N, int64_t K, const Quantized& acts, int64_t m0,
                const uint8_t* panel, int64_t k_blocks) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const int8_t* xq = acts.q.data() + m0 * K;
  const int8_t* xr = Split ? acts.r.data() + m0 * K : nullptr;
  const float* scales = acts.scale.data() + m0 * k_blocks;
  const float* sums = acts.sum.data() + m0 * k_blocks;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint8_t* tile = panel + kb * kTileBytes;
    for (int line = 0; line < kTileBytes / 64; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchTiles * kTileBytes + 64 * line),
                   _MM_HINT_T1);
    __m512i w[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = _mm512_loadu_si512(tile + 64 * c);
      w[2 * c] = _mm512_and_si512(bytes, low_nibbles);
      w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
    }
    const __m512 d = load_halves(tile + 256), m = load_halves(tile + 288);
    // Every row's dot products in one unrolled body, each as two chains of four: a chain of
    // eight dependent vpdpbusd (5 cycles apiece) per row, rows in a loop the compiler kept
    // rolled, left the port idle between them (HISTORY, session 26).
    __m512i even[R], odd[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      even[r] = dot_half<0>(w, xq + r * K + 32 * kb);
      odd[r] = dot_half<1>(w, xq + r * K + 32 * kb);
    }
    if constexpr (Split) {  // 128 q.x + q.r: below 2^23, exact in int32 and in float32
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* rest = xr + r * K + 32 * kb;
        const __m512i fine = _mm512_add_epi32(dot_half<0>(w, rest), dot_half<1>(w, rest));
        even[r] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(even[r], odd[r]), 7), fine);
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) even[r] = _mm512_add_epi32(even[r], odd[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 scaled_d = _mm512_mul_ps(d, _mm512_set1_ps(scales[r * k_blocks + kb]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even[r]), scaled_d, total[r]);
      total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * k_blocks + kb]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_bf16(out + r * N, total[r]);
}

template <int R = kMaxRows>
void dispatch_rows(int64_t rows, uint16_t* out, int64_t N, int64_t K, const Quantized& acts,
                   int64_t m0, const uint8_t* panel, int64_t k_blocks) {
  if constexpr (R > 1) {
    if (rows < R) return dispatch_rows<R - 1>(rows, out, N, K, acts, m0, panel, k_blocks);
  }
  if (acts.split) panel_rows<R, true>(out, N, K, acts, m0, panel, k_blocks);
  else panel_rows<R, false>(out, N, K, acts, m0, panel, k_blocks);
}

}  // namespace

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T with W as the tiles above.
void gemm_q4a8(at::Tensor out, const at::Tensor& x, const at::Tensor& tiles, bool split) {
  const Shapes p = check_io(out, x);
  const int64_t k_blocks = p.K / 32, panels = p.N / 16;
  TORCH_CHECK(tiles.numel() == panels * k_blocks * kTileBytes &&
              tiles.scalar_type() == at::kByte && tiles.is_contiguous(),
              "4-bit weight does not match [N, K]");
  // one buffer per calling thread, kept between calls (the team reads the caller's)
  thread_local Quantized caller_acts;
  quantize(caller_acts, reinterpret_cast<const uint16_t*>(x.data_ptr()), p.M, p.K, split);
  const Quantized& acts = caller_acts;
  const auto* weights = tiles.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel
  {
    int64_t lo, hi;
    thread_share(panels, &lo, &hi);
    // Row blocks outside, panels inside: a block's activations stay in L2 while this thread's
    // share of the weight is read once per block.
    for (int64_t b0 = 0; b0 < p.M; b0 += kRowBlock) {
      const int64_t b1 = std::min(p.M, b0 + kRowBlock);
      for (int64_t panel = lo; panel < hi; ++panel) {
        const uint8_t* panel_w = weights + panel * k_blocks * kTileBytes;
        for (int64_t m0 = b0; m0 < b1; m0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, b1 - m0);
          dispatch_rows(rows, dst + m0 * p.N + panel * 16, p.N, p.K, acts, m0, panel_w,
                        k_blocks);
        }
      }
    }
  }
}

}  // namespace kvrelay
