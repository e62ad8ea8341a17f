"""Send a workload to a server on its arrival schedule, within a request count and a time limit.

Each request is its own task: it sleeps until its arrival offset, then streams. At the time
limit every unfinished request is cancelled (closing its connection, which aborts it on the
server) and recorded as such; requests whose time had not come are not sent at all.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from kvrelay.bench.client import ServerOptions, send
from kvrelay.bench.progress import Progress
from kvrelay.bench.records import RequestRecord
from kvrelay.bench.workloads import BenchRequest


@dataclass(slots=True)
class Limits:
    max_requests: int | None = None
    time_limit_s: float = 600.0
    max_concurrency: int | None = None  # None: as many in flight as the arrivals make


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]  # the requests that were sent, in workload order
    duration_s: float             # first send to last completion (or the time limit)
    planned: int                  # requests the run meant to send


def make_client(connections: int) -> aiohttp.ClientSession:
    # trust_env=False: no proxy from the environment, so traffic goes only to the given URL.
    # No total timeout: a long generation is bounded by the run's time limit instead.
    # force_close: a connection per request. llama-server closes a stream's connection at its
    # end, and a pooled one reused after that fails at once ("Server disconnected": every
    # other request of a one-at-a-time run); a loopback connect costs ~0.1 ms, for every system.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections,
                                       force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0), trust_env=False)


async def run(requests: list[BenchRequest], options: ServerOptions, limits: Limits,
              progress: Progress | None = None) -> RunResult:
    requests = requests[:limits.max_requests] if limits.max_requests else requests
    progress = progress or Progress("bench", len(requests), enabled=False)
    gate = asyncio.Semaphore(limits.max_concurrency or len(requests) or 1)
    records: dict[int, RequestRecord] = {}
    async with make_client(max(1, limits.max_concurrency or len(requests))) as client:
        start = time.perf_counter()
        progress.start()
        tasks = [asyncio.create_task(_one(client, index, request, options, start, gate,
                                          records, progress))
                 for index, request in enumerate(requests)]
        _, pending = await asyncio.wait(tasks, timeout=limits.time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        finished = [r.sent_s + r.done_s for r in records.values() if r.done_s is not None]
        duration = limits.time_limit_s if pending else max(finished, default=0.0)
        progress.stop()
    return RunResult([records[i] for i in sorted(records)], duration, len(requests))


async def _one(client, index: int, request: BenchRequest, options: ServerOptions,
               start: float, gate: asyncio.Semaphore, records: dict, progress: Progress):
    delay = start + request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    async with gate:
        record = RequestRecord(index, request.tag, sent_s=time.perf_counter() - start)
        records[index] = record
        progress.sent += 1
        try:
            await send(client, request, options, record, progress.on_token)
        except asyncio.CancelledError:
            record.error = "cancelled at the time limit"
            raise
        finally:
            if record.ok:
                progress.done += 1
            else:
                progress.failed += 1
