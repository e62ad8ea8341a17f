// Causal prefill attention on CPU straight from the paged KV cache, free of torch headers: the
// binding (paged_decode_binding.cpp) checks the tensors and fills PagedPrefillArgs;
// paged_prefill.cpp computes.
#pragma once

#include <cstdint>

#include "paged_decode.h"

namespace kvrelay {

struct PagedPrefillArgs : PagedAttentionArgs {
  // Per sequence: its queries are rows token_starts[s] .. + query_lens[s] of the flat batch and
  // the last query_lens[s] of its seq_lens[s] keys (the keys before them are its context).
  const int64_t* token_starts;  // [seqs]
  const int32_t* query_lens;  // [seqs], >= 1
  const int32_t* seq_lens;  // [seqs], >= query_lens and within the block table
  const int32_t* block_tables;  // [seqs, block_table_stride]
  int64_t block_table_stride, seqs;
};

// True where this kernel takes the shape (head_dim 64 or 128, a GQA group of 1-8 q heads).
bool paged_prefill_supported(int64_t head_dim, int64_t group_size);

// Writes out rows of every sequence's queries, query j attending to keys 0 .. context + j.
// Returns false when a block table entry among a sequence's keys lies outside the cache.
bool paged_prefill_attention(const PagedPrefillArgs& args, int num_threads);

}  // namespace kvrelay
