"""bfloat16 matmuls on weights pre-packed once into oneDNN's blocked layout (CPU only).

F.linear re-lays-out the weight on every call; for small-M matmuls that reorder costs as much
as the multiply, so weights are packed once at load time (services/engine/models/
packed_linear.py for the dense layers, kernels/moe_weights.py for the experts).
"""
from __future__ import annotations

import torch

PACK_BATCH_HINT = 64  # the batch size oneDNN tunes the blocked layout for; any M still works


def onednn_packs_bf16() -> bool:
    """Whether oneDNN can pre-pack bf16 weights on this CPU (it raises where it cannot)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] bf16 -> an opaque oneDNN copy (only where
    onednn_packs_bf16())."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def packed_matmul(x: torch.Tensor, packed_weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in_features] bf16 @ packed_weight^T (+ bias) -> [T, out_features]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight, bias, "none", [], "")
