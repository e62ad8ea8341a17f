// Tensor entry points of the paged attention kernels: validate the tensors (a wrong shape, dtype
// or index would otherwise read out of bounds) and hand raw pointers to paged_decode.cpp and
// paged_prefill.cpp. The Python module is paged_attention_module.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "paged_attention_ops.h"
#include "paged_decode.h"
#include "paged_decode_runs.h"
#include "paged_prefill.h"
#include "kv_codes.h"

namespace {

kvrelay::Dtype dtype_of(const at::Tensor& tensor, const char* name) {
  if (tensor.scalar_type() == at::kFloat) return kvrelay::Dtype::kFloat32;
  TORCH_CHECK(tensor.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16, got ", tensor.scalar_type());
  return kvrelay::Dtype::kBFloat16;
}

// A cache of 8-bit codes (kernels/kv_quant.py): its dtype names the code, its rows are head_dim
// codes and a float32 scale.
bool is_coded(const at::Tensor& cache) {
  const at::ScalarType type = cache.scalar_type();
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

kvrelay::Dtype cache_dtype_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return kvrelay::Dtype::kInt8;
    case at::kFloat8_e4m3fn: return kvrelay::Dtype::kFp8E4M3;
    case at::kFloat8_e5m2: return kvrelay::Dtype::kFp8E5M2;
    default: return dtype_of(cache, "the KV cache");
  }
}

// head_dim of a cache row: the row less its scale for 8-bit codes.
int64_t cache_head_dim(const at::Tensor& cache) {
  return is_coded(cache) ? cache.size(3) - kvrelay::kScaleBytes : cache.size(3);
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
  TORCH_CHECK(cache_head_dim(k_cache) == query.size(2), "head_dim differs between query and cache");
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
  kvrelay::PagedAttentionArgs args{};
  args.query = query.data_ptr();
  args.query_token_stride = query.stride(0);
  args.query_head_stride = query.stride(1);
  args.out = out.data_ptr();
  args.out_token_stride = out.stride(0);
  args.out_head_stride = out.stride(1);
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.num_blocks = k_cache.size(0);
  args.block_size = k_cache.size(1);
  args.num_kv_heads = k_cache.size(2);
  args.head_dim = query.size(2);
  args.group_size = query.size(1) / k_cache.size(2);
  args.row_stride = k_cache.size(3);
  args.scale = static_cast<float>(scale);
  args.query_dtype = dtype_of(query, "query");
  args.cache_dtype = cache_dtype_of(k_cache);
  args.window = window;
  args.soft_cap = static_cast<float>(soft_cap);
  return args;
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

// One row of head_dim values as 8-bit codes and their scale, as kernels/kv_quant.py's
// quantize_rows computes them (bit for bit: the same float32 operations in the same order, and
// fp8 rounding as torch's casts round, kv_codes.h's `encode`): the row rotated (x <- H x), then
// scale = max |x| / the code's largest value, code = x / scale rounded to nearest even (int8)
// or converted (fp8), 0 where the row is zero. `rotated`: head_dim floats of scratch.
template <typename T>
void code_row(const T* src, int64_t head_dim, at::ScalarType code_type, float* rotated, uint8_t* dst) {
  for (int64_t d = 0; d < head_dim; ++d) rotated[d] = static_cast<float>(src[d]);
  kvrelay::rotate(rotated, head_dim);
  float absmax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(rotated[d]));
  const float max_code = code_type == at::kChar ? 127.0f : code_type == at::kFloat8_e4m3fn ? 448.0f : 57344.0f;
  const float scale = absmax / max_code;
  for (int64_t d = 0; d < head_dim; ++d)
    rotated[d] = scale > 0.0f ? std::clamp(rotated[d] / scale, -max_code, max_code) : 0.0f;
  // one loop per code, without a branch inside: the int8 one vectorizes
  if (code_type == at::kChar)
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(rotated[d])));
  else if (code_type == at::kFloat8_e4m3fn)
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = kvrelay::encode<kvrelay::E4M3Code>(rotated[d]);
  else
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = kvrelay::encode<kvrelay::E5M2Code>(rotated[d]);
  std::memcpy(dst + head_dim, &scale, sizeof(scale));
}

// Every kept token's K and V heads coded into their cache rows.
template <typename T>
void store_coded(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                 const at::Tensor& v_cache, const int64_t* slots) {
  const int64_t num_tokens = key.size(0), heads = k_cache.size(2), row_bytes = k_cache.size(3);
  const int64_t head_dim = row_bytes - kvrelay::kScaleBytes;
  const at::ScalarType code_type = k_cache.scalar_type();
  uint8_t* k_dst = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* v_dst = static_cast<uint8_t*>(v_cache.data_ptr());
  const T* k_src = static_cast<const T*>(key.data_ptr());
  const T* v_src = static_cast<const T*>(value.data_ptr());
  // A prefill step's thousands of tokens, shared out (each token's rows are its own).
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = slots[t] * heads + h;
        code_row(k_src + t * key.stride(0) + h * key.stride(1), head_dim, code_type, rotated.data(),
                 k_dst + row * row_bytes);
        code_row(v_src + t * value.stride(0) + h * value.stride(1), head_dim, code_type, rotated.data(),
                 v_dst + row * row_bytes);
      }
    }
  });
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
  TORCH_CHECK(is_coded(k_cache) || k_cache.scalar_type() == query.scalar_type(),
              "the prefill kernel takes a cache of the query's dtype or of 8-bit codes");
  const int64_t group_size = query.size(1) / k_cache.size(2);
  TORCH_CHECK(kvrelay::paged_prefill_supported(query.size(2), group_size),
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
  const bool coded = is_coded(k_cache);
  const int64_t num_tokens = slot_mapping.numel(), heads = k_cache.size(2), head_dim = cache_head_dim(k_cache);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == heads && t->size(2) == head_dim,
                "key and value must be [num_tokens, num_kv_heads, head_dim]");
    TORCH_CHECK(coded ? t->scalar_type() == key.scalar_type() && (t->scalar_type() == at::kFloat ||
                                                                   t->scalar_type() == at::kBFloat16)
                      : t->scalar_type() == k_cache.scalar_type(),
                "key and value must have the cache's dtype (float32 or bfloat16 for 8-bit codes)");
    TORCH_CHECK(t->stride(2) == 1 && (heads == 1 || t->stride(1) == head_dim),
                "key and value need each token's heads contiguous");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " lies outside the cache");
  if (coded) {
    if (key.scalar_type() == at::kFloat)
      store_coded<float>(key, value, k_cache, v_cache, slots);
    else
      store_coded<at::BFloat16>(key, value, k_cache, v_cache, slots);
    return;
  }
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
