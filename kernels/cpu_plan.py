"""Gather indices and masks for the CPU attention path, computed once per step for all layers.

Decode rows (one query token) are batched: sorted by length and cut into groups, each padded to
its longest sequence. Prefill rows (few, long) run one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Padded key tokens per decode group (rows * longest row). Gathering the whole decode batch at
# once measured 2-4x slower than chunks of this size on SmolLM2-135M (3 kv heads x 64 dims): a
# multi-MB gather is fresh mmap'd memory every layer, page faults and all, and it falls out of
# cache before SDPA reads it back. Sorting by length first keeps the padding small too.
DECODE_GROUP_KEY_TOKENS = 4096


@dataclass(slots=True)
class DecodeGroup:
    token_ids: torch.Tensor  # [rows] int64, rows of the flat batch holding these decode queries
    slot_ids: torch.Tensor  # [rows * max_len] int64, cache slots gathered as each row's keys
    key_mask: torch.Tensor  # [rows, 1, 1, max_len] bool, True where the key belongs to the row
    max_len: int


@dataclass(slots=True)
class PrefillSeq:
    token_start: int
    query_len: int
    slot_ids: torch.Tensor  # [seq_len] int64, cache slots of the whole sequence
    causal_mask: torch.Tensor | None  # [query_len, seq_len] bool; None without context (is_causal)


@dataclass(slots=True)
class CpuAttentionPlan:
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]


def plan_cpu_attention(
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    block_size: int,
) -> CpuAttentionPlan:
    query_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if bool((seq_lens < query_lens).any()):
        raise ValueError("seq_lens must include the new query tokens (seq_len >= query_len)")
    decode_seqs = (query_lens == 1).nonzero().squeeze(1)
    decode_groups = [
        _plan_decode_group(group, cu_seqlens_q, seq_lens, block_tables, block_size)
        for group in _split_by_length(decode_seqs, seq_lens[decode_seqs])
    ]
    prefill_seqs = (query_lens > 1).nonzero().squeeze(1).tolist()
    prefills = [
        _plan_prefill(int(cu_seqlens_q[seq]), int(query_lens[seq]), int(seq_lens[seq]), block_tables[seq], block_size)
        for seq in prefill_seqs
    ]
    return CpuAttentionPlan(decode_groups=decode_groups, prefills=prefills)


def _split_by_length(
    seqs: torch.Tensor,  # [num_decode] int64
    lens: torch.Tensor,  # [num_decode] int32
) -> list[torch.Tensor]:  # [rows] int64 each
    order = torch.argsort(lens)
    groups, group = [], []
    for seq, seq_len in zip(seqs[order].tolist(), lens[order].tolist()):
        # Ascending order: this row is the group's longest, so it sets the padded length.
        if group and (len(group) + 1) * seq_len > DECODE_GROUP_KEY_TOKENS:
            groups.append(group)
            group = []
        group.append(seq)
    if group:
        groups.append(group)
    return [torch.tensor(group, dtype=torch.int64) for group in groups]


def _slot_ids(
    block_table_rows: torch.Tensor,  # [rows, max_blocks_per_seq] int32
    positions: torch.Tensor,  # [rows, length] int64, token positions inside each sequence
    block_size: int,
) -> torch.Tensor:  # [rows, length] int64
    blocks = block_table_rows.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _plan_decode_group(
    seqs: torch.Tensor,  # [rows] int64
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    block_size: int,
) -> DecodeGroup:
    lens = seq_lens[seqs].long()
    max_len = int(lens.max())
    positions = torch.arange(max_len).expand(seqs.numel(), max_len)
    key_mask = positions < lens[:, None]
    # Padding keys point at the row's own first token rather than past its end: that slot holds
    # a real finite value, whereas unwritten cache memory may hold NaN, and a masked NaN key or
    # value still poisons the softmax sum (NaN * 0 = NaN).
    positions = torch.where(key_mask, positions, 0)
    return DecodeGroup(
        token_ids=cu_seqlens_q[seqs].long(),
        slot_ids=_slot_ids(block_tables[seqs], positions, block_size).reshape(-1),
        key_mask=key_mask[:, None, None, :],
        max_len=max_len,
    )


def _plan_prefill(
    token_start: int,
    query_len: int,
    seq_len: int,
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    block_size: int,
) -> PrefillSeq:
    positions = torch.arange(seq_len)
    context_len = seq_len - query_len
    causal_mask = None
    if context_len > 0:
        query_positions = context_len + torch.arange(query_len)
        causal_mask = positions[None, :] <= query_positions[:, None]
    return PrefillSeq(
        token_start=token_start,
        query_len=query_len,
        slot_ids=_slot_ids(block_table[None], positions[None], block_size)[0],
        causal_mask=causal_mask,
    )
