// A verify step gives each speculating sequence 1 + k decode rows: row i is query i of the
// sequence and sees one key more than row i - 1. Alone, each row reads the sequence's keys again
// and scores them with fp32 FMAs, G q heads at a time. As one causal block of the prefill kernel,
// the run's keys are read once per kv head and its (query, head) pairs scored as one matrix:
// 1 + 4 queries of a GQA group of 3 fill one 16-row AMX tile. Only bf16 runs go that way (the
// prefill kernel's bf16 forms round the weights to bf16, as its prefill does); fp32 rows keep
// the decode kernel, whose arithmetic per row does not depend on the batch.
#include "paged_decode_runs.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "paged_prefill.h"

namespace kvrelay {
namespace {

// Row `next` is the query after row `prev` in a run that starts at row `first`: the next token,
// one key more, and a block table that holds the same blocks for every key of `prev` from the
// run's first visible one (with a window, the entries before it may be stale: never compared).
bool continues(const PagedDecodeArgs& a, int64_t first, int64_t prev, int64_t next) {
  if (a.token_ids[next] != a.token_ids[prev] + 1 || a.seq_lens[next] != a.seq_lens[prev] + 1) return false;
  const int64_t first_block = first_visible_key(a.seq_lens[first] - 1, a.window) / a.block_size;
  const int64_t blocks = (a.seq_lens[prev] + a.block_size - 1) / a.block_size;
  const int32_t* prev_table = a.block_tables + prev * a.block_table_stride;
  return std::equal(prev_table + first_block, prev_table + blocks,
                    a.block_tables + next * a.block_table_stride + first_block);
}

// The rows of one call sorted into runs (as prefill sequences) and lone rows (as decode rows),
// each with its own copy of the indices the kernels read.
struct RowSplit {
  std::vector<int64_t> run_starts;  // [runs] first token of each run
  std::vector<int32_t> run_queries, run_lens;  // [runs] rows of the run, keys of its last row
  std::vector<int32_t> run_tables;  // [runs, block_table_stride] the last row's table
  std::vector<int64_t> lone_tokens;  // [lone]
  std::vector<int32_t> lone_lens;  // [lone]
  std::vector<int32_t> lone_tables;  // [lone, block_table_stride]
};

RowSplit split_rows(const PagedDecodeArgs& a) {
  RowSplit split;
  const int64_t stride = a.block_table_stride;
  for (int64_t first = 0, end; first < a.rows; first = end) {
    for (end = first + 1; end < a.rows && continues(a, first, end - 1, end);) ++end;
    const int64_t last = end - 1;
    const int32_t* table = a.block_tables + last * stride;
    if (end - first > 1) {
      split.run_starts.push_back(a.token_ids[first]);
      split.run_queries.push_back(int32_t(end - first));
      split.run_lens.push_back(a.seq_lens[last]);
      split.run_tables.insert(split.run_tables.end(), table, table + stride);
    } else {
      split.lone_tokens.push_back(a.token_ids[first]);
      split.lone_lens.push_back(a.seq_lens[first]);
      split.lone_tables.insert(split.lone_tables.end(), table, table + stride);
    }
  }
  return split;
}

bool runs_enabled() {
  const char* value = std::getenv("KVRELAY_DECODE_RUNS");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

bool has_run(const PagedDecodeArgs& a) {
  for (int64_t row = 1; row < a.rows; ++row)
    if (continues(a, row - 1, row - 1, row)) return true;
  return false;
}

// A plain decode step (no run) is checked in one pass and left as it is, without copies.
bool runs_apply(const PagedDecodeArgs& a) {
  return a.rows > 1 && a.query_dtype == Dtype::kBFloat16 && a.cache_dtype == Dtype::kBFloat16 &&
         paged_prefill_supported(a.head_dim, a.group_size) && runs_enabled() && has_run(a);
}

}  // namespace

bool paged_decode_with_runs(const PagedDecodeArgs& args, int num_threads) {
  if (!runs_apply(args)) return paged_decode_attention(args, num_threads);
  const RowSplit split = split_rows(args);
  PagedPrefillArgs runs{};
  static_cast<PagedAttentionArgs&>(runs) = args;
  runs.token_starts = split.run_starts.data();
  runs.query_lens = split.run_queries.data();
  runs.seq_lens = split.run_lens.data();
  runs.block_tables = split.run_tables.data();
  runs.block_table_stride = args.block_table_stride;
  runs.seqs = int64_t(split.run_starts.size());
  if (!paged_prefill_attention(runs, num_threads)) return false;
  if (split.lone_tokens.empty()) return true;
  PagedDecodeArgs lone = args;
  lone.token_ids = split.lone_tokens.data();
  lone.seq_lens = split.lone_lens.data();
  lone.block_tables = split.lone_tables.data();
  lone.rows = int64_t(split.lone_tokens.size());
  return paged_decode_attention(lone, num_threads);
}

}  // namespace kvrelay
