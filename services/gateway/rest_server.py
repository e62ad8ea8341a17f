"""uvicorn as one task of the gateway's asyncio loop."""
from __future__ import annotations

import contextlib

import uvicorn


class RestServer(uvicorn.Server):
    def __init__(self, app, host: str, port: int) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off",
                                        log_config=None, access_log=False,
                                        timeout_graceful_shutdown=5))

    @contextlib.contextmanager
    def capture_signals(self):
        # The gRPC server owns SIGTERM/SIGINT (it drains first); uvicorn must not take them.
        yield
