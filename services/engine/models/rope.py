"""Rotary position embedding with the config's theta and scaling (default, linear, llama3, yarn).

The inverse frequencies come from transformers' own rope initialisers, so every scaling type a
config can name is computed exactly as the reference model computes it. cos/sin are tabulated once
for all positions up to the model length and gathered by position each step.
"""
from __future__ import annotations

import torch
from torch import nn


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


def _inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    try:
        return init(config)
    except TypeError:  # transformers 4.x takes the device positionally
        return init(config, None)


class RotaryEmbedding(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute cos/sin on the CPU; needed after building the model on the meta device."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        with torch.device("cpu"):
            inv_freq, attention_scaling = _inv_freq(config, head_dim)
            positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
            freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_pos, head_dim / 2]
            angles = torch.cat((freqs, freqs), dim=-1)
            self.cos_table = angles.cos() * attention_scaling
            self.sin_table = angles.sin() * attention_scaling

    def tables_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, 1, D] for a step's positions [T]; gathered once, used by every layer."""
        cos = self.cos_table[positions].to(dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (q and k heads together: one pass for both); cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
