"""The torch decode path, kept for where the native kernel cannot be built: decode rows sorted
by length and cut into groups, each gathered into padded K/V and run through one SDPA call (or,
with a soft cap, which SDPA lacks, the explicit soft_capped_attention). With a sliding window a
row gathers only the keys it sees, from its first visible one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.kernels.kv_quant import as_float_rows
from kvrelay.kernels.cpu_plan import CpuAttentionPlan, DecodeGroup, DecodeRows, slot_ids
from kvrelay.kernels.soft_capped_attention import soft_capped_attention

# Padded key tokens per decode group (rows * longest row). Gathering the whole decode batch at
# once measured 2-4x slower than chunks of this size on SmolLM2-135M (3 kv heads x 64 dims): a
# multi-MB gather is fresh mmap'd memory every layer, page faults and all, and it falls out of
# cache before SDPA reads it back. Sorting by length first keeps the padding small too.
DECODE_GROUP_KEY_TOKENS = 4096


def decode_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_slots: torch.Tensor,  # [num_slots, num_kv_heads, row_width] (8-bit rows: kv_quant.py)
    value_slots: torch.Tensor,  # [num_slots, num_kv_heads, row_width]
    plan: CpuAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float = 0.0,
) -> None:
    if plan.padded_decode_groups is None:  # the step's first layer plans for all the others
        plan.padded_decode_groups = plan_decode_groups(plan.decode, plan.block_size, plan.window)
    for group in plan.padded_decode_groups:
        _group_attention(query, key_slots, value_slots, group, scale, out, soft_cap)


def plan_decode_groups(rows: DecodeRows, block_size: int, window: int = 0) -> list[DecodeGroup]:
    first_keys = _first_keys(rows.seq_lens, window)
    key_counts = rows.seq_lens.long() - first_keys
    return [_plan_group(rows, members, first_keys, key_counts, block_size)
            for members in _split_by_length(key_counts)]


def _first_keys(
    seq_lens: torch.Tensor,  # [rows] int32, keys of each row incl. its own
    window: int,
) -> torch.Tensor:  # [rows] int64, each row's first visible key
    # A decode row's query is its last key, at position seq_len - 1: first_visible_key of that,
    # max(0, seq_len - window), for all rows at once.
    if window <= 0:
        return torch.zeros(seq_lens.shape[0], dtype=torch.int64)
    return (seq_lens.long() - window).clamp(min=0)


def _split_by_length(
    key_counts: torch.Tensor,  # [rows] int64, keys each row sees
) -> list[torch.Tensor]:  # [group_rows] int64 each, indices into the decode rows
    order = torch.argsort(key_counts)
    groups, group = [], []
    for row, seq_len in zip(order.tolist(), key_counts[order].tolist()):
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
    first_keys: torch.Tensor,  # [rows] int64, each decode row's first visible key
    key_counts: torch.Tensor,  # [rows] int64, keys each decode row sees
    block_size: int,
) -> DecodeGroup:
    lens = key_counts[members]
    max_len = int(lens.max())
    offsets = torch.arange(max_len).expand(members.numel(), max_len)
    key_mask = offsets < lens[:, None]
    # Padding keys point at the row's own first visible key rather than past its end: that slot
    # holds a real finite value, whereas unwritten cache memory may hold NaN, and a masked NaN
    # key or value still poisons the softmax sum (NaN * 0 = NaN).
    positions = first_keys[members][:, None] + torch.where(key_mask, offsets, 0)
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
    soft_cap: float,
) -> None:
    rows = group.token_ids.numel()
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = key_slots.shape[1]
    keys = as_float_rows(key_slots.index_select(0, group.slot_ids), query.dtype)
    values = as_float_rows(value_slots.index_select(0, group.slot_ids), query.dtype)
    keys = keys.view(rows, group.max_len, num_kv_heads, head_dim)
    values = values.view(rows, group.max_len, num_kv_heads, head_dim)
    # The q heads of one kv head become that head's query "sequence": plain attention, no GQA
    # expansion, and the per-row key mask broadcasts over them.
    queries = query.index_select(0, group.token_ids).view(rows, num_kv_heads, -1, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [rows, num_kv_heads, max_len, head_dim]
    if soft_cap > 0:
        attended = soft_capped_attention(queries, keys, values, group.key_mask, scale, soft_cap)
    else:
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.key_mask, scale=scale)
    # attended: [rows, num_kv_heads, group_size, head_dim]
    out.index_copy_(0, group.token_ids, attended.reshape(rows, num_q_heads, head_dim))
