"""One service as a child process: spawn it so it cannot outlive `kvrelay up`, stop it, read its log.

Each child leads its own process group, so a terminal's Ctrl-C reaches only `up`, which then stops
the children in order, and so a straggler's helpers (compiler runs, tokenizer threads) die with it.
On Linux each child also asks the kernel for SIGKILL when `up` dies (see child_entry.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

from kvrelay.stack.plan import ServiceSpec

LOG_TAIL_LINES = 40


class Child:
    def __init__(self, spec: ServiceSpec, log_dir: Path | None) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log" if log_dir else None
        self.process: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, base_env: dict[str, str]) -> None:
        env = {**base_env, **self.spec.env}
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            # No preexec_fn (see child_entry.py): the child sets its own death signal, then
            # execs the service's own command line.
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvrelay.stack.child_entry", str(os.getpid()),
                 *self.spec.command()],
                env=env, stdin=subprocess.DEVNULL, stdout=log or sys.stderr,
                stderr=subprocess.STDOUT if log else sys.stderr, start_new_session=True)
        finally:
            if log:
                log.close()  # the child holds its own descriptor

    def started(self) -> bool:
        return self.process is not None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return self.process.poll() if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        # Only the service itself: it drains, then exits with its helpers.
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            self.kill_group()
            self.process.wait()

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the child's process group, so nothing it spawned survives.
        Called right after the child exits, before its group id could be reused."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None:
            return "(its output went to this terminal, above)"
        try:
            with open(self.log_path, "rb") as handle:
                tail = deque(handle, maxlen=lines)
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"
        return b"".join(tail).decode("utf-8", "replace").rstrip()
