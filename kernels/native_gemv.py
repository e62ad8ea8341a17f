"""Matmuls of a few rows on AVX512-BF16 dot products (kernels/csrc/cpu_gemv.cpp), or None.

For decode steps of 1 to a few tokens, which are bound by reading the weights once: the
4-bit form reads the checkpoint's blocks (0.625 bytes a weight with their float16 scales)
and the bf16 form the head. Both take the AMX kernel's weight layouts (kernels/native_amx.py:
`pack_q4`, `pack_bf16`), so one copy of the weights serves both kernels. Same build, cache and
fallback rules as the other native kernels (kernels/native_cpu.py); built where the CPU has
AVX512-BF16 (AMX is not needed).
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from kernels.native_amx import Q4Tiles
from kernels.native_cpu import CFLAGS, _machine_tag, _put_pip_ninja_on_path, cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "cpu_gemv.cpp"
ENV_SWITCH = "KVRELAY_NATIVE_GEMV"  # 0: keep torch's int4 kernel for the smallest steps
_GEMV_CFLAGS = CFLAGS + ["-mavx512bf16", "-mavx512bw", "-mavx512vl"]


def cpu_has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


@functools.cache
def gemv_ops():
    """The built extension (gemv_q4, gemv_bf16), or None where off, unsupported or unbuildable."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils import cpp_extension

        _put_pip_ninja_on_path()
        return cpp_extension.load(name=f"kvrelay_gemv_{_machine_tag()}", sources=[str(SOURCE)],
                                  extra_cflags=_GEMV_CFLAGS, extra_ldflags=["-fopenmp"],
                                  verbose=False)
    except Exception as error:  # no compiler: torch's int4 kernel stays
        warnings.warn(f"native small-step matmuls unavailable ({type(error).__name__}: "
                      f"{str(error)[-2000:]}); using torch's int4 kernel", RuntimeWarning,
                      stacklevel=2)
        return None


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
