"""A one-line progress counter on stderr while a run goes on.

On a terminal the line is redrawn in place twice a second; in a log file a line is written every
ten seconds instead, so logs stay readable."""
from __future__ import annotations

import asyncio
import sys
import time


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream=None) -> None:
        self.label = label
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.sent = self.done = self.failed = self.tokens = 0
        self.started = time.perf_counter()
        self._task: asyncio.Task | None = None

    def line(self) -> str:
        running = self.sent - self.done - self.failed
        return (f"[{self.label}] {self.done}/{self.total} done, {running} running, "
                f"{self.failed} failed, {self.tokens} tokens, "
                f"{time.perf_counter() - self.started:.1f} s")

    def on_token(self) -> None:
        self.tokens += 1

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        interactive = self.stream.isatty()
        while True:
            await asyncio.sleep(0.5 if interactive else 10)
            self._write(interactive)

    def _write(self, interactive: bool) -> None:
        end = "" if interactive else "\n"
        print(("\r\033[K" if interactive else "") + self.line(), end=end, file=self.stream,
              flush=True)

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self.enabled:
            interactive = self.stream.isatty()
            print(("\r\033[K" if interactive else "") + self.line(), file=self.stream,
                  flush=True)
