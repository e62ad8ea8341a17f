// Tensor entry points of the paged attention kernels: validate the tensors (a wrong shape, dtype
// or index would otherwise read out of bounds) and hand raw pointers to paged_decode.cpp and
// paged_prefill.cpp. The Python module is paged_attention_module.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>

#include "paged_attention_ops.h"
#include "paged_decode.h"
#include "paged_decode_runs.h"
#include "paged_prefill.h"

namespace {

kvrelay::Dtype dtype_of(const at::Tensor& tensor, const char* name) {
  if (tensor.scalar_type() == at::kFloat) return kvrelay::Dtype::kFloat32;
  TORCH_CHECK(tensor.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16, got ", tensor.scalar_type());
  return kvrelay::Dtype::kBFloat16;
}

void check_shapes(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& token_ids, const at::Tensor& seq_lens,
                  const at::Tensor& block_tables) {
  for (const at::Tensor* t : {&out, &query, &k_cache, &v_cache, &token_ids, &seq_lens, &block_tables})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention takes CPU tensors");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [tokens, q_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a contiguous head_dim");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out must have the query's dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "K and V caches differ in shape or dtype");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "q heads must be a multiple of kv heads");
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.dim() == 1 && token_ids.is_contiguous(),
              "token_ids must be contiguous int64 [rows]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == token_ids.numel(),
              "seq_lens must be contiguous int32 [rows]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == token_ids.numel(),
              "block_tables must be int32 [rows, max_blocks] with contiguous rows");
}

// The fields both kernels read, from tensors check_shapes has passed.
kvrelay::PagedAttentionArgs attention_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, double scale, int64_t window,
                                           double soft_cap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK(soft_cap >= 0.0, "soft_cap must be >= 0 (0: none), got ", soft_cap);
  return {query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
          k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3),
          query.size(1) / k_cache.size(2), static_cast<float>(scale), dtype_of(query, "query"),
          dtype_of(k_cache, "the KV cache"), window, static_cast<float>(soft_cap)};
}

// Indices the kernel trusts: a bad one would read outside query, out or the block table.
void check_rows(const at::Tensor& token_ids, const at::Tensor& seq_lens, int64_t num_tokens, int64_t max_keys) {
  const int64_t* tokens = token_ids.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t row = 0; row < token_ids.numel(); ++row) {
    TORCH_CHECK(tokens[row] >= 0 && tokens[row] < num_tokens, "decode token index ", tokens[row], " out of range");
    TORCH_CHECK(lens[row] >= 1 && lens[row] <= max_keys, "seq_len ", lens[row], " is < 1 or beyond the block table");
  }
}

}  // namespace

namespace kvrelay {

void paged_decode_attention_op(
    const at::Tensor& out,           // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& query,         // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& token_ids,     // [rows] int64
    const at::Tensor& seq_lens,      // [rows] int32
    const at::Tensor& block_tables,  // [rows, max_blocks] int32
    double scale, int64_t window, double soft_cap) {
  check_shapes(out, query, k_cache, v_cache, token_ids, seq_lens, block_tables);
  check_rows(token_ids, seq_lens, query.size(0), block_tables.size(1) * k_cache.size(1));
  const int64_t rows = token_ids.numel();
  if (rows == 0) return;
  kvrelay::PagedDecodeArgs args{attention_args(out, query, k_cache, v_cache, scale, window, soft_cap),
                                token_ids.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(),
                                block_tables.data_ptr<int32_t>(), block_tables.stride(0), rows};
  // torch's intra-op thread count governs, as it does for torch's own CPU ops.
  const int num_threads = int(std::min<int64_t>(at::get_num_threads(), rows * k_cache.size(2)));
  const bool ok = kvrelay::paged_decode_with_runs(args, num_threads);
  TORCH_CHECK(ok, "paged_decode_attention: a block table entry lies outside the cache");
}

// Prefill rows: each sequence's query_lens[s] queries sit at rows token_starts[s].. of the flat
// batch and are the last of its seq_lens[s] keys; query j sees keys 0 .. context + j (with a
// window, only the last `window` of them).
void paged_prefill_attention_op(
    const at::Tensor& out,           // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& query,         // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& token_starts,  // [seqs] int64
    const at::Tensor& query_lens,    // [seqs] int32
    const at::Tensor& seq_lens,      // [seqs] int32
    const at::Tensor& block_tables,  // [seqs, max_blocks] int32
    double scale, int64_t window, double soft_cap) {
  check_shapes(out, query, k_cache, v_cache, token_starts, seq_lens, block_tables);
  TORCH_CHECK(query_lens.scalar_type() == at::kInt && query_lens.is_contiguous() &&
                  query_lens.numel() == token_starts.numel(),
              "query_lens must be contiguous int32 [seqs]");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(), "the prefill kernel takes a cache of the query's dtype");
  const int64_t group_size = query.size(1) / k_cache.size(2);
  TORCH_CHECK(kvrelay::paged_prefill_supported(k_cache.size(3), group_size),
              "paged_prefill_attention takes head_dim 64 or 128 and 1, 2, 3, 4, 6 or 8 q heads per kv head");
  const int64_t* starts = token_starts.data_ptr<int64_t>();
  const int32_t* queries = query_lens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_keys = block_tables.size(1) * k_cache.size(1);
  for (int64_t s = 0; s < token_starts.numel(); ++s) {
    TORCH_CHECK(queries[s] >= 1 && starts[s] >= 0 && starts[s] + queries[s] <= query.size(0),
                "prefill rows ", starts[s], " + ", queries[s], " out of range");
    TORCH_CHECK(lens[s] >= queries[s] && lens[s] <= max_keys, "seq_len ", lens[s],
                " is below its query count or beyond the block table");
  }
  const int64_t seqs = token_starts.numel();
  if (seqs == 0) return;
  kvrelay::PagedPrefillArgs args{attention_args(out, query, k_cache, v_cache, scale, window, soft_cap), starts,
                                 queries, lens,
                                 block_tables.data_ptr<int32_t>(), block_tables.stride(0), seqs};
  const int num_threads = at::get_num_threads();
  const bool ok = kvrelay::paged_prefill_attention(args, num_threads);
  TORCH_CHECK(ok, "paged_prefill_attention: a block table entry lies outside the cache");
}

// Writes key[t] and value[t] into the caches at slot_mapping[t] (block * block_size + offset),
// skipping tokens whose slot is negative. key/value must have the caches' dtype and each token's
// [num_kv_heads, head_dim] contiguous (a head slice of a fused qkv output qualifies).
void store_kv_op(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : {&key, &value, &k_cache, &v_cache, &slot_mapping})
    TORCH_CHECK(t->device().is_cpu(), "store_kv takes CPU tensors");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] of one dtype");
  const int64_t num_tokens = slot_mapping.numel(), heads = k_cache.size(2), head_dim = k_cache.size(3);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == heads && t->size(2) == head_dim,
                "key and value must be [num_tokens, num_kv_heads, head_dim]");
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "key and value must have the cache's dtype");
    TORCH_CHECK(t->stride(2) == 1 && (heads == 1 || t->stride(1) == head_dim),
                "key and value need each token's heads contiguous");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " lies outside the cache");
  const int64_t row_bytes = heads * head_dim * int64_t(k_cache.element_size());
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * k_stride, row_bytes);
    std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * v_stride, row_bytes);
  }
}

}  // namespace kvrelay
