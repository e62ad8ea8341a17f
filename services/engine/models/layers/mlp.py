"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.kernels import native_elementwise as fused

ACTIVATIONS = ("silu", "gelu_tanh")


def gate_activation(name: str, gate: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(gate)
    if name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r}; kvrelay knows {', '.join(ACTIVATIONS)}")


def activation_of(config) -> str:
    """A config's gate activation by its transformers name (hidden_activation before
    hidden_act: Gemma names the one it uses there)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_tanh": "gelu_tanh"}
    if name not in names:
        raise ValueError(f"unsupported activation {name!r}; kvrelay serves "
                         f"{', '.join(sorted(names))}")
    return names[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.native = None  # fused CPU ops: act(gate) * up in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.native is not None:
            act_and_mul = fused.silu_and_mul if self.activation == "silu" \
                else fused.gelu_tanh_and_mul
            return self.down_proj(act_and_mul(self.native, gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(gate_activation(self.activation, gate) * up)
