"""Mixture-of-experts kernels: the router against Hugging Face's, the CPU path against the
per-token reference on fresh random inputs (experts with no token, one token, every token), whole
HF sparse-MoE blocks against select_experts + fused_moe in float32, and bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kvrelay.kernels.moe_dispatch import fused_moe
from kvrelay.kernels.moe_reference import fused_moe_reference
from kvrelay.kernels.moe_routing import select_experts
from kvrelay.kernels.moe_weights import ExpertWeights
from tests.kernels.moe_cases import random_experts, skewed_routing

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.07, rtol=1e-2)}


def _fresh_generator() -> tuple[torch.Generator, int]:
    seed = int(torch.randint(0, 2**31, ()).item())  # fresh inputs every run; the seed is shown
    return torch.Generator().manual_seed(seed), seed


def _config(family: str, norm_topk_prob: bool = True):
    common = dict(hidden_size=48, num_experts_per_tok=3, hidden_act="silu")
    if family == "mixtral":
        return MixtralConfig(intermediate_size=40, num_local_experts=7, **common)
    return Qwen3MoeConfig(moe_intermediate_size=40, num_experts=7, norm_topk_prob=norm_topk_prob,
                          **common)


def _hf_block(family: str, norm_topk_prob: bool, experts_implementation: str):
    config = _config(family, norm_topk_prob)
    config._experts_implementation = experts_implementation
    block = (MixtralSparseMoeBlock if family == "mixtral" else Qwen3MoeSparseMoeBlock)(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    return block.eval()


@pytest.mark.parametrize("family, renormalize", [("mixtral", True), ("qwen3", True), ("qwen3", False)])
def test_routing_matches_the_hf_router(family, renormalize):
    gate = _hf_block(family, renormalize, "eager").gate
    generator, seed = _fresh_generator()
    hidden = torch.randn(33, gate.hidden_dim, generator=generator)
    with torch.no_grad():
        logits, hf_weights, hf_ids = gate(hidden)
    weights, ids = select_experts(logits.float(), gate.top_k, renormalize)
    assert torch.equal(ids, hf_ids), seed
    assert weights.dtype == torch.float32 and torch.allclose(weights, hf_weights, atol=1e-6), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (2, 1), (17, 2), (40, 4)])
@pytest.mark.parametrize("prepared", [False, True])
def test_cpu_path_matches_the_reference(dtype, activation, num_tokens, top_k, prepared):
    generator, seed = _fresh_generator()
    experts = random_experts(8, 64, 48, dtype, generator)
    hidden = torch.randn(num_tokens, 64, generator=generator).to(dtype)
    weights, ids = skewed_routing(num_tokens, top_k, 8, generator)
    want = fused_moe_reference(hidden, experts, weights, ids, activation)
    if prepared:  # oneDNN-packed experts where this CPU packs bf16, else a no-op
        experts.prepare_for_cpu_()
    got = fused_moe(hidden, experts, weights, ids, activation)
    assert got.shape == hidden.shape and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), **TOLERANCES[dtype]), seed


def test_no_tokens_gives_an_empty_output():
    experts = random_experts(4, 16, 8, torch.float32, torch.Generator().manual_seed(0))
    out = fused_moe(torch.empty(0, 16), experts, torch.empty(0, 2),
                    torch.empty(0, 2, dtype=torch.int64), "silu")
    assert out.shape == (0, 16)


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family, norm_topk_prob", [("mixtral", True), ("qwen3", True), ("qwen3", False)])
def test_hf_sparse_moe_blocks_match_in_float32(family, norm_topk_prob, experts_implementation):
    block = _hf_block(family, norm_topk_prob, experts_implementation)
    generator, seed = _fresh_generator()
    hidden = torch.randn(2, 11, block.gate.hidden_dim, generator=generator)
    # the model loader's fused layout: gate rows then up rows, as HF's gate_up_proj holds them
    experts = ExpertWeights(block.experts.gate_up_proj.detach().clone(),
                            block.experts.down_proj.detach().clone())
    with torch.no_grad():
        want = block(hidden).view(-1, hidden.shape[-1])
        flat = hidden.view(-1, hidden.shape[-1])
        logits = torch.nn.functional.linear(flat, block.gate.weight)
        weights, ids = select_experts(logits, block.gate.top_k, norm_topk_prob)
        got = fused_moe(flat, experts, weights, ids, "silu")
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (seed, (got - want).abs().max())


def _bad_inputs():
    experts = random_experts(4, 16, 8, torch.float32, torch.Generator().manual_seed(0))
    hidden, ids = torch.randn(3, 16), torch.tensor([[0, 1], [2, 3], [1, 0]])
    weights = torch.full((3, 2), 0.5)
    return experts, hidden, weights, ids


@pytest.mark.parametrize("change, message", [
    (lambda e, h, w, i: (e, torch.randn(3, 15), w, i), "hidden must be"),
    (lambda e, h, w, i: (e, h.bfloat16(), w, i), "experts are"),
    (lambda e, h, w, i: (e, h, w, i[:2]), "topk_ids must be"),
    (lambda e, h, w, i: (e, h, w[:, :1], i), "must match topk_ids"),
    (lambda e, h, w, i: (e, h, w, i.int()), "int64"),
    (lambda e, h, w, i: (e, h, w.double(), i), "float32"),
    (lambda e, h, w, i: (e, h, w, i.masked_fill(i == 3, 4)), r"\[0, 4\)"),
    (lambda e, h, w, i: (e, h, w, i.masked_fill(i == 3, -1)), r"\[0, 4\)"),
])
@pytest.mark.parametrize("entry", [fused_moe, fused_moe_reference])
def test_bad_input_raises_a_clear_value_error(change, message, entry):
    with pytest.raises(ValueError, match=message):
        experts, hidden, weights, ids = change(*_bad_inputs())
        entry(hidden, experts, weights, ids, "silu")


def test_unknown_activation_and_bad_weights_raise_value_errors():
    experts, hidden, weights, ids = _bad_inputs()
    with pytest.raises(ValueError, match="unknown expert activation"):
        fused_moe(hidden, experts, weights, ids, "relu")
    with pytest.raises(ValueError, match="w2 must be"):
        ExpertWeights(torch.randn(4, 16, 8), torch.randn(4, 8, 9))
    with pytest.raises(ValueError, match="w13"):
        ExpertWeights(torch.randn(4, 15, 8), torch.randn(4, 8, 7))
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match="float32"):
        select_experts(torch.randn(3, 4).bfloat16(), 2, True)
