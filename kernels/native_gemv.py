"""Matmuls of a few rows on AVX-512 (kernels/csrc/cpu_gemv.cpp, cpu_gemv_q8.cpp), or None.

For decode steps of 1 to a few tokens, which are bound by reading the weights once: the
4-bit form reads the checkpoint's blocks (0.625 bytes a weight with their float16 scales), the
8-bit form a Q8_0 head's (1.06 bytes a weight), the bf16 form any other head. The 4-bit and
bf16 forms take the AMX kernel's weight layouts (kernels/native_amx.py: `pack_q4`,
`pack_bf16`), so one copy of the weights serves both kernels; the 8-bit one is its own
(`pack_q8`). Same build, cache and fallback rules as the other native kernels
(kernels/native_build.py); built where the CPU has AVX512-BF16 (AMX is not needed).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.env_switches import NATIVE_GEMV
from kvrelay.kernels.native_amx import Q4Tiles
from kvrelay.kernels.native_build import CFLAGS, cpu_flags, load_extension

SOURCES = ("cpu_gemv.cpp", "cpu_gemv_q8.cpp", "cpu_gemv_binding.cpp")
GEMV_CFLAGS = CFLAGS + ["-mavx512bf16", "-mavx512bw", "-mavx512vl"]


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


@functools.cache
def gemv_ops():
    """The built extension (gemv_q4, gemv_q8, gemv_bf16), or None where off, unsupported or
    unbuildable."""
    if not NATIVE_GEMV.enabled() or not cpu_has_avx512_bf16():
        return None
    return load_extension("kvrelay_gemv", SOURCES, GEMV_CFLAGS,
                          "native small-step matmuls", "using torch's int4 kernel")


def matmul_q4(ops, x: torch.Tensor, tiles: Q4Tiles) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] with `tiles` from native_amx.pack_q4."""
    out = x.new_empty(x.shape[0], tiles.out_features)
    ops.gemv_q4(out, x.contiguous(), tiles.tiles)
    return out


def matmul_bf16(ops, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] with `packed` from native_amx.pack_bf16."""
    out = x.new_empty(x.shape[0], packed.shape[0] * 16)
    ops.gemv_bf16(out, x.contiguous(), packed)
    return out


@dataclass(frozen=True, slots=True)
class Q8Tiles:
    """A weight's 8-bit blocks in cpu_gemv_q8.cpp's order: tiles [N/16, K/32, 544] uint8, each
    32 rows (one K each) of 16 columns' int8 codes, then the 16 columns' d as float16."""
    tiles: torch.Tensor
    out_features: int


def pack_q8(q: np.ndarray, d: np.ndarray) -> Q8Tiles:
    """q [N, K] int8, d [N, K/32] float32 holding float16 values (weight = d * q, per 32
    weights of a row) -> the kernel's tiles. Raises ValueError where d is not float16."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"8-bit tiles need N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    halves = np.asarray(d, dtype=np.float32).astype(np.float16)
    if not np.array_equal(halves.astype(np.float32), d):
        raise ValueError("8-bit scales are not float16 values")
    # [N, K] -> [N/16, K/32, 32 (k), 16 (column)]
    codes = np.ascontiguousarray(q, dtype=np.int8).reshape(n // 16, 16, k // 32, 32)
    codes = codes.transpose(0, 2, 3, 1).reshape(n // 16, k // 32, 512).view(np.uint8)
    scales = halves.reshape(n // 16, 16, k // 32).transpose(0, 2, 1)
    scales = np.ascontiguousarray(scales).view(np.uint8).reshape(n // 16, k // 32, 32)
    tiles = np.concatenate([codes, scales], axis=-1)
    return Q8Tiles(torch.from_numpy(np.ascontiguousarray(tiles)), n)


def matmul_q8(ops, x: torch.Tensor, tiles: Q8Tiles) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] with `tiles` from pack_q8."""
    out = x.new_empty(x.shape[0], tiles.out_features)
    ops.gemv_q8(out, x.contiguous(), tiles.tiles)
    return out
