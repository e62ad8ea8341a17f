"""Entry point of the mixture-of-experts layers: Triton on CUDA tensors, the grouped torch
path on CPU (kernels/moe_cpu.py). Routing is kernels/moe_routing.py; the experts'
weights are kernels/moe_weights.py's ExpertWeights."""
from __future__ import annotations

import torch

from kvrelay.kernels.moe_checks import check_moe_inputs
from kvrelay.kernels.moe_cpu import fused_moe_cpu
from kvrelay.kernels.moe_weights import ExpertWeights


def fused_moe(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """hidden [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 in [0, E);
    activation "silu" or "gelu_tanh" -> sum over k of weight * expert(hidden) [T, H]."""
    check_moe_inputs(hidden, experts, topk_weights, topk_ids, activation)
    if hidden.shape[0] == 0:
        return hidden.new_empty(hidden.shape)
    if hidden.is_cuda:
        # Imported here so that CPU-only installs never need a working triton.
        from kvrelay.kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(hidden, experts, topk_weights, topk_ids, activation)
    return fused_moe_cpu(hidden, experts, topk_weights, topk_ids, activation)
