"""What a served system holds in memory: the resident set of its process and every descendant
(a `kvrelay up` stack's services, vLLM's engine core, llama-server alone), read from /proc
while the server is still up, after its workloads: VmRSS now and VmHWM, the peak."""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def process_tree(root_pid: int) -> list[int]:
    """root_pid and its descendants, parents first (empty if root_pid is gone)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    if not (PROC / str(root_pid)).exists():
        return []
    tree, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop(0)
        tree.append(pid)
        frontier += sorted(children.get(pid, []))
    return tree


def tree_memory(root_pid: int) -> list[dict]:
    """One entry per live process of the tree: pid, a short name, rss_mib and peak_mib."""
    entries = []
    for pid in process_tree(root_pid):
        status = _status(pid)
        if "VmRSS" not in status:  # a zombie, or gone since the scan
            continue
        entries.append({"pid": pid, "name": _short_name(pid),
                        "rss_mib": status["VmRSS"] / 1024,
                        "peak_mib": status.get("VmHWM", status["VmRSS"]) / 1024})
    return entries


def _parent_of(entry: Path) -> int | None:
    try:
        # the command name may hold spaces and parentheses: the fields follow its last ')'
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1])


def _status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/<pid>/status."""
    try:
        lines = (PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            values[key] = int(parts[0])
    return values


def _short_name(pid: int) -> str:
    """`kvrelay worker --role decode` -> "worker decode"; otherwise the program's base name."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [arg.decode(errors="replace") for arg in argv if arg]
    if not args:
        return "?"
    if "kvrelay.cli" in args:
        rest = args[args.index("kvrelay.cli") + 1:]
        role = rest[rest.index("--role") + 1] if "--role" in rest[:-1] else ""
        return " ".join(part for part in (rest[0] if rest else "kvrelay", role) if part)
    return os.path.basename(args[0])
