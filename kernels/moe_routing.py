"""Top-k expert selection for mixture-of-experts layers (Mixtral, Qwen3-MoE).

Follows the Hugging Face routers op for op, so float32 results match theirs bit for bit: softmax
over all experts in float32, torch.topk of the probabilities (its order and tie-breaking), then,
where the family renormalizes, an in-place division by the sum of the k kept weights. Mixtral
always renormalizes; Qwen3-MoE only with `norm_topk_prob`.
"""
from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (topk_weights [T, k] float32, topk_ids [T, k] int64),
    each token's k likeliest experts, likeliest first."""
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"select_experts takes router_logits [T, E] float32, got "
                         f"{tuple(router_logits.shape)} {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts}] (the number of experts), "
                         f"got {top_k}")
    probs = torch.softmax(router_logits, dim=-1)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
