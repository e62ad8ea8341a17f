"""The torch decode path, kept for where the native kernel cannot be built: decode rows sorted
by length and cut into groups, each gathered into padded K/V and run through one SDPA call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.kernels.cpu_plan import CpuAttentionPlan, DecodeGroup, DecodeRows, slot_ids

# Padded key tokens per decode group (rows * longest row). Gathering the whole decode batch at
# once measured 2-4x slower than chunks of this size on SmolLM2-135M (3 kv heads x 64 dims): a
# multi-MB gather is fresh mmap'd memory every layer, page faults and all, and it falls out of
# cache before SDPA reads it back. Sorting by length first keeps the padding small too.
DECODE_GROUP_KEY_TOKENS = 4096


def decode_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    plan: CpuAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
) -> None:
    if plan.padded_decode_groups is None:  # the step's first layer plans for all the others
        plan.padded_decode_groups = plan_decode_groups(plan.decode, plan.block_size)
    for group in plan.padded_decode_groups:
        _group_attention(query, key_slots, value_slots, group, scale, out)


def plan_decode_groups(rows: DecodeRows, block_size: int) -> list[DecodeGroup]:
    return [_plan_group(rows, members, block_size) for members in _split_by_length(rows.seq_lens)]


def _split_by_length(
    seq_lens: torch.Tensor,  # [rows] int32
) -> list[torch.Tensor]:  # [group_rows] int64 each, indices into the decode rows
    order = torch.argsort(seq_lens)
    groups, group = [], []
    for row, seq_len in zip(order.tolist(), seq_lens[order].tolist()):
        # Ascending order: this row is the group's longest, so it sets the padded length.
        if group and (len(group) + 1) * seq_len > DECODE_GROUP_KEY_TOKENS:
            groups.append(group)
            group = []
        group.append(row)
    if group:
        groups.append(group)
    return [torch.tensor(group, dtype=torch.int64) for group in groups]


def _plan_group(
    rows: DecodeRows,
    members: torch.Tensor,  # [group_rows] int64, indices into the decode rows
    block_size: int,
) -> DecodeGroup:
    lens = rows.seq_lens[members].long()
    max_len = int(lens.max())
    positions = torch.arange(max_len).expand(members.numel(), max_len)
    key_mask = positions < lens[:, None]
    # Padding keys point at the row's own first token rather than past its end: that slot holds
    # a real finite value, whereas unwritten cache memory may hold NaN, and a masked NaN key or
    # value still poisons the softmax sum (NaN * 0 = NaN).
    positions = torch.where(key_mask, positions, 0)
    return DecodeGroup(
        token_ids=rows.token_ids[members],
        slot_ids=slot_ids(rows.block_tables[members], positions, block_size).reshape(-1),
        key_mask=key_mask[:, None, None, :],
        max_len=max_len,
    )


def _group_attention(
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
