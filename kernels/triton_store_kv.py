"""Triton kernel writing new K/V rows into the paged cache: one program per token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrelay.kernels.triton_support import ensure_runnable


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    k_cache_stride_block,
    k_cache_stride_offset,
    k_cache_stride_head,
    v_cache_stride_block,
    v_cache_stride_offset,
    v_cache_stride_head,
    num_kv_heads,
    head_dim,
    block_size,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    k_dst = k_cache_ptr + block * k_cache_stride_block + offset * k_cache_stride_offset + heads * k_cache_stride_head
    tl.store(k_dst + dims, key.to(k_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    v_dst = v_cache_ptr + block * v_cache_stride_block + offset * v_cache_stride_offset + heads * v_cache_stride_head
    tl.store(v_dst + dims, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip the token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The kernel addresses head_dim with unit stride; everything else goes by strides.
    for tensor in (key, value, k_cache, v_cache):
        if tensor.stride(-1) != 1:
            raise ValueError("store_kv_triton needs a unit stride on head_dim")
    ensure_runnable(_store_kv_kernel, key.device)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
