// Causal prefill attention on CPU straight from the paged KV cache, free of torch headers: the
// binding (paged_decode_binding.cpp) checks the tensors and fills PagedPrefillArgs;
// paged_prefill.cpp computes.
#pragma once

#include <cstdint>

#include "paged_decode.h"

namespace kvrelay {

struct PagedPrefillArgs {
  const void* query;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous
  int64_t query_token_stride, query_head_stride;
  void* out;  // [num_tokens, num_q_heads, head_dim], head_dim contiguous, the query's dtype
  int64_t out_token_stride, out_head_stride;
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const void* v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group_size;
  // Per sequence: its queries are rows token_starts[s] .. + query_lens[s] of the flat batch and
  // the last query_lens[s] of its seq_lens[s] keys (the keys before them are its context).
  const int64_t* token_starts;  // [seqs]
  const int32_t* query_lens;  // [seqs], >= 1
  const int32_t* seq_lens;  // [seqs], >= query_lens and within the block table
  const int32_t* block_tables;  // [seqs, block_table_stride]
  int64_t block_table_stride, seqs;
  float scale;
  Dtype query_dtype, cache_dtype;
};

// True where this kernel takes the shape (head_dim 64 or 128, a GQA group of 1-8 q heads).
bool paged_prefill_supported(int64_t head_dim, int64_t group_size);

// Writes out rows of every sequence's queries, query j attending to keys 0 .. context + j.
// Returns false when a block table entry among a sequence's keys lies outside the cache.
bool paged_prefill_attention(const PagedPrefillArgs& args, int num_threads);

}  // namespace kvrelay
