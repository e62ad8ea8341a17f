"""The experts of one mixture-of-experts layer: stacked weights, and their packed CPU form."""
from __future__ import annotations

import torch
from torch import nn

from kvrelay.common.env_switches import WIDEN_BF16_WEIGHTS
from kvrelay.kernels.onednn_linear import onednn_packs_bf16, pack_weight


class ExpertWeights(nn.Module):
    """w13 [E, 2 * I, H]: each expert's gate rows then its up rows (the loader fuses the
    checkpoint's gate_proj/up_proj, or w1/w3); w2 [E, H, I]: the down projections."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
            raise ValueError(f"ExpertWeights takes w13 [E, 2*I, H] and w2 [E, H, I], got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        num_experts, two_inter, hidden = w13.shape
        if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
            raise ValueError(f"w2 must be [E, H, I] = {(num_experts, hidden, two_inter // 2)} "
                             f"to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts, hidden, two_inter // 2)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        # per expert, oneDNN's opaque copies of w13[e] and w2[e] (prepare_for_cpu_)
        self.packed_w13: list[torch.Tensor] | None = None
        self.packed_w2: list[torch.Tensor] | None = None
        # or, where oneDNN cannot pack bf16, float32 copies of w13 and w2 (prepare_for_cpu_)
        self.wide_w13: torch.Tensor | None = None
        self.wide_w2: torch.Tensor | None = None
        # steps of at most small_step_rows tokens: x [n, in] -> x @ w13[e]^T, x @ w2[e]^T on
        # another kernel (the native gemv kernel's bf16 tiles, models/small_steps.py)
        self.small_step_rows = 0
        self.small_step_w13: list | None = None
        self.small_step_w2: list | None = None

    def add_small_step_kernels_(self, max_rows: int, w13_matmuls: list, w2_matmuls: list) -> None:
        """w13_matmuls[e]: x [n, H] bf16 contiguous -> [n, 2 * I]; w2_matmuls[e]: [n, I] ->
        [n, H]; for steps of at most max_rows tokens."""
        if len(w13_matmuls) != self.num_experts or len(w2_matmuls) != self.num_experts:
            raise ValueError(f"one matmul per expert ({self.num_experts}) for w13 and for w2")
        self.small_step_rows = max_rows
        self.small_step_w13, self.small_step_w2 = list(w13_matmuls), list(w2_matmuls)

    def prepare_for_cpu_(self) -> None:
        """After the weights are loaded and cast: pack each bf16 expert for oneDNN where this
        CPU can. The packed copies replace w13 and w2 (which are released, as PackedLinear
        drops its plain weight), so the experts are held once. Where oneDNN cannot pack bf16
        (AVX2), the experts are widened to float32 instead, as PackedLinear widens the dense
        layers (models/packed_linear.py says why), unless KVRELAY_WIDEN_BF16_WEIGHTS=0."""
        if self.w13.device.type != "cpu" or self.w13.dtype != torch.bfloat16:
            return
        if self.packed_w13 is not None or self.wide_w13 is not None:
            return
        if not onednn_packs_bf16():
            if WIDEN_BF16_WEIGHTS.enabled():
                self.wide_w13, self.wide_w2 = self.w13.detach().float(), self.w2.detach().float()
                self.w13 = self.w2 = None
            return
        self.packed_w13 = [pack_weight(self.w13[e]) for e in range(self.num_experts)]
        self.packed_w2 = [pack_weight(self.w2[e]) for e in range(self.num_experts)]
        self.w13 = self.w2 = None

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (bf16 where the experts were packed or widened)."""
        if self.w13 is not None:
            return self.w13.dtype
        return torch.bfloat16 if self.wide_w13 is not None else self.packed_w13[0].dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.w13 is None else self.w13.device

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, "
                f"packed={self.packed_w13 is not None}, widened={self.wide_w13 is not None}")
