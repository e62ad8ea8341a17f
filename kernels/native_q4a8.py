"""Matmuls over the checkpoint's 4-bit blocks on integer dot products (kernels/csrc/
cpu_gemm_q4a8.cpp): the activations coded as int8 per 32 values, once or twice.

For CPUs with AVX512-VNNI, where bf16 dot products do half the multiply-adds of the integer ones
(on AMX machines too, for the few-row steps that AMX tiles, 16 rows high, would waste). Coded
twice (`split`: int8 codes, then their rounding error in 128ths of a step, ~15 bits), the
activations are finer than bf16's and steps of a few rows beat both bf16 kernels; coded once
(llama.cpp's Q8 activations) every step, prefill included, multiplies faster than oneDNN's bf16,
at a cost in accuracy (models/small_steps.py routes). The weights are the checkpoint's own
blocks in this kernel's tile order (`pack`). Same build, cache and fallback rules as the other
native kernels (kernels/native_build.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.env_switches import Q4A8
from kvrelay.kernels.native_amx import Q4_TILE_BYTES, q4_scales_as_float16, tile_scales
from kvrelay.kernels.native_build import CFLAGS, cpu_flags, load_extension

SOURCES = ("cpu_gemm_q4a8.cpp", "cpu_gemm_q4a8_binding.cpp")
_CFLAGS = CFLAGS + ["-mavx512vnni", "-mavx512bw", "-mavx512vl", "-mf16c"]


def cpu_has_avx512_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()


@functools.cache
def q4a8_ops():
    """The built extension (gemm_q4a8), or None where off, unsupported or unbuildable."""
    if not Q4A8.enabled() or not cpu_has_avx512_vnni():
        return None
    return load_extension("kvrelay_q4a8", SOURCES, _CFLAGS,
                          "int8-activation 4-bit matmuls", "using the bf16 kernels")


@dataclass(frozen=True, slots=True)
class Q4A8Tiles:
    """A weight's 4-bit blocks in cpu_gemm_q4a8.cpp's order: tiles [N/16, K/32, 320] uint8."""
    tiles: torch.Tensor
    out_features: int


def pack(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Q4A8Tiles:
    """q [N, K] in 0..15, scale and zero [N, K/32] float32 (weight = (q - 8) * scale + zero per
    32 weights of a row) -> the kernel's tiles. Raises ValueError where scale and
    zero - 8 * scale are not float16 values (they are for GGUF's Q4_0 and Q4_1 blocks)."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"[{n}, {k}]: N must be a multiple of 16 and K of 32")
    codes = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8))
    # [nb, col, kb, chunk, half, j] -> [nb, kb, chunk, col, j, half]
    grid = codes.reshape(n // 16, 16, k // 32, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (grid[..., 0] | (grid[..., 1] << 4)).reshape(n // 16, k // 32, 256)
    d, m = q4_scales_as_float16(scale, zero)
    tiles = torch.cat([nibbles, tile_scales(d), tile_scales(m)], dim=-1).contiguous()
    assert tiles.shape[-1] == Q4_TILE_BYTES
    return Q4A8Tiles(tiles, n)


def matmul(ops, x: torch.Tensor, tiles: Q4A8Tiles, split: bool = True) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16. split: each 32 activations coded twice (int8 codes, then
    their rounding error as int8 in 128ths of a step: ~15 significant bits, finer than bf16);
    otherwise once (~7 bits against the block's largest value, as llama.cpp's Q8 activations)."""
    out = x.new_empty(x.shape[0], tiles.out_features)
    ops.gemm_q4a8(out, x.contiguous(), tiles.tiles, split)
    return out


def reference(x: torch.Tensor, q: np.ndarray, scale: np.ndarray, zero: np.ndarray,
              split: bool = True) -> torch.Tensor:
    """What the kernel computes, in float32 torch: with the weight q * d + m per 32 weights of a
    row, x [M, K] coded as int8 per 32 values (step = max |x| / 127, round half to even; split:
    plus the rounding error in 128ths of a step) times q * d, plus the exact x times m."""
    rows, k = x.shape
    n = q.shape[0]
    x = x.float()
    blocks = x.view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    step = amax / 127
    # torch.full / amax, not 127 / amax: torch computes the latter as 127 * (1 / amax), which
    # rounds twice, and a code at a .5 boundary then rounds the other way than the kernel's
    scaled = blocks * torch.where(step > 0, torch.full_like(amax, 127.0) / amax, 0)
    codes = torch.round(scaled)
    if split:
        codes = codes + torch.round((scaled - codes) * 128) / 128
    rounded = (codes * step).view(rows, k)
    d, m = (torch.from_numpy(v.astype(np.float32)) for v in q4_scales_as_float16(scale, zero))
    codes_w = torch.from_numpy(q.astype(np.float32)).view(n, k // 32, 32)
    weight = (codes_w * d[..., None]).view(n, k)
    offsets = m[..., None].expand(n, k // 32, 32).reshape(n, k)
    return rounded @ weight.T + x @ offsets.T
