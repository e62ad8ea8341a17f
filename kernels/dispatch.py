"""Entry points the model runner calls: Triton on CUDA tensors, the torch fast path on CPU.

KV layout, per layer and for K and V alike: [num_blocks, block_size, num_kv_heads, head_dim];
a token's slot is block_id * block_size + offset.

kvrelay.kernels has no __init__.py on purpose: its folder sits at the top of the repository,
where a regular package named `kernels` would shadow Hugging Face's `kernels` distribution
(which transformers imports) for anything run from the checkout. Import the modules directly."""
from __future__ import annotations

import torch

from kvrelay.kernels.attention_cpu import paged_attention_cpu
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels import kv_quant
from kvrelay.kernels.store_kv_torch import store_kv_cpu, store_kv_torch


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 means skip the token
) -> None:
    if k_cache.is_cuda and kv_quant.format_of(k_cache) is not None:
        # 8-bit rows: torch's ops rotate and code them (kv_quant.py), a few launches per layer
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping)
    elif k_cache.is_cuda:
        # Imported here so that CPU-only installs never need a working triton.
        from kvrelay.kernels.triton_store_kv import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each query over its sequence's cached keys, limited to meta.window
    keys where that is > 0; soft_cap > 0 caps each score s = scale * q.k to
    soft_cap * tanh(s / soft_cap) before the mask and softmax (kernels/attention_reference.py)."""
    if soft_cap < 0:
        raise ValueError(f"soft_cap must be >= 0 (0: none), got {soft_cap}")
    if query.is_cuda:
        from kvrelay.kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, meta, scale, out, soft_cap)
    return paged_attention_cpu(query, k_cache, v_cache, meta, scale, out, soft_cap)
