// Decode attention (one query token per row) read straight from the paged KV cache through the
// block table, with an online softmax in fp32, one OpenMP work item per (row, kv head).
//
// A work item owns the q heads of its kv head's GQA group, so each K/V row leaves memory once
// for all of them. Keys go by tiles of kLanes rows (crossing block boundaries as needed): the
// tile's scores fill one vector, and the accumulators are rescaled once per tile.
#include "paged_decode.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fp32_lanes.h"
#include "kv_codes.h"

namespace kvrelay {
namespace {

constexpr float kLog2e = 1.4426950408889634f;  // scores in base 2: the softmax needs only exp2
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Per-thread working set, allocated once per call.
struct Scratch {
  std::vector<float> query;  // [group_size, head_dim], times scale * log2(e)
  std::vector<float> acc;  // [group_size, head_dim], unnormalized output
  std::vector<float> probs;  // [group_size, kLanes], the tile's scores, then its weights
  std::vector<float> max, sum;  // [group_size], running max and weight sum (base 2)
  std::vector<float> rows;  // [kLanes, head_dim], the tile's K or V rows widened to fp32

  explicit Scratch(const PagedDecodeArgs& a)
      : query(a.group_size * a.head_dim), acc(a.group_size * a.head_dim), probs(a.group_size * kLanes),
        max(a.group_size), sum(a.group_size), rows(kLanes * a.head_dim) {}
};

// fp32 rows are read in place; bf16 rows are widened once into `buffer`, for every q head.
inline const float* row_as_float(const float* row, float*, int64_t) { return row; }
inline const float* row_as_float(const uint16_t* row, float* buffer, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; ++d) buffer[d] = widen(row[d]);
  return buffer;
}
template <typename KT, std::enable_if_t<kCoded<KT>, int> = 0>
inline const float* row_as_float(const KT* row, float* buffer, int64_t head_dim) {
  const float scale = row_scale(row, head_dim);
  for (int64_t d = 0; d < head_dim; ++d) buffer[d] = decode(row[d]) * scale;
  return buffer;
}

// `rotated`: the cache holds 8-bit rows of rotated K and V (kv_codes.h), so the query is
// rotated too.
template <typename QT>
void start_item(const PagedDecodeArgs& a, const QT* query, bool rotated, Scratch& s) {
  const float query_scale = a.scale * kLog2e;
  for (int64_t g = 0; g < a.group_size; ++g) {
    const QT* src = query + g * a.query_head_stride;
    float* dst = s.query.data() + g * a.head_dim;
    for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = widen(src[d]) * query_scale;
    if (rotated) rotate(dst, a.head_dim);
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.max.begin(), s.max.end(), kMinusInf);
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
}

// Up to kLanes keys of one row, possibly from several blocks.
struct Tile {
  int count = 0;
  int64_t offsets[kLanes];  // cache element index of each key's row for this kv head
};

// Walks a row's keys block by block without a division per key, from key `pos` (in block
// table entry block_index, at `offset`): entries before it are never looked up.
struct KeyCursor {
  const int32_t* block_table;
  int64_t seq_len, pos = 0, block_index = 0, offset = 0;
};

// The next keys (none once seq_len is reached: slots past it are never read). False on a
// block id outside the cache.
bool next_tile(const PagedDecodeArgs& a, int64_t kv_head, KeyCursor& c, Tile& tile) {
  tile.count = int(std::min<int64_t>(kLanes, c.seq_len - c.pos));
  int64_t block = tile.count > 0 ? c.block_table[c.block_index] : 0;
  for (int j = 0; j < tile.count; ++j) {
    if (block < 0 || block >= a.num_blocks) return false;
    tile.offsets[j] = ((block * a.block_size + c.offset) * a.num_kv_heads + kv_head) * a.row_stride;
    if (++c.offset == a.block_size && c.pos + j + 1 < c.seq_len) {
      c.offset = 0;
      block = c.block_table[++c.block_index];
    }
  }
  c.pos += tile.count;
  return true;
}

// Asks for a tile's K and V rows while the previous tile computes: blocks lie scattered in
// memory, so the hardware prefetcher cannot guess where the next one starts.
template <typename KT>
void prefetch_tile(const PagedDecodeArgs& a, const Tile& tile) {
  constexpr int64_t kLineElements = 64 / sizeof(KT);
  for (int j = 0; j < tile.count; ++j)
    for (int64_t d = 0; d < a.row_stride; d += kLineElements) {
      __builtin_prefetch(static_cast<const KT*>(a.k_cache) + tile.offsets[j] + d);
      __builtin_prefetch(static_cast<const KT*>(a.v_cache) + tile.offsets[j] + d);
    }
}

template <typename KT>
void score_tile(const PagedDecodeArgs& a, const Tile& tile, Scratch& s) {
  const int count = tile.count;
  const KT* k_cache = static_cast<const KT*>(a.k_cache);
  const float* keys[kLanes];
  for (int j = 0; j < count; ++j)
    keys[j] = row_as_float(k_cache + tile.offsets[j], s.rows.data() + j * a.head_dim, a.head_dim);
  for (int64_t g = 0; g < a.group_size; ++g) {
    const float* query = s.query.data() + g * a.head_dim;
    float* scores = s.probs.data() + g * kLanes;
    Lanes partial[kLanes] = {};
    for (int j = 0; j < count; ++j) partial[j] = dot_lanes(query, keys[j], a.head_dim);
    store_lanes(sum_each(partial), scores);
    if (a.head_dim % kLanes != 0)
      for (int j = 0; j < count; ++j) scores[j] += dot_tail(query, keys[j], a.head_dim);
    if (a.soft_cap > 0.0f) store_lanes(soft_cap_lanes(load_lanes(scores), a.soft_cap * kLog2e), scores);
    for (int j = count; j < kLanes; ++j) scores[j] = kMinusInf;  // weighs exactly 0
  }
}

// Online softmax step: scores become weights against the new running max, and what was
// accumulated against the old max is scaled down to match.
void softmax_tile(const PagedDecodeArgs& a, Scratch& s) {
  for (int64_t g = 0; g < a.group_size; ++g) {
    float* probs = s.probs.data() + g * kLanes;
    float lanes[kLanes];
    std::copy(probs, probs + kLanes, lanes);
    const float new_max = std::max(s.max[g], max_lanes(lanes));
    const float rescale = exp2_nonpositive(s.max[g] - new_max);
    for (int l = 0; l < kLanes; ++l) lanes[l] = probs[l] = exp2_nonpositive(probs[l] - new_max);
    s.max[g] = new_max;
    s.sum[g] = s.sum[g] * rescale + sum_lanes(lanes);
    if (rescale != 1.0f) {
      float* acc = s.acc.data() + g * a.head_dim;
      for (int64_t d = 0; d < a.head_dim; ++d) acc[d] *= rescale;
    }
  }
}

// acc[g] += sum_j probs[g, j] * V[j]. Each 16-dim slice of acc stays in a register over the
// whole tile instead of making a store/load round trip per key.
void weigh_values(const PagedDecodeArgs& a, const float* const* values, int count, Scratch& s) {
  for (int64_t g = 0; g < a.group_size; ++g) {
    const float* probs = s.probs.data() + g * kLanes;
    float* acc = s.acc.data() + g * a.head_dim;
    int64_t d = 0;
    for (; d + kLanes <= a.head_dim; d += kLanes) {
      Lanes sum = load_lanes(acc + d);
      for (int j = 0; j < count; ++j) sum += probs[j] * load_lanes(values[j] + d);
      store_lanes(sum, acc + d);
    }
    for (; d < a.head_dim; ++d)
      for (int j = 0; j < count; ++j) acc[d] += probs[j] * values[j][d];
  }
}

template <typename KT>
void accumulate_tile(const PagedDecodeArgs& a, const Tile& tile, Scratch& s) {
  const KT* v_cache = static_cast<const KT*>(a.v_cache);
  const float* values[kLanes];
  for (int j = 0; j < tile.count; ++j)
    values[j] = row_as_float(v_cache + tile.offsets[j], s.rows.data() + j * a.head_dim, a.head_dim);
  weigh_values(a, values, tile.count, s);
}

// `rotated`: the values were rotated rows, so the output is rotated back.
template <typename QT>
void finish_item(const PagedDecodeArgs& a, QT* out, bool rotated, Scratch& s) {
  for (int64_t g = 0; g < a.group_size; ++g) {
    const float inv_sum = 1.0f / s.sum[g];
    float* acc = s.acc.data() + g * a.head_dim;
    for (int64_t d = 0; d < a.head_dim; ++d) acc[d] *= inv_sum;
    if (rotated) rotate(acc, a.head_dim);
    QT* dst = out + g * a.out_head_stride;
    for (int64_t d = 0; d < a.head_dim; ++d) narrow(acc[d], dst + d);
  }
}

// One decode row's q heads that share kv_head. False on a bad block id.
template <typename QT, typename KT>
bool attend_item(const PagedDecodeArgs& a, int64_t row, int64_t kv_head, Scratch& s) {
  const int64_t token = a.token_ids[row];
  const int64_t first_q_head = kv_head * a.group_size;
  const QT* query = static_cast<const QT*>(a.query) + token * a.query_token_stride;
  start_item(a, query + first_q_head * a.query_head_stride, kCoded<KT>, s);
  const int64_t first_key = first_visible_key(a.seq_lens[row] - 1, a.window);
  KeyCursor cursor{a.block_tables + row * a.block_table_stride, a.seq_lens[row], first_key,
                   first_key / a.block_size, first_key % a.block_size};
  Tile tiles[2];
  if (!next_tile(a, kv_head, cursor, tiles[0])) return false;
  for (int t = 0; tiles[t].count > 0; t ^= 1) {
    if (!next_tile(a, kv_head, cursor, tiles[t ^ 1])) return false;
    prefetch_tile<KT>(a, tiles[t ^ 1]);
    score_tile<KT>(a, tiles[t], s);
    softmax_tile(a, s);
    accumulate_tile<KT>(a, tiles[t], s);
  }
  QT* out = static_cast<QT*>(a.out) + token * a.out_token_stride;
  finish_item(a, out + first_q_head * a.out_head_stride, kCoded<KT>, s);
  return true;
}

// ---- Fixed shapes: head_dim and group size known at compile time. ----
// The item's accumulators (group_size x head_dim fp32) live in registers for the whole row;
// each K/V row is loaded (and widened) once and used for all q heads; a tile's 16 scores are
// reduced into one vector with sum_each, exponentiated in one vector pass, and the
// accumulators are rescaled once per tile.
// A K or V row as NC fp32 vectors. fp32 rows are read as they are. A bf16 row is read 32
// elements (one vector of 32-bit words) at a time and split with a shift and a mask into its
// even elements then its odd ones, each widened: no cross-lane shuffle, which would compete with
// the score reductions for the one shuffle port. Query and output use the same dim order.
template <int NC>
inline void load_row(const float* src, Lanes (&row)[NC]) {
  for (int c = 0; c < NC; ++c) row[c] = load_lanes(src + c * kLanes);
}
template <int NC>
inline void load_row(const uint16_t* src, Lanes (&row)[NC]) {
  static_assert(NC % 2 == 0, "bf16 rows go by 32 elements");
  for (int c = 0; c < NC; c += 2) {
    Words pairs;
    std::memcpy(&pairs, src + c * kLanes, sizeof(pairs));
    row[c] = (Lanes)(pairs << 16);
    row[c + 1] = (Lanes)(pairs & 0xffff0000u);
  }
}
// An 8-bit row: its codes 16 at a time, each vector times the row's scale.
template <int NC, typename KT, std::enable_if_t<kCoded<KT>, int> = 0>
inline void load_row(const KT* src, Lanes (&row)[NC]) {
  const float scale = row_scale(src, NC * kLanes);
  for (int c = 0; c < NC; ++c) row[c] = decode_lanes(src + c * kLanes) * scale;
}
// Position in that order of dim d: identity for fp32 and 8-bit rows, even/odd split per 32 for
// bf16.
template <typename KT>
inline int lane_order(int d) {
  if constexpr (!std::is_same_v<KT, uint16_t>) return d;
  return d / (2 * kLanes) * (2 * kLanes) + d % 2 * kLanes + d % (2 * kLanes) / 2;
}

// Items a thread takes at a time: a row's kv heads together where there are rows enough to share
// out. The kv heads of a key sit side by side in memory, and a core fetching one head's lines
// pulls its neighbours' into its own cache too (measured 10-20% faster on 2 threads).
inline int64_t items_per_grab(const PagedDecodeArgs& a, int num_threads) {
  return a.rows >= 4 * num_threads ? a.num_kv_heads : 1;
}

// One part of a row's keys (see key_parts below): its online-softmax state, unnormalized, in the
// kernel's lane order. A part that saw no key has max -inf and sum 0.
template <int G, int D>
struct PartState {
  float acc[G][D];
  float max[G], sum[G];
};

// acc / sum of each q head in natural dim order, narrowed into the row's output.
template <int G, int D, typename QT, typename KT>
void write_heads(const PagedDecodeArgs& a, int64_t row, int64_t kv_head, const float (&acc)[G][D],
                 const float (&sum)[G]) {
  QT* out = static_cast<QT*>(a.out) + a.token_ids[row] * a.out_token_stride + kv_head * G * a.out_head_stride;
  for (int g = 0; g < G; ++g) {
    const float inv_sum = 1.0f / sum[g];
    QT* dst = out + g * a.out_head_stride;
    if constexpr (kCoded<KT>) {  // rotated values: the output rotated back (lane order is dim order)
      float head[D];
      for (int d = 0; d < D; ++d) head[d] = acc[g][d] * inv_sum;
      rotate(head, D);
      for (int d = 0; d < D; ++d) narrow(head[d], dst + d);
    } else {
      for (int d = 0; d < D; ++d) narrow(acc[g][lane_order<KT>(d)] * inv_sum, dst + d);
    }
  }
}

// Weights are taken against a running max that may lag the true one by up to kRescaleSlack
// (base 2): a weight then reaches at most 2^kRescaleSlack, far inside fp32, and the softmax is
// the same function. Only a tile whose max moves past that slack rescales the accumulators.
// The exact online softmax paid a horizontal sum, a scalar exp2 and a rescale of every
// accumulator on every tile, one long dependent chain per q head that the kernel's time went
// to (perf: ~45% of its samples on rows hot in L2); most tiles now pay a max and the weights.
constexpr float kRescaleSlack = 8.0f;

// Keys [key_begin, key_end) of one (row, kv head). With `part` the unnormalized state goes
// there for merge_parts; without it the output is written.
template <int G, int D, typename QT, typename KT>
bool attend_keys_fixed(const PagedDecodeArgs& a, int64_t row, int64_t kv_head, int64_t key_begin,
                       int64_t key_end, PartState<G, D>* part) {
  constexpr int NC = D / kLanes;
  constexpr int kLinesPerRow = int((row_stride<KT>(D) * sizeof(KT) + 63) / 64);
  const QT* query = static_cast<const QT*>(a.query) + a.token_ids[row] * a.query_token_stride + kv_head * G * a.query_head_stride;
  const float query_scale = a.scale * kLog2e;
  Lanes q[G][NC];
  for (int g = 0; g < G; ++g) {
    alignas(64) float widened[D];
    for (int d = 0; d < D; ++d) widened[lane_order<KT>(d)] = widen(query[g * a.query_head_stride + d]) * query_scale;
    if constexpr (kCoded<KT>) rotate(widened, D);  // rotated K rows: the query rotated alike
    for (int c = 0; c < NC; ++c) q[g][c] = load_lanes(widened + c * kLanes);
  }
  Lanes acc[G][NC];
  Lanes sums[G];  // weight sums by lane, folded once at the end
  float max[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) acc[g][c] = Lanes{};
    sums[g] = Lanes{};
    max[g] = kMinusInf;
  }
  const KT* k_cache = static_cast<const KT*>(a.k_cache);
  const KT* v_cache = static_cast<const KT*>(a.v_cache);
  const Lanes lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Lanes minus_inf = Lanes{} + kMinusInf;
  const float cap_base2 = a.soft_cap * kLog2e;  // 0: no soft cap

  KeyCursor cursor{a.block_tables + row * a.block_table_stride, key_end, key_begin,
                   key_begin / a.block_size, key_begin % a.block_size};
  Tile tiles[2];
  if (!next_tile(a, kv_head, cursor, tiles[0])) return false;
  for (int t = 0; tiles[t].count > 0; t ^= 1) {
    const Tile& tile = tiles[t];
    if (!next_tile(a, kv_head, cursor, tiles[t ^ 1])) return false;
    const Tile& next = tiles[t ^ 1];
    const int count = tile.count;
    // The next tile's rows are asked for a key at a time, alongside this tile's: a burst of
    // them all at once would queue behind the core's few outstanding-miss slots.
    auto prefetch_row = [&](const KT* cache, int j) {
      if (j < next.count)
        for (int l = 0; l < kLinesPerRow; ++l)
          __builtin_prefetch(reinterpret_cast<const char*>(cache + next.offsets[j]) + 64 * l);
    };
    // Scores: per key, G vectors of partial dot products; sum_each folds 16 of them into one.
    Lanes partial[G][kLanes];
    for (int j = 0; j < count; ++j) {
      prefetch_row(k_cache, j);
      Lanes k[NC];
      load_row(k_cache + tile.offsets[j], k);
      for (int g = 0; g < G; ++g) {
        Lanes s = q[g][0] * k[0];
        for (int c = 1; c < NC; ++c) s += q[g][c] * k[c];
        partial[g][j] = s;
      }
    }
    for (int j = count; j < kLanes; ++j)
      for (int g = 0; g < G; ++g) partial[g][j] = Lanes{};
    alignas(64) float probs[G][kLanes];
    for (int g = 0; g < G; ++g) {
      Lanes scores = sum_each(partial[g]);
      if (cap_base2 > 0.0f) scores = soft_cap_lanes(scores, cap_base2);
      scores = lane_index < float(count) ? scores : minus_inf;  // padding lanes weigh exactly 0
      const float tile_max = max_of(scores);
      if (tile_max > max[g] + kRescaleSlack) {
        const float rescale = exp2_nonpositive(max[g] - tile_max);
        max[g] = tile_max;
        sums[g] *= rescale;
        for (int c = 0; c < NC; ++c) acc[g][c] *= rescale;
      }
      const Lanes weights = exp2_lanes(scores - max[g]);
      sums[g] += weights;
      store_lanes(weights, probs[g]);
    }
    for (int j = 0; j < count; ++j) {
      prefetch_row(v_cache, j);
      Lanes v[NC];
      load_row(v_cache + tile.offsets[j], v);
      for (int g = 0; g < G; ++g) {
        const float p = probs[g][j];
        for (int c = 0; c < NC; ++c) acc[g][c] += p * v[c];
      }
    }
  }
  PartState<G, D> local;
  PartState<G, D>& state = part != nullptr ? *part : local;
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) store_lanes(acc[g][c], state.acc[g] + c * kLanes);
    state.max[g] = max[g];
    state.sum[g] = sum_of(sums[g]);
  }
  if (part == nullptr) write_heads<G, D, QT, KT>(a, row, kv_head, state.acc, state.sum);
  return true;
}

// The keys a decode row sees: [first, end), its query being key end - 1.
struct KeyRange {
  int64_t first, end;
};
inline KeyRange visible_keys(const PagedDecodeArgs& a, int64_t row) {
  return {first_visible_key(a.seq_lens[row] - 1, a.window), a.seq_lens[row]};
}

template <int G, int D, typename QT, typename KT>
bool attend_item_fixed(const PagedDecodeArgs& a, int64_t row, int64_t kv_head) {
  const KeyRange keys = visible_keys(a, row);
  return attend_keys_fixed<G, D, QT, KT>(a, row, kv_head, keys.first, keys.end, nullptr);
}

// How a call's (row, kv head) items share the team. Where they are too few to share out evenly
// (one sequence's 3 kv heads on 2 threads: one thread did two, the other one and waited), each
// row's keys are cut into parts, attended apart and merged. The cut depends on the call's rows
// only, not on the thread count, so a row's output does not either. Only bf16 queries: the
// merge sums in another order, and an fp32 row stays what it is in any batch (speculation's
// exact float32 path relies on that). KVRELAY_DECODE_SPLIT=0 turns it off.
constexpr int64_t kMinItems = 8;      // items (parts included) enough to share out
constexpr int64_t kMinPartKeys = 64;  // fewer keys are not worth a part of their own

bool split_enabled() {
  const char* value = std::getenv("KVRELAY_DECODE_SPLIT");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// Parts per row: 1, or enough that the call has kMinItems items, none of the longest row's
// parts under kMinPartKeys keys.
template <typename QT>
int64_t key_parts(const PagedDecodeArgs& a) {
  const int64_t items = a.rows * a.num_kv_heads;
  if (!std::is_same_v<QT, uint16_t> || items >= kMinItems || !split_enabled()) return 1;
  int64_t longest = 0;
  for (int64_t row = 0; row < a.rows; ++row) {
    const KeyRange keys = visible_keys(a, row);
    longest = std::max<int64_t>(longest, keys.end - keys.first);
  }
  const int64_t wanted = (kMinItems + items - 1) / items;
  return std::max<int64_t>(1, std::min(wanted, longest / kMinPartKeys));
}

// Part p of P of a row's keys [first, end): from first + n p / P, with n = end - first.
inline int64_t part_edge(KeyRange keys, int64_t part, int64_t parts) {
  return keys.first + (keys.end - keys.first) * part / parts;
}

// The parts' states of one (row, kv head) as one softmax: each part's sums rescaled to the
// largest max, then the output written as an unsplit item writes it.
template <int G, int D, typename QT, typename KT>
void merge_parts(const PagedDecodeArgs& a, int64_t row, int64_t kv_head, const PartState<G, D>* parts,
                 int64_t count) {
  PartState<G, D> merged{};
  for (int g = 0; g < G; ++g) {
    float top = kMinusInf;
    for (int64_t p = 0; p < count; ++p) top = std::max(top, parts[p].max[g]);
    for (int64_t p = 0; p < count; ++p) {
      if (parts[p].sum[g] == 0.0f) continue;  // a part with no key
      const float weight = std::exp2(parts[p].max[g] - top);
      merged.sum[g] += weight * parts[p].sum[g];
      for (int d = 0; d < D; ++d) merged.acc[g][d] += weight * parts[p].acc[g][d];
    }
  }
  write_heads<G, D, QT, KT>(a, row, kv_head, merged.acc, merged.sum);
}

template <int G, int D, typename QT, typename KT>
bool run_fixed(const PagedDecodeArgs& a, int num_threads) {
  const int64_t items = a.rows * a.num_kv_heads;
  const int64_t parts = key_parts<QT>(a);
  const int64_t chunk = items_per_grab(a, num_threads);
  std::atomic<bool> ok{true};
  if (parts == 1) {
    // Dynamic scheduling: rows differ in length, and a thread that a busy machine deschedules
    // leaves its share to the others instead of holding up the whole step.
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, chunk)
    for (int64_t item = 0; item < items; ++item)
      if (!attend_item_fixed<G, D, QT, KT>(a, item / a.num_kv_heads, item % a.num_kv_heads))
        ok.store(false, std::memory_order_relaxed);
    return ok.load();
  }
  std::vector<PartState<G, D>> states(items * parts);  // [rows, kv heads, parts]
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items * parts; ++i) {
      const int64_t item = i / parts, part = i % parts, row = item / a.num_kv_heads;
      const KeyRange keys = visible_keys(a, row);
      if (!attend_keys_fixed<G, D, QT, KT>(a, row, item % a.num_kv_heads, part_edge(keys, part, parts),
                                           part_edge(keys, part + 1, parts), &states[i]))
        ok.store(false, std::memory_order_relaxed);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item)
      if (ok.load(std::memory_order_relaxed))
        merge_parts<G, D, QT, KT>(a, item / a.num_kv_heads, item % a.num_kv_heads, &states[item * parts], parts);
  }
  return ok.load();
}

template <typename QT, typename KT>
using FixedRun = bool (*)(const PagedDecodeArgs&, int);

template <typename QT, typename KT, int D>
FixedRun<QT, KT> fixed_for_group(int64_t group_size) {
  switch (group_size) {
    case 1: return run_fixed<1, D, QT, KT>;
    case 2: return run_fixed<2, D, QT, KT>;
    case 3: return run_fixed<3, D, QT, KT>;
    case 4: return run_fixed<4, D, QT, KT>;
    case 6: return run_fixed<6, D, QT, KT>;
    case 8: return run_fixed<8, D, QT, KT>;
    default: return nullptr;
  }
}

// The fixed-shape kernel for these args, or nullptr for the generic one.
template <typename QT, typename KT>
FixedRun<QT, KT> fixed_run(const PagedDecodeArgs& a) {
  if (a.head_dim == 64) return fixed_for_group<QT, KT, 64>(a.group_size);
  if (a.head_dim == 128) return fixed_for_group<QT, KT, 128>(a.group_size);
  return nullptr;
}

template <typename QT, typename KT>
bool attend_all(const PagedDecodeArgs& a, int num_threads) {
  if (const FixedRun<QT, KT> fixed = fixed_run<QT, KT>(a)) return fixed(a, num_threads);
  const int64_t items = a.rows * a.num_kv_heads;
  const int64_t chunk = items_per_grab(a, num_threads);
  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch(a);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < items; ++item)
      if (!attend_item<QT, KT>(a, item / a.num_kv_heads, item % a.num_kv_heads, scratch))
        ok.store(false, std::memory_order_relaxed);
  }
  return ok.load();
}

template <typename QT>
bool dispatch_cache(const PagedDecodeArgs& a, int num_threads) {
  return with_cache_element(a.cache_dtype, [&](auto element) {
    return attend_all<QT, decltype(element)>(a, num_threads);
  });
}

}  // namespace

bool paged_decode_attention(const PagedDecodeArgs& args, int num_threads) {
  if (args.query_dtype == Dtype::kFloat32) return dispatch_cache<float>(args, num_threads);
  return dispatch_cache<uint16_t>(args, num_threads);
}

}  // namespace kvrelay
