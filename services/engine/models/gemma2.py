"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) norms before and after both attention
and MLP, a GELU-tanh gate, queries scaled by query_pre_attn_scalar, attention and final logits
soft-capped, sliding and global layers alternating (`layer_types`)."""
from __future__ import annotations

from kvrelay.engine.models.arch import ArchSpec, dense_spec, layer_types_windows
from kvrelay.engine.models.layers.mlp import activation_of

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2"}


def gemma_options(config) -> dict:
    """What Gemma 2 and 3 share."""
    bias = bool(getattr(config, "attention_bias", False))
    return dict(norm_offset=True, sandwich_norms=True, activation=activation_of(config),
                query_scale=config.query_pre_attn_scalar ** -0.5,
                attn_soft_cap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
                final_soft_cap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
                embed_scale=config.hidden_size ** 0.5, qkv_bias=bias, o_bias=bias,
                layer_windows=layer_types_windows(config))


def spec(config) -> ArchSpec:
    return dense_spec(config, **gemma_options(config))
