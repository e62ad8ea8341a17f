"""uvicorn as one task of the gateway's asyncio loop."""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn

# uvicorn wakes ten times a second to refresh its Date header (once a second) and to notice
# should_exit. An idle wakeup costs about a millisecond of CPU on a small machine, taken from
# the model's threads, so this server refreshes the header once a second and is woken to exit.
TICK_S = 1.0


class RestServer(uvicorn.Server):
    def __init__(self, app, host: str, port: int, tls_options: dict | None = None) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off",
                                        log_config=None, access_log=False,
                                        timeout_graceful_shutdown=5, **(tls_options or {})))
        self.exit_requested = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        # The gRPC server owns SIGTERM/SIGINT (it drains first); uvicorn must not take them.
        yield

    def request_exit(self) -> None:
        self.should_exit = True
        self.exit_requested.set()

    async def main_loop(self) -> None:
        counter = 0  # uvicorn refreshes the Date header on ticks that are multiples of 10
        while not await self.on_tick(counter):
            counter += 10
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.exit_requested.wait(), TICK_S)
