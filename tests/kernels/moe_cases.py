"""Random mixture-of-experts inputs for the kernel tests, with experts that receive no token,
exactly one token, and every token."""
from __future__ import annotations

import torch

from kvrelay.kernels.moe_weights import ExpertWeights


def random_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                   generator: torch.Generator) -> ExpertWeights:
    """Weights scaled so that every layer's outputs stay of order one."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=generator) / inter ** 0.5
    return ExpertWeights(w13.to(dtype), w2.to(dtype))


def skewed_routing(num_tokens: int, top_k: int, num_experts: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] float32, topk_ids [T, k] int64): expert 0 in every token's slot 0,
    expert 1 in exactly one token (where T > 1), the last expert in none, the rest at random.
    Needs num_experts >= top_k + 2."""
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for token in range(num_tokens):
        others = torch.randperm(num_experts - 3, generator=generator)[:top_k - 1] + 2
        ids[token] = torch.cat([torch.zeros(1, dtype=torch.int64), others])
    if num_tokens > 1 and top_k > 1:
        ids[num_tokens // 2, -1] = 1
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids
