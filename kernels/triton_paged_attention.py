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

An 8-bit cache (kernels/kv_quant.py) is read as bytes: each K/V row's codes are decoded in the
kernel (KV_CODE: int8 converts; an fp8 code's bits shift into an fp32's, as kv_codes.h does on
CPU) and multiplied by the row's float32 scale, which sits after its codes. Its rows hold
rotated K and V, so the wrapper hands the kernel the rotated queries (in fp32) and rotates the
output back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.triton_support import ensure_runnable

LOG2_E = 1.4426950408889634
TILE_N = 32  # keys per inner step; independent of the cache block size
KV_CODES = {None: 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}  # the kernel's KV_CODE


@triton.jit
def _decode_codes(codes, KV_CODE: tl.constexpr):
    """uint8 codes -> fp32 values before the row's scale: int8 converts; an fp8 code's exponent
    and mantissa go into an fp32's low exponent and high mantissa bits (the code's value times
    2^(its bias - 127)), and one multiply by a power of two restores it."""
    if KV_CODE == 1:
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    bits = codes.to(tl.uint32)
    if KV_CODE == 2:  # e4m3: bias 7, 3 mantissa bits
        magnitude = (bits & 0x7F) << 20
        rebias = 1.329227995784916e36  # 2^120
    else:  # e5m2: bias 15, 2 mantissa bits
        magnitude = (bits & 0x7F) << 21
        rebias = 5.192296858534828e33  # 2^112
    return (magnitude | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True) * rebias


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
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, row_width]; bytes for 8-bit codes
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, row_width]
    k_scale_ptr,  # the K cache as float32 (8-bit codes: a row's scale follows its codes)
    v_scale_ptr,  # the V cache as float32
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
    KV_CODE: tl.constexpr,  # 0: a float cache; else the 8-bit code (KV_CODES)
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
        if KV_CODE != 0:  # a row's scale: the float32 after its head_dim code bytes
            k_scale = tl.load(k_scale_ptr + (k_rows + head_dim) // 4, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + (v_rows + head_dim) // 4, mask=key_valid, other=0.0)
            keys_t = _decode_codes(keys_t, KV_CODE) * k_scale[None, :]
            values = _decode_codes(values, KV_CODE) * v_scale[:, None]
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
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    fmt = kv_quant.format_of(k_cache)
    if fmt is not None:  # rotated rows: rotated fp32 queries in, the output rotated back
        rotated_out = _launch(kv_quant.rotate(query), k_cache.view(torch.uint8),
                              v_cache.view(torch.uint8), meta, scale, None, soft_cap, fmt.name)
        out.copy_(kv_quant.rotate(rotated_out))
        return out
    return _launch(query, k_cache, v_cache, meta, scale, out, soft_cap, None)


def _launch(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]; uint8 for codes
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float,
    code: str | None,  # the 8-bit format of uint8 caches, or None
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
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
        k_cache.view(torch.float32) if code else k_cache,
        v_cache.view(torch.float32) if code else v_cache,
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
        KV_CODE=KV_CODES[code],
    )
    return out
