// Matmuls of a few rows on 8-bit weights (GGUF Q8_0 blocks: 32 int8 q and a float16 d, the
// weight d * q): out [M, N] = x [M, K] @ W^T, bf16 in and out, float32 arithmetic. For the
// head of a checkpoint that stores it as Q8_0: 1.06 bytes a weight instead of bf16's 2, and the
// checkpoint's weights exactly (each q is exact in float32; d multiplies the float32 sum).
//
// Why float32 FMAs and not bf16 dot products: an int8 is not one shift away from a bf16 (its 8
// significant bits overflow bf16's mantissa), and on the machines measured here (BENCHMARKS.md)
// a 512-bit bf16 dot product costs 3.7x an FMA for 2x the products. Sign-extend 16 bytes,
// convert, multiply-add: 21.7 G weights/s on one core with the tiles in L2, past what memory
// delivers, so the kernel is bound by reading the weights.
//
// Tiles [N/16, K/32, 544 bytes]: 32 rows of 16 int8 (row k: the K index k0 + k for the tile's
// 16 output columns), then the 16 columns' d as float16. One contiguous stream a panel.
#include <ATen/core/Tensor.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv_io.h"

namespace {

constexpr int64_t kQ8TileBytes = 32 * 16 + 32;  // int8 codes, then 16 float16 d
constexpr int kPrefetchL2Tiles = 16;  // as the 4-bit kernel: into L2 far ahead, L1 just ahead
constexpr int kPrefetchL1Tiles = 2;
constexpr int kLinesPerTile = (kQ8TileBytes + 63) / 64 + 1;  // tiles straddle cache lines

// x [M, K] bf16 -> float32, for broadcasting one K at a time.
void widen(std::vector<float>& wide, const uint16_t* x, int64_t count) {
  wide.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(&wide[i], &bits, sizeof(float));
  }
}

inline __m512 codes(const uint8_t* row) {  // 16 int8 -> float32
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
}

// Rows x_rows[0 .. R) of one 16-column panel; four accumulators per row so that the FMAs'
// latency overlaps.
template <int R>
void q8_panel_rows(uint16_t* out, int64_t N, const float* const* x_rows, const uint8_t* panel,
                   int64_t k_blocks) {
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const uint8_t* tile = panel + kb * kQ8TileBytes;
    for (int line = 0; line < kLinesPerTile; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchL2Tiles * kQ8TileBytes + 64 * line),
                   _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(tile + kPrefetchL1Tiles * kQ8TileBytes + 64 * line),
                   _MM_HINT_T0);
    }
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int k = 0; k < 32; ++k) {
      const __m512 w = codes(tile + 16 * k);
      for (int r = 0; r < R; ++r)
        acc[r][k % 4] = _mm512_fmadd_ps(w, _mm512_set1_ps(x_rows[r][32 * kb + k]), acc[r][k % 4]);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 512)));
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                       _mm512_add_ps(acc[r][2], acc[r][3]));
      total[r] = _mm512_fmadd_ps(sum, d, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) kvrelay::store_bf16(out + r * N, total[r]);
}

}  // namespace

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T with W as 8-bit tiles (see the top of the file).
void gemv_q8(at::Tensor out, const at::Tensor& x, const at::Tensor& q8_tiles) {
  const Shapes p = check_io(out, x);
  const int64_t k_blocks = p.K / 32;
  TORCH_CHECK(q8_tiles.numel() == (p.N / 16) * k_blocks * kQ8TileBytes &&
              q8_tiles.scalar_type() == at::kByte && q8_tiles.is_contiguous(),
              "8-bit weight does not match [N, K]");
  // one buffer per calling thread, kept between calls (the OpenMP team reads the caller's)
  thread_local std::vector<float> caller_wide;
  widen(caller_wide, reinterpret_cast<const uint16_t*>(x.data_ptr()), p.M * p.K);
  const float* wide = caller_wide.data();
  const auto* q = q8_tiles.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_each_pass(dst, p, [&](int64_t panel, int64_t m0, int64_t rows, uint16_t* o) {
    const uint8_t* panel_q = q + panel * k_blocks * kQ8TileBytes;
    const float* x_rows[kMaxRowsPerPass];
    for (int64_t r = 0; r < rows; ++r) x_rows[r] = wide + (m0 + r) * p.K;
    if (rows == 3) q8_panel_rows<3>(o, p.N, x_rows, panel_q, k_blocks);
    else if (rows == 2) q8_panel_rows<2>(o, p.N, x_rows, panel_q, k_blocks);
    else q8_panel_rows<1>(o, p.N, x_rows, panel_q, k_blocks);
  });
}

}  // namespace kvrelay
