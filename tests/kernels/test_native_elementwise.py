"""Fused CPU RMSNorm, rotary embedding and silu(gate) * up against the torch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels import native_elementwise as fused


def _torch_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.07)])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (37, 576), (300, 128)])
def test_rms_norm_matches_torch(ops, dtype, atol, rows, hidden):
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    got = fused.rms_norm(ops, x, weight, 1e-5)
    want = _torch_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=atol, rtol=1e-2)
    if dtype == torch.bfloat16:  # at most one bf16 step apart, and nearly always equal
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 12, 64), (45, 4, 128), (200, 3, 64)])
def test_rope_matches_torch_on_a_strided_qkv_slice(ops, dtype, tokens, heads, head_dim):
    qkv = torch.randn(tokens, (heads + 2) * head_dim).to(dtype)  # q|k heads, then v
    qk = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # rows strided, like the model
    cos, sin = torch.randn(2, tokens, 1, head_dim).to(dtype)
    got = fused.rope(ops, qk, cos.contiguous(), sin.contiguous())
    want = _torch_rope(qk, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # every rounding where torch's eager ops round
    else:
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (33, 1536), (5, 100)])  # 100: a scalar tail
def test_silu_and_mul_matches_torch(ops, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -90.0])
    got = fused.silu_and_mul(ops, gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    assert (got != want).float().mean() < 0.01  # the same bf16 roundings as torch's two ops


def test_bad_shapes_are_rejected(ops):
    with pytest.raises(RuntimeError):
        fused.rms_norm(ops, torch.randn(4, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError):
        fused.rope(ops, torch.randn(4, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError):  # float32 stays on torch's ops
        fused.silu_and_mul(ops, torch.randn(4, 8))


@pytest.mark.parametrize("vocab", [64, 100, 49152])  # 100: a word cut by the vocabulary's end
def test_token_bitmask_matches_the_torch_unpacking(ops, vocab):
    from kvrelay.engine.structured import bitmask
    words = (vocab + 31) // 32
    masks = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32)
    masks[1] = -1  # everything allowed
    masks[2, :] = 0
    masks[2, 0] = 1 << 3  # one token allowed
    logits = torch.randn(5, vocab)
    rows = [4, 0, 2]
    got = logits.clone()
    ops.apply_token_bitmask(got, masks, torch.tensor(rows))
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~bitmask.unpack(masks, vocab), float("-inf"))
    assert torch.equal(got, want)
    assert torch.isfinite(got[2]).sum() == 1 and torch.isfinite(got[2, 3])
    with pytest.raises(RuntimeError):
        ops.apply_token_bitmask(got, masks, torch.tensor([0, 1, 9]))


@pytest.mark.parametrize("rows, hidden", [(1, 576), (64, 576), (300, 100)])  # 100: a scalar tail
def test_add_rms_norm_matches_torchs_add_then_norm(ops, rows, hidden):
    x = (torch.randn(rows, hidden) * 3).to(torch.bfloat16)
    residual = (torch.randn(rows, hidden) * 3).to(torch.bfloat16)
    weight = torch.randn(hidden).to(torch.bfloat16)
    want_residual = residual + x  # torch's bf16 add: each sum rounded to bf16
    want = _torch_rms_norm(want_residual, weight, 1e-5)
    got = fused.add_rms_norm(ops, x, residual, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # updated in place, bit for bit
    assert torch.allclose(got.float(), want.float(), atol=0.07, rtol=1e-2)
    assert (got != want).float().mean() < 0.01


def test_add_rms_norm_rejects_float32_and_mismatched_residuals(ops):
    with pytest.raises(RuntimeError):
        fused.add_rms_norm(ops, torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), 1e-5)
    x = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        fused.add_rms_norm(ops, x, torch.randn(3, 8).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16), 1e-5)


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (64, 49152), (3, 37), (2, 5)])
def test_argmax_rows_matches_torch_max(ops, rows, vocab):
    logits = torch.randn(rows, vocab)
    # ties (the first index wins), infinities, and a row that is all -inf
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1
    if rows > 1:
        logits[1] = -float("inf")
    if rows > 2:
        logits[2, 3] = float("inf")
    got = fused.argmax_rows(ops, logits)
    assert torch.equal(got, logits.max(-1).indices)


def test_argmax_rows_takes_torchs_nan_rule(ops):
    logits = torch.randn(2, 1000)
    logits[0, 700] = float("nan")
    logits[0, 900] = float("nan")
    logits[1, 999] = float("nan")  # in the scalar tail
    assert fused.argmax_rows(ops, logits).tolist() == logits.max(-1).indices.tolist() == [700, 999]
