"""The native CPU attention kernels (kernels/csrc/paged_decode*.cpp, paged_prefill.cpp): built
on first use, or None where switched off or unbuildable (kernels/native_build.py: the build,
cache and fallback rules every native kernel shares). Without the extension the CPU path keeps
its torch decode.
"""
from __future__ import annotations

import functools
from typing import Callable

from kvrelay.common.env_switches import NATIVE_CPU_ATTENTION, NATIVE_CPU_PREFILL
from kvrelay.kernels.native_build import CFLAGS, load_extension

SOURCES = ("paged_decode.cpp", "paged_decode_runs.cpp", "paged_prefill.cpp",
           "paged_decode_binding.cpp", "paged_attention_module.cpp")


_module = None  # the built extension, once paged_decode_op has loaded it


@functools.cache
def paged_decode_op() -> Callable | None:
    """The kernel's entry point, or None where it is switched off or cannot be built."""
    if not NATIVE_CPU_ATTENTION.enabled():
        return None
    global _module
    _module = load_extension("kvrelay_paged_decode", SOURCES, CFLAGS,
                             "native CPU decode attention", "using the slower torch path")
    return None if _module is None else _module.paged_decode_attention


def store_kv_op() -> Callable | None:
    """The extension's store of new K/V rows into the cache, or None where the decode kernel is
    off or unavailable (the same build holds both)."""
    if paged_decode_op() is None or _module is None:
        return None
    return _module.store_kv


def paged_prefill_op() -> Callable | None:
    """The extension's causal prefill attention, or None where it or the decode kernel (the same
    build holds both) is off or unavailable."""
    if not NATIVE_CPU_PREFILL.enabled() or paged_decode_op() is None or _module is None:
        return None
    return _module.paged_prefill_attention


def paged_prefill_supported(head_dim: int, group_size: int) -> bool:
    return _module is not None and _module.paged_prefill_supported(head_dim, group_size)
