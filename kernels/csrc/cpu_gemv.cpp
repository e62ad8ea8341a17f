// Matmuls of a few rows (decode steps of 1 to ~8 tokens) on AVX512-BF16 dot products:
// out [M, N] = x [M, K] @ W^T, bf16 in and out, float32 accumulation. Such steps are bound by
// reading W once, so the loop is arranged for the bytes: each weight is read from memory once
// per call whatever M is, and turned into the dot product's operand in a few instructions.
//
// Weights are in the AMX kernel's layouts (kernels/csrc/cpu_amx_gemm.cpp, kernels/native_amx.py),
// so one copy serves both kernels:
//   * 4-bit GGUF blocks, [N/16, K/32] tiles of 320 bytes: 16 rows of 16 bytes, row r being the
//     K pair (k0 + 2r, k0 + 2r + 1) for the tile's 16 output columns, byte j holding lane j in
//     its low nibble and lane j + 16 in its high one (lane l: column l / 2, K parity l % 2);
//     then the 16 columns' d and m as float16: w = q * d + m. One contiguous stream a panel.
//   * bf16, [N/16, K/32, 16 rows, 32 lanes], lanes as above.
//
// The 4-bit trick: the bf16 with bits 0x3F80 | q << 3 is exactly 1 + q / 16 for q in 0..15
// (q in the mantissa's top bits), so a shift, a mask and a byte interleave with 0x3F turn 64
// nibbles into two dot-product operands with no conversion. Per tile of 32 K and column, with
// S = the sum of x over those 32 K (the sums come from float32 dot products of such values, so
// placing q high in the mantissa keeps the constant 1 from swamping it: 0x4300 | q, i.e.
// 128 + q, measured 8x the rounding error):
//   sum x * w = 16 d * sum x * (1 + q / 16) + S * (m - 16 d).
// The scale multiplies a float32 sum (not each weight), so this differs from the bf16 copy
// (whose weights were rounded to bf16) by float32 rounding only: it is closer to the float32
// dequantized reference than the bf16 path.
//
// Lane arrangement for the 4-bit form: one 64-byte load is 4 rows of a tile (4 K pairs); each
// 128-bit lane of the interleaved operands holds one K pair for 4 columns, so the activation
// operand holds a different K pair per 128-bit lane (`pair_groups`), and the 4 lanes are summed
// once per panel at the end.
#include <ATen/core/Tensor.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gemv.h"
#include "gemv_io.h"

namespace {

using kvrelay::check_io;
using kvrelay::for_each_pass;
using kvrelay::kMaxRowsPerPass;
using kvrelay::Shapes;
using kvrelay::store_bf16;

constexpr int64_t kQ4TileBytes = 256 + 32 + 32;  // one 4-bit tile: nibbles, d, m
constexpr int64_t kTileElems = 16 * 32;    // one bf16 tile
// Software prefetch, in tiles ahead: into L2 far ahead (L2 tracks more misses in flight than
// L1), into L1 just ahead. On 30 layers of distinct weights with the LLC cold, at one row: the
// hardware's streams alone 4.6 ms, L1 16 ahead 4.9, L2 32 + L1 4 ahead 4.1-4.3 (no gain past).
constexpr int kPrefetchL2Tiles = 32;
constexpr int kPrefetchL1Tiles = 4;
constexpr int kBf16PrefetchTiles = 4;  // 4 KB ahead

// The activations of one call, laid out for the loops: per row, K/8 operands of 16 dwords
// (128-bit lane i: the K pair 4g + i, four times) and the K/32 block sums.
struct Activations {
  std::vector<uint32_t> pair_groups;  // [M, K/8, 16]
  std::vector<float> block_sums;      // [M, K/32]
  int64_t K = 0;
  const uint32_t* groups(int64_t m) const { return pair_groups.data() + m * (K / 8) * 16; }
  const float* sums(int64_t m) const { return block_sums.data() + m * (K / 32); }
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

void prepare_activations(Activations& acts, const uint16_t* x, int64_t M, int64_t K) {
  acts.K = K;
  acts.pair_groups.resize(M * (K / 8) * 16);
  acts.block_sums.resize(M * (K / 32));
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * K;
    uint32_t* groups = acts.pair_groups.data() + m * (K / 8) * 16;
    for (int64_t g = 0; g < K / 8; ++g) {
      const __m512i four_pairs = _mm512_castsi128_si512(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * g)));
      _mm512_storeu_si512(groups + 16 * g, _mm512_permutexvar_epi32(spread, four_pairs));
    }
    float* sums = acts.block_sums.data() + m * (K / 32);
    for (int64_t b = 0; b < K / 32; ++b) {
      float total = 0.f;
      for (int j = 0; j < 32; ++j) total += bf16_to_float(row[32 * b + j]);
      sums[b] = total;
    }
  }
}

inline __m512 load_halves(const uint8_t* src) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// Sums the four 128-bit lanes of each of a, b, c, d (columns 0-3, 4-7, 8-11, 12-15, one K
// residue per lane) into the 16 columns in order.
inline __m512 reduce_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
  // [a0 a1 b0 b1] + [a2 a3 b2 b3], where ai is lane i of a: lanes 0-1 hold a's halves summed
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // [ab0 ab2 cd0 cd2] + [ab1 ab3 cd1 cd3] = [a b c d], each summed over its four lanes
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}

// Rows m0 .. m0 + R of one 16-column panel of the 4-bit weight.
template <int R>
void q4_panel_rows(uint16_t* out, int64_t N, const Activations& acts, int64_t m0,
                   const uint8_t* panel, int64_t k_blocks) {
  const __m512i mantissa_top = _mm512_set1_epi8(0x78);  // q << 3, the mantissa's top 4 bits
  const __m512i mantissa_lead = _mm512_set1_epi8(static_cast<char>(0x80));  // exponent's low bit
  const __m512i exponent = _mm512_set1_epi8(0x3F);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  const __m512i cols_a = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
  const __m512i cols_b = _mm512_add_epi32(cols_a, _mm512_set1_epi32(4));
  const __m512i cols_c = _mm512_add_epi32(cols_a, _mm512_set1_epi32(8));
  const __m512i cols_d = _mm512_add_epi32(cols_a, _mm512_set1_epi32(12));
  __m512 total[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) total[r][j] = _mm512_setzero_ps();
  const uint32_t* groups[R];
  for (int r = 0; r < R; ++r) groups[r] = acts.groups(m0 + r);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint8_t* tile = panel + kb * kQ4TileBytes;
    for (int line = 0; line < kQ4TileBytes / 64; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchL2Tiles * kQ4TileBytes + 64 * line),
                   _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchL1Tiles * kQ4TileBytes + 64 * line),
                   _MM_HINT_T0);
    }
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int g = 0; g < 4; ++g) {
      const __m512i bytes = _mm512_loadu_si512(tile + 64 * g);
      // (b << 3) & 0x78 | 0x80 and (b >> 1) & 0x78 | 0x80, one ternary-logic op each
      const __m512i lo = _mm512_ternarylogic_epi32(_mm512_slli_epi16(bytes, 3), mantissa_top,
                                                   mantissa_lead, 0xEA);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 1), mantissa_top,
                                                   mantissa_lead, 0xEA);
      const __m512bh w_a = (__m512bh)_mm512_unpacklo_epi8(lo, exponent);
      const __m512bh w_b = (__m512bh)_mm512_unpackhi_epi8(lo, exponent);
      const __m512bh w_c = (__m512bh)_mm512_unpacklo_epi8(hi, exponent);
      const __m512bh w_d = (__m512bh)_mm512_unpackhi_epi8(hi, exponent);
      for (int r = 0; r < R; ++r) {
        const __m512bh xs = (__m512bh)_mm512_loadu_si512(groups[r] + 16 * (4 * kb + g));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w_a, xs);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w_b, xs);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w_c, xs);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w_d, xs);
      }
    }
    const __m512 s = _mm512_mul_ps(sixteen, load_halves(tile + 256));  // 16 d: exact
    const __m512 s_by_lane[4] = {_mm512_permutexvar_ps(cols_a, s), _mm512_permutexvar_ps(cols_b, s),
                                 _mm512_permutexvar_ps(cols_c, s), _mm512_permutexvar_ps(cols_d, s)};
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) total[r][j] = _mm512_fmadd_ps(acc[r][j], s_by_lane[j], total[r][j]);
  }
  // The block-sum term, from the panel's d and m (still in cache).
  for (int r = 0; r < R; ++r) {
    const float* sums = acts.sums(m0 + r);
    __m512 shift = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const uint8_t* tile = panel + kb * kQ4TileBytes;
      const __m512 per_col = _mm512_fnmadd_ps(sixteen, load_halves(tile + 256),
                                              load_halves(tile + 288));
      shift = _mm512_fmadd_ps(_mm512_set1_ps(sums[kb]), per_col, shift);
    }
    const __m512 dots = reduce_lanes(total[r][0], total[r][1], total[r][2], total[r][3]);
    store_bf16(out + r * N, _mm512_add_ps(dots, shift));
  }
}

}  // namespace

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T with W as 4-bit tiles (see the top of the file).
void gemv_q4(at::Tensor out, const at::Tensor& x, const at::Tensor& q4_tiles) {
  const Shapes p = check_io(out, x);
  const int64_t k_blocks = p.K / 32, tiles = (p.N / 16) * k_blocks;
  TORCH_CHECK(q4_tiles.numel() == tiles * kQ4TileBytes && q4_tiles.scalar_type() == at::kByte &&
              q4_tiles.is_contiguous(), "4-bit weight does not match [N, K]");
  // one buffer per calling thread, kept between calls; the OpenMP team reads the caller's
  // (a thread_local named inside the parallel region would be each team thread's own)
  thread_local Activations caller_acts;
  const Activations& acts = caller_acts;
  prepare_activations(caller_acts, reinterpret_cast<const uint16_t*>(x.data_ptr()), p.M, p.K);
  const auto* q = q4_tiles.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_each_pass(dst, p, [&](int64_t panel, int64_t m0, int64_t rows, uint16_t* o) {
    const uint8_t* panel_q = q + panel * k_blocks * kQ4TileBytes;
    if (rows == 3) q4_panel_rows<3>(o, p.N, acts, m0, panel_q, k_blocks);
    else if (rows == 2) q4_panel_rows<2>(o, p.N, acts, m0, panel_q, k_blocks);
    else q4_panel_rows<1>(o, p.N, acts, m0, panel_q, k_blocks);
  });
}

}  // namespace kvrelay

namespace {

// Rows m0 .. m0 + R of one 16-column panel of the bf16 weight: tile row r is one K pair for the
// 16 columns, multiplied by that pair broadcast. Four accumulators per row so that the dot
// products' latency overlaps.
template <int R>
void bf16_panel_rows(uint16_t* out, int64_t N, const uint32_t* const* x_pairs,
                     const uint16_t* panel, int64_t k_blocks) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint16_t* tile = panel + kb * kTileElems;
    for (int row = 0; row < 16; ++row) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + kBf16PrefetchTiles * kTileElems + 32 * row),
                   _MM_HINT_T0);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(tile + 32 * row);
      for (int r = 0; r < R; ++r) {
        const __m512bh xs = (__m512bh)_mm512_set1_epi32(x_pairs[r][16 * kb + row]);
        acc[r][row % 4] = _mm512_dpbf16_ps(acc[r][row % 4], w, xs);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                     _mm512_add_ps(acc[r][2], acc[r][3]));
    store_bf16(out + r * N, sum);
  }
}

}  // namespace

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T with W packed as bf16 tiles.
void gemv_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  const Shapes p = check_io(out, x);
  TORCH_CHECK(packed.numel() == p.N * p.K && packed.scalar_type() == at::kBFloat16,
              "packed weight does not match [N, K]");
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr());  // [M, K/2]
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t k_blocks = p.K / 32;
  for_each_pass(dst, p, [&](int64_t panel, int64_t m0, int64_t rows, uint16_t* o) {
    const uint16_t* w = weights + panel * k_blocks * kTileElems;
    const uint32_t* rows_x[kMaxRowsPerPass];
    for (int64_t r = 0; r < rows; ++r) rows_x[r] = x_pairs + (m0 + r) * (p.K / 2);
    if (rows == 3) bf16_panel_rows<3>(o, p.N, rows_x, w, k_blocks);
    else if (rows == 2) bf16_panel_rows<2>(o, p.N, rows_x, w, k_blocks);
    else bf16_panel_rows<1>(o, p.N, rows_x, w, k_blocks);
  });
}

}  // namespace kvrelay
