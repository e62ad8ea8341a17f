"""Qwen3-MoE: Qwen3's attention; experts on every `decoder_sparse_step`-th layer but those in
`mlp_only_layers`, top-k of a softmax, renormalised where `norm_topk_prob`."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, MoESpec, dense_spec

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}


def spec(config) -> ArchSpec:
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
    moe_layers = tuple(index not in dense_layers and num_experts > 0 and (index + 1) % step == 0
                       for index in range(config.num_hidden_layers))
    moe = MoESpec(num_experts=num_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.moe_intermediate_size,
                  renormalize=bool(config.norm_topk_prob))
    bias = bool(getattr(config, "attention_bias", False))
    return dense_spec(config, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe,
                      moe_layers=moe_layers)
