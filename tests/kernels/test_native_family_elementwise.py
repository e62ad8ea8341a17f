"""The fused CPU ops the other families' layers add to Llama's, against the torch modules they
replace: RMSNorm by 1 + w (Gemma), per-head q/k RMSNorm fused with rope (Qwen3, Gemma 3), and
gelu_tanh(gate) * up (Gemma)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.models.layers.norm import RMSNorm
from kvrelay.engine.models.rope import apply_rope
from kvrelay.kernels import native_elementwise as fused


def _norm(hidden: int, offset: bool, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * (0.3 if offset else 1.0))
    return norm.to(dtype)


def _mostly_equal(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Within one bf16 step anywhere (the sum of squares runs in another order) and bit-equal
    nearly everywhere."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=atol, rtol=1e-2)
    if got.dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.07)])
@pytest.mark.parametrize("rows, hidden", [(1, 640), (37, 576), (9, 100)])  # 100: scalar tail
def test_offset_rms_norm_matches_the_float32_reference(ops, dtype, atol, rows, hidden):
    norm = _norm(hidden, True, dtype)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    _mostly_equal(fused.rms_norm(ops, x, norm.weight, norm.eps, True), norm(x), atol)


@pytest.mark.parametrize("rows, hidden", [(1, 576), (20, 100)])
def test_offset_add_rms_norm_adds_then_normalizes(ops, rows, hidden):
    norm = _norm(hidden, True, torch.bfloat16)
    x, residual = (torch.randn(2, rows, hidden) * 2).to(torch.bfloat16)
    want_residual = residual + x
    got_residual = residual.clone()
    got = fused.add_rms_norm(ops, x, got_residual, norm.weight, norm.eps, True)
    assert torch.equal(got_residual, want_residual)
    _mostly_equal(got, norm(want_residual), 0.07)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim",
                         [(1, 8, 2, 64), (13, 4, 4, 128), (40, 3, 1, 32)])
def test_qk_norm_rope_equals_norm_then_rope(ops, dtype, offset, tokens, q_heads, kv_heads,
                                            head_dim):
    q_norm, k_norm = _norm(head_dim, offset, dtype), _norm(head_dim, offset, dtype)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim) * 2).to(dtype)
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim)  # strided rows
    cos, sin = (torch.randn(2, tokens, 1, head_dim)).to(dtype)
    q, k = qk.split([q_heads, kv_heads], dim=1)
    want = apply_rope(torch.cat((q_norm(q), k_norm(k)), dim=1), cos, sin)
    got = fused.qk_norm_rope(ops, qk, q_norm.weight, k_norm.weight, q_heads, q_norm.eps, offset,
                             cos.contiguous(), sin.contiguous())
    _mostly_equal(got, want, 1e-5 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (33, 640), (5, 100)])  # 100: scalar tail
def test_gelu_tanh_and_mul_matches_torch(ops, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    gate_up[0, :5] = torch.tensor([float("inf"), -float("inf"), 0.0, -90.0, 1e-3])
    gate, up = gate_up.split(inter, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = fused.gelu_tanh_and_mul(ops, gate_up)
    finite = want.isfinite()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got[finite].float(), want[finite].float(), rtol=1e-2, atol=1e-4)
    # torch's 1 + tanh cancels where gate << 0 (results below ~1e-4): compared above only
    sizable = finite & (want.float().abs() > 1e-3)
    assert (got[sizable] != want[sizable]).float().mean() < 0.01


def test_qk_norm_rope_rejects_a_weight_of_another_size(ops):
    qk = torch.randn(2, 3, 64).to(torch.bfloat16)
    cos = sin = torch.randn(2, 1, 64).to(torch.bfloat16)
    wrong = torch.ones(32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim"):
        fused.qk_norm_rope(ops, qk, wrong, wrong, 2, 1e-6, False, cos, sin)
