"""The experts' gated activations by name: act(gate) * up over gate_up = gate | up."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from kvrelay.kernels import native_elementwise

# name -> act, as the families' configs name it (hidden_act "silu", "gelu_pytorch_tanh")
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda gate: F.gelu(gate, approximate="tanh"),
}


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}: expected one of "
                         f"{sorted(ACTIVATIONS)}")


def gated_torch(activation: str, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] -> act(gate) * up [rows, inter], in gate_up's dtype (as HF:
    the activation's result is rounded before the product)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


def gated(activation: str, gate_up: torch.Tensor) -> torch.Tensor:
    """gated_torch, in one native pass where one exists (silu on bf16 CPU rows)."""
    if activation == "silu" and gate_up.dtype == torch.bfloat16 and not gate_up.is_cuda:
        ops = native_elementwise.elementwise_ops()
        if ops is not None:
            return native_elementwise.silu_and_mul(ops, gate_up.contiguous())
    return gated_torch(activation, gate_up)
