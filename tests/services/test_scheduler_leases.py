"""The lease reaper: a worker that stops heartbeating is declared dead, but a stall of the
scheduler's own event loop (during which no heartbeat could be handled) is not held against it.

It runs as the service runs it, minus the service's metrics: the scheduler's metrics module
cannot be imported beside the gateway's in one process (both define kvrelay:prompt_tokens)."""
import asyncio
import time

from kvrelay.engine.config import EngineConfig
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.messages import BOTH
from kvrelay.scheduler.outputs import DeltaSink
from kvrelay.scheduler.lease_reaper import reap_leases
from tests.services.cluster_driver import worker_info

LEASE_MS = 400


def _cluster() -> ClusterScheduler:
    engine = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8)
    cluster = ClusterScheduler(SchedulerConfig(engine=engine, lease_s=LEASE_MS / 1000),
                               DeltaSink())
    cluster.register(worker_info("w0", BOTH, num_blocks=32))
    return cluster


async def _with_reaper(cluster: ClusterScheduler, body) -> list[str]:
    expired = []
    reaper = asyncio.create_task(reap_leases(cluster, LEASE_MS / 4000,
                                             lambda worker: expired.append(worker.worker_id),
                                             cluster.sink.flush))
    try:
        await body()
    finally:
        reaper.cancel()
    return expired


def test_a_silent_worker_is_declared_dead():
    cluster = _cluster()

    async def body():
        await asyncio.sleep(3 * LEASE_MS / 1000)

    assert asyncio.run(_with_reaper(cluster, body)) == ["w0"]
    assert not cluster.registry.workers["w0"].alive


def test_a_stall_of_the_scheduler_loop_does_not_expire_its_workers():
    cluster = _cluster()

    async def body():
        for _ in range(5):
            assert cluster.heartbeat("w0", draining=False)
            await asyncio.sleep(LEASE_MS / 4000)
        time.sleep(3 * LEASE_MS / 1000)  # the loop stalls: nothing runs, no heartbeat is handled
        await asyncio.sleep(0.05)  # the overdue reaper tick runs first, then the queued heartbeat
        assert cluster.heartbeat("w0", draining=False)

    assert asyncio.run(_with_reaper(cluster, body)) == []
    assert cluster.registry.workers["w0"].alive
