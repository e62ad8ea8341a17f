"""Every environment variable kvrelay reads besides its flags' `KVRELAY_<FLAG>` (flags.py): one
declaration each, read through here by the Python code, and by name by the C++ kernels' getenv.

Most are on/off switches that rule a native kernel or an optimisation out (to compare, or to
work around a machine): on unless set to "0", as the C++ reads them too. tests/test_env_switches.py
checks that every KVRELAY_* variable the sources read is declared here and every one declared is
read; docs/configuration.md lists them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PYTHON = "python"


@dataclass(frozen=True, slots=True)
class EnvSwitch:
    name: str
    type: str  # "on/off" (on unless "0"), "path" or "choice"
    default: str
    help: str
    read_in: str = PYTHON  # or the C++ source that reads it per call with getenv

    def value(self) -> str:
        return os.environ.get(self.name, self.default)

    def enabled(self) -> bool:
        """An on/off switch's state: on unless the variable is "0"."""
        return self.value() != "0"

    def path(self) -> Path:
        """A path setting's value; the default's `~` is the user's home (a set value is taken
        as written)."""
        raw = os.environ.get(self.name)
        return Path(raw) if raw is not None else Path(self.default).expanduser()


def _on_off(name: str, help_text: str, read_in: str = PYTHON) -> EnvSwitch:
    return EnvSwitch(name, "on/off", "1", help_text, read_in)


CACHE_DIR = EnvSwitch(
    "KVRELAY_CACHE_DIR", "path", "~/.cache/kvrelay",
    "where converted checkpoints are kept (a GGUF file's weights as loaded; "
    "services/engine/model_loader.py)")
EVENT_LOOP = EnvSwitch(
    "KVRELAY_EVENT_LOOP", "choice", "uvloop",
    "a service's event loop: uvloop where it is installed; anything else (asyncio) runs "
    "asyncio's own loop")
PAD_STEPS = _on_off(
    "KVRELAY_PAD_STEPS",
    "0: steps keep their own row count on oneDNN instead of a padded bucket "
    "(services/engine/step_padding.py says why they are padded)")
WIDEN_BF16_WEIGHTS = _on_off(
    "KVRELAY_WIDEN_BF16_WEIGHTS",
    "0: on a CPU whose oneDNN cannot pack bf16 (no AVX-512 or AVX-NE-CONVERT), keep the large "
    "steps' weights (dense layers, head, experts) in bf16 (half the memory, 3-4x slower "
    "matmuls there) instead of float32 (services/engine/models/packed_linear.py)")
Q8_HEAD = _on_off(
    "KVRELAY_Q8_HEAD",
    "0: the head's small steps on its bf16 tiles even where the checkpoint has 8-bit blocks")
NATIVE_CPU_ATTENTION = _on_off(
    "KVRELAY_NATIVE_CPU_ATTENTION",
    "0: the torch decode-attention path instead of the native CPU kernel (kernels/native_cpu.py)")
NATIVE_CPU_PREFILL = _on_off(
    "KVRELAY_NATIVE_CPU_PREFILL",
    "0: prefill rows on torch's SDPA while decode rows stay native")
NATIVE_CPU_ELEMENTWISE = _on_off(
    "KVRELAY_NATIVE_CPU_ELEMENTWISE",
    "0: torch's ops instead of the fused native RMSNorm, RoPE, SiLU-and-mul and argmax")
NATIVE_GEMV = _on_off(
    "KVRELAY_NATIVE_GEMV",
    "0: torch's int4 kernel instead of the native AVX-512 matmuls for the smallest steps")
NATIVE_AMX = _on_off(
    "KVRELAY_NATIVE_AMX",
    "0: oneDNN and torch's int4 kernel instead of the AMX-tile matmuls")
Q4A8 = _on_off(
    "KVRELAY_Q4A8",
    "0: the bf16 kernels where the VNNI kernel (4-bit weights, int8-coded activations) would run")
NATIVE_DECODE_STACK = _on_off(
    "KVRELAY_NATIVE_DECODE_STACK",
    "0: a small decode step's layers one op at a time from Python instead of one native call")
PREFILL_AMX = _on_off(
    "KVRELAY_PREFILL_AMX",
    "0: native prefill attention on AVX512-BF16 pairs instead of AMX tiles",
    "kernels/csrc/paged_prefill.cpp")
DECODE_RUNS = _on_off(
    "KVRELAY_DECODE_RUNS",
    "0: native decode attention computes every row alone instead of a sequence's consecutive "
    "rows (a speculative step's) together", "kernels/csrc/paged_decode_runs.cpp")
DECODE_SPLIT = _on_off(
    "KVRELAY_DECODE_SPLIT",
    "0: a bf16 decode row's keys are never cut into parts that threads attend apart",
    "kernels/csrc/paged_decode.cpp")

SWITCHES = {switch.name: switch for switch in (
    CACHE_DIR, EVENT_LOOP, PAD_STEPS, WIDEN_BF16_WEIGHTS, Q8_HEAD, NATIVE_CPU_ATTENTION, NATIVE_CPU_PREFILL,
    NATIVE_CPU_ELEMENTWISE, NATIVE_GEMV, NATIVE_AMX, Q4A8, NATIVE_DECODE_STACK, PREFILL_AMX,
    DECODE_RUNS, DECODE_SPLIT)}
