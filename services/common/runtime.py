"""Process entry for a service: uvloop, logging, one asyncio main."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from services.common.log import setup_logging


def run_service(name: str, main: Coroutine, log_level: str = "info") -> None:
    setup_logging(name, log_level)
    try:
        import uvloop
        uvloop.run(main)
    except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works everywhere
        asyncio.run(main)
