// Python module of the paged attention kernels (paged_decode_binding.cpp). The attention calls
// run without the GIL, so the worker's other Python threads go on meanwhile.
#include <torch/csrc/utils/pybind.h>

#include "paged_attention_ops.h"
#include "paged_prefill.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  using pybind11::arg;
  m.def("paged_decode_attention", &kvrelay::paged_decode_attention_op, no_gil(), arg("out"), arg("query"),
        arg("k_cache"), arg("v_cache"), arg("token_ids"), arg("seq_lens"), arg("block_tables"), arg("scale"),
        arg("window") = 0, arg("soft_cap") = 0.0,
        "Decode attention (one query token per row) straight from the paged KV cache");
  m.def("paged_prefill_attention", &kvrelay::paged_prefill_attention_op, no_gil(), arg("out"), arg("query"),
        arg("k_cache"), arg("v_cache"), arg("token_starts"), arg("query_lens"), arg("seq_lens"),
        arg("block_tables"), arg("scale"), arg("window") = 0, arg("soft_cap") = 0.0,
        "Causal prefill attention straight from the paged KV cache");
  m.def("paged_prefill_supported", &kvrelay::paged_prefill_supported,
        "Whether the prefill kernel takes this head_dim and GQA group size");
  m.def("store_kv", &kvrelay::store_kv_op, "Write new K/V rows into the paged cache at their slots (negative: skip)");
}
