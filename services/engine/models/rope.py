"""Rotary position embedding with the config's theta and scaling: default, linear, dynamic,
llama3, yarn, longrope (su), per layer type where a config gives each its own (Gemma 3's local
and global layers), on all of a head or its first `partial_rotary_factor` part (Phi-4-mini).

Inverse frequencies come from transformers' own rope initialisers, so every scaling type is
computed as the reference model computes it. cos/sin are tabulated once for all positions up to
the model length and gathered by position each step. Two types depend on the sequence's length in
transformers, which a batch of sequences cannot share; both are tabulated by position instead:
- dynamic: transformers rescales only past max_position_embeddings, which is also the longest
  sequence kvrelay serves, so every served position gets the unscaled frequencies, as there;
- longrope: positions below original_max_position_embeddings use the short factors, those above
  the long ones (transformers switches a whole sequence to the long factors once it is longer:
  the same for every sequence up to the original length).
"""
from __future__ import annotations

import torch
from torch import nn

DEFAULT_KEY = "default"  # the rope of configs with one set of rope parameters


def rope_parameters(config, key: str = DEFAULT_KEY) -> dict:
    """The rope parameters of a config (of one layer type, where it has several)."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5
    if params:
        params = dict(params)
        return dict(params[key]) if key in params and isinstance(params[key], dict) else params
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


def rope_keys(config) -> tuple[str, ...]:
    """Per layer, the key of its rope parameters: its layer type where the config gives each
    type its own, else DEFAULT_KEY."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and all(isinstance(params.get(kind), dict) for kind in set(types)):
        return tuple(types)
    return (DEFAULT_KEY,) * config.num_hidden_layers


def rotary_dim_of(config, head_dim: int) -> int:
    factor = rope_parameters(config).get("partial_rotary_factor", None)
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    return int(head_dim * factor)


def _init_kwargs(key: str) -> dict:
    return {} if key == DEFAULT_KEY else {"layer_type": key}


def _default_inv_freq(params: dict, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (params["rope_theta"] ** exponents)


def _angles_and_scaling(config, key: str, rotary_dim: int, max_positions: int):
    """angles [max_positions, rotary_dim / 2] and the cos/sin scaling (1 but for yarn, longrope)."""
    params = rope_parameters(config, key)
    rope_type = params.get("rope_type", "default")
    positions = torch.arange(max_positions, dtype=torch.float)
    if rope_type in ("default", "dynamic"):
        return positions[:, None] * _default_inv_freq(params, rotary_dim)[None, :], 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; kvrelay knows default, "
                         f"dynamic, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config, None, **_init_kwargs(key))
    angles = positions[:, None] * inv_freq.float()[None, :]
    if rope_type == "longrope":
        original = params["original_max_position_embeddings"]
        long_freq, _ = init(config, None, seq_len=original + 1, **_init_kwargs(key))
        beyond = positions >= original
        angles[beyond] = positions[beyond, None] * long_freq.float()[None, :]
    return angles, scaling


class RotaryEmbedding(nn.Module):
    def __init__(self, config, key: str = DEFAULT_KEY, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.key = key
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute cos/sin on the CPU; needed after building the model on the meta device."""
        with torch.device("cpu"):
            freqs, scaling = _angles_and_scaling(self.config, self.key, self.rotary_dim,
                                                 self.config.max_position_embeddings)
            angles = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rotary_dim]
            self.cos_table = angles.cos() * scaling
            self.sin_table = angles.sin() * scaling

    def tables_for(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin [T, 1, rotary_dim] for a step's positions [T]; gathered once per step."""
        cos = self.cos_table[positions].to(dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (q and k heads together: one pass for both); cos, sin [T, 1, R], R <= D:
    the first R of each head rotate, the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
