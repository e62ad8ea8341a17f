"""Process entry for a service: logging, then one asyncio main on uvloop (or asyncio's own loop
with KVRELAY_EVENT_LOOP=asyncio)."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine

from kvrelay.common.env_switches import EVENT_LOOP
from kvrelay.common.log import setup_logging


def run_service(name: str, main: Coroutine, log_level: str = "info") -> None:
    setup_logging(name, log_level)
    freeze_heap()
    run_loop(main)


def run_loop(main: Coroutine):
    """Run `main` to completion on uvloop where it is installed; returns its result."""
    if EVENT_LOOP.value() == "uvloop":
        try:
            import uvloop
        except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works everywhere
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def freeze_heap() -> None:
    """Move every object alive now (imported modules: torch, transformers, grpc) out of the
    garbage collector's sight. Full collections otherwise rescan those hundreds of thousands of
    objects every few thousand allocations, which the per-step protos trigger often."""
    gc.collect()
    gc.freeze()
