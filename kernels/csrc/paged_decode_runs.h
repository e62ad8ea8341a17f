// Decode rows that are consecutive queries of one sequence (a speculative step's token and its
// drafts) computed together as a short causal prefill; every other row as plain decode.
#pragma once

#include "paged_decode.h"

namespace kvrelay {

// paged_decode_attention's contract (same rows, same outputs up to rounding), with runs of
// consecutive queries handed to the prefill kernel where it has a bf16 form for the shape.
// KVRELAY_DECODE_RUNS=0 computes every row alone. False on a block id outside the cache.
bool paged_decode_with_runs(const PagedDecodeArgs& args, int num_threads);

}  // namespace kvrelay
