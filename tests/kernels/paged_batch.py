"""Random varlen batches over a paged KV cache, shared by the kernel tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels import kv_quant
from kvrelay.kernels.metadata import AttentionMetadata, build_attention_metadata
from kvrelay.kernels.store_kv_torch import store_kv_reference


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float


def random_block_tables(
    seq_lens: list[int], block_size: int, generator: torch.Generator, spare_blocks: int = 3, pad: int = 0
) -> tuple[torch.Tensor, int]:
    """Block tables drawn from a shuffled pool, so no sequence owns a contiguous run by luck."""
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq, default=0) + 1  # one extra column of padding
    tables = torch.full((len(seq_lens), width), pad, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = pool[used : used + count]
        used += count
    return tables, num_blocks


def slots_of(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    slots = []
    for seq, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots.append(block_tables[seq].long()[positions // block_size] * block_size + positions % block_size)
    return torch.cat(slots)


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    pad: int = 0,
    strided_query: bool = False,
    window: int = 0,
    kv_format: str = "auto",  # or an 8-bit format (kernels/kv_quant.py): keys and values coded
) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    block_tables, num_blocks = random_block_tables(seq_lens, block_size, generator, pad=pad)
    fmt = kv_quant.parse(kv_format)
    cache_shape = (num_blocks, block_size, num_kv_heads, kv_quant.row_width(head_dim, fmt))
    # NaN everywhere no token was stored: reading an unwritten slot must show up in the output.
    # (An 8-bit row of 0xff bytes has a NaN scale.)
    k_cache, v_cache = (torch.full(cache_shape, float("nan"), dtype=dtype) if fmt is None else
                        torch.full(cache_shape, 0xff, dtype=torch.uint8).view(fmt.dtype)
                        for _ in range(2))
    num_cached = sum(seq_lens)
    keys = torch.randn(num_cached, num_kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_cached, num_kv_heads, head_dim, generator=generator).to(dtype)
    store_kv_reference(keys, values, k_cache, v_cache, slots_of(block_tables, seq_lens, block_size))

    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_q_heads + 2, head_dim, generator=generator).to(dtype)
    # A head slice of a wider tensor, like q split out of a fused qkv projection.
    query = query[:, 1 : num_q_heads + 1] if strided_query else query[:, :num_q_heads].contiguous()
    cu_seqlens_q = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    meta = build_attention_metadata(
        cu_seqlens_q, torch.tensor(seq_lens, dtype=torch.int32), block_tables, block_size, window=window
    )
    return PagedBatch(query, k_cache, v_cache, meta, scale=head_dim**-0.5)
