"""Entry point of the batched LoRA ops (Punica's BGMV/SGMV shape): each token of a flat batch
applies its own adapter slot's A and B, -1 meaning none. Triton on CUDA tensors
(kernels/triton_lora.py); on CPU the native kernels (kernels/native_lora.py) where they build,
else the torch reference (kernels/lora_reference.py), which defines the results.

Called about 200 times a decode step (a shrink and an expand per adapted part of each layer),
so nothing here syncs or allocates beyond the output. Bad operands raise ValueError on every
path: the native extension checks them itself (a Python check costs more than its small
calls), the other paths are checked here. Slot values are checked on the CPU paths; on a GPU
a slot outside -1..S-1 counts as -1, since checking it would cost a sync.
"""
from __future__ import annotations

import torch

from kvrelay.kernels import lora_reference, native_lora

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def lora_shrink(x: torch.Tensor,  # [T, in] bf16, f16 or f32, unit column stride
                a: torch.Tensor,  # [S, R, in] x's dtype, contiguous, zero past each rank
                token_slots: torch.Tensor,  # [T] int32, -1: no adapter
                ) -> torch.Tensor:  # [T, R] float32, zero rows for slot -1
    if not x.is_cuda:
        ops = native_lora.lora_ops()
        if ops is not None:
            return native_lora.shrink(ops, x, a, token_slots)
    _check_operands("x", x, "a", a, token_slots, "in")
    if x.is_cuda:
        from kvrelay.kernels import triton_lora  # CPU-only installs never need a working triton

        return triton_lora.shrink(x, a, token_slots)
    return lora_reference.lora_shrink(x, a, token_slots)


def lora_expand_(y: torch.Tensor,  # [T, out] bf16, f16 or f32, unit column stride; may be a
                 #                   column slice of a wider tensor
                 xa: torch.Tensor,  # [T, R] float32 (a shrink's output, or a column slice)
                 b_t: torch.Tensor,  # [S, R, out] y's dtype, contiguous, scaling folded in
                 token_slots: torch.Tensor,  # [T] int32, -1: no adapter (row untouched)
                 ) -> None:  # y[t] = round(y[t] + xa[t] @ b_t[slot]) in float32, in place
    if not y.is_cuda:
        ops = native_lora.lora_ops()
        if ops is not None:
            return native_lora.expand_(ops, y, xa, b_t, token_slots)
    _check_operands("y", y, "b_t", b_t, token_slots, "out")
    if (xa.dtype != torch.float32 or xa.dim() != 2 or xa.shape[0] != y.shape[0]
            or xa.shape[1] != b_t.shape[1] or (xa.shape[1] > 1 and xa.stride(1) != 1)
            or xa.device != y.device):
        raise ValueError(f"xa must be [T, R] = [{y.shape[0]}, {b_t.shape[1]}] float32 with unit "
                         f"column stride on {y.device}, got {xa.dtype} {list(xa.shape)} "
                         f"strides {list(xa.stride())} on {xa.device}")
    if y.is_cuda:
        from kvrelay.kernels import triton_lora

        return triton_lora.expand_(y, xa, b_t, token_slots)
    return lora_reference.lora_expand_(y, xa, b_t, token_slots)


def _check_operands(rows_name: str, rows: torch.Tensor, weights_name: str,
                    weights: torch.Tensor, token_slots: torch.Tensor, width_name: str) -> None:
    """rows [T, width] (x or y) and weights [S, R, width] (a or b_t) of one supported dtype on
    one device, in the layouts the kernels read; token_slots [T] int32 there too. The same
    checks, and messages, as the native extension's (kernels/csrc/cpu_lora.cpp)."""
    if rows.dim() != 2 or weights.dim() != 3 or weights.shape[2] != rows.shape[1]:
        raise ValueError(f"{rows_name} must be [T, {width_name}] and {weights_name} "
                         f"[S, R, {width_name}], got {list(rows.shape)} and "
                         f"{list(weights.shape)}")
    if rows.dtype not in _DTYPES or weights.dtype != rows.dtype:
        raise ValueError(f"{rows_name} and {weights_name} must share one of bfloat16, float16, "
                         f"float32, got {rows.dtype} and {weights.dtype}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"{rows_name} needs unit column stride, got strides {list(rows.stride())}")
    if not weights.is_contiguous():
        raise ValueError(f"{weights_name} must be contiguous")
    if (token_slots.dtype != torch.int32 or token_slots.dim() != 1
            or token_slots.shape[0] != rows.shape[0] or not token_slots.is_contiguous()):
        raise ValueError(f"token_slots must be a contiguous [T] = [{rows.shape[0]}] int32 tensor, "
                         f"got {token_slots.dtype} {list(token_slots.shape)}")
    if weights.device != rows.device or token_slots.device != rows.device:
        raise ValueError(f"{rows_name}, {weights_name} and token_slots must be on one device, got "
                         f"{rows.device}, {weights.device} and {token_slots.device}")
