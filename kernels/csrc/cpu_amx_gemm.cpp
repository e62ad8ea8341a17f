// Small-M matmuls on AMX tiles: out [M, N] = x [M, K] @ W^T, W [N, K], bf16 in and out,
// float32 accumulation. For decode steps (M of 1 to a few hundred rows), where oneDNN's
// bf16 GEMM ran at 0.4-0.6 TFLOP/s and streamed the weights at a third of the copy bandwidth.
//
// Two weight forms, one compute core:
//   * bf16, packed once into AMX's B-tile layout: [N/16, K/32, 16 rows, 32 lanes], lane l of
//     row r holding W[n0 + l/2][k0 + 2r + l%2] (the VNNI pairs TDPBF16PS reads);
//   * 4-bit GGUF blocks (Q4_0 / Q4_1: w = q * d + m per 32 weights of a row), [N/16, K/32]
//     tiles of 320 bytes: 16 rows of 16 bytes, byte j of a row holding lane j (low nibble) and
//     lane j + 16 (high nibble), then the 16 columns' d and m as float16. Each 16 x 32 tile is
//     widened into an L1 buffer right before it is multiplied, rounded to bf16 exactly as the
//     bf16 copy of the same weights is ((q - 8) * d + (m + 8 d), float32 multiplies and adds,
//     round-to-nearest-even), so both forms give the same bits; the 4-bit form reads 320 bytes
//     a tile instead of 1,024.
//
// Blocking: each thread owns a range of 32-column panel pairs; for each, up to 32 rows at a
// time accumulate in four C tiles (2 x 2) while the pair's K/32 B tiles stream through. Activations
// are first copied into tile order (one contiguous KB per A tile: strided tile loads measured
// 2x slower per multiply on this machine).
#include <ATen/core/Tensor.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "cpu_amx_gemm.h"
#include "omp_share.h"

namespace {

using kvrelay::amx_permitted;
using kvrelay::configure_full_tiles;  // tiles: C 0-3 (fp32 16 x 16), B 4-5 and A 6-7 (bf16 16 x 32)
using kvrelay::thread_share;

constexpr int64_t kTileElems = 16 * 32;     // bf16 elements of one A or B tile
constexpr int64_t kQ4TileBytes = 256 + 32 + 32;  // one 4-bit B tile: nibbles, d, m

// x [M, K] -> [ceil(M/16), K/32, 16, 32], rows past M zero.
void pack_rows(uint16_t* dst, const uint16_t* x, int64_t M, int64_t K) {
  const int64_t k_blocks = K / 32, m_tiles = (M + 15) / 16;
  for (int64_t mt = 0; mt < m_tiles; ++mt)
    for (int64_t kb = 0; kb < k_blocks; ++kb)
      for (int row = 0; row < 16; ++row) {
        uint16_t* tile_row = dst + ((mt * k_blocks + kb) * 16 + row) * 32;
        const int64_t m = mt * 16 + row;
        if (m < M) std::memcpy(tile_row, x + m * K + kb * 32, 64);
        else std::memset(tile_row, 0, 64);
      }
}

constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// One 4-bit tile -> bf16 B tile. Lanes 0-15 are columns 0-7 (two K each), 16-31 columns 8-15.
inline void widen_q4_tile(uint16_t* dst, const uint8_t* tile) {
  const uint8_t* nibbles = tile;
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  // q - 8 for q in 0..15, by table lookup (exact, one instruction)
  const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
  // zero = m + 8 d, as the float32 dequantization computed it (8 d is exact)
  const __m512 z = _mm512_add_ps(m, _mm512_mul_ps(_mm512_set1_ps(8.f), s));
  const __m512 s_lo = _mm512_permutexvar_ps(lo_cols, s), s_hi = _mm512_permutexvar_ps(hi_cols, s);
  const __m512 z_lo = _mm512_permutexvar_ps(lo_cols, z), z_hi = _mm512_permutexvar_ps(hi_cols, z);
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int row = 0; row < 16; ++row) {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + row * 16)));
    const __m512 q_lo = _mm512_permutexvar_ps(_mm512_and_si512(bytes, low_nibble), centred);
    const __m512 q_hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), centred);
    // multiply, then add: two roundings, as the float32 dequantization the bf16 copy came from.
    // The explicit-rounding forms are never fused into an FMA, whatever the build's
    // -ffp-contract (the decode stack compiles this file with its own flags).
    const __m512 w_lo = _mm512_add_round_ps(_mm512_mul_round_ps(q_lo, s_lo, kNearest), z_lo, kNearest);
    const __m512 w_hi = _mm512_add_round_ps(_mm512_mul_round_ps(q_hi, s_hi, kNearest), z_hi, kNearest);
    _mm512_storeu_si512(dst + row * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
  }
}

inline void store_row_bf16(uint16_t* dst, const float* src) {  // 16 float32 -> 16 bf16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
}

inline void store_rows(uint16_t* out, int64_t N, int64_t rows, float (*scratch)[16]) {
  for (int64_t row = 0; row < rows; ++row) store_row_bf16(out + row * N, scratch[row]);
}

// Weights to pull into L2 while a panel computes: lines_per_step cache lines per K step.
// Tile loads from DRAM are not prefetched by the hardware well enough: on 30 layers of distinct
// weights a 64-row step's matmuls took 43 ms where one layer's weights, hot, took 25.
struct Prefetch {
  const char* bytes;
  int64_t lines_per_step;
};
constexpr Prefetch kNoPrefetch{nullptr, 0};

// Rows m0 .. m0 + 16 * MT (MT 1 or 2) of a pair of 16-column panels (32 output columns).
// `a` is the packed rows' first m-tile; b0, b1 the two panels' K/32 bf16 tiles; out points at
// out[m0, n0]. 2 x 2 blocking: per K step two A and two B loads feed four independent
// multiplies (a chain of load, multiply, load on one register measured 4x slower: the
// multiply's latency is exposed).
template <int MT>
void panel_rows(uint16_t* out, int64_t N, int64_t rows_left, const uint16_t* a,
                const uint16_t* b0, const uint16_t* b1, int64_t k_blocks, const Prefetch& next) {
  alignas(64) float scratch[16][16];
  const uint16_t* a1 = a + k_blocks * kTileElems;  // the next m-tile
  _tile_zero(0);
  _tile_zero(1);
  if (MT > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const char* ahead = next.bytes + kb * next.lines_per_step * 64;
    for (int64_t line = 0; line < next.lines_per_step; ++line)
      _mm_prefetch(ahead + 64 * line, _MM_HINT_T1);
    _tile_loadd(4, b0 + kb * kTileElems, 64);
    _tile_loadd(5, b1 + kb * kTileElems, 64);
    _tile_loadd(6, a + kb * kTileElems, 64);
    if (MT > 1) _tile_loadd(7, a1 + kb * kTileElems, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if (MT > 1) {
      _tile_dpbf16ps(2, 7, 4);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  // (the tile intrinsics take register numbers as literals, hence the spelled-out stores)
  const int64_t rows0 = std::min<int64_t>(16, rows_left);
  _tile_stored(0, scratch, 64);
  store_rows(out, N, rows0, scratch);
  _tile_stored(1, scratch, 64);
  store_rows(out + 16, N, rows0, scratch);
  if (MT > 1) {
    const int64_t rows1 = std::min<int64_t>(16, rows_left - 16);
    _tile_stored(2, scratch, 64);
    store_rows(out + 16 * N, N, rows1, scratch);
    _tile_stored(3, scratch, 64);
    store_rows(out + 16 * N + 16, N, rows1, scratch);
  }
}

// Every row of one 32-column panel pair, 32 at a time. The next pair's weights are fetched
// into L2 during the first 32 rows, spread over the K steps.
void panel(uint16_t* out, int64_t M, int64_t N, const uint16_t* a_packed, const uint16_t* b0,
           const uint16_t* b1, int64_t k_blocks, const Prefetch& next) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const uint16_t* a = a_packed + (m0 / 16) * k_blocks * kTileElems;
    const Prefetch& fetch = m0 == 0 ? next : kNoPrefetch;
    if (M - m0 > 16) panel_rows<2>(out + m0 * N, N, M - m0, a, b0, b1, k_blocks, fetch);
    else panel_rows<1>(out + m0 * N, N, M - m0, a, b0, b1, k_blocks, fetch);
  }
}

// The next panel pair's weights, or none where this thread has no next pair.
Prefetch next_pair(const void* weights, int64_t pair, int64_t last, int64_t pair_bytes,
                   int64_t k_blocks) {
  if (pair + 1 >= last) return kNoPrefetch;
  return {static_cast<const char*>(weights) + (pair + 1) * pair_bytes, pair_bytes / 64 / k_blocks};
}

struct Problem {
  int64_t M, N, K;
  const uint16_t* a_packed;
  uint16_t* out;
};

Problem prepare(at::Tensor& out, const at::Tensor& x, std::vector<uint16_t>& a_buffer) {
  TORCH_CHECK(amx_permitted(), "the kernel refused AMX tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous [M, K] bf16 matrix");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
              out.size(0) == x.size(0), "out must be a contiguous [M, N] bf16 matrix");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0, "K and N must be multiples of 32");
  a_buffer.resize(((M + 15) / 16) * 16 * K);
  pack_rows(a_buffer.data(), reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  return {M, N, K, a_buffer.data(), reinterpret_cast<uint16_t*>(out.data_ptr())};
}

}  // namespace

namespace kvrelay {

// out [M, N] = x [M, K] @ W^T with W packed by pack_bf16 ([N/16, K/32, 16, 32] bf16).
void amx_gemm_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& packed) {
  thread_local std::vector<uint16_t> a_buffer;
  const Problem p = prepare(out, x, a_buffer);
  TORCH_CHECK(packed.numel() == p.N * p.K && packed.scalar_type() == at::kBFloat16,
              "packed weight does not match [N, K]");
  const auto* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t k_blocks = p.K / 32;
#pragma omp parallel
  {
    int64_t lo, hi;
    thread_share(p.N / 32, &lo, &hi);
    configure_full_tiles();
    const int64_t pair_bytes = 2 * k_blocks * kTileElems * 2;
    for (int64_t pair = lo; pair < hi; ++pair) {
      const uint16_t* b0 = weights + 2 * pair * k_blocks * kTileElems;
      panel(p.out + pair * 32, p.M, p.N, p.a_packed, b0, b0 + k_blocks * kTileElems, k_blocks,
            next_pair(weights, pair, hi, pair_bytes, k_blocks));
    }
    _tile_release();
  }
}

// The same with W as 4-bit tiles, [N/16, K/32, kQ4TileBytes] uint8 (see the top of the file).
void amx_gemm_q4(at::Tensor out, const at::Tensor& x, const at::Tensor& q4_tiles) {
  thread_local std::vector<uint16_t> a_buffer;
  const Problem p = prepare(out, x, a_buffer);
  const int64_t k_blocks = p.K / 32, tiles = (p.N / 16) * k_blocks;
  TORCH_CHECK(q4_tiles.numel() == tiles * kQ4TileBytes && q4_tiles.scalar_type() == at::kByte &&
              q4_tiles.is_contiguous(), "4-bit weight does not match [N, K]");
  const auto* q = q4_tiles.data_ptr<uint8_t>();
#pragma omp parallel
  {
    int64_t lo, hi;
    thread_share(p.N / 32, &lo, &hi);
    configure_full_tiles();
    // a panel pair's bf16 tiles, 32 x K: 36 KB for K = 576 (in L1), 96 KB for 1,536 (in L2);
    // one per OpenMP thread, kept between calls (120 calls a decode step)
    thread_local std::vector<uint16_t> widened;
    widened.resize(2 * k_blocks * kTileElems);
    // Widening a whole pair before multiplying it measured faster than widening each K step
    // just ahead of its multiplies (the tile loads then wait on the fresh stores).
    uint16_t* b0 = widened.data();
    for (int64_t pair = lo; pair < hi; ++pair) {
      const int64_t tile0 = 2 * pair * k_blocks;  // tiles are [N/16, K/32]: two panels in a row
      for (int64_t t = 0; t < 2 * k_blocks; ++t)
        widen_q4_tile(b0 + t * kTileElems, q + (tile0 + t) * kQ4TileBytes);
      panel(p.out + pair * 32, p.M, p.N, p.a_packed, b0, b0 + k_blocks * kTileElems, k_blocks,
            next_pair(q, pair, hi, 2 * k_blocks * kQ4TileBytes, k_blocks));
    }
    _tile_release();
  }
}

}  // namespace kvrelay
