"""Fast torch paged attention for CPU: batched decode rows, one SDPA call per prefill row.

All indices and masks come from the step's CpuAttentionPlan, so a layer only gathers K/V and
runs SDPA (whose CPU flash kernel accumulates bf16 in fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_plan import DecodeGroup, PrefillSeq
from kernels.metadata import AttentionMetadata


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
) -> torch.Tensor:
    plan = meta.cpu_plan
    if plan is None:
        raise ValueError("metadata has no CPU plan: build it from CPU tensors")
    if out is None:
        out = torch.empty_like(query)
    # Slot-major views: one index_select then gathers whole [num_kv_heads, head_dim] rows.
    key_slots = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    value_slots = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    for group in plan.decode_groups:
        _decode_group_attention(query, key_slots, value_slots, group, scale, out)
    for seq in plan.prefills:
        _prefill_attention(query, key_slots, value_slots, seq, scale, out)
    return out


def _decode_group_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    group: DecodeGroup,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
) -> None:
    rows = group.token_ids.numel()
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_slots.shape[1]
    keys = key_slots.index_select(0, group.slot_ids).view(rows, group.max_len, num_kv_heads, head_dim)
    values = value_slots.index_select(0, group.slot_ids).view(rows, group.max_len, num_kv_heads, head_dim)
    # The q heads of one kv head become that head's query "sequence": plain attention, no GQA
    # expansion, and the per-row key mask broadcasts over them.
    queries = query.index_select(0, group.token_ids).view(rows, num_kv_heads, -1, head_dim)
    attended = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.key_mask, scale=scale
    )  # [rows, num_kv_heads, group_size, head_dim]
    out.index_copy_(0, group.token_ids, attended.reshape(rows, num_q_heads, head_dim))


def _prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    seq: PrefillSeq,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
) -> None:
    tokens = slice(seq.token_start, seq.token_start + seq.query_len)
    keys = key_slots.index_select(0, seq.slot_ids).transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
    values = value_slots.index_select(0, seq.slot_ids).transpose(0, 1)
    group_size = query.shape[1] // key_slots.shape[1]
    if seq.causal_mask is not None and group_size > 1:
        # SDPA's CPU flash kernel rejects enable_gqa together with a mask and falls back to the
        # math path, ~50x slower on a 200-token chunk; expanding the kv heads keeps it on flash.
        keys = keys.repeat_interleave(group_size, dim=0)
        values = values.repeat_interleave(group_size, dim=0)
    attended = F.scaled_dot_product_attention(
        query[tokens].transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=seq.causal_mask,
        is_causal=seq.causal_mask is None,
        scale=scale,
        enable_gqa=seq.causal_mask is None,
    )  # [1, num_q_heads, query_len, head_dim]
    out[tokens] = attended[0].transpose(0, 1)
