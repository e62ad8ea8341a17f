"""Paged self-attention with the options the families differ by: qkv bias, per-head q/k
RMSNorm, partial rotary, query scale, logit soft-capping; the window lives in the metadata."""
from __future__ import annotations

import torch
from torch import nn

from kvrelay.kernels import native_elementwise as fused
from kvrelay.kernels.dispatch import paged_attention, store_kv
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.engine.models.arch import ArchSpec
from kvrelay.engine.models.layers.norm import RMSNorm
from kvrelay.engine.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, spec: ArchSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, spec.norm_offset)
        self.qk_norm = spec.qk_norm
        self.scale = spec.scale
        self.soft_cap = spec.attn_soft_cap
        self.partial_rotary = spec.rotary_dim is not None and spec.rotary_dim < spec.head_dim
        self.native = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:
        # rope: cos, sin [T, 1, R]; hidden [T, hidden]; K,V [num_blocks, block_size, kv_heads, D]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)  # q and k heads, one pass
        qk = self._norm_and_rope(qk, rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        out = paged_attention(q, k_cache, v_cache, attn_meta, self.scale, soft_cap=self.soft_cap)
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _norm_and_rope(self, qk: torch.Tensor, rope) -> torch.Tensor:  # qk [T, heads, D]
        native = self.native is not None and not self.partial_rotary
        if self.qk_norm and native:  # one pass: each head normalized, then rotated
            return fused.qk_norm_rope(self.native, qk, self.q_norm.weight, self.k_norm.weight,
                                      self.num_heads, self.q_norm.eps, self.q_norm.offset, *rope)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        if native:
            return fused.rope(self.native, qk, *rope)
        return apply_rope(qk, *rope)
