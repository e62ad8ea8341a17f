"""bfloat16 linears with weights pre-packed once for oneDNN (AMX) on CPU.

F.linear re-lays-out the weight into oneDNN's blocked format on every call; for the small-M
matmuls of a decode step that reorder costs as much as the multiply. Packing once at load time
measured 1.5-2x faster per call for M <= 64 (e.g. [64, 576] x [49152, 576]: 5.1 -> 2.6 ms).
Only used where it pays and is exact: bf16 on CPU (float32 stays on F.linear, so the float32
parity tests with HF exercise the very same GEMM path HF uses). oneDNN packs bf16 only on CPUs
with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on others (an AVX2-only EPYC) the large steps stay
on F.linear and the small-step kernels (int4) still apply. There bf16 F.linear is emulated:
measured on a 2-core AVX2 EPYC, a [64, 576] x [3072, 576] matmul took 13.8 ms in bf16 and 3.3 ms
as float32 (the activations widened, the result rounded once to bf16, which is what the bf16
GEMM computes too: it accumulates in float32), 2.4-4x at every row count from 16 to 2,048. So
there the weights are kept in float32 (twice the memory; KVRELAY_WIDEN_BF16_WEIGHTS=0 keeps
bf16).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kvrelay.common.env_switches import WIDEN_BF16_WEIGHTS
from kvrelay.kernels.onednn_linear import onednn_packs_bf16, pack_weight, packed_matmul

EVERY_STEP = 1 << 30  # a small-step kernel's max_rows that takes any step


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's linears become PackedLinears (bf16 on CPU)."""
    return device.type == "cpu" and dtype == torch.bfloat16


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # weight [out_features, in_features]; the packed copy is opaque (mkldnn layout).
        self.out_features, self.in_features = weight.shape
        self.packed_weight = self.weight = None
        if onednn_packs_bf16():
            self.packed_weight = pack_weight(weight)
        elif WIDEN_BF16_WEIGHTS.enabled():
            self.weight = weight.detach().float()  # see the module docstring
        else:
            self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        # Kernels for small steps (services/engine/models/small_steps.py), as (max_rows,
        # matmul) in increasing max_rows: a step of T rows runs on the first with max_rows >= T
        # (the checkpoint's 4-bit weights, AMX tiles), larger ones on oneDNN.
        self.small_steps: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = []

    def add_small_step_kernel_(self, max_rows: int,
                               matmul: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """matmul: x [T, in_features] bf16 contiguous -> [T, out_features], without the bias."""
        self.small_steps = sorted([*self.small_steps, (max_rows, matmul)], key=lambda k: k[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in_features]
        rows = x.shape[0]
        for max_rows, matmul in self.small_steps:
            if rows <= max_rows:
                out = matmul(x.contiguous())
                return out if self.bias is None else out + self.bias
        if self.packed_weight is not None:
            return self.onednn_matmul(x)
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x.to(self.weight.dtype), self.weight)  # widened: float32 GEMM
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def onednn_matmul(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in_features], packed only
        return packed_matmul(x, self.packed_weight, self.bias)


def onednn_min_rows(layers: nn.Module) -> int | None:
    """The fewest rows of a step that some packed matmul of `layers` runs on oneDNN, or None
    where none does (nothing packed, or small-step kernels take every step)."""
    fewest = None
    for linear in _onednn_linears(layers):
        largest_small = max((max_rows for max_rows, _ in linear.small_steps), default=0)
        if largest_small < EVERY_STEP:
            fewest = largest_small + 1 if fewest is None else min(fewest, largest_small + 1)
    return fewest


def warm_onednn_rows(module: nn.Module, row_counts: list[int]) -> None:
    """Run every oneDNN-packed matmul of `module` once at each row count, on zeros. oneDNN
    JIT-compiles a kernel per (weight shape, row count) and caches it for every weight of that
    shape, so one layer warms them all (step_padding.py)."""
    linears = list(_onednn_linears(module))
    with torch.inference_mode():
        for rows in row_counts:
            for linear in linears:
                linear.onednn_matmul(torch.zeros(rows, linear.in_features, dtype=torch.bfloat16))


def _onednn_linears(module: nn.Module):
    """The PackedLinears under `module` that hold a oneDNN-packed weight."""
    return (m for m in module.modules()
            if isinstance(m, PackedLinear) and m.packed_weight is not None)


def pack_linears_(model: nn.Module,
                  skip_parent: Callable[[nn.Module], bool] = lambda parent: False) -> None:
    """Replace every nn.Linear in the model by a PackedLinear, in place (but the children of
    modules `skip_parent` picks)."""
    for parent in list(model.modules()):
        if skip_parent(parent):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
