"""The scheduler's periodic sweep: declare workers whose lease ran out dead, free the decode
blocks set aside for lost senders once their deadline passed, end recovered samples that no
live worker came back for.

A lease measures a worker's silence, and only this event loop can hear it: while the loop is
stalled (CPU starvation, a long pause), heartbeats that arrive wait behind the sweep's own
overdue tick. So a tick that wakes late by more than a period extends every live lease by that
much before any expires.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvrelay.common.log import get_logger
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.registry import WorkerRecord

log = get_logger(__name__)


async def reap_leases(cluster: ClusterScheduler, period_s: float,
                      on_expired: Callable[[WorkerRecord], None],
                      after_sweep: Callable[[], None]) -> None:
    while True:
        wake_at = time.monotonic() + period_s
        await asyncio.sleep(period_s)
        late = time.monotonic() - wake_at
        if late > period_s:
            log.warning("scheduler loop stalled; leases extended", seconds=round(late, 3))
            cluster.registry.extend_leases(late)
        for worker in cluster.expire_leases():
            on_expired(worker)
        cluster.release_set_aside(time.monotonic())
        cluster.expire_waits(time.monotonic())
        after_sweep()
