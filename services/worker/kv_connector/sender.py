"""The prefill side: runs each send order through its transport with a deadline, records the
transfer metrics and turns the outcome into a SendResult for the scheduler."""
from __future__ import annotations

import asyncio
import time

from kvrelay.common import metrics
from kvrelay.common.log import get_logger
from kvrelay.step_messages import SendOrder, SendResult
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed, seconds_left
from kvrelay.worker.kv_connector.feed import Lander, LayerFeed

log = get_logger(__name__)

TRANSFER_BYTES = metrics.counter("kv_transfer_bytes", "KV bytes pushed to decode workers",
                                 ("transport",))
TRANSFER_SECONDS = metrics.histogram("kv_transfer_seconds", "Seconds per KV transfer",
                                     ("transport",))
TRANSFER_FAILURES = metrics.counter("kv_transfer_failures", "KV transfers that failed",
                                    ("transport",))


class KvSender:
    def __init__(self, transports: dict[str, KvTransport], timeout_s: float) -> None:
        self.transports = transports
        self.timeout_s = timeout_s

    def lander(self, order: SendOrder) -> Lander | None:
        """The order's transport's lander (base.py), or None."""
        transport = self.transports.get(order.transport or "grpc")
        return transport.lander(order) if transport is not None else None

    async def send(self, order: SendOrder, feed: LayerFeed) -> SendResult:
        transport = self.transports.get(order.transport or "grpc")
        started = time.perf_counter()
        try:
            if transport is None:
                raise TransferFailed(f"transport {order.transport!r} is not enabled here")
            timeout_s = min(self.timeout_s, seconds_left(order))
            if timeout_s <= 0:
                raise TransferFailed("the order's deadline passed before the send started")
            num_bytes = await asyncio.wait_for(transport.push(order, feed), timeout_s)
        except Exception as exc:  # noqa: BLE001
            # Every failure must reach the scheduler, or the blocks on both sides stay held.
            error = str(exc) or type(exc).__name__
            if isinstance(exc, asyncio.TimeoutError):
                error = f"timed out after {timeout_s:.1f} s"
            TRANSFER_FAILURES.labels(order.transport or "grpc").inc()
            log.warning("kv transfer failed", transfer_id=order.transfer_id, error=error)
            return SendResult(order.transfer_id, ok=False, error=error)
        seconds = time.perf_counter() - started
        TRANSFER_BYTES.labels(transport.name).inc(num_bytes)
        TRANSFER_SECONDS.labels(transport.name).observe(seconds)
        return SendResult(order.transfer_id, ok=True, num_bytes=num_bytes, seconds=seconds)
