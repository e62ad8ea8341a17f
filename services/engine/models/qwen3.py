"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before rope, no q/k/v
bias, windows per `layer_types`."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, dense_spec, layer_types_windows

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}


def spec(config) -> ArchSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return dense_spec(config, qk_norm=True, qkv_bias=bias, o_bias=bias,
                      layer_windows=layer_types_windows(config))
