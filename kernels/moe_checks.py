"""Argument checks shared by every fused_moe path: bad input raises ValueError, not a crash
inside a kernel (an expert id out of range would read past the weights on a GPU)."""
from __future__ import annotations

import torch

from kvrelay.kernels.moe_activations import check_activation
from kvrelay.kernels.moe_weights import ExpertWeights


def check_moe_inputs(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str) -> None:
    """hidden [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 in [0, E)."""
    check_activation(activation)
    if hidden.dim() != 2 or hidden.shape[1] != experts.hidden_size:
        raise ValueError(f"hidden must be [T, {experts.hidden_size}], got {tuple(hidden.shape)}")
    if hidden.dtype != experts.dtype or hidden.device != experts.device:
        raise ValueError(f"hidden is {hidden.dtype} on {hidden.device} but the experts are "
                         f"{experts.dtype} on {experts.device}")
    routing_shape = (hidden.shape[0], topk_ids.shape[-1] if topk_ids.dim() else 0)
    if topk_ids.dim() != 2 or tuple(topk_ids.shape) != routing_shape or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, k] with T = {hidden.shape[0]} and k >= 1, got "
                         f"{tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != routing_shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_ids must be int64 and topk_weights float32, got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    if topk_ids.device != hidden.device or topk_weights.device != hidden.device:
        raise ValueError("topk_ids and topk_weights must lie on hidden's device")
    if topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= experts.num_experts)).any()):
        raise ValueError(f"expert ids must lie in [0, {experts.num_experts}), got values from "
                         f"{int(topk_ids.min())} to {int(topk_ids.max())}")
