"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with q/k/v and gate/up already fused in the
checkpoint (qkv_proj, gate_up_proj: loaded whole), LongRoPE, rope on part of each head
(partial_rotary_factor), a window on every layer where `sliding_window` is set."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, dense_spec, head_dim_of
from kvrelay.engine.models.rope import rotary_dim_of

ARCHITECTURES = {"Phi3ForCausalLM": "phi3"}


def spec(config) -> ArchSpec:
    head_dim = head_dim_of(config)
    rotary_dim = rotary_dim_of(config, head_dim)
    return dense_spec(config, rotary_dim=rotary_dim if rotary_dim < head_dim else None)
