"""Torch versions of writing new K/V rows into the paged cache at their slots. An 8-bit cache
(kernels/kv_quant.py) gets each row's codes and scale: [..., head_dim + 4] bytes a row."""
from __future__ import annotations

import torch

from kvrelay.kernels import kv_quant, native_cpu


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
    for cache, rows in ((k_cache, key[keep]), (v_cache, value[keep])):
        kv_quant.byte_view(cache)[slots // block_size, slots % block_size] = _cache_rows(rows, cache)


def _cache_rows(
    rows: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]
) -> torch.Tensor:  # [num_tokens, num_kv_heads, row_width], as kv_quant.byte_view(cache) holds them
    fmt = kv_quant.format_of(cache)
    if fmt is None:
        return rows.to(cache.dtype)
    return kv_quant.quantize_rows(rows, fmt).view(torch.uint8)


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
    store_kv_torch(key, value, k_cache, v_cache, slot_mapping)


def store_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, row_width]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip the token
) -> None:
    """Torch ops on any device: where the native store does not run, and CUDA's 8-bit caches."""
    slots = slot_mapping.long()
    # Skipped tokens are rare (padding), so pay for the boolean filter only when there are any.
    if slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    num_kv_heads, row_width = k_cache.shape[2:]
    for cache, rows in ((k_cache, key), (v_cache, value)):
        kv_quant.byte_view(cache).view(-1, num_kv_heads, row_width).index_copy_(
            0, slots, _cache_rows(rows, cache))


def _native_takes(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """What the native store handles: one dtype throughout (or float32/bf16 rows into 8-bit
    codes), int64 slots, each token's heads contiguous; anything else takes the torch path."""
    coded = kv_quant.format_of(k_cache) is not None
    return (
        v_cache.dtype == k_cache.dtype
        and value.dtype == key.dtype
        and (key.dtype in (torch.float32, torch.bfloat16) if coded else key.dtype == k_cache.dtype)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and all(t.dim() == 3 and t.stride(2) == 1 and (t.size(1) == 1 or t.stride(1) == t.size(2)) for t in (key, value))
    )
