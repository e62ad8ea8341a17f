// Paged decode attention on CPU, free of torch headers: the binding (paged_decode_binding.cpp)
// checks the tensors and fills PagedDecodeArgs; paged_decode.cpp computes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvrelay {

// The cache's dtypes past kBFloat16 are 8-bit codes with a scale per row (kv_codes.h).
enum class Dtype { kFloat32, kBFloat16, kInt8, kFp8E4M3, kFp8E5M2 };

// What every paged attention kernel reads: the queries, where it writes, the caches.
struct PagedAttentionArgs {
  const void* query;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous
  int64_t query_token_stride, query_head_stride;
  void* out;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous, the query's dtype
  int64_t out_token_stride, out_head_stride;
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, row_stride] contiguous
  const void* v_cache;  // [num_blocks, block_size, num_kv_heads, row_stride] contiguous
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group_size;
  // Cache elements from one row (a token's kv head) to the next: head_dim, or for 8-bit codes
  // head_dim + 4 (the row's scale follows its codes).
  int64_t row_stride;
  float scale;
  Dtype query_dtype, cache_dtype;
  // Sliding window: the query at position i sees keys i - window < j <= i; 0 sees all j <= i.
  // No kernel looks up a block-table entry before a query's first visible key (a hybrid cache
  // frees those blocks and leaves stale ids there).
  int64_t window;
  // > 0: each score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) before the softmax.
  float soft_cap;
};

// The first key that a query at `position`, or any later one, sees.
inline int64_t first_visible_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

struct PagedDecodeArgs : PagedAttentionArgs {
  const int64_t* token_ids;  // [rows] row of the flat batch holding each decode query
  const int32_t* seq_lens;  // [rows] keys per row, >= 1 and within the block table
  const int32_t* block_tables;  // [rows, block_table_stride]
  int64_t block_table_stride, rows;
};

// Writes out[token_ids[r], :, :] for every row r (its query is the row's last key, at position
// seq_len - 1). Returns false when a block table entry among the keys a row sees lies outside the
// cache (that block is never read).
bool paged_decode_attention(const PagedDecodeArgs& args, int num_threads);

}  // namespace kvrelay
