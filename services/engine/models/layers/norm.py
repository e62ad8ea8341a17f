"""RMSNorm in both conventions: scale by w (Llama, Qwen, Mistral, Phi) or by 1 + w (Gemma)."""
from __future__ import annotations

import torch
from torch import nn

from kvrelay.kernels import native_elementwise as fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset  # scale by 1 + weight (Gemma's checkpoints store w - 1)
        # fused CPU ops (bf16), see DecoderLM.use_native_cpu_ops_ (1 + w: in float32 there too)
        self.native = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., hidden]
        if self.native is not None:
            shape = x.shape
            out = fused.rms_norm(self.native, x.reshape(-1, shape[-1]).contiguous(),
                                 self.weight, self.eps, self.offset)
            return out.view(shape)
        # Same order of operations as transformers (in float32 whatever the dtype), so float32
        # outputs match bit for bit; F.rms_norm on bf16 measured no faster and less accurate.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual). x, residual [T, hidden]."""
        if self.native is not None:
            return fused.add_rms_norm(self.native, x.contiguous(), residual, self.weight,
                                      self.eps, self.offset)
        residual += x
        return self(residual)
