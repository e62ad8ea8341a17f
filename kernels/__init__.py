"""Paged-KV kernels: Triton for CUDA tensors, torch for CPU, and torch references for tests.

KV layout, per layer and for K and V alike: [num_blocks, block_size, num_kv_heads, head_dim];
a token's slot is block_id * block_size + offset.
"""
from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_reference import paged_attention_reference
from kernels.dispatch import paged_attention, store_kv
from kernels.metadata import AttentionMetadata, build_attention_metadata
from kernels.store_kv_torch import store_kv_cpu, store_kv_reference

# The Triton entry points load on first use: importing triton must not be needed (or able to
# fail) just to import kernels, and TRITON_INTERPRET is read when the kernels are decorated.
_TRITON_ENTRY_POINTS = {
    "store_kv_triton": "kernels.triton_store_kv",
    "paged_attention_triton": "kernels.triton_paged_attention",
}


def __getattr__(name: str):
    if name in _TRITON_ENTRY_POINTS:
        import importlib

        return getattr(importlib.import_module(_TRITON_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_reference",
    "paged_attention_triton",
    "store_kv",
    "store_kv_cpu",
    "store_kv_reference",
    "store_kv_triton",
]
