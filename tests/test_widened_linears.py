"""packed_linear.py on a CPU whose oneDNN cannot pack bf16 (every machine here, by patching
that check): the large steps' weights are kept in float32 and the result rounded once to bf16,
which agrees with bf16 F.linear (that GEMM accumulates in float32 too) within a rounding of the
output; KVRELAY_WIDEN_BF16_WEIGHTS=0 keeps the bf16 weights; small-step kernels still take
their steps and get the bf16 bias; mixture-of-experts layers widen their experts the same way."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvrelay.engine.models import packed_linear
from kvrelay.engine.models.packed_linear import PackedLinear


@pytest.fixture(autouse=True)
def no_onednn_bf16(monkeypatch):
    monkeypatch.setattr(packed_linear, "onednn_packs_bf16", lambda: False)


def test_weights_are_widened_and_agree_with_the_bf16_gemm():
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    linear = PackedLinear(weight, bias)
    assert linear.weight.dtype == torch.float32 and linear.packed_weight is None
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64).bfloat16()
        got = linear(x)
        assert got.dtype == torch.bfloat16
        exact = x.double() @ weight.double().T + bias.double()
        # one rounding of the float32 sum to bf16: within half a bf16 ulp, plus float32's error
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()
        bf16 = F.linear(x, weight, bias).double()
        assert ((got.double() - bf16).abs() <= exact.abs() * 2 ** -7 + 1e-5).all()


def test_the_switch_keeps_bf16_weights(monkeypatch):
    monkeypatch.setenv("KVRELAY_WIDEN_BF16_WEIGHTS", "0")
    linear = PackedLinear(torch.randn(32, 16).bfloat16(), None)
    assert linear.weight.dtype == torch.bfloat16
    x = torch.randn(5, 16).bfloat16()
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight), atol=0, rtol=0)


def test_small_steps_keep_their_kernel_and_the_bf16_bias():
    weight, bias = torch.randn(32, 16).bfloat16(), torch.randn(32).bfloat16()
    linear = PackedLinear(weight, bias)
    calls = []
    linear.add_small_step_kernel_(4, lambda x: calls.append(x.shape[0]) or F.linear(x, weight))
    out = linear(torch.randn(3, 16).bfloat16())
    assert calls == [3] and out.dtype == torch.bfloat16
    linear(torch.randn(9, 16).bfloat16())
    assert calls == [3]  # 9 rows: the widened GEMM


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_experts_are_widened_too_and_match_the_reference(monkeypatch, num_tokens):
    from kvrelay.kernels import moe_weights
    from kvrelay.kernels.moe_dispatch import fused_moe
    from kvrelay.kernels.moe_reference import fused_moe_reference
    from tests.kernels.moe_cases import random_experts, skewed_routing
    monkeypatch.setattr(moe_weights, "onednn_packs_bf16", lambda: False)
    generator = torch.Generator().manual_seed(num_tokens)
    experts = random_experts(8, 64, 48, torch.bfloat16, generator)
    hidden = torch.randn(num_tokens, 64, generator=generator).bfloat16()
    weights, ids = skewed_routing(num_tokens, 2, 8, generator)
    want = fused_moe_reference(hidden, experts, weights, ids, "silu")
    experts.prepare_for_cpu_()
    assert experts.wide_w13 is not None and experts.wide_w13.dtype == torch.float32
    assert experts.w13 is None and experts.dtype == torch.bfloat16
    got = fused_moe(hidden, experts, weights, ids, "silu")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.07, rtol=1e-2)
