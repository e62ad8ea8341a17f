"""An FP8 checkpoint read as the model loader reads any other (weights.py): each float8 weight
(e4m3 or e5m2) times its scale becomes a float32 `weight` (rounded once; exact for bf16 and
power-of-two scales), which the model then holds in its own dtype: the matmuls run on the
dequantized weights, in bf16 on CPU (there is no FP8 matmul on these CPUs).

Scales, by shape: one value (per tensor), one a row ([N] or [N, 1], per channel), or one per
block of rows and columns ([ceil(N / bn), ceil(K / bk)], `weight_block_size` [bn, bk], as Qwen3's
and DeepSeek's FP8 releases store them in `weight_scale_inv`, which multiplies despite its name).
Activation scales (`input_scale`, static W8A8 calibration) and the KV cache's (`k_scale`,
`v_scale`) have no use here: activations stay in the model's dtype (bf16), as vLLM runs FP8
checkpoints on hardware without FP8 matmuls; they are counted in the start log.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvrelay.engine.models.quant_schemes import Fp8Scheme
from kvrelay.engine.models.weights import iter_checkpoint

log = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = ("weight_scale", "weight_scale_inv")
_UNUSED_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")


class Fp8Checkpoint:
    def __init__(self, model_dir: Path, scheme: Fp8Scheme) -> None:
        self.model_dir = model_dir
        self.scheme = scheme

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor): float8 weights dequantized by their scales, other tensors
        as they are, activation and KV scales left out."""
        weights: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        unused = 0
        for name, tensor in iter_checkpoint(self.model_dir):
            module, _, part = name.rpartition(".")
            if part == "weight" and tensor.dtype in FP8_DTYPES:
                weights[module] = tensor
            elif part in _SCALES:
                scales[module] = tensor
            elif part in _UNUSED_SCALES:
                unused += 1
            else:
                yield name, tensor
        orphans = sorted(set(scales) - set(weights))
        if orphans:
            raise ValueError(f"{orphans[0]}: a weight scale without a float8 weight")
        for module, weight in weights.items():
            if module not in scales:
                raise ValueError(f"{module}.weight is float8 without a weight_scale")
            yield f"{module}.weight", dequantize(module, weight, scales[module], self.scheme)
        if unused:
            log.info("%s: %d activation/KV scales unused (activations stay in the model's "
                     "dtype)", self.scheme.describe(), unused)


def dequantize(module: str, weight: torch.Tensor, scale: torch.Tensor,
               scheme: Fp8Scheme) -> torch.Tensor:
    """weight [N, K] float8, scale as the module docstring lists -> [N, K] float32."""
    if weight.dim() != 2:
        raise ValueError(f"{module}.weight: a float8 weight must be 2-D, got "
                         f"{tuple(weight.shape)}")
    rows, cols = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        expanded = scale.reshape(1, 1)
    elif tuple(scale.shape) in ((rows,), (rows, 1)):
        expanded = scale.reshape(rows, 1)
    elif scheme.block is not None and tuple(scale.shape) == _block_grid(rows, cols, scheme.block):
        block_rows, block_cols = scheme.block
        expanded = scale.repeat_interleave(block_rows, 0)[:rows]
        expanded = expanded.repeat_interleave(block_cols, 1)[:, :cols]
    else:
        expected = "1, [N], [N, 1]" + (f" or {_block_grid(rows, cols, scheme.block)}"
                                       if scheme.block else "")
        raise ValueError(f"{module}: scale shape {tuple(scale.shape)} fits no FP8 scheme for a "
                         f"[{rows}, {cols}] weight (expected {expected})")
    if not torch.isfinite(expanded).all():
        raise ValueError(f"{module}: not every weight scale is finite")
    return weight.float() * expanded


def _block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return (-(-rows // block[0]), -(-cols // block[1]))
