"""bfloat16 linears with weights pre-packed once for oneDNN (AMX) on CPU.

F.linear re-lays-out the weight into oneDNN's blocked format on every call; for the small-M
matmuls of a decode step that reorder costs as much as the multiply. Packing once at load time
measured 1.5-2x faster per call for M <= 64 (e.g. [64, 576] x [49152, 576]: 5.1 -> 2.6 ms).
Only used where it pays and is exact: bf16 on CPU (float32 stays on F.linear, so the float32
parity tests with HF exercise the very same GEMM path HF uses). oneDNN packs bf16 only on CPUs
with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on others (an AVX2-only EPYC) the large steps stay
on F.linear and the small-step kernels (int4) still apply.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels import native_amx
from services.engine.models.gguf_int4 import Int4Weight

_PACK_BATCH_HINT = 64  # the batch size oneDNN tunes the blocked layout for; any M still works


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's linears become PackedLinears (bf16 on CPU)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def onednn_packs_bf16() -> bool:
    """Whether oneDNN can pre-pack bf16 weights on this CPU (it raises where it cannot)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # weight [out_features, in_features]; the packed copy is opaque (mkldnn layout).
        self.out_features = weight.shape[0]
        self.packed_weight = self.weight = None
        if onednn_packs_bf16():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                         _PACK_BATCH_HINT)
        else:
            self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        # The checkpoint's own 4-bit weight, for steps of at most int4_max_tokens tokens: they
        # are bound by reading the weights, and it is a quarter of the bytes (gguf_int4.py).
        self.int4: Int4Weight | None = None
        self.int4_max_tokens = 0
        # AMX tiles (kernels/native_amx.py) for steps of int4_max_tokens + 1 to amx_max_tokens
        # tokens, where oneDNN runs its slowest: the 4-bit tiles where the checkpoint has
        # them, else a bf16 copy (the head).
        self.amx_ops = None
        self.amx_weight: torch.Tensor | native_amx.Q4Tiles | None = None
        self.amx_max_tokens = 0

    def use_amx_(self, ops, weight: "torch.Tensor | native_amx.Q4Tiles", max_tokens: int) -> None:
        self.amx_ops, self.amx_weight, self.amx_max_tokens = ops, weight, max_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in_features]
        rows = x.shape[0]
        if self.int4 is not None and rows <= self.int4_max_tokens:
            out = self.int4.matmul(x.contiguous())
        elif self.amx_weight is not None and rows <= self.amx_max_tokens:
            out = self._amx_matmul(x)
        elif self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        else:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight,
                                                      self.bias, "none", [], "")
        return out if self.bias is None else out + self.bias

    def _amx_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.amx_weight, native_amx.Q4Tiles):
            return native_amx.matmul_q4(self.amx_ops, x, self.amx_weight)
        return native_amx.matmul_bf16(self.amx_ops, x, self.amx_weight)


def pack_linears_(model: nn.Module) -> None:
    """Replace every nn.Linear in the model by a PackedLinear, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
