"""Per-step attention metadata, built once and shared by every layer of a forward pass."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels.cpu_plan import CpuAttentionPlan, plan_cpu_attention


@dataclass(slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, query token offsets into the flat batch
    seq_lens: torch.Tensor  # [num_seqs] int32, cached tokens per sequence incl. the new ones
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    block_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    # Sliding window of every layer that uses this metadata: the query at position i sees keys
    # i - window < j <= i; 0 is full causal attention (kernels/sliding_window.py).
    window: int = 0
    # Only for CPU tensors: the decode/prefill split and gather indices of the torch fast path.
    cpu_plan: CpuAttentionPlan | None = None

    def __post_init__(self):
        num_seqs = self.seq_lens.shape[0]
        if self.cu_seqlens_q.shape != (num_seqs + 1,):
            raise ValueError(f"cu_seqlens_q must be [{num_seqs + 1}], got {list(self.cu_seqlens_q.shape)}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {list(self.block_tables.shape)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0: no window), got {self.window}")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_attention_metadata(
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    block_size: int,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window: int = 0,
) -> AttentionMetadata:
    # Callers on GPU should pass the maxima: computing them here costs a device sync.
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if seq_lens.numel() else 0
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max()) if seq_lens.numel() else 0
    meta = AttentionMetadata(
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        block_size=block_size,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        window=window,
    )
    if seq_lens.device.type == "cpu":
        meta.cpu_plan = plan_cpu_attention(cu_seqlens_q, seq_lens, block_tables, block_size, window)
    return meta
