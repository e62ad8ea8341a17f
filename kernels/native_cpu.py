"""The native CPU attention kernels (kernels/csrc/paged_decode*.cpp, paged_prefill.cpp): built
on first use, or None.

torch.utils.cpp_extension compiles it once into torch's extension directory
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); later processes find it built and only
load it. Without a compiler or ninja the build fails, and the CPU path keeps its torch decode
instead: the decision is made once per process, with one warning.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sysconfig
import warnings
from pathlib import Path
from typing import Callable

import torch

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_decode.cpp", "paged_decode_runs.cpp", "paged_prefill.cpp", "paged_decode_binding.cpp",
                         "paged_attention_module.cpp")]
# -march=native: the build is for this machine's vector units, so the extension's name carries
# the CPU's feature flags and a cache directory shared by different machines never mixes them.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # gcc's tuning for recent Xeons keeps loops at 256 bits; full AVX-512 measured ~5-10% faster.
    CFLAGS.append("-mprefer-vector-width=512")
# Set to 0 to keep the torch decode path (to compare the two, or to rule the kernel out).
ENV_SWITCH = "KVRELAY_NATIVE_CPU_ATTENTION"
# Set to 0 to keep prefill rows on torch's SDPA while decode rows stay native.
PREFILL_SWITCH = "KVRELAY_NATIVE_CPU_PREFILL"


_module = None  # the built extension, once paged_decode_op has loaded it


@functools.cache
def paged_decode_op() -> Callable | None:
    """The kernel's entry point, or None where it is switched off or cannot be built."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    global _module
    try:
        _module = _build()
        return _module.paged_decode_attention
    except Exception as error:  # no compiler, no ninja, no headers: any of these means fall back
        reason = str(error)[-2000:]  # a failed build's log ends with the compiler's complaint
        warnings.warn(
            f"native CPU decode attention unavailable ({type(error).__name__}: {reason}); "
            "using the slower torch path",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def store_kv_op() -> Callable | None:
    """The extension's store of new K/V rows into the cache, or None where the decode kernel is
    off or unavailable (the same build holds both)."""
    if paged_decode_op() is None or _module is None:
        return None
    return _module.store_kv


def paged_prefill_op() -> Callable | None:
    """The extension's causal prefill attention, or None where it or the decode kernel (the same
    build holds both) is off or unavailable."""
    if os.environ.get(PREFILL_SWITCH, "1") == "0" or paged_decode_op() is None or _module is None:
        return None
    return _module.paged_prefill_attention


def paged_prefill_supported(head_dim: int, group_size: int) -> bool:
    return _module is not None and _module.paged_prefill_supported(head_dim, group_size)


def _build():
    from torch.utils import cpp_extension

    _put_pip_ninja_on_path()
    return cpp_extension.load(
        name=f"kvrelay_paged_decode_{_machine_tag()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next((line for line in cpuinfo if line.startswith("flags")),
                                  "").split())
    except OSError:
        return frozenset()


def _put_pip_ninja_on_path() -> None:
    """pip installs ninja next to the interpreter, which is not on PATH unless the virtual
    environment is activated, and cpp_extension looks for ninja on PATH only."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])


def _machine_tag() -> str:
    """Short hash of what the binary depends on besides its source: CPU features and torch."""
    cpu_flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu_flags = next((line for line in cpuinfo if line.startswith("flags")), cpu_flags)
    except OSError:
        pass
    return hashlib.sha1(f"{cpu_flags}|{torch.__version__}".encode()).hexdigest()[:10]
