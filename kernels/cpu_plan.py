"""What the CPU attention path needs per step, computed once and shared by all layers.

Decode rows (one query token) go to the native kernel as index tensors it reads directly; only
if that kernel is unavailable does the torch path derive its padded gather groups from them (on
first use, see cpu_decode_torch.py). Prefill sequences go to the native prefill kernel the same
way (PrefillRows), or one by one through SDPA (PrefillSeq) where it does not run.
A sequence with a few query tokens (a speculative step's token and drafts) becomes that many
decode rows, row j seeing the keys up to its own position: causal. The native decode op finds
such runs of consecutive rows again (csrc/paged_decode_runs.cpp): in bf16 it computes each run as
one short causal block on the prefill kernel, reading its keys once; in fp32 each row's attention
is computed exactly as a plain decode step would compute it.
With a sliding window (the plan's `window`), every index built here starts at a query's first
visible key (sliding_window.py): block-table entries before it are never looked up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels.sliding_window import first_visible_key, limits_keys

# Sequences with at most this many query tokens are planned as decode rows (1 + the most
# speculative drafts, spec/config.py).
MAX_DECODE_ROWS_PER_SEQ = 17


@dataclass(slots=True)
class DecodeRows:
    token_ids: torch.Tensor  # [rows] int64, rows of the flat batch holding the decode queries
    seq_lens: torch.Tensor  # [rows] int32, contiguous; keys of each row incl. its new token
    block_tables: torch.Tensor  # [rows, max_blocks_per_seq] int32, contiguous

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]


@dataclass(slots=True)
class PrefillRows:
    """The prefill sequences as the native kernel reads them: sequence s has query_lens[s]
    queries at rows token_starts[s].. of the flat batch, the last of its seq_lens[s] keys."""
    token_starts: torch.Tensor  # [seqs] int64
    query_lens: torch.Tensor  # [seqs] int32
    seq_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, max_blocks_per_seq] int32, contiguous


@dataclass(slots=True)
class PrefillSeq:
    token_start: int
    query_len: int
    # [num_keys] int64, cache slots of the keys the queries see: the whole sequence, or with a
    # sliding window its keys from the first query's first visible one
    slot_ids: torch.Tensor
    # [query_len, num_keys] bool, causal and windowed; None (plain causal over the whole
    # sequence) when no window limits it and context <= query_len
    causal_mask: torch.Tensor | None


# Built by cpu_decode_torch.plan_decode_groups, but defined here beside the plan that holds it,
# so that cpu_decode_torch depends on this module and not the other way round.
@dataclass(slots=True)
class DecodeGroup:
    token_ids: torch.Tensor  # [rows] int64, rows of the flat batch holding these decode queries
    slot_ids: torch.Tensor  # [rows * max_len] int64, cache slots gathered as each row's keys
    key_mask: torch.Tensor  # [rows, 1, 1, max_len] bool, True where the key belongs to the row
    max_len: int


@dataclass(slots=True)
class CpuAttentionPlan:
    decode: DecodeRows
    block_size: int
    num_tokens: int  # the step's query rows (a padded step's tensors have more)
    window: int = 0  # the metadata's sliding window (0: none)
    prefill_rows: PrefillRows | None = None  # None: no prefill sequence in the step
    # The torch decode path's padded groups: built by the first layer that needs them, if any.
    padded_decode_groups: list[DecodeGroup] | None = None
    # SDPA's per-sequence plans (slot ids, masks): built only where the native prefill kernel
    # does not run, by the first layer that needs them.
    sdpa_prefills: list[PrefillSeq] | None = None

    @property
    def prefills(self) -> list[PrefillSeq]:
        if self.sdpa_prefills is None:
            self.sdpa_prefills = _plan_prefills(self.prefill_rows, self.block_size, self.window)
        return self.sdpa_prefills


def plan_cpu_attention(
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    block_size: int,
    window: int = 0,
) -> CpuAttentionPlan:
    query_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if bool((seq_lens < query_lens).any()):
        raise ValueError("seq_lens must include the new query tokens (seq_len >= query_len)")
    prefill_seqs = (query_lens > MAX_DECODE_ROWS_PER_SEQ).nonzero().squeeze(1).tolist()
    decode = _decode_rows(query_lens, cu_seqlens_q, seq_lens, block_tables)
    return CpuAttentionPlan(decode=decode, block_size=block_size,
                            num_tokens=int(cu_seqlens_q[-1]), window=window,
                            prefill_rows=_prefill_rows(prefill_seqs, cu_seqlens_q, query_lens,
                                                       seq_lens, block_tables))


def _prefill_rows(
    seqs: list[int],
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    query_lens: torch.Tensor,  # [num_seqs] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
) -> PrefillRows | None:
    if not seqs:
        return None
    index = torch.tensor(seqs, dtype=torch.long)
    return PrefillRows(
        token_starts=cu_seqlens_q[index].long(),
        query_lens=query_lens[index].to(torch.int32).contiguous(),
        seq_lens=seq_lens[index].to(torch.int32).contiguous(),
        block_tables=block_tables[index].to(torch.int32).contiguous(),
    )


def _decode_rows(
    query_lens: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
) -> DecodeRows:
    if bool((query_lens == 1).all()):  # a pure decode step, the common case: no row selection
        token_ids, lens, tables = cu_seqlens_q[:-1], seq_lens, block_tables
    else:
        token_ids, lens, tables = _short_query_rows(query_lens, cu_seqlens_q, seq_lens,
                                                    block_tables)
    return DecodeRows(
        token_ids=token_ids.long(),
        seq_lens=lens.to(torch.int32).contiguous(),
        block_tables=tables.to(torch.int32).contiguous(),
    )


def _short_query_rows(
    query_lens: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [rows] each, tables [rows, max_blocks]
    """One decode row per query token of each short sequence: token j of a sequence with q
    queries and s keys attends to its first s - q + 1 + j keys."""
    seqs = (query_lens <= MAX_DECODE_ROWS_PER_SEQ).nonzero().squeeze(1)
    counts = query_lens[seqs].long()  # [n]
    seq_of_row = seqs.repeat_interleave(counts)  # [rows]
    first_row = torch.cumsum(counts, 0) - counts  # [n]
    offset = torch.arange(int(counts.sum())) - first_row.repeat_interleave(counts)  # [rows]
    token_ids = cu_seqlens_q[seq_of_row].long() + offset
    lens = seq_lens[seq_of_row].long() - query_lens[seq_of_row].long() + 1 + offset
    return token_ids, lens, block_tables[seq_of_row]


def slot_ids(
    block_table_rows: torch.Tensor,  # [rows, max_blocks_per_seq] int32
    positions: torch.Tensor,  # [rows, length] int64, token positions inside each sequence
    block_size: int,
) -> torch.Tensor:  # [rows, length] int64
    blocks = block_table_rows.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _plan_prefills(rows: PrefillRows | None, block_size: int, window: int) -> list[PrefillSeq]:
    if rows is None:
        return []
    return [_plan_prefill(int(start), int(query_len), int(seq_len), table, block_size, window)
            for start, query_len, seq_len, table in zip(rows.token_starts, rows.query_lens,
                                                        rows.seq_lens, rows.block_tables)]


def _plan_prefill(
    token_start: int,
    query_len: int,
    seq_len: int,
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    block_size: int,
    window: int,
) -> PrefillSeq:
    context_len = seq_len - query_len
    if not limits_keys(window, seq_len):
        window = 0  # every query sees all its keys: plain causal attention, cheaper below
    positions = torch.arange(first_visible_key(context_len, window), seq_len)
    causal_mask = None
    # A short context (e.g. a prefix-cache hit) is cheaper as is_causal over padded queries
    # than as a mask (see attention_cpu._causal_with_short_context): no mask then.
    if context_len > query_len or window:
        query_positions = context_len + torch.arange(query_len)
        causal_mask = positions[None, :] <= query_positions[:, None]
        if window:
            causal_mask &= positions[None, :] > query_positions[:, None] - window
    return PrefillSeq(
        token_start=token_start,
        query_len=query_len,
        slot_ids=slot_ids(block_table[None], positions[None], block_size)[0],
        causal_mask=causal_mask,
    )
