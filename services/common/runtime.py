"""Process entry for a service: logging, then one asyncio main on uvloop (or asyncio's own loop
with KVRELAY_EVENT_LOOP=asyncio)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine

from services.common.log import setup_logging


def run_service(name: str, main: Coroutine, log_level: str = "info") -> None:
    setup_logging(name, log_level)
    if os.environ.get("KVRELAY_EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
        except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works everywhere
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)
