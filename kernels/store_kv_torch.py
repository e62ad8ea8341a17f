"""Torch versions of writing new K/V rows into the paged cache at their slots."""
from __future__ import annotations

import torch

from kvrelay.kernels import native_cpu


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip the token
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = key[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[keep].to(v_cache.dtype)


def store_kv_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip the token
) -> None:
    native = native_cpu.store_kv_op() if _native_takes(key, value, k_cache, v_cache, slot_mapping) else None
    if native is not None:
        native(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    # Skipped tokens are rare (padding), so pay for the boolean filter only when there are any.
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _native_takes(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """What the native store handles: one dtype throughout, int64 slots, each token's heads
    contiguous; anything else takes the torch path."""
    dtypes = (key.dtype, value.dtype, v_cache.dtype)
    return (
        all(dtype == k_cache.dtype for dtype in dtypes)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and all(t.dim() == 3 and t.stride(2) == 1 and (t.size(1) == 1 or t.stride(1) == t.size(2)) for t in (key, value))
    )
