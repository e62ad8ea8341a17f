"""The Triton mixture-of-experts kernels against the per-token reference, on fresh random
inputs with experts that receive no token, one token and every token, under TRITON_INTERPRET=1
(the conftest sets it for this package)."""
from __future__ import annotations

import pytest
import torch

from kvrelay.kernels.moe_reference import fused_moe_reference
from kvrelay.kernels.triton_moe_align import align_pairs_by_expert
from tests.kernels.moe_cases import random_experts, skewed_routing

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.07, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("num_tokens, top_k, hidden, inter", [(1, 2, 32, 24), (13, 2, 80, 72),
                                                              (40, 3, 32, 16)])
def test_kernel_matches_the_reference(dtype, activation, num_tokens, top_k, hidden, inter):
    from kvrelay.kernels.triton_moe import fused_moe_triton

    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs every run; the seed is shown
    generator = torch.Generator().manual_seed(seed)
    experts = random_experts(6, hidden, inter, dtype, generator)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    weights, ids = skewed_routing(num_tokens, top_k, 6, generator)
    want = fused_moe_reference(x, experts, weights, ids, activation)
    got = fused_moe_triton(x, experts, weights, ids, activation)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), **TOLERANCES[dtype]), seed


def test_alignment_gives_each_row_block_one_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 1]])  # expert 4 gets nothing
    sorted_pairs, block_experts = align_pairs_by_expert(ids, num_experts=5, block_m=2)
    pairs = sorted_pairs.view(-1, 2)
    flat = ids.reshape(-1)
    seen = []
    for block, expert in enumerate(block_experts.tolist()):
        real = [p for p in pairs[block].tolist() if p < flat.numel()]
        if expert == 5:  # past the end: padding only
            assert not real
            continue
        assert all(flat[p] == expert for p in real) and real, (block, expert)
        seen += real
    assert sorted(seen) == list(range(flat.numel()))  # every pair exactly once
    assert block_experts.tolist()[:5] == [0, 1, 2, 2, 3]
