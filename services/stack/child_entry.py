"""Where every child of `kvrelay up` starts: tie its life to `up`'s, then exec the service.

This runs after exec, in the child itself, rather than as a Popen preexec_fn: a preexec_fn forces
a plain fork(), whose gRPC fork handlers can crash the child before it execs while `up` holds open
channels (grpc/grpc#43055, grpcio >= 1.80). Without one, Popen uses vfork and no handler runs.

The service itself is then exec'd from its own command line (ServiceSpec.command()) rather than
imported, so the stack knows the services only as commands and never imports kvrelay.cli (which
imports the stack for `up`). The death signal survives the exec; the pid stays the same.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `up` dies, even by SIGKILL (Linux only)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # `up` died before prctl took effect: nobody will signal us
        os._exit(1)


def main() -> NoReturn:
    die_with_parent(int(sys.argv[1]))
    command = sys.argv[2:]  # the service's full command line, interpreter first
    os.execv(command[0], command)  # does not return


if __name__ == "__main__":
    main()
