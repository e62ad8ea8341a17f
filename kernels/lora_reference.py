"""The batched LoRA ops in plain torch: the definition the native (kernels/native_lora.py) and
Triton (kernels/triton_lora.py) kernels are tested against, and the CPU path where the native
extension cannot be built.

Each token of a flat batch applies its own adapter slot (-1: none). Tokens are grouped by slot
and each distinct slot's rows go through one float32 matmul, so the arithmetic is the
definition itself: shrink x @ A^T in float32; expand y + xa @ B^T in float32, rounded once to
y's dtype. Not fast (a device sync and a Python loop over the slots each call), but plainly
right. Shapes are the dispatcher's to check (kernels/lora_ops.py); slot values are checked here.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch


def lora_shrink(x: torch.Tensor,  # [T, in]
                a: torch.Tensor,  # [S, R, in], x's dtype
                token_slots: torch.Tensor,  # [T] int32, -1: no adapter
                ) -> torch.Tensor:  # [T, R] float32, zero rows for slot -1
    out = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, rows in _rows_by_slot(token_slots, a.shape[0]):
        out[rows] = x[rows].float() @ a[slot].float().T
    return out


def lora_expand_(y: torch.Tensor,  # [T, out], may be a column slice of a wider tensor
                 xa: torch.Tensor,  # [T, R] float32
                 b_t: torch.Tensor,  # [S, R, out], y's dtype
                 token_slots: torch.Tensor,  # [T] int32, -1: no adapter (row untouched)
                 ) -> None:
    for slot, rows in _rows_by_slot(token_slots, b_t.shape[0]):
        # indexed assignment writes through a view into the tensor it slices
        y[rows] = (y[rows].float() + xa[rows] @ b_t[slot].float()).to(y.dtype)


def _rows_by_slot(token_slots: torch.Tensor, num_slots: int
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(slot, the indices of its tokens) for each distinct slot other than -1. Checks every slot
    first, so that a bad one raises before any row is written."""
    slots = token_slots.long()
    distinct = torch.unique(slots).tolist()
    bad = [slot for slot in distinct if not -1 <= slot < num_slots]
    if bad:
        raise ValueError(f"token slots {bad}: a slot is -1 (no adapter) or below the weights' "
                         f"{num_slots} slots")
    for slot in distinct:
        if slot >= 0:
            yield slot, (slots == slot).nonzero().squeeze(1)
