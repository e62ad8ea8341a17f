// The paged attention kernels' tensor entry points (paged_decode_binding.cpp), shared by the
// Python module (paged_attention_module.cpp) and the fused decode stack (decode_stack.cpp).
// They check every tensor and index, then compute; none touches the GIL.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvrelay {

// out[token_ids[r]] = attention of query[token_ids[r]] over its row's first seq_lens[r] keys (the
// last `window` of them where window > 0), scores soft-capped where soft_cap > 0.
void paged_decode_attention_op(
    const at::Tensor& out,           // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& query,         // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& token_ids,     // [rows] int64
    const at::Tensor& seq_lens,      // [rows] int32
    const at::Tensor& block_tables,  // [rows, max_blocks] int32
    double scale, int64_t window, double soft_cap);

// Causal attention of every prefill sequence's queries over its keys, windowed and soft-capped
// as the decode op.
void paged_prefill_attention_op(
    const at::Tensor& out,           // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& query,         // [num_tokens, num_q_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& token_starts,  // [seqs] int64
    const at::Tensor& query_lens,    // [seqs] int32
    const at::Tensor& seq_lens,      // [seqs] int32
    const at::Tensor& block_tables,  // [seqs, max_blocks] int32
    double scale, int64_t window, double soft_cap);

// key[t], value[t] [num_kv_heads, head_dim] into the caches at slot_mapping[t] (< 0: skipped).
void store_kv_op(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const at::Tensor& slot_mapping);

}  // namespace kvrelay
