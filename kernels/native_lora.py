"""The batched LoRA kernels on CPU (kernels/csrc/cpu_lora.cpp): built on first use, or None.

Each token of a flat batch applies its own adapter slot's A and B (Punica's BGMV/SGMV shape).
At about 200 calls a decode step, these wrappers only call: the extension checks every operand
(ValueError saying what it wanted and got, slot values included) and allocates the shrink's
output, where Python checks and a torch.empty would cost more than a small call's kernel.
Same build, cache and fallback rules as every native kernel (kernels/native_build.py); the
source is portable C++ with OpenMP, so it builds on any x86-64 g++ and uses AVX-512 where
-march=native finds it.
"""
from __future__ import annotations

import functools

import torch

from kvrelay.kernels.native_build import CFLAGS, load_extension

SOURCES = ("cpu_lora.cpp", "cpu_lora_binding.cpp")


@functools.cache
def lora_ops():
    """The built extension (lora_shrink, lora_expand), or None where it cannot be built."""
    return load_extension("kvrelay_lora", SOURCES, CFLAGS, "native LoRA kernels",
                          "using the torch reference")


def shrink(ops, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """x [T, in]; a [S, R, in] x's dtype; token_slots [T] int32 -> [T, R] float32 (allocated by
    the extension: at::empty there costs a fraction of torch.empty's ~1.5 us from Python)."""
    return ops.lora_shrink(x, a, token_slots)


def expand_(ops, y: torch.Tensor, xa: torch.Tensor, b_t: torch.Tensor,
            token_slots: torch.Tensor) -> None:
    """y [T, out] += xa [T, R] float32 @ b_t[slot] [R, out], in place, rounded once."""
    ops.lora_expand(y, xa, b_t, token_slots)
