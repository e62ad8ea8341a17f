"""How many bytes a worker's KV cache takes: what --kv-cache-memory says, or by default (`auto`)
a share of the memory the worker can see.

The KV cache is what lets a server keep many sequences running and serve repeated prefixes from
cache; a fixed default (1 GiB was ~46,000 tokens of SmolLM2-135M) leaves most of a large
machine unused and cannot fit a burst of long prompts a second time. `auto` takes
--kv-cache-memory-fraction of the memory limit (the worker's cgroup limit inside a container,
else the machine's RAM), at most what is free when the worker sizes its cache less a margin for
everything else, and at most the free room of the filesystem a shared-memory cache lives in.
The fraction is per worker: `kvrelay up` starts two on one host. Every page is committed at
start (model_runner.allocate_kv_cache), so the size is what the worker really holds.

vLLM's CPU build reads its KV size in GiB from VLLM_CPU_KVCACHE_SPACE; a worker whose flag and
KVRELAY_KV_CACHE_MEMORY are unset reads it too, so a deployment written for vLLM keeps its size.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
GIB = 1 << 30
DEFAULT_FRACTION = 0.2
# Kept free when sizing from what is available: the other worker, the tokenizer and the
# gateway on the same host, and the step's own activations.
HEADROOM_BYTES = 2 * GIB
MIN_BYTES = 64 << 20
VLLM_ENV = "VLLM_CPU_KVCACHE_SPACE"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12,
          "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_kv_memory(text: str) -> int | str:
    """A flag value: "auto", or a size in bytes with an optional unit (4GiB, 512MiB, 2G)."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected auto or a size such as 4GiB or 536870912, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"a KV cache of {text!r} holds nothing")
    return size


def parse_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"a fraction in (0, 1], got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class MemoryView:
    limit: int  # bytes the worker may use: its cgroup's limit, else the machine's RAM
    available: int  # bytes free for it now
    source: str  # where the limit comes from: "cgroup" or "machine"


@dataclass(frozen=True, slots=True)
class KvBudget:
    num_bytes: int
    reason: str  # how the size was chosen, for the worker's start-up line


def memory_view(root: Path = Path("/")) -> MemoryView:
    """The machine's RAM and what is available (/proc/meminfo), narrowed by a cgroup limit
    (v2 memory.max, else v1 memory.limit_in_bytes) when it is below the RAM."""
    meminfo = _meminfo(root / "proc/meminfo")
    total, available = meminfo["MemTotal"], meminfo.get("MemAvailable", meminfo["MemTotal"])
    for limit_file, usage_file in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                                   ("sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(root / limit_file)
        if limit is not None and limit < total:
            usage = _read_int(root / usage_file) or 0
            return MemoryView(limit, max(0, min(available, limit - usage)), "cgroup")
    return MemoryView(total, available, "machine")


def resolve(setting: int | str, fraction: float, view: MemoryView,
            shm_free: int | None = None, environ=os.environ) -> KvBudget:
    """The KV cache's size for a worker: `setting` as given, else vLLM's variable, else auto.
    `shm_free`: free bytes where a shared-memory cache will live (None: not in shared memory)."""
    if setting != AUTO:
        return KvBudget(int(setting), "--kv-cache-memory")
    raw = environ.get(VLLM_ENV, "").strip()
    if raw:
        try:
            gib = int(raw)
        except ValueError:
            raise ValueError(f"{VLLM_ENV}={raw!r}: expected a whole number of GiB") from None
        if gib > 0:
            return KvBudget(gib * GIB, f"{VLLM_ENV}={gib} (GiB)")
    share = int(fraction * view.limit)
    bounds = [(share, f"{fraction:g} of the {view.source}'s {_gib(view.limit)}"),
              (view.available - HEADROOM_BYTES,
               f"{_gib(view.available)} available less {_gib(HEADROOM_BYTES)}")]
    if shm_free is not None:
        bounds.append((shm_free - HEADROOM_BYTES // 4, f"{_gib(shm_free)} free in shared memory"))
    num_bytes, reason = min(bounds, key=lambda bound: bound[0])
    if num_bytes < MIN_BYTES:
        raise ValueError(f"no room for a KV cache: {reason}; free memory or set "
                         "--kv-cache-memory")
    return KvBudget(num_bytes, f"auto: {reason}")


def filesystem_free(path: str | os.PathLike) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def _meminfo(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # (v2's "max": no limit)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"
