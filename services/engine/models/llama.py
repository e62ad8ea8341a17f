"""Llama 2/3.x (and SmolLM2), Mistral (a window on every layer), Qwen2 (q/k/v bias; windows on
the layers past max_window_layers where use_sliding_window is set)."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, dense_spec, layer_types_windows

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2"}


def spec(config) -> ArchSpec:
    if getattr(config, "mlp_bias", False):
        raise ValueError("Llama checkpoints with mlp_bias are not supported")
    if config.model_type == "qwen2":
        return dense_spec(config, qkv_bias=True, layer_windows=layer_types_windows(config))
    bias = bool(getattr(config, "attention_bias", False))  # o_proj's too, in transformers
    if config.model_type == "mistral":
        return dense_spec(config, qkv_bias=bias, o_bias=bias)
    # Llama attends to every key whatever `sliding_window` or `layer_types` a config carries
    return dense_spec(config, qkv_bias=bias, o_bias=bias,
                      layer_windows=(0,) * config.num_hidden_layers)
