"""Every decoder layer of a small decode step in one native call (kernels/csrc/decode_stack.cpp),
or None.

The extension compiles the very kernels the Python path calls one by one (the few-row 4-bit
matmuls, the fused elementwise ops, paged decode attention) with a loop over the layers, so a
step of a few rows pays one Python call instead of ~300. Same build, cache and fallback rules
as the other native kernels (kernels/native_build.py); built where the 4-bit kernel builds
(AVX512-BF16).
"""
from __future__ import annotations

import functools

from kvrelay.common.env_switches import NATIVE_DECODE_STACK
from kvrelay.kernels import native_amx, native_q4a8
from kvrelay.kernels.native_build import load_extension
from kvrelay.kernels.native_gemv import GEMV_CFLAGS, cpu_has_avx512_bf16

SOURCES = ("decode_stack.cpp", "cpu_gemv.cpp", "cpu_elementwise.cpp", "paged_decode.cpp",
           "paged_decode_runs.cpp", "paged_prefill.cpp", "paged_decode_binding.cpp")
# where the CPU has AVX512-VNNI, the steps above the gemv kernel's rows (kernels/native_q4a8.py)
VNNI_SOURCES = ("cpu_gemm_q4a8.cpp",)
VNNI_CFLAGS = ["-mavx512vnni", "-mf16c", "-DKVRELAY_STACK_VNNI"]
# where the CPU has AMX tiles, the steps above those (kernels/native_amx.py)
AMX_SOURCES = ("cpu_amx_gemm.cpp",)
AMX_CFLAGS = native_amx.AMX_CFLAGS + ["-DKVRELAY_STACK_AMX"]


@functools.cache
def stack_ops():
    """The built extension (its DecodeStack class), or None where off, unsupported or
    unbuildable."""
    if not NATIVE_DECODE_STACK.enabled() or not cpu_has_avx512_bf16():
        return None
    vnni = native_q4a8.cpu_has_avx512_vnni()
    amx = native_amx.amx_ops() is not None  # the CPU has AMX and the OS grants its tiles
    sources = SOURCES + (VNNI_SOURCES if vnni else ()) + (AMX_SOURCES if amx else ())
    cflags = GEMV_CFLAGS + (VNNI_CFLAGS if vnni else []) + (AMX_CFLAGS if amx else [])
    return load_extension("kvrelay_decode_stack", sources, cflags, "native decode stack",
                          "running the layers from Python")
