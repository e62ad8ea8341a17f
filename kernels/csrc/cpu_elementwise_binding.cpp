// Python module of the fused elementwise ops (cpu_elementwise.cpp).
#include <torch/csrc/utils/pybind.h>

#include "cpu_elementwise.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &kvrelay::rms_norm, "RMSNorm over the last dim, torch's rounding",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("offset") = false);
  m.def("add_rms_norm", &kvrelay::add_rms_norm, "residual += x (bf16), then RMSNorm of it",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"),
        pybind11::arg("eps"), pybind11::arg("offset") = false);
  m.def("qk_norm_rope", &kvrelay::qk_norm_rope, "per-head RMSNorm of q and k heads, then rope");
  m.def("gelu_tanh_and_mul", &kvrelay::gelu_tanh_and_mul, "gelu_tanh(gate) * up over gate_up, bf16");
  m.def("rope", &kvrelay::rope, "x * cos + rotate_half(x) * sin");
  m.def("silu_and_mul", &kvrelay::silu_and_mul, "silu(gate) * up over gate_up = gate | up, bf16");
  m.def("argmax_rows", &kvrelay::argmax_rows, "first index of each row's maximum (NaN first), float32");
  m.def("apply_token_bitmask", &kvrelay::apply_token_bitmask, "-inf where a row's bitmask bit is 0");
}
