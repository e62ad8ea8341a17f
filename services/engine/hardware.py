"""Choices that depend on the machine: device and the fastest dtype on it."""
from __future__ import annotations

import functools

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(name)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    # AMX or AVX512-BF16 make oneDNN's bf16 GEMMs several times faster than float32.
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
