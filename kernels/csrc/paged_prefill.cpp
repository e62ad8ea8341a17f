// Causal prefill attention read straight from the paged KV cache through the block table, with
// an online softmax in fp32 (flash attention's order of work), one OpenMP work item per
// (sequence, block of kQueryBlock query tokens, kv head).
//
// Why not torch's SDPA: on 2 cores it ran a 200-token causal prompt at ~45 GFLOP/s and a
// 2,048-token one at ~110, and the per-sequence gathers of K and V around it cost as much again
// (BENCHMARKS.md, session 21). Here a tile of keys is read once per item for all its queries and
// the item's q heads (a GQA group); no padding, no mask tensor: each query sees the keys up to
// its own position.
//
// Two forms. bf16 on a CPU with AVX512-BF16: scores from the raw bf16 pairs on vdpbf16ps (32
// multiply-adds an instruction), the weights rounded to bf16 for the values' sum, 64 keys a tile
// (~260 GFLOP/s on 2 cores here; its error against float32 attention is SDPA's). Otherwise
// (fp32, or no AVX512-BF16): fp32 FMAs, 16 keys a tile, K transposed so one query row's scores
// are head_dim FMAs of a broadcast query value (~110 GFLOP/s).
//
// A sliding window starts an item's tiles at its first query's first visible key (block-table
// entries before it are never looked up), and each query's lanes outside [its first visible
// key, its own key] weigh 0. A soft cap bends the scores before that mask, in every form.
#include "paged_prefill.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "fp32_lanes.h"
#include "kv_codes.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvrelay {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // scores in base 2: the softmax needs only exp2
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr int kQueryBlock = 32;  // query tokens per work item
constexpr int kPartials = 4;  // independent FMA chains per score vector

struct Item {
  int64_t seq, first_query, kv_head;
  // keys first_key..last_key serve the item's queries: first_key is its first query's first
  // visible key (0 without a window), last_key its last query's own
  int64_t first_key, last_key;
};

// The lanes [low, limit) of a tile of `count` keys from first_key that the query at `position`
// sees; none where low >= limit (the tile lies wholly after the query or before its window).
struct Span {
  int low, limit;
  bool empty() const { return low >= limit; }
};
inline Span visible_span(const PagedAttentionArgs& a, int64_t position, int64_t first_key, int count) {
  const int64_t low = first_visible_key(position, a.window) - first_key;
  const int64_t limit = position + 1 - first_key;
  return {int(std::clamp<int64_t>(low, 0, count)), int(std::clamp<int64_t>(limit, 0, count))};
}

// True in the lanes first_lane + l (l < kLanes) that lie in the span.
inline auto in_span(const Span& span, int first_lane) {
  const Lanes lane = Lanes{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + float(first_lane);
  return (lane >= float(span.low)) & (lane < float(span.limit));
}

// One tile of up to kLanes keys for one kv head, widened to fp32: K transposed, V as rows.
// Lanes past `count` hold zeros (their weights are exactly 0, and 0 * 0 stays 0).
template <int D>
struct KeyTile {
  alignas(64) float keys[D][kLanes];
  alignas(64) float values[kLanes][D];
  int count = 0;
};

// Keys first_key .. first_key + count - 1 of sequence `seq`. False on a block id outside the cache.
template <int D, typename KT>
bool load_tile(const PagedPrefillArgs& a, int64_t seq, int64_t kv_head, int64_t first_key, int count,
               KeyTile<D>& tile) {
  const int32_t* table = a.block_tables + seq * a.block_table_stride;
  const KT* k_cache = static_cast<const KT*>(a.k_cache);
  const KT* v_cache = static_cast<const KT*>(a.v_cache);
  for (int j = 0; j < count; ++j) {
    const int64_t key = first_key + j;
    const int64_t block = table[key / a.block_size];
    if (block < 0 || block >= a.num_blocks) return false;
    const int64_t offset = ((block * a.block_size + key % a.block_size) * a.num_kv_heads + kv_head) *
                           row_stride<KT>(D);
    const KT* k_row = k_cache + offset;
    const KT* v_row = v_cache + offset;
    if constexpr (kCoded<KT>) {
      const float k_scale = row_scale(k_row, D), v_scale = row_scale(v_row, D);
      for (int d = 0; d < D; ++d) tile.keys[d][j] = decode(k_row[d]) * k_scale;
      for (int d = 0; d < D; ++d) tile.values[j][d] = decode(v_row[d]) * v_scale;
    } else {
      for (int d = 0; d < D; ++d) tile.keys[d][j] = widen(k_row[d]);
      for (int d = 0; d < D; ++d) tile.values[j][d] = widen(v_row[d]);
    }
  }
  for (int j = count; j < kLanes; ++j) {
    for (int d = 0; d < D; ++d) tile.keys[d][j] = 0.0f;
    for (int d = 0; d < D; ++d) tile.values[j][d] = 0.0f;
  }
  tile.count = count;
  return true;
}

// The running state of one query token's G heads: queries (scaled, base 2), unnormalized
// outputs, running max and weight sum.
template <int G, int D>
struct QueryState {
  alignas(64) float query[G][D];
  alignas(64) float acc[G][D];
  float max[G], sum[G];
};

// Scores of one query token's G heads against a tile, soft-capped where cap_base2 > 0, valid in
// the span's lanes (-inf elsewhere).
template <int G, int D>
inline void score(const QueryState<G, D>& q, const KeyTile<D>& tile, Span span, float cap_base2,
                  Lanes (&scores)[G]) {
  Lanes partial[G][kPartials] = {};
  for (int d = 0; d < D; d += kPartials)
    for (int p = 0; p < kPartials; ++p) {
      const Lanes keys = load_lanes(tile.keys[d + p]);
      for (int g = 0; g < G; ++g) partial[g][p] += q.query[g][d + p] * keys;
    }
  const Lanes minus_inf = Lanes{} + kMinusInf;
  const auto visible = in_span(span, 0);
  for (int g = 0; g < G; ++g) {
    Lanes sum = (partial[g][0] + partial[g][1]) + (partial[g][2] + partial[g][3]);
    if (cap_base2 > 0.0f) sum = soft_cap_lanes(sum, cap_base2);
    scores[g] = visible ? sum : minus_inf;
  }
}

// Online softmax and the weighted sum of the tile's values for one query token's G heads.
template <int G, int D>
inline void accumulate(QueryState<G, D>& q, const KeyTile<D>& tile, Span span, const Lanes (&scores)[G]) {
  constexpr int NC = D / kLanes;
  alignas(64) float weights[G][kLanes];
  float rescale[G];
  for (int g = 0; g < G; ++g) {
    const float new_max = std::max(q.max[g], max_of(scores[g]));
    rescale[g] = exp2_nonpositive(q.max[g] - new_max);
    const Lanes w = exp2_lanes(scores[g] - new_max);
    q.max[g] = new_max;
    q.sum[g] = q.sum[g] * rescale[g] + sum_of(w);
    store_lanes(w, weights[g]);
  }
  Lanes acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = load_lanes(q.acc[g] + c * kLanes) * rescale[g];
  for (int j = span.low; j < span.limit; ++j)
    for (int c = 0; c < NC; ++c) {
      const Lanes values = load_lanes(tile.values[j] + c * kLanes);
      for (int g = 0; g < G; ++g) acc[g][c] += weights[g][j] * values;
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) store_lanes(acc[g][c], q.acc[g] + c * kLanes);
}

// KT: the cache's element; 8-bit rows hold rotated K and V (kv_codes.h), so each query is
// rotated on the way in and each output back on the way out.
template <int G, int D, typename T, typename KT>
void start_queries(const PagedPrefillArgs& a, const Item& item, int num_queries, QueryState<G, D>* states) {
  const T* query = static_cast<const T*>(a.query);
  const float query_scale = a.scale * kLog2e;
  const int64_t first_token = a.token_starts[item.seq] + item.first_query;
  for (int i = 0; i < num_queries; ++i) {
    QueryState<G, D>& s = states[i];
    for (int g = 0; g < G; ++g) {
      const T* src = query + (first_token + i) * a.query_token_stride + (item.kv_head * G + g) * a.query_head_stride;
      for (int d = 0; d < D; ++d) s.query[g][d] = widen(src[d]) * query_scale;
      if constexpr (kCoded<KT>) rotate(s.query[g], D);
      for (int d = 0; d < D; ++d) s.acc[g][d] = 0.0f;
      s.max[g] = kMinusInf;
      s.sum[g] = 0.0f;
    }
  }
}

template <int G, int D, typename T, typename KT>
void finish_queries(const PagedPrefillArgs& a, const Item& item, int num_queries, const QueryState<G, D>* states) {
  T* out = static_cast<T*>(a.out);
  const int64_t first_token = a.token_starts[item.seq] + item.first_query;
  for (int i = 0; i < num_queries; ++i)
    for (int g = 0; g < G; ++g) {
      // every query sees at least its own key, so sum >= 1
      const float inv_sum = 1.0f / states[i].sum[g];
      T* dst = out + (first_token + i) * a.out_token_stride + (item.kv_head * G + g) * a.out_head_stride;
      float head[D];
      for (int d = 0; d < D; ++d) head[d] = states[i].acc[g][d] * inv_sum;
      if constexpr (kCoded<KT>) rotate(head, D);
      for (int d = 0; d < D; ++d) narrow(head[d], dst + d);
    }
}

// One work item: up to kQueryBlock query tokens of one sequence, the G q heads of one kv head.
// T: the queries' and output's element type; KT: the cache's.
template <int G, int D, typename T, typename KT>
bool attend_item(const PagedPrefillArgs& a, const Item& item, KeyTile<D>& tile, QueryState<G, D>* states) {
  const int64_t context = a.seq_lens[item.seq] - a.query_lens[item.seq];
  const int num_queries = int(std::min<int64_t>(kQueryBlock, a.query_lens[item.seq] - item.first_query));
  const int64_t first_position = context + item.first_query;  // key index of the first query's own key
  const float cap_base2 = a.soft_cap * kLog2e;
  start_queries<G, D, T, KT>(a, item, num_queries, states);
  for (int64_t first_key = item.first_key; first_key <= item.last_key; first_key += kLanes) {
    const int count = int(std::min<int64_t>(kLanes, item.last_key + 1 - first_key));
    if (!load_tile<D, KT>(a, item.seq, item.kv_head, first_key, count, tile)) return false;
    for (int i = 0; i < num_queries; ++i) {
      const Span span = visible_span(a, first_position + i, first_key, count);
      if (span.empty()) continue;
      Lanes scores[G];
      score(states[i], tile, span, cap_base2, scores);
      accumulate(states[i], tile, span, scores);
    }
  }
  finish_queries<G, D, T, KT>(a, item, num_queries, states);
  return true;
}

std::vector<Item> work_items(const PagedPrefillArgs& a) {
  std::vector<Item> items;
  for (int64_t seq = 0; seq < a.seqs; ++seq) {
    const int64_t context = a.seq_lens[seq] - a.query_lens[seq];
    for (int64_t first = 0; first < a.query_lens[seq]; first += kQueryBlock) {
      const int64_t last_query = std::min<int64_t>(first + kQueryBlock, a.query_lens[seq]) - 1;
      const int64_t first_key = first_visible_key(context + first, a.window);
      for (int64_t head = 0; head < a.num_kv_heads; ++head)
        items.push_back({seq, first, head, first_key, context + last_query});
    }
  }
  // The longest first: the causal triangle makes late blocks of a long prompt the heaviest, and
  // a thread that draws one last would leave the other idle.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.last_key - x.first_key > y.last_key - y.first_key;
  });
  return items;
}

// Every work item of the step on the team. Tile and State are one form's scratch (a thread's
// own), attend its work on one item; false when an item met a block id outside the cache.
template <typename Tile, typename State, int kStatesPerThread = kQueryBlock, typename Attend>
bool run_items(const PagedPrefillArgs& a, int num_threads, Attend attend) {
  const std::vector<Item> items = work_items(a);
  const int64_t count = int64_t(items.size());
  std::atomic<bool> ok{true};
  num_threads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, count)));
#pragma omp parallel num_threads(num_threads)
  {
    Tile tile;
    std::vector<State> states(kStatesPerThread);
    // Dynamic: items differ in length, and a descheduled thread leaves its share to the others.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i)
      if (!attend(a, items[i], tile, states.data())) ok.store(false, std::memory_order_relaxed);
  }
  return ok.load();
}

template <int G, int D, typename T, typename KT>
bool attend_all(const PagedPrefillArgs& a, int num_threads) {
  return run_items<KeyTile<D>, QueryState<G, D>>(a, num_threads, attend_item<G, D, T, KT>);
}

#if defined(__AVX512BF16__)
// ---- bf16 queries and cache on AVX512-BF16: each vdpbf16ps does 32 multiply-adds, twice an
// fp32 FMA's. Scores come from the raw bf16 pairs (dims 2i and 2i+1 of a key, one 32-bit word);
// the weights are rounded to bf16 for the values' sum, in pairs of keys, and the normalizer sums
// the same rounded weights, so the output is their exact weighted mean.

// A tile of kPairTileKeys keys: K as [D/2][kPairTileKeys] words (word i of key j: its dims 2i
// and 2i+1); V as [kPairTileKeys/2][D] words (word d of pair m: dim d of keys 2m and 2m+1).
// Keys past `count` are zero rows. Two vectors of scores a tile halve the softmax's fixed work
// per key (its horizontal max and sum, the rescale) against one.
constexpr int kScoreVectors = 4;
constexpr int kPairTileKeys = kScoreVectors * kLanes;

template <int D>
struct PairTile {
  alignas(64) uint32_t keys[D / 2][kPairTileKeys];
  alignas(64) uint32_t values[kPairTileKeys / 2][D];
};

// 16 x 16 words, transposed in registers: out[i] holds word i of rows[0..15]. Unpacks pair
// rows within 128-bit lanes (columns 4L + c of rows 4g..4g+3 gather in lane L), then the lanes
// move across vectors: 64 shuffles where the scalar loop did 256 loads and 256 stores.
inline void transpose_16x16(__m512i rows[16]) {
  __m512i pairs[16], quads[16];
  for (int k = 0; k < 8; ++k) {
    pairs[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    pairs[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // quads[4g + c], lane L: column 4L + c of rows 4g .. 4g+3
    quads[4 * g + 0] = _mm512_unpacklo_epi64(pairs[4 * g], pairs[4 * g + 2]);
    quads[4 * g + 1] = _mm512_unpackhi_epi64(pairs[4 * g], pairs[4 * g + 2]);
    quads[4 * g + 2] = _mm512_unpacklo_epi64(pairs[4 * g + 1], pairs[4 * g + 3]);
    quads[4 * g + 3] = _mm512_unpackhi_epi64(pairs[4 * g + 1], pairs[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // out[4L + c], lane g = quads[4g + c], lane L
    const __m512i low01 = _mm512_shuffle_i32x4(quads[c], quads[4 + c], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(quads[c], quads[4 + c], 0xEE);
    const __m512i low23 = _mm512_shuffle_i32x4(quads[8 + c], quads[12 + c], 0x44);
    const __m512i high23 = _mm512_shuffle_i32x4(quads[8 + c], quads[12 + c], 0xEE);
    rows[c] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    rows[4 + c] = _mm512_shuffle_i32x4(low01, low23, 0xDD);
    rows[8 + c] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    rows[12 + c] = _mm512_shuffle_i32x4(high01, high23, 0xDD);
  }
}

// Keys into the [D/2][kPairTileKeys] word layout, 16 keys by 16 words at a time.
template <int D>
void pack_pair_keys(const uint16_t* const* k_rows, PairTile<D>& tile) {
  for (int first_key = 0; first_key < kPairTileKeys; first_key += 16)
    for (int first_word = 0; first_word < D / 2; first_word += 16) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(k_rows[first_key + j] + 2 * first_word);
      transpose_16x16(rows);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(&tile.keys[first_word + i][first_key], rows[i]);
    }
}

// Values into [kPairTileKeys/2][D] words: dim d of the even key in the low half, the odd key's
// in the high half; one two-source permute interleaves 16 dims of each.
template <int D>
void pack_pair_values(const uint16_t* const* v_rows, PairTile<D>& tile) {
  alignas(64) static const uint16_t kInterleave[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i low = _mm512_load_si512(kInterleave[0]);
  const __m512i high = _mm512_load_si512(kInterleave[1]);
  for (int m = 0; m < kPairTileKeys / 2; ++m)
    for (int d = 0; d < D; d += 32) {
      const __m512i even = _mm512_loadu_si512(v_rows[2 * m] + d);
      const __m512i odd = _mm512_loadu_si512(v_rows[2 * m + 1] + d);
      _mm512_store_si512(&tile.values[m][d], _mm512_permutex2var_epi16(even, low, odd));
      _mm512_store_si512(&tile.values[m][d + 16], _mm512_permutex2var_epi16(even, high, odd));
    }
}

template <int D>
bool load_pair_tile(const PagedPrefillArgs& a, int64_t seq, int64_t kv_head, int64_t first_key, int count,
                    PairTile<D>& tile) {
  static const uint16_t kZeroRow[D] = {};
  const int32_t* table = a.block_tables + seq * a.block_table_stride;
  const uint16_t* k_rows[kPairTileKeys];
  const uint16_t* v_rows[kPairTileKeys];
  for (int j = 0; j < kPairTileKeys; ++j) {
    k_rows[j] = v_rows[j] = kZeroRow;
    if (j >= count) continue;
    const int64_t key = first_key + j;
    const int64_t block = table[key / a.block_size];
    if (block < 0 || block >= a.num_blocks) return false;
    const int64_t offset = ((block * a.block_size + key % a.block_size) * a.num_kv_heads + kv_head) * D;
    k_rows[j] = static_cast<const uint16_t*>(a.k_cache) + offset;
    v_rows[j] = static_cast<const uint16_t*>(a.v_cache) + offset;
  }
  if constexpr (D % 32 == 0) {
    pack_pair_keys<D>(k_rows, tile);
    pack_pair_values<D>(v_rows, tile);
    return true;
  }
  for (int j = 0; j < kPairTileKeys; ++j) {
    uint32_t words[D / 2];
    std::memcpy(words, k_rows[j], sizeof(words));
    for (int i = 0; i < D / 2; ++i) tile.keys[i][j] = words[i];
  }
  for (int m = 0; m < kPairTileKeys / 2; ++m) {
    const uint16_t* even = v_rows[2 * m];
    const uint16_t* odd = v_rows[2 * m + 1];
    for (int d = 0; d < D; ++d) tile.values[m][d] = uint32_t(even[d]) | (uint32_t(odd[d]) << 16);
  }
  return true;
}

template <int G, int D>
struct PairQueryState {
  alignas(64) uint32_t query[G][D / 2];  // the query's own bf16 pairs (scaled in the scores)
  alignas(64) float acc[G][D];
  float max[G], sum[G];
};

inline __m512bh as_pairs(__m512i words) { return (__m512bh)words; }

// Scores of one query token's G heads against a tile, soft-capped where cap_base2 > 0, valid for
// the span's keys (-inf elsewhere). Only the first V vectors (V * 16 keys >= span.limit) are
// computed: on the causal diagonal and at a prompt's last tile the rest would be masked anyway.
template <int G, int D, int V>
inline void score_pairs(const PairQueryState<G, D>& q, const PairTile<D>& tile, Span span, float scale,
                        float cap_base2, Lanes (&scores)[G][kScoreVectors]) {
  __m512 partial[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) partial[g][v] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i)
    for (int v = 0; v < V; ++v) {
      const __m512bh keys = as_pairs(_mm512_load_si512(tile.keys[i] + v * kLanes));
      for (int g = 0; g < G; ++g)
        partial[g][v] = _mm512_dpbf16_ps(partial[g][v], as_pairs(_mm512_set1_epi32(int(q.query[g][i]))), keys);
    }
  const Lanes minus_inf = Lanes{} + kMinusInf;
  for (int v = 0; v < V; ++v) {
    const auto visible = in_span(span, v * kLanes);
    for (int g = 0; g < G; ++g) {
      Lanes raw = (Lanes)partial[g][v] * scale;
      if (cap_base2 > 0.0f) raw = soft_cap_lanes(raw, cap_base2);
      scores[g][v] = visible ? raw : minus_inf;
    }
  }
}

// The online softmax step of one score row over a tile's first V vectors: the weights against
// the new running max, rounded to bf16 into `weights` (V * 16 of them), and the running max and
// sum of the rounded weights moved on. Returns the factor that what was accumulated against the
// old max must be scaled by.
template <int V>
inline float softmax_step(const Lanes* scores, float& max, float& sum, uint16_t* weights) {
  Lanes tile_max = scores[0];
  for (int v = 1; v < V; ++v) tile_max = max_each(tile_max, scores[v]);
  const float new_max = std::max(max, max_of(tile_max));
  const float rescale = exp2_nonpositive(max - new_max);
  Lanes rounded_sum = Lanes{};
  for (int v = 0; v < V; ++v) {
    const __m256bh rounded = _mm512_cvtneps_pbh((__m512)exp2_lanes(scores[v] - new_max));
    rounded_sum += (Lanes)_mm512_cvtpbh_ps(rounded);
    std::memcpy(weights + v * kLanes, &rounded, sizeof(rounded));
  }
  max = new_max;
  sum = sum * rescale + sum_of(rounded_sum);
  return rescale;
}

template <int G, int D, int V>
inline void accumulate_pairs(PairQueryState<G, D>& q, const PairTile<D>& tile, Span span,
                             const Lanes (&scores)[G][kScoreVectors]) {
  constexpr int NC = D / kLanes;
  alignas(64) uint32_t weights[G][kPairTileKeys / 2];  // bf16 weights, a pair of keys per word
  float rescale[G];
  for (int g = 0; g < G; ++g)
    rescale[g] = softmax_step<V>(scores[g], q.max[g], q.sum[g], reinterpret_cast<uint16_t*>(weights[g]));
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(_mm512_load_ps(q.acc[g] + c * kLanes), _mm512_set1_ps(rescale[g]));
  for (int m = span.low / 2; m < (span.limit + 1) / 2; ++m)
    for (int c = 0; c < NC; ++c) {
      const __m512bh values = as_pairs(_mm512_load_si512(tile.values[m] + c * kLanes));
      for (int g = 0; g < G; ++g)
        acc[g][c] = _mm512_dpbf16_ps(acc[g][c], as_pairs(_mm512_set1_epi32(int(weights[g][m]))), values);
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_store_ps(q.acc[g] + c * kLanes, acc[g][c]);
}

template <int G, int D, int V>
inline void attend_tile_vectors(PairQueryState<G, D>& q, const PairTile<D>& tile, Span span, float scale,
                                float cap_base2) {
  Lanes scores[G][kScoreVectors];
  score_pairs<G, D, V>(q, tile, span, scale, cap_base2, scores);
  accumulate_pairs<G, D, V>(q, tile, span, scores);
}

// One query token against the span's keys of a tile, in as many score vectors as cover them.
template <int G, int D>
inline void attend_tile(PairQueryState<G, D>& q, const PairTile<D>& tile, Span span, float scale,
                        float cap_base2) {
  static_assert(kScoreVectors == 4, "one case per live vector count");
  switch ((span.limit + kLanes - 1) / kLanes) {
    case 1: return attend_tile_vectors<G, D, 1>(q, tile, span, scale, cap_base2);
    case 2: return attend_tile_vectors<G, D, 2>(q, tile, span, scale, cap_base2);
    case 3: return attend_tile_vectors<G, D, 3>(q, tile, span, scale, cap_base2);
    default: return attend_tile_vectors<G, D, 4>(q, tile, span, scale, cap_base2);
  }
}

template <int G, int D>
bool attend_item_pairs(const PagedPrefillArgs& a, const Item& item, PairTile<D>& tile, PairQueryState<G, D>* states) {
  const int64_t context = a.seq_lens[item.seq] - a.query_lens[item.seq];
  const int num_queries = int(std::min<int64_t>(kQueryBlock, a.query_lens[item.seq] - item.first_query));
  const int64_t first_position = context + item.first_query;
  const int64_t first_token = a.token_starts[item.seq] + item.first_query;
  const uint16_t* query = static_cast<const uint16_t*>(a.query);
  for (int i = 0; i < num_queries; ++i)
    for (int g = 0; g < G; ++g) {
      const uint16_t* src = query + (first_token + i) * a.query_token_stride + (item.kv_head * G + g) * a.query_head_stride;
      std::memcpy(states[i].query[g], src, D * sizeof(uint16_t));
      std::fill(states[i].acc[g], states[i].acc[g] + D, 0.0f);
      states[i].max[g] = kMinusInf;
      states[i].sum[g] = 0.0f;
    }
  const float scale = a.scale * kLog2e;
  const float cap_base2 = a.soft_cap * kLog2e;
  for (int64_t first_key = item.first_key; first_key <= item.last_key; first_key += kPairTileKeys) {
    const int count = int(std::min<int64_t>(kPairTileKeys, item.last_key + 1 - first_key));
    if (!load_pair_tile<D>(a, item.seq, item.kv_head, first_key, count, tile)) return false;
    for (int i = 0; i < num_queries; ++i) {
      const Span span = visible_span(a, first_position + i, first_key, count);
      if (!span.empty()) attend_tile(states[i], tile, span, scale, cap_base2);
    }
  }
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int i = 0; i < num_queries; ++i)
    for (int g = 0; g < G; ++g) {
      const float inv_sum = 1.0f / states[i].sum[g];
      uint16_t* dst = out + (first_token + i) * a.out_token_stride + (item.kv_head * G + g) * a.out_head_stride;
      for (int d = 0; d < D; ++d) narrow(states[i].acc[g][d] * inv_sum, dst + d);
    }
  return true;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX, head_dim 64: a tile's two products, S = Q K^T and O += P V, as tile matmuls (a
// tdpbf16ps does 16 x 16 x 32 multiply-adds, 8x a row of vdpbf16ps), with the online softmax
// between them on AVX-512 rows. The item's rows are its (query, head) pairs, row i * G + g; the
// weights are rounded to bf16 and the normalizer sums the rounded weights, as in the pairs form.
// Tiles: C 0-3 (S or O, 16 rows x 16 fp32), A 4 (Q or P, 16 rows x 32 bf16), B 5 (K or V pairs).
constexpr int kAmxDim = 64;

template <int G>
struct AmxRows {
  static constexpr int kRows = kQueryBlock * G;  // a multiple of 16
  alignas(64) uint16_t query[kRows][kAmxDim];
  alignas(64) float scores[kRows][kPairTileKeys];
  alignas(64) uint16_t weights[kRows][kPairTileKeys];
  alignas(64) float out[kRows][kAmxDim];
  float max[kRows], sum[kRows];
};

constexpr int kKeyWordsStride = kPairTileKeys * 4;  // bytes per row of PairTile::keys
constexpr int kValueWordsStride = kAmxDim * 4;  // bytes per row of PairTile::values

// S rows 16 * m_tile .. + 16 against the tile's first key_tiles * 16 keys.
#define KVRELAY_SCORE_KEYS(T)                                                          \
  if (key_tiles > T) {                                                                 \
    _tile_loadd(5, &tile.keys[chunk * 16][T * 16], kKeyWordsStride);                  \
    _tile_dpbf16ps(T, 4, 5);                                                           \
  }
#define KVRELAY_STORE_SCORES(T) \
  if (key_tiles > T) _tile_stored(T, &rows.scores[16 * m_tile][T * 16], kPairTileKeys * 4);

template <int G>
void score_tiles(AmxRows<G>& rows, const PairTile<kAmxDim>& tile, int m_tile, int key_tiles) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int chunk = 0; chunk < kAmxDim / 32; ++chunk) {
    _tile_loadd(4, &rows.query[16 * m_tile][chunk * 32], kAmxDim * 2);
    KVRELAY_SCORE_KEYS(0)
    KVRELAY_SCORE_KEYS(1)
    KVRELAY_SCORE_KEYS(2)
    KVRELAY_SCORE_KEYS(3)
  }
  KVRELAY_STORE_SCORES(0)
  KVRELAY_STORE_SCORES(1)
  KVRELAY_STORE_SCORES(2)
  KVRELAY_STORE_SCORES(3)
}

// O rows 16 * m_tile .. + 16 plus their weights times the first key_chunks * 32 keys' values.
#define KVRELAY_WEIGH_VALUES(T)                                                   \
  _tile_loadd(5, &tile.values[chunk * 16][T * 16], kValueWordsStride);           \
  _tile_dpbf16ps(T, 4, 5);

template <int G>
void value_tiles(AmxRows<G>& rows, const PairTile<kAmxDim>& tile, int m_tile, int key_chunks) {
  float* out = &rows.out[16 * m_tile][0];
  _tile_loadd(0, out, kAmxDim * 4);
  _tile_loadd(1, out + 16, kAmxDim * 4);
  _tile_loadd(2, out + 32, kAmxDim * 4);
  _tile_loadd(3, out + 48, kAmxDim * 4);
  for (int chunk = 0; chunk < key_chunks; ++chunk) {
    _tile_loadd(4, &rows.weights[16 * m_tile][chunk * 32], kPairTileKeys * 2);
    KVRELAY_WEIGH_VALUES(0)
    KVRELAY_WEIGH_VALUES(1)
    KVRELAY_WEIGH_VALUES(2)
    KVRELAY_WEIGH_VALUES(3)
  }
  _tile_stored(0, out, kAmxDim * 4);
  _tile_stored(1, out + 16, kAmxDim * 4);
  _tile_stored(2, out + 32, kAmxDim * 4);
  _tile_stored(3, out + 48, kAmxDim * 4);
}
#undef KVRELAY_SCORE_KEYS
#undef KVRELAY_STORE_SCORES
#undef KVRELAY_WEIGH_VALUES

// One row's online softmax step over a tile's scores, soft-capped where cap_base2 > 0: the
// span's keys are visible (none where it is empty: its weights are zeros and its state stays).
template <int G>
void softmax_row(AmxRows<G>& rows, int row, Span span, float scale, float cap_base2) {
  uint16_t* weights = rows.weights[row];
  if (span.empty()) {
    std::memset(weights, 0, sizeof(rows.weights[row]));
    return;
  }
  const Lanes minus_inf = Lanes{} + kMinusInf;
  Lanes scores[kScoreVectors];
  for (int v = 0; v < kScoreVectors; ++v) {
    Lanes raw = load_lanes(rows.scores[row] + v * kLanes) * scale;
    if (cap_base2 > 0.0f) raw = soft_cap_lanes(raw, cap_base2);
    scores[v] = in_span(span, v * kLanes) ? raw : minus_inf;
  }
  const float rescale = softmax_step<kScoreVectors>(scores, rows.max[row], rows.sum[row], weights);
  if (rescale != 1.0f)
    for (int c = 0; c < kAmxDim; c += kLanes) store_lanes(load_lanes(rows.out[row] + c) * rescale, rows.out[row] + c);
}

template <int G>
void start_rows(const PagedPrefillArgs& a, const Item& item, int64_t first_token, int live_rows, AmxRows<G>& rows) {
  const uint16_t* query = static_cast<const uint16_t*>(a.query);
  // Only the live rows' 16-row tiles are ever read: a short item (a verify step's run of 5
  // queries) need not clear the other ~80 rows' 384 bytes each.
  const int used_rows = (live_rows + 15) / 16 * 16;
  for (int row = 0; row < used_rows; ++row) {
    if (row < live_rows) {
      const uint16_t* src = query + (first_token + row / G) * a.query_token_stride +
                            (item.kv_head * G + row % G) * a.query_head_stride;
      std::memcpy(rows.query[row], src, sizeof(rows.query[row]));
    } else {
      std::memset(rows.query[row], 0, sizeof(rows.query[row]));
    }
    std::fill(rows.out[row], rows.out[row] + kAmxDim, 0.0f);
    rows.max[row] = kMinusInf;
    rows.sum[row] = 0.0f;
  }
}

template <int G>
void finish_rows(const PagedPrefillArgs& a, const Item& item, int64_t first_token, int live_rows, const AmxRows<G>& rows) {
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int row = 0; row < live_rows; ++row) {
    const float inv_sum = 1.0f / rows.sum[row];
    uint16_t* dst = out + (first_token + row / G) * a.out_token_stride + (item.kv_head * G + row % G) * a.out_head_stride;
    for (int d = 0; d < kAmxDim; ++d) narrow(rows.out[row][d] * inv_sum, dst + d);
  }
}

template <int G>
bool attend_item_amx(const PagedPrefillArgs& a, const Item& item, PairTile<kAmxDim>& tile, AmxRows<G>* state) {
  AmxRows<G>& rows = *state;
  const int64_t context = a.seq_lens[item.seq] - a.query_lens[item.seq];
  const int num_queries = int(std::min<int64_t>(kQueryBlock, a.query_lens[item.seq] - item.first_query));
  const int64_t first_position = context + item.first_query;
  const int64_t first_token = a.token_starts[item.seq] + item.first_query;
  const int live_rows = num_queries * G;
  const int live_m_tiles = (live_rows + 15) / 16;
  start_rows<G>(a, item, first_token, live_rows, rows);
  const float scale = a.scale * kLog2e;
  const float cap_base2 = a.soft_cap * kLog2e;
  configure_full_tiles();
  bool ok = true;
  for (int64_t first_key = item.first_key; first_key <= item.last_key; first_key += kPairTileKeys) {
    const int count = int(std::min<int64_t>(kPairTileKeys, item.last_key + 1 - first_key));
    if (!load_pair_tile<kAmxDim>(a, item.seq, item.kv_head, first_key, count, tile)) {
      ok = false;
      break;
    }
    const int key_tiles = (count + 15) / 16;
    // The last live query sees the most keys of this tile; pairs past them weigh 0.
    const int64_t widest = std::min<int64_t>(count, first_position + num_queries - first_key);
    const int key_chunks = int((widest + 31) / 32);
    // Rows whose queries see none of this tile's keys would get zero weights: their 16-row
    // tiles are skipped whole, and those before the first seeing one are exactly those.
    int first_m_tile = 0;
    while (first_m_tile < live_m_tiles &&
           first_position + std::min(16 * first_m_tile + 15, live_rows - 1) / G + 1 - first_key <= 0)
      ++first_m_tile;
    // Each phase for every 16-row tile before the next phase: a tile load of rows that vector
    // code has just stored waits for those stores to drain (measured: a fifth of this kernel's
    // time at the first product after each load), and the other tiles' work covers that wait.
    for (int m_tile = first_m_tile; m_tile < live_m_tiles; ++m_tile) score_tiles<G>(rows, tile, m_tile, key_tiles);
    for (int row = 16 * first_m_tile; row < live_rows; ++row)
      softmax_row<G>(rows, row, visible_span(a, first_position + row / G, first_key, count), scale, cap_base2);
    for (int m_tile = first_m_tile; m_tile < live_m_tiles; ++m_tile) value_tiles<G>(rows, tile, m_tile, key_chunks);
  }
  _tile_release();
  if (ok) finish_rows<G>(a, item, first_token, live_rows, rows);
  return ok;
}

// KVRELAY_PREFILL_AMX=0 runs the AVX512-BF16 pairs form instead (the tests check both); read
// per call, so a process can switch.
inline bool amx_prefill_enabled() {
  const char* value = std::getenv("KVRELAY_PREFILL_AMX");
  return amx_permitted() && (value == nullptr || std::strcmp(value, "0") != 0);
}

template <int G>
bool attend_all_amx(const PagedPrefillArgs& a, int num_threads) {
  return run_items<PairTile<kAmxDim>, AmxRows<G>, 1>(a, num_threads, attend_item_amx<G>);
}
#endif  // __AMX_TILE__ && __AMX_BF16__

template <int G, int D>
bool attend_all_pairs(const PagedPrefillArgs& a, int num_threads) {
  return run_items<PairTile<D>, PairQueryState<G, D>>(a, num_threads, attend_item_pairs<G, D>);
}
#endif  // __AVX512BF16__

// The bf16 forms read bf16 queries from a bf16 cache; every other pair of dtypes (8-bit codes
// included) takes the fp32 form.
template <int G, int D, typename T, typename KT>
bool attend_all_best(const PagedPrefillArgs& a, int num_threads) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t> && std::is_same_v<KT, uint16_t>;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (kBf16 && D == kAmxDim)
    if (amx_prefill_enabled()) return attend_all_amx<G>(a, num_threads);
#endif
#if defined(__AVX512BF16__)
  if constexpr (kBf16) return attend_all_pairs<G, D>(a, num_threads);
#endif
  return attend_all<G, D, T, KT>(a, num_threads);
}

template <typename T, typename KT, int D>
bool for_group(const PagedPrefillArgs& a, int num_threads) {
  switch (a.group_size) {
    case 1: return attend_all_best<1, D, T, KT>(a, num_threads);
    case 2: return attend_all_best<2, D, T, KT>(a, num_threads);
    case 3: return attend_all_best<3, D, T, KT>(a, num_threads);
    case 4: return attend_all_best<4, D, T, KT>(a, num_threads);
    case 6: return attend_all_best<6, D, T, KT>(a, num_threads);
    case 8: return attend_all_best<8, D, T, KT>(a, num_threads);
    default: return false;
  }
}

template <typename T, typename KT>
bool for_head_dim(const PagedPrefillArgs& a, int num_threads) {
  if (a.head_dim == 64) return for_group<T, KT, 64>(a, num_threads);
  return for_group<T, KT, 128>(a, num_threads);
}

// A float cache has the queries' dtype (the binding checks); 8-bit codes go with either.
template <typename T>
bool for_cache(const PagedPrefillArgs& a, int num_threads) {
  return with_cache_element(a.cache_dtype, [&](auto element) {
    using KT = decltype(element);
    if constexpr (!kCoded<KT> && !std::is_same_v<KT, T>) return false;  // never reached
    else return for_head_dim<T, KT>(a, num_threads);
  });
}

}  // namespace

bool paged_prefill_supported(int64_t head_dim, int64_t group_size) {
  const bool group_ok = group_size == 1 || group_size == 2 || group_size == 3 || group_size == 4 ||
                        group_size == 6 || group_size == 8;
  return (head_dim == 64 || head_dim == 128) && group_ok;
}

bool paged_prefill_attention(const PagedPrefillArgs& args, int num_threads) {
  if (args.query_dtype == Dtype::kFloat32) return for_cache<float>(args, num_threads);
  return for_cache<uint16_t>(args, num_threads);
}

}  // namespace kvrelay
