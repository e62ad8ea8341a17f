"""Where every child of `kvrelay up` starts: tie its life to `up`'s, then run the service.

This runs after exec, in the child itself, rather than as a Popen preexec_fn: a preexec_fn forces
a plain fork(), whose gRPC fork handlers can crash the child before it execs while `up` holds open
channels (grpc/grpc#43055, grpcio >= 1.80). Without one, Popen uses vfork and no handler runs.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `up` dies, even by SIGKILL (Linux only)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # `up` died before prctl took effect: nobody will signal us
        os._exit(1)


def main() -> int:
    die_with_parent(int(sys.argv[1]))
    from services.cli import main as cli_main
    return cli_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
