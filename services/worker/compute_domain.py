"""The compute domain a worker reports: the hardware it computes on, named so that workers on the
same hardware match, also from two containers on one machine. The scheduler shares a domain's
CPUs (or its GPU) between its workers' steps (services/scheduler/core_share.py)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def compute_domain(device) -> str:
    """The machine (its kernel's boot id, the same in every container on it) and the GPU's
    UUID, or the CPUs this process may run on. A process whose cgroup caps its CPU time (a
    Kubernetes CPU limit) has that share to itself, so its domain is its own."""
    machine = boot_id() or socket.gethostname()
    if device.type == "cuda":
        import torch
        properties = torch.cuda.get_device_properties(device)
        return f"{machine}/cuda:{getattr(properties, 'uuid', device.index)}"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    domain = f"{machine}/cpus:{','.join(map(str, cpus))}"
    if cpu_time_capped():
        domain += f"/own:{socket.gethostname()}:{os.getpid()}"
    return domain


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cpu_time_capped(cgroup_root: Path = CGROUP_ROOT,
                    proc_cgroup: Path = Path("/proc/self/cgroup")) -> bool:
    """Whether a CPU quota applies to this process's cgroup (v2 `cpu.max`, v1
    `cpu.cfs_quota_us`). Inside a container the cgroup's files are at the root of the mount."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates = [cgroup_root / "cpu.max", cgroup_root / "cpu" / "cpu.cfs_quota_us",
                  cgroup_root / "cpu,cpuacct" / "cpu.cfs_quota_us"]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":
            candidates.append(cgroup_root / relative / "cpu.max")
        elif "cpu" in controllers.split(","):
            candidates.append(cgroup_root / controllers / relative / "cpu.cfs_quota_us")
    return any(_caps(candidate) for candidate in candidates)


def _caps(path: Path) -> bool:
    try:
        quota = path.read_text().split()[0]
    except (OSError, IndexError):
        return False
    return quota not in ("max", "-1")
