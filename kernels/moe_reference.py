"""Obviously correct mixture-of-experts forward, for tests: each token, each of its k experts,
one at a time. Every expert's output is accumulated in float32, weighted by its routing weight."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from kvrelay.kernels.moe_activations import gated_torch
from kvrelay.kernels.moe_checks import check_moe_inputs
from kvrelay.kernels.moe_weights import ExpertWeights


def fused_moe_reference(hidden: torch.Tensor, experts: ExpertWeights,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        activation: str) -> torch.Tensor:
    """hidden [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 -> [T, H]."""
    if experts.w13 is None:
        raise ValueError("the reference needs the plain weights, which prepare_for_cpu_ released")
    check_moe_inputs(hidden, experts, topk_weights, topk_ids, activation)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
    for token in range(hidden.shape[0]):
        x = hidden[token:token + 1]  # [1, H]
        for slot in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, slot])
            act = gated_torch(activation, F.linear(x, experts.w13[expert]))  # [1, I]
            y = F.linear(act, experts.w2[expert])  # [1, H]
            out[token] += topk_weights[token, slot] * y[0].float()
    return out.to(hidden.dtype)
