"""How every native CPU extension (kernels/csrc) is built and loaded, and what happens when it
cannot be: one place for the rules the kernels/native_*.py modules share.

torch.utils.cpp_extension compiles an extension once into torch's extension directory
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), under a name that hashes its sources, the
CPU and torch; later processes find it built and only load it. Without a compiler or ninja the build fails, and the caller keeps its torch path
instead: each native_* module decides once per process (functools.cache), with one warning.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
# -march=native: the build is for this machine's vector units, so the extension's name carries
# the CPU's feature flags and a cache directory shared by different machines never mixes them.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # gcc's tuning for recent Xeons keeps loops at 256 bits; full AVX-512 measured ~5-10% faster.
    CFLAGS.append("-mprefer-vector-width=512")


def load_extension(name: str, sources: Sequence[str], cflags: Sequence[str], what: str,
                   fallback: str, check: Callable[[ModuleType], None] | None = None
                   ) -> ModuleType | None:
    """The extension built from `sources` (file names in kernels/csrc) with `cflags`, named
    `name` plus this machine's tag; None, with a warning that `what` is unavailable and
    `fallback` runs instead, where the build (or `check` of the built module) fails."""
    try:
        module = _build(f"{name}_{_build_tag(cflags)}", sources, cflags)
        if check is not None:
            check(module)
        return module
    except Exception as error:  # no compiler, no ninja, no headers: any of these means fall back
        reason = str(error)[-2000:]  # a failed build's log ends with the compiler's complaint
        # stacklevel 3: the warning names the code that asked the native_* module for its ops
        warnings.warn(f"{what} unavailable ({type(error).__name__}: {reason}); {fallback}",
                      RuntimeWarning, stacklevel=3)
        return None


def _build(name: str, sources: Sequence[str], cflags: Sequence[str]) -> ModuleType:
    from torch.utils import cpp_extension

    _put_pip_ninja_on_path()
    return cpp_extension.load(name=name, sources=[str(CSRC / source) for source in sources],
                              extra_cflags=list(cflags), extra_ldflags=["-fopenmp"],
                              verbose=False)


@functools.cache
def _cpuinfo_flags_line() -> str | None:
    """/proc/cpuinfo's first `flags` line, or None where it cannot be read or has none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), None)
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset((_cpuinfo_flags_line() or "").split())


def _put_pip_ninja_on_path() -> None:
    """pip installs ninja next to the interpreter, which is not on PATH unless the virtual
    environment is activated, and cpp_extension looks for ninja on PATH only."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])


@functools.cache
def _sources_digest() -> str:
    """Every file under csrc/ (sources and headers): a changed kernel gets a new name, so no
    process loads a build of other sources that sits in the shared cache directory (torch
    rebuilds by file times, which a build from another checkout of the same name defeats)."""
    digest = hashlib.sha1()
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _build_tag(cflags: Sequence[str]) -> str:
    """Short hash of what the binary depends on: its sources, CPU features, torch, flags."""
    flags_line = _cpuinfo_flags_line() or platform.machine()
    key = f"{flags_line}|{torch.__version__}|{' '.join(cflags)}|{_sources_digest()}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]
