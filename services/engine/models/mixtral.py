"""Mixtral: Mistral's attention, a sparse MoE block on every layer (top-k of a softmax,
renormalised); its checkpoints name the experts' matrices w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

import re

from kvrelay.engine.models.arch import ArchSpec, MoESpec, dense_spec

ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}
_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def spec(config) -> ArchSpec:
    moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, renormalize=True)
    return dense_spec(config, moe=moe, moe_layers=(True,) * config.num_hidden_layers)


def rename(name: str) -> str:
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PROJECTIONS[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.", ".mlp.")
