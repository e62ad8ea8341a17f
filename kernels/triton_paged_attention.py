"""One Triton paged attention kernel for varlen queries: decode, prefill and chunked prefill.

A program owns a tile of BLOCK_Q query tokens of one sequence and one kv head. Its rows are
those tokens times the GQA group of q heads sharing the kv head (BLOCK_M = BLOCK_Q * group),
so each K/V tile read from the paged cache serves the whole group. It walks the sequence's keys
in TILE_N chunks, looking up physical blocks in the block table in-kernel, with an online
softmax in fp32 and a causal mask shifted by the sequence's cached context.

A sliding window (meta.window) starts a program's keys at its first query's first visible key,
so block-table entries before it are never loaded, and masks each row's keys before its own
window; a soft cap bends the scores before the mask. Both are compile-time switches: the
default kernel is the one without them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.triton_support import ensure_runnable

LOG2_E = 1.4426950408889634
TILE_N = 32  # keys per inner step; independent of the cache block size


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, q_tile, BLOCK_Q: tl.constexpr):
    # Sequence s owns the tiles starting at cu_seqlens_q[s] // BLOCK_Q + s (a layout with room
    # for every sequence's partial last tile); find the last s whose first tile is <= q_tile.
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        low = tl.where(first_tile <= q_tile, mid + 1, low)
        high = tl.where(first_tile <= q_tile, high, mid)
    return low - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    qk_scale_log2,  # softmax scale times log2(e): the softmax runs on exp2
    window,  # sliding window in keys (read only with HAS_WINDOW)
    soft_cap_log2,  # soft cap times log2(e), the cap of the base-2 scores (read only with HAS_SOFT_CAP)
    num_seqs,
    head_dim,
    out_stride_token,
    out_stride_head,
    query_stride_token,
    query_stride_head,
    k_stride_block,
    k_stride_offset,
    k_stride_head,
    v_stride_block,
    v_stride_offset,
    v_stride_head,
    block_tables_stride,
    GROUP_SIZE: tl.constexpr,  # q heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q * GROUP_SIZE rounded up to a power of two
    TILE_N: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands (the CPU interpreter cannot dot bf16)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs out of TF32
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, q_tile, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile_in_seq = q_tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= query_len:
        return  # a spare program of the over-provisioned grid
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    rows = tl.arange(0, BLOCK_M)
    q_token = tile_in_seq * BLOCK_Q + rows // GROUP_SIZE  # token index inside the sequence
    q_head = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_valid = (rows < BLOCK_Q * GROUP_SIZE) & (q_token < query_len)
    q_position = context_len + q_token
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < head_dim

    q_rows = (q_start + q_token).to(tl.int64) * query_stride_token + q_head * query_stride_head
    query = tl.load(
        query_ptr + q_rows[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )
    if DOT_IN_FP32:
        query = query.to(tl.float32)

    # Keys past the tile's last query position are masked for every row, so never read them.
    num_keys = context_len + tl.minimum(query_len, (tile_in_seq + 1) * BLOCK_Q)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    first_key = 0
    if HAS_WINDOW:  # the tile's first query sees the earliest keys of all its rows
        first_key = tl.maximum(context_len + tile_in_seq * BLOCK_Q - window + 1, 0)
    for key_start in range(first_key, num_keys, TILE_N):
        key_position = key_start + tl.arange(0, TILE_N)
        key_valid = key_position < num_keys
        physical_block = tl.load(block_table + key_position // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offset = key_position % BLOCK_SIZE
        k_rows = physical_block * k_stride_block + offset * k_stride_offset + kv_head * k_stride_head
        v_rows = physical_block * v_stride_block + offset * v_stride_offset + kv_head * v_stride_head
        keys_t = tl.load(  # [HEAD_DIM_PADDED, TILE_N], transposed for the QK^T dot
            k_cache_ptr + k_rows[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None], other=0.0
        )
        values = tl.load(
            v_cache_ptr + v_rows[:, None] + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :], other=0.0
        )
        if DOT_IN_FP32:
            keys_t = keys_t.to(tl.float32)
            values = values.to(tl.float32)

        scores = tl.dot(query, keys_t, input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, TILE_N] fp32
        if HAS_SOFT_CAP:
            # cap * tanh(s / cap) on base-2 scores: tanh(y) = sign(y) (1 - e) / (1 + e), with
            # e = exp(-2 |y|) = 2^(-2 |y| log2 e) <= 1.
            e = tl.exp2(tl.abs(scores) * (-2.0 * 1.4426950408889634 / soft_cap_log2))
            capped = soft_cap_log2 * (1.0 - e) / (1.0 + e)
            scores = tl.where(scores < 0.0, -capped, capped)
        allowed = key_valid[None, :] & (key_position[None, :] <= q_position[:, None])
        if HAS_WINDOW:
            allowed = allowed & (key_position[None, :] > q_position[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Rows with no allowed key yet (only padding rows) keep a finite max: no inf - inf.
        new_max = tl.where(new_max > float("-inf"), new_max, 0.0)
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        row_max = new_max

    row_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    attended = acc / row_sum[:, None]
    o_rows = (q_start + q_token).to(tl.int64) * out_stride_token + q_head * out_stride_head
    tl.store(
        out_ptr + o_rows[:, None] + dims[None, :],
        attended.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def _tile_shape(group_size: int, max_seqlen_q: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): small tiles when every row is a decode, larger ones for prefill."""
    min_rows = 16 if max_seqlen_q <= 1 else 64  # tl.dot needs at least 16 rows
    block_m = max(min_rows, triton.next_power_of_2(group_size))
    return block_m, block_m // group_size


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float = 0.0,  # > 0: scores become soft_cap * tanh(score / soft_cap)
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    for tensor in (query, k_cache, v_cache, out):
        if tensor.stride(-1) != 1:
            raise ValueError("paged_attention_triton needs a unit stride on head_dim")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads do not split into {num_kv_heads} kv head groups")
    group_size = num_q_heads // num_kv_heads
    block_m, block_q = _tile_shape(group_size, meta.max_seqlen_q)
    # Enough tiles for every sequence's partial last tile; the extra programs return at once.
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads)
    ensure_runnable(_paged_attention_kernel, query.device)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        scale * LOG2_E,
        meta.window,
        soft_cap * LOG2_E,
        meta.num_seqs,
        head_dim,
        out.stride(0),
        out.stride(1),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=TILE_N,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        # Triton only runs CPU tensors through its interpreter, whose dot multiplies bf16 as raw
        # uint16 bits; on GPUs bf16 operands go to the tensor cores as they are.
        DOT_IN_FP32=query.device.type == "cpu",
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_WINDOW=meta.window > 0,
        HAS_SOFT_CAP=soft_cap > 0,
    )
    return out
