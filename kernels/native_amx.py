"""Small-M matmuls on AMX tiles (kernels/csrc/cpu_amx_gemm.cpp): built on first use, or None.

The weights are laid out once at load time, in bf16 (`pack_bf16`) or as the checkpoint's
4-bit blocks (`pack_q4`); `matmul_bf16` / `matmul_q4` then multiply a step's rows by them.
Both forms give the same bits for the same weights (the 4-bit tiles are widened to exactly
the bf16 copy's values). Same build, cache and fallback rules as the other native kernels
(kernels/native_build.py); only built where the CPU has AMX-BF16.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.env_switches import NATIVE_AMX
from kvrelay.kernels.native_build import CFLAGS, cpu_flags, load_extension

SOURCES = ("cpu_amx_gemm.cpp", "cpu_amx_gemm_binding.cpp")
# (The widening of 4-bit weights rounds a multiply and an add apart, as the float32
# dequantization did, through explicit-rounding intrinsics that no flag fuses.)
AMX_CFLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]
_AMX_CFLAGS = CFLAGS + AMX_CFLAGS


def cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f"} <= cpu_flags()


@functools.cache
def amx_ops():
    """The built extension (gemm_bf16, gemm_q4), or None where off, unsupported or unbuildable.
    A first tiny multiply checks that the OS grants the tile state before anyone relies on it."""
    if not NATIVE_AMX.enabled() or not cpu_has_amx():
        return None
    return load_extension("kvrelay_amx_gemm", SOURCES, _AMX_CFLAGS, "AMX matmuls",
                          "using oneDNN", check=_probe_tiles)


def _probe_tiles(ops) -> None:
    """Raises where the OS does not grant the tile state (the multiply faults or is wrong)."""
    probe = torch.ones(1, 32, dtype=torch.bfloat16)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    ops.gemm_bf16(out, probe, pack_bf16(torch.ones(32, 32, dtype=torch.bfloat16)))
    if not torch.all(out == 32):
        raise RuntimeError(f"AMX probe multiply gave {out.tolist()}")


def shape_supported(out_features: int, in_features: int) -> bool:
    return out_features % 32 == 0 and in_features % 32 == 0


def _tile_lanes(matrix: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: lane l of tile row r is M[n0 + l // 2, k0 + 2r + l % 2]
    (the pairs AMX's bf16 dot product reads), for the weights and for their 4-bit codes."""
    n, k = matrix.shape
    tiles = matrix.reshape(n // 16, 16, k // 32, 16, 2)  # [nb, col, kb, row, pair]
    return tiles.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> its B tiles, [N/16, K/32, 16, 32] (_tile_lanes)."""
    return _tile_lanes(weight.detach()).contiguous()


# One 4-bit tile in memory: 16 K pairs x 16 columns of nibbles, then the 16 columns' scale and
# offset as float16 (the GGUF block's own d and m).
Q4_TILE_BYTES = 256 + 32 + 32


@dataclass(frozen=True, slots=True)
class Q4Tiles:
    """A weight's 4-bit blocks in the kernels' tile order (cpu_amx_gemm.cpp, cpu_gemv.cpp):
    tiles [N/16, K/32, Q4_TILE_BYTES] uint8, each 256 bytes of nibbles, 16 float16 scales d
    and 16 float16 offsets m, the weight being q * d + m per 32 weights of a column."""
    tiles: torch.Tensor
    out_features: int


def q4_scales_as_float16(scale: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K/32] float32 scale and zero (weight = (q - 8) * scale + zero) -> the tiles' d and m
    as float16 (weight = q * d + m). Raises ValueError where they are not float16 values."""
    scale = np.asarray(scale, dtype=np.float32)
    d = scale.astype(np.float16)
    m = (np.asarray(zero, dtype=np.float32) - 8 * scale).astype(np.float16)
    # the kernels rebuild zero as m + 8 d in float32: it must come back bit for bit
    if not (np.array_equal(d.astype(np.float32), scale)
            and np.array_equal(m.astype(np.float32) + 8 * scale, zero)):
        raise ValueError("4-bit scales or offsets are not float16 values")
    return d, m


def tile_scales(values: np.ndarray) -> torch.Tensor:
    """[N, K/32] float16 -> [N/16, K/32, 32] bytes: each tile's 16 columns' values, in order."""
    n, k_blocks = values.shape
    grid = torch.from_numpy(np.ascontiguousarray(values)).view(torch.uint8)
    return grid.reshape(n // 16, 16, k_blocks, 2).permute(0, 2, 1, 3).reshape(n // 16, k_blocks, 32)


def pack_q4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Q4Tiles:
    """q [N, K] in 0..15, scale and zero [N, K/32] float32 (weight = (q - 8) * scale + zero,
    per 32 weights of a row) -> the kernels' tiles. Raises ValueError where scale and
    zero - 8 * scale are not float16 values (they are for GGUF's Q4_0 and Q4_1 blocks)."""
    n, k = q.shape
    lanes = _tile_lanes(torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)))
    nibbles = (lanes[..., :16] | (lanes[..., 16:] << 4)).reshape(n // 16, k // 32, 256)
    d, m = q4_scales_as_float16(scale, zero)
    tiles = torch.cat([nibbles, tile_scales(d), tile_scales(m)], dim=-1).contiguous()
    return Q4Tiles(tiles, n)


def matmul_bf16(ops, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] with `packed` from pack_bf16."""
    out = x.new_empty(x.shape[0], packed.shape[0] * 16)
    ops.gemm_bf16(out, x.contiguous(), packed)
    return out


def matmul_q4(ops, x: torch.Tensor, tiles: Q4Tiles) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] with `tiles` from pack_q4."""
    out = x.new_empty(x.shape[0], tiles.out_features)
    ops.gemm_q4(out, x.contiguous(), tiles.tiles)
    return out
