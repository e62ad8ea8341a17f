"""Fast paged attention for CPU: decode rows and prefill sequences in native kernels.

Both read K/V in place through the block table (kernels/csrc/paged_decode.cpp, paged_prefill.cpp;
a speculative step's bf16 runs of rows go to the prefill kernel, paged_decode_runs.cpp).
Where a kernel cannot be built, or does not take the dtypes or shapes, decode rows go the torch
way (cpu_decode_torch.py) and prefill sequences one SDPA call each (with a soft cap, which SDPA
lacks, an explicit fp32 path). All indices and masks come from the step's CpuAttentionPlan,
which holds the sliding window: the torch paths gather only the keys a query sees.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.kernels import kv_quant, native_cpu
from kvrelay.kernels.cpu_decode_torch import decode_attention_torch
from kvrelay.kernels.cpu_plan import CpuAttentionPlan, PrefillSeq
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.soft_capped_attention import soft_capped_attention

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float = 0.0,  # > 0: scores become soft_cap * tanh(score / soft_cap)
) -> torch.Tensor:
    plan = meta.cpu_plan
    if plan is None:
        raise ValueError("metadata has no CPU plan: build it from CPU tensors")
    if out is None:
        out = torch.empty_like(query)
        # Rows past the batch's tokens (a step padded to a bucketed size) are no query's: zero
        # rather than whatever the allocator left there, for the layers after them.
        if plan.num_tokens < query.shape[0]:
            out[plan.num_tokens:].zero_()
    if plan.decode.num_rows:
        _decode_attention(query, k_cache, v_cache, plan, scale, out, soft_cap)
    if plan.prefill_rows is not None and not _native_prefill(query, k_cache, v_cache, plan,
                                                              scale, out, soft_cap):
        key_slots, value_slots = _slot_major(k_cache), _slot_major(v_cache)
        for seq in plan.prefills:
            _prefill_attention(query, key_slots, value_slots, seq, scale, out, soft_cap)
    return out


def _decode_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: CpuAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float,
) -> None:
    native = native_cpu.paged_decode_op() if _native_takes(query, k_cache, v_cache, out) else None
    if native is None:
        decode_attention_torch(query, _slot_major(k_cache), _slot_major(v_cache), plan, scale, out,
                               soft_cap)
        return
    rows = plan.decode
    native(out, query, k_cache, v_cache, rows.token_ids, rows.seq_lens, rows.block_tables, scale,
           plan.window, soft_cap)


def _native_prefill(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: CpuAttentionPlan,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float,
) -> bool:
    """Every prefill sequence of the step in one native call; False where the kernel does not
    run (then the SDPA path does)."""
    native = native_cpu.paged_prefill_op() if _native_takes(query, k_cache, v_cache, out) else None
    float_cache_of_other_dtype = kv_quant.format_of(k_cache) is None and query.dtype != k_cache.dtype
    if native is None or float_cache_of_other_dtype or not native_cpu.paged_prefill_supported(
            query.shape[2], query.shape[1] // k_cache.shape[2]):
        return False
    rows = plan.prefill_rows
    native(out, query, k_cache, v_cache, rows.token_starts, rows.query_lens, rows.seq_lens,
           rows.block_tables, scale, plan.window, soft_cap)
    return True


def _native_takes(query, k_cache, v_cache, out) -> bool:
    """The layouts and dtypes the native kernel reads (8-bit codes too); others (fp16, odd
    strides) go via torch."""
    return (
        query.dtype in NATIVE_DTYPES
        and (k_cache.dtype in NATIVE_DTYPES or kv_quant.format_of(k_cache) is not None)
        and v_cache.dtype == k_cache.dtype
        and out.dtype == query.dtype
        and query.stride(-1) == 1
        and out.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _slot_major(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]
) -> torch.Tensor:  # [num_slots, num_kv_heads, row_width]
    # One index_select on this view gathers whole [num_kv_heads, head_dim] rows.
    return cache.view(-1, cache.shape[2], cache.shape[3])


def _prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    value_slots: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    seq: PrefillSeq,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float,
) -> None:
    tokens = slice(seq.token_start, seq.token_start + seq.query_len)
    keys = kv_quant.as_float_rows(key_slots.index_select(0, seq.slot_ids), query.dtype)
    values = kv_quant.as_float_rows(value_slots.index_select(0, seq.slot_ids), query.dtype)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [num_kv_heads, num_keys, head_dim]
    queries = query[tokens].transpose(0, 1)  # [num_q_heads, query_len, head_dim]
    if soft_cap > 0:
        attended = _soft_capped(queries, keys, values, _visible(seq), scale, soft_cap)
    elif seq.causal_mask is None:
        context_len = seq.slot_ids.numel() - seq.query_len
        attended = _causal_with_short_context(queries, keys, values, context_len, scale)
    else:
        attended = _masked(queries, keys, values, seq.causal_mask, scale)
    out[tokens] = attended.transpose(0, 1)


def _causal_with_short_context(
    queries: torch.Tensor,  # [num_q_heads, query_len, head_dim]
    keys: torch.Tensor,  # [num_kv_heads, seq_len, head_dim]
    values: torch.Tensor,  # [num_kv_heads, seq_len, head_dim]
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [num_q_heads, query_len, head_dim]
    # SDPA's fast CPU kernel takes is_causal (top-left aligned) with GQA but no mask. Padding
    # the queries with context_len dummy rows makes the causal square line up with the keys;
    # the dummy rows cost context_len / seq_len extra work and are dropped. Used when the
    # context is short (typically a prefix-cache hit), where this beats the masked path.
    if context_len:
        padding = queries.new_zeros(queries.shape[0], context_len, queries.shape[2])
        queries = torch.cat((padding, queries), dim=1)
    attended = F.scaled_dot_product_attention(queries[None], keys[None], values[None],
                                              is_causal=True, scale=scale, enable_gqa=True)
    return attended[0, :, context_len:]


def _visible(seq: PrefillSeq) -> torch.Tensor:  # [query_len, num_keys] bool
    """The plan's mask, or where it has none (plain causal over the whole sequence) that one."""
    if seq.causal_mask is not None:
        return seq.causal_mask
    context_len = seq.slot_ids.numel() - seq.query_len
    query_positions = context_len + torch.arange(seq.query_len)
    return torch.arange(seq.slot_ids.numel())[None, :] <= query_positions[:, None]


def _soft_capped(
    queries: torch.Tensor,  # [num_q_heads, query_len, head_dim]
    keys: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    values: torch.Tensor,  # [num_kv_heads, num_keys, head_dim]
    visible: torch.Tensor,  # [query_len, num_keys] bool
    scale: float,
    soft_cap: float,
) -> torch.Tensor:  # [num_q_heads, query_len, head_dim]
    group_size = queries.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group_size, dim=0)
    values = values.repeat_interleave(group_size, dim=0)
    return soft_capped_attention(queries, keys, values, visible, scale, soft_cap)


def _masked(
    queries: torch.Tensor,  # [num_q_heads, query_len, head_dim]
    keys: torch.Tensor,  # [num_kv_heads, seq_len, head_dim]
    values: torch.Tensor,  # [num_kv_heads, seq_len, head_dim]
    causal_mask: torch.Tensor,  # [query_len, seq_len] bool
    scale: float,
) -> torch.Tensor:  # [num_q_heads, query_len, head_dim]
    group_size = queries.shape[0] // keys.shape[0]
    if group_size > 1:
        # SDPA's CPU flash kernel rejects enable_gqa together with a mask and falls back to the
        # math path, ~50x slower on a 200-token chunk; expanding the kv heads keeps it on flash.
        keys = keys.repeat_interleave(group_size, dim=0)
        values = values.repeat_interleave(group_size, dim=0)
    attended = F.scaled_dot_product_attention(queries[None], keys[None], values[None],
                                              attn_mask=causal_mask, scale=scale)
    return attended[0]
