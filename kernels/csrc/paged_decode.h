// Paged decode attention on CPU, free of torch headers: the binding (paged_decode_binding.cpp)
// checks the tensors and fills PagedDecodeArgs; paged_decode.cpp computes.
#pragma once

#include <cstdint>

namespace kvrelay {

enum class Dtype { kFloat32, kBFloat16 };

// What every paged attention kernel reads: the queries, where it writes, the caches.
struct PagedAttentionArgs {
  const void* query;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous
  int64_t query_token_stride, query_head_stride;
  void* out;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous, the query's dtype
  int64_t out_token_stride, out_head_stride;
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const void* v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group_size;
  float scale;
  Dtype query_dtype, cache_dtype;
};

struct PagedDecodeArgs : PagedAttentionArgs {
  const int64_t* token_ids;  // [rows] row of the flat batch holding each decode query
  const int32_t* seq_lens;  // [rows] keys per row, >= 1 and within the block table
  const int32_t* block_tables;  // [rows, block_table_stride]
  int64_t block_table_stride, rows;
};

// Writes out[token_ids[r], :, :] for every row r. Returns false when a block table entry in a
// row's first seq_len keys lies outside the cache (that block is never read).
bool paged_decode_attention(const PagedDecodeArgs& args, int num_threads);

}  // namespace kvrelay
