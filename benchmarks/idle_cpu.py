"""CPU each service of an idle stack uses: what timers and polls cost while nothing is served.

    python benchmarks/idle_cpu.py [--topology pd] [--seconds 20]

Starts a stack with `kvrelay up`, waits until it is ready and a few seconds more, then reads
each process's CPU time (utime + stime from /proc) over `--seconds` with no request in flight.
On a 2-core machine every wake-up of an idle process costs CPU the model's threads would use
once requests come, so these numbers should stay near zero.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stack import cpu_seconds, start_stack  # noqa: E402

SETTLE_S = 5.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="pd", help="pd, colocated, or pd@ENV=value...")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=18500)
    args = parser.parse_args()
    stack_args = argparse.Namespace(dtype=None, threads_per_worker=None, kv_transport=None)
    process, state = start_stack(args.topology, stack_args, Path(tempfile.mkdtemp()), args.port)
    try:
        time.sleep(SETTLE_S)
        pids = {name: info["pid"] for name, info in state["services"].items()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(args.seconds)
        used = {name: (cpu_seconds(pid) - before[name]) / args.seconds
                for name, pid in pids.items()}
    finally:
        process.terminate()
        process.wait(timeout=120)
    print(f"| service ({args.topology}, idle {args.seconds:.0f} s) | CPU, % of one core |")
    print("|---|---|")
    for name, share in used.items():
        print(f"| {name} | {share * 100:.2f} |")
    print(f"| all | {sum(used.values()) * 100:.2f} |")


if __name__ == "__main__":
    main()
