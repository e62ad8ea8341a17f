"""Draining a worker (SIGTERM): it takes no new requests, its queued ones move to another
worker of its role, the ones it computes finish there, and then it holds nothing."""
from __future__ import annotations

from kvrelay.engine.request import RequestStatus
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL
from tests.services.cluster_driver import LENGTH, ClusterDriver, prompt, worker_info


def _drain(driver: ClusterDriver, worker_id: str) -> None:
    assert driver.cluster.heartbeat(worker_id, draining=True)
    driver.flush()


def _queued_on(driver: ClusterDriver, worker_id: str) -> list[str]:
    return [sequence_id for sequence_id, sample in driver.cluster.samples.items()
            if sample.worker.worker_id == worker_id
            and sample.request.status is RequestStatus.WAITING]


def test_draining_prefill_worker_hands_its_queue_to_the_other_one():
    driver = ClusterDriver([worker_info("p0", PREFILL, 32), worker_info("p1", PREFILL, 32),
                            worker_info("d0", DECODE, 64)], max_num_seqs=2)
    for i in range(8):  # placement by load alternates between p0 and p1
        driver.submit(f"r{i}", prompt(20, first=i * 3), max_tokens=3)
    assert len(_queued_on(driver, "p0")) == 4
    driver.start_step("p0")  # two of p0's four start computing
    running = {r.sequence_id for r in driver.worker("p0").core.running}
    assert len(running) == 2
    _drain(driver, "p0")
    assert _queued_on(driver, "p0") == []
    assert len(_queued_on(driver, "p1")) == 6
    driver.submit("late", prompt(20, first=40), max_tokens=3)
    assert driver.cluster.samples["late/0"].worker.worker_id == "p1"
    driver.run()
    driver.check_deltas(ended=True)
    assert all(driver.final(rid).finish_reason == LENGTH for rid in driver.requests)
    driver.check_accounting()
    driver.assert_quiescent()
    assert not driver.cluster.holds_sequences(driver.worker("p0"))


def test_a_lone_draining_worker_finishes_its_queue_itself():
    driver = ClusterDriver([worker_info("c0", BOTH, 32)], max_num_seqs=1)
    for i in range(3):
        driver.submit(f"r{i}", prompt(20, first=i), max_tokens=2)
    _drain(driver, "c0")
    assert len(_queued_on(driver, "c0")) == 3
    driver.run()
    assert all(driver.final(rid).finish_reason == LENGTH for rid in driver.requests)
    driver.assert_quiescent()

