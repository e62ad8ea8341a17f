"""The lease reaper: a worker that stops heartbeating is declared dead, but a stall of the
scheduler's own event loop (during which no heartbeat could be handled) is not held against it."""
import asyncio
import time

from services.api.kvrelay.v1 import scheduler_pb2
from services.engine.config import EngineConfig
from services.scheduler.cluster import ClusterScheduler
from services.scheduler.deltas import DeltaSink
from services.scheduler.service import SchedulerService
from tests.services.cluster_driver import worker_info

LEASE_MS = 400


def _service() -> tuple[SchedulerService, ClusterScheduler]:
    config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8)
    cluster = ClusterScheduler(config, lease_s=LEASE_MS / 1000, sink=DeltaSink())
    cluster.register(worker_info("w0", scheduler_pb2.WORKER_ROLE_BOTH, num_blocks=32))
    return SchedulerService(cluster, LEASE_MS), cluster


async def _with_reaper(service: SchedulerService, body) -> None:
    reaper = asyncio.create_task(service.reap_leases())
    try:
        await body()
    finally:
        reaper.cancel()


def test_a_silent_worker_is_declared_dead():
    service, cluster = _service()

    async def body():
        await asyncio.sleep(3 * LEASE_MS / 1000)

    asyncio.run(_with_reaper(service, body))
    assert not cluster.workers["w0"].alive


def test_a_stall_of_the_scheduler_loop_does_not_expire_its_workers():
    service, cluster = _service()

    async def body():
        for _ in range(5):
            assert cluster.heartbeat("w0", draining=False)
            await asyncio.sleep(LEASE_MS / 4000)
        time.sleep(3 * LEASE_MS / 1000)  # the loop stalls: nothing runs, no heartbeat is handled
        await asyncio.sleep(0.05)  # the overdue reaper tick runs first, then the queued heartbeat
        assert cluster.heartbeat("w0", draining=False)

    asyncio.run(_with_reaper(service, body))
    assert cluster.workers["w0"].alive
