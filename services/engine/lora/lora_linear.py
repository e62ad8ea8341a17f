"""A model linear with per-token LoRA updates: y = base(x) + x A_s^T B_s^T for each token's
adapter slot s (none: the base alone).

The base matmul runs once for the whole step, whatever the adapters (packed oneDNN, 4-bit
small steps: all unchanged); each adapted part of the output (q, k and v of a fused qkv_proj,
gate and up of gate_up_proj) then gets its low-rank update through the batched shrink/expand
kernels (kernels/lora_ops.py), every token reading its own slot's A and B. Parts no resident
adapter targets cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvrelay.kernels.lora_ops import lora_expand_, lora_shrink


class LoRAStep:
    """The running step's token -> slot map, shared by every LoRALinear of a model."""
    __slots__ = ("token_slots",)

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None  # [T] int32, -1: the base; None: no adapter


@dataclass(slots=True)
class LoRAPart:
    """One adaptable part of a linear's output: columns [offset, offset + size)."""
    offset: int
    size: int
    a: torch.Tensor  # [slots, max_rank, in] the model's dtype, zero past each adapter's rank
    b_t: torch.Tensor  # [slots, max_rank, size], B transposed with its scaling folded in
    slots_in_use: set[int] = field(default_factory=set)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, spans: dict[str, tuple[int, int]],
                 step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.spans = spans  # adapter module name -> (offset, size) of the columns it updates
        self.step = step
        self.parts: dict[str, LoRAPart] = {}  # made when an adapter first targets the name
        self.active: list[LoRAPart] = []  # the parts some resident adapter fills

    def part(self, name: str, num_slots: int, max_rank: int, like: torch.Tensor) -> LoRAPart:
        if name not in self.parts:
            offset, size = self.spans[name]
            self.parts[name] = LoRAPart(
                offset, size, like.new_zeros(num_slots, max_rank, self.in_features),
                like.new_zeros(num_slots, max_rank, size))
        return self.parts[name]

    def refresh_active(self) -> None:
        self.active = [part for part in self.parts.values() if part.slots_in_use]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        out = self.base(x)
        token_slots = self.step.token_slots
        if token_slots is None or not self.active:
            return out
        x = x.contiguous()
        for part in self.active:
            shrunk = lora_shrink(x, part.a, token_slots)  # [T, max_rank] float32
            lora_expand_(out[:, part.offset:part.offset + part.size], shrunk, part.b_t,
                         token_slots)
        return out
