"""Fused CPU elementwise ops (kernels/csrc/cpu_elementwise.cpp): built on first use, or None.

Same build, cache and fallback rules as every native kernel (kernels/native_build.py).
"""
from __future__ import annotations

import functools

import torch

from kvrelay.common.env_switches import NATIVE_CPU_ELEMENTWISE
from kvrelay.kernels.native_build import CFLAGS, load_extension

SOURCES = ("cpu_elementwise.cpp", "cpu_elementwise_binding.cpp")


@functools.cache
def elementwise_ops():
    """Module with rms_norm, add_rms_norm, rope, qk_norm_rope, silu_and_mul and gelu_tanh_and_mul,
    or None where unavailable."""
    if not NATIVE_CPU_ELEMENTWISE.enabled():
        return None
    return load_extension("kvrelay_elementwise", SOURCES, CFLAGS,
                          "native CPU elementwise ops", "using torch ops")


def rms_norm(ops, x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: bool = False) -> torch.Tensor:
    """x [rows, hidden] contiguous; weight [hidden] -> [rows, hidden]. offset: scale by
    1 + weight in float32, rounded once (Gemma's norms)."""
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, eps, offset)
    return out


def add_rms_norm(ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, offset: bool = False) -> torch.Tensor:
    """x, residual [rows, hidden] bf16 contiguous; weight [hidden]. residual += x in place (the
    decoder's skip connection, rounded as torch's bf16 add), returns RMSNorm(residual)."""
    out = torch.empty_like(x)
    ops.add_rms_norm(out, x, residual, weight, eps, offset)
    return out


def qk_norm_rope(ops, qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 num_q_heads: int, eps: float, offset: bool, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """qk [tokens, heads, head_dim] (rows may be strided), its first num_q_heads heads q, the
    rest k; q_weight, k_weight [head_dim]; cos, sin [tokens, 1, head_dim] -> each head
    RMS-normalized with its weight, then rotated, [tokens, heads, head_dim]."""
    out = qk.new_empty(qk.shape)
    ops.qk_norm_rope(out, qk, q_weight, k_weight, num_q_heads, eps, offset, cos, sin)
    return out


def rope(ops, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (rows may be strided); cos, sin [tokens, 1, head_dim]."""
    out = x.new_empty(x.shape)
    ops.rope(out, x, cos, sin)
    return out


def silu_and_mul(ops, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] bf16 contiguous (gate | up) -> silu(gate) * up [rows, inter]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ops.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(ops, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] bf16 contiguous (gate | up) -> gelu_tanh(gate) * up."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ops.gelu_tanh_and_mul(out, gate_up)
    return out


def argmax_rows(ops, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 contiguous -> [B] int64: torch.max(-1).indices (first index on
    ties, a NaN wins), at memory speed."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ops.argmax_rows(out, logits)
    return out
