// Python module of the batched LoRA kernels (cpu_lora.cpp).
#include <torch/csrc/utils/pybind.h>

#include "cpu_lora.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_shrink", &kvrelay::lora_shrink,
        "out [T, R] float32 = x @ a[slot]^T per token, zero rows for slot -1",
        pybind11::arg("x"), pybind11::arg("a"), pybind11::arg("token_slots"));
  m.def("lora_expand", &kvrelay::lora_expand,
        "y += xa @ b_t[slot] per token in float32, rounded once, in place; slot -1 rows untouched",
        pybind11::arg("y"), pybind11::arg("xa"), pybind11::arg("b_t"),
        pybind11::arg("token_slots"));
}
