"""Prometheus metrics: vLLM's names where they exist, under the `kvrelay:` prefix.

Every service exposes its registry over HTTP on its own port (`--metrics-port`), never on a
public one, with its health at /health beside it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvrelay.common.metrics_http import start_metrics_server

REGISTRY = CollectorRegistry()

# Latency buckets in seconds, from a fast decode step to a long queued prompt.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(f"kvrelay:{name}", doc, labels, registry=REGISTRY)


def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(f"kvrelay:{name}", doc, labels, registry=REGISTRY)


def histogram(name: str, doc: str, labels: tuple[str, ...] = (),
              buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
    return Histogram(f"kvrelay:{name}", doc, labels, registry=REGISTRY, buckets=buckets)


async def serve_metrics(port: int, host: str = "0.0.0.0",
                        health: Callable[[], bool] | None = None) -> asyncio.Server | None:
    """Expose REGISTRY on http://host:port/metrics (0: do not expose) from the running loop,
    and `health()` on /health (200 or 503): probes that cannot speak mutual TLS use this."""
    if not port:
        return None
    return await start_metrics_server(host, port, render_metrics, health)


def render_metrics() -> bytes:
    return generate_latest(REGISTRY)
