"""Mixture-of-experts forward on CPU: tokens grouped by expert, one matmul per active expert.

The T*k (token, slot) pairs are sorted by expert once; each active expert then runs gate_up,
its gated activation and down on its rows in one go (the native gemv kernel's bf16 tiles for
steps of a few tokens where they were attached, else oneDNN-packed bf16 weights where
ExpertWeights.prepare_for_cpu_ packed them, else F.linear). The order of operations is
Hugging Face's default experts path (grouped_mm): down's output times the float32 routing
weight, then the k slots of each token summed in slot order, then cast to the model's dtype.
For k = 2 this is also bit for bit HF's eager loop (index_add of the two products), so float32
models match HF's greedy tokens.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from kvrelay.kernels.moe_activations import gated
from kvrelay.kernels.moe_weights import ExpertWeights
from kvrelay.kernels.onednn_linear import packed_matmul


def fused_moe_cpu(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """hidden [T, H]; topk_weights [T, k] float32; topk_ids [T, k] int64 (checked by the
    caller) -> [T, H] in hidden's dtype."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 1:
        return _one_token(hidden, experts, topk_weights, topk_ids, activation)
    flat_ids = topk_ids.reshape(-1)  # [P = T*k], pair p is token p // k, slot p % k
    sorted_ids, pair_order = torch.sort(flat_ids, stable=True)  # [P] each
    rows = hidden[pair_order // top_k]  # [P, H], grouped by expert
    # one host read of the group sizes, instead of a sync per expert
    counts = torch.bincount(sorted_ids, minlength=experts.num_experts).tolist()
    down = torch.empty(rows.shape, dtype=hidden.dtype)  # [P, H]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            down[start:end] = _expert_mlp(experts, expert, rows[start:end], activation)
            start = end
    weighted = down * topk_weights.reshape(-1)[pair_order].unsqueeze(1)  # [P, H] float32
    by_pair = torch.empty_like(weighted)
    by_pair[pair_order] = weighted  # back to (token, slot) order
    return by_pair.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _one_token(hidden: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """A decode step of one token: its k experts in slot order, without the sort and scatter
    (the same products and the same sum over the slots)."""
    downs = [_expert_mlp(experts, expert, hidden, activation) for expert in topk_ids[0].tolist()]
    weighted = torch.cat(downs) * topk_weights.view(-1, 1)  # [k, H] float32
    return weighted.sum(dim=0, keepdim=True).to(hidden.dtype)


def _expert_mlp(experts: ExpertWeights, expert: int, x: torch.Tensor,
                activation: str) -> torch.Tensor:
    """x [n, H] -> down(act(gate) * up) [n, H]."""
    if x.shape[0] <= experts.small_step_rows:
        x = x.contiguous()
        act = gated(activation, experts.small_step_w13[expert](x))  # [n, I]
        return experts.small_step_w2[expert](act.contiguous())
    if experts.packed_w13 is not None:
        act = gated(activation, packed_matmul(x, experts.packed_w13[expert]))  # [n, I]
        return packed_matmul(act, experts.packed_w2[expert])
    if experts.wide_w13 is not None:  # float32 GEMMs, rounded to bf16 where oneDNN's are
        act = gated(activation, F.linear(x.float(), experts.wide_w13[expert]).to(x.dtype))
        return F.linear(act.float(), experts.wide_w2[expert]).to(x.dtype)
    act = gated(activation, F.linear(x, experts.w13[expert]))
    return F.linear(act, experts.w2[expert])
