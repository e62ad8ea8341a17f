"""Attention with logit soft-capping for the CPU torch paths, where SDPA (which has no soft cap)
cannot run it: scores in fp32, capped, masked, softmax, as the reference computes them."""
from __future__ import annotations

import torch


def soft_capped_attention(
    queries: torch.Tensor,  # [..., num_queries, head_dim]
    keys: torch.Tensor,  # [..., num_keys, head_dim], the queries' head count (no GQA)
    values: torch.Tensor,  # [..., num_keys, head_dim]
    visible: torch.Tensor,  # [..., num_queries, num_keys] bool, broadcast; every query sees a key
    scale: float,
    soft_cap: float,
) -> torch.Tensor:  # [..., num_queries, head_dim], the queries' dtype
    scores = queries.float() @ keys.float().transpose(-1, -2) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ values.float()).to(queries.dtype)
