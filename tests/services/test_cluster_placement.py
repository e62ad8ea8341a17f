"""Placement over several workers: a prompt goes where its prefix is cached while queues are
even, a burst spreads over the prefill workers, and decode reservations go to the worker with
the most free blocks."""
from __future__ import annotations

from kvrelay.scheduler.messages import DECODE, PREFILL
from tests.services.cluster_driver import ClusterDriver, prompt, worker_info


def _two_prefill_workers() -> ClusterDriver:
    return ClusterDriver([worker_info("p0", PREFILL, 64), worker_info("p1", PREFILL, 64),
                          worker_info("d0", DECODE, 64), worker_info("d1", DECODE, 64)],
                         max_num_seqs=8)


def _placed_on(driver: ClusterDriver, request_id: str) -> str:
    return driver.cluster.samples[f"{request_id}/0"].worker.worker_id


def test_a_cached_prefix_draws_the_prompt_to_its_worker_while_queues_are_even():
    driver = _two_prefill_workers()
    shared = prompt(64)
    driver.submit("warm", shared + prompt(4, first=1), max_tokens=1)
    warm_worker = _placed_on(driver, "warm")
    driver.run()
    for i in range(3):
        driver.submit(f"hit{i}", shared + prompt(4, first=20 + i), max_tokens=1)
        assert _placed_on(driver, f"hit{i}") == warm_worker
        driver.run()
    driver.assert_quiescent()


def test_a_burst_sharing_a_prefix_spreads_over_the_prefill_workers():
    driver = _two_prefill_workers()
    shared = prompt(64)
    for i in range(8):
        driver.submit(f"r{i}", shared + prompt(8, first=30 + i), max_tokens=2)
    placed = [_placed_on(driver, f"r{i}") for i in range(8)]
    assert placed.count("p0") == placed.count("p1") == 4
    driver.run()
    driver.check_deltas(ended=True)
    driver.assert_quiescent()


def test_decode_reservations_go_to_the_worker_with_the_most_free_blocks():
    driver = _two_prefill_workers()
    for i in range(4):
        driver.submit(f"r{i}", prompt(40, first=i), max_tokens=3)
    driver.start_step("p0")
    driver.start_step("p1")
    decode_workers = [s.transfer.destination.worker_id for s in driver.cluster.samples.values()
                      if s.transfer is not None]
    assert sorted(decode_workers) == ["d0", "d0", "d1", "d1"]
    driver.run()
    driver.assert_quiescent()


def _shared_hardware(scheduler_config: dict | None = None, **config) -> ClusterDriver:
    """p0 and d0 on one machine's CPUs, p1 on another machine."""
    domain = "host-a/cpus:0,1"
    return ClusterDriver([worker_info("p0", PREFILL, 64, 1024, domain),
                          worker_info("d0", DECODE, 64, 1024, domain),
                          worker_info("p1", PREFILL, 64, 1024, "host-b/cpus:0,1")],
                         scheduler_config, max_num_batched_tokens=256, **config)


def test_prefill_steps_stay_small_while_a_decode_worker_on_the_same_hardware_decodes():
    driver = _shared_hardware({"shared_prefill_max_num_batched_tokens": 32})
    p0, p1 = driver.worker("p0"), driver.worker("p1")
    assert driver.cluster.registry.step_budget(p0) is None  # the decode worker is idle: full steps
    driver.submit("first", prompt(20), max_tokens=50)
    assert _placed_on(driver, "first") == "p0"
    driver.step("p0")
    driver.deliver_sends()
    driver.step("d0")
    assert driver.worker("d0").core.running
    assert driver.cluster.registry.step_budget(p0) == 32
    assert driver.cluster.registry.step_budget(p1) is None  # other hardware: its own budget
    driver.cluster.heartbeat("p1", draining=True)  # so the long prompt lands on p0
    driver.submit("long", prompt(200, first=40), max_tokens=2)
    assert _placed_on(driver, "long") == "p0"
    driver.start_step("p0")
    assert driver.steps["p0"].plan.output.num_batched_tokens <= 32
    driver.run()
    driver.check_deltas(ended=True)
    driver.assert_quiescent()


def test_long_prompts_are_chunked_on_a_prefill_worker_sharing_hardware_with_decodes():
    driver = _shared_hardware(long_prefill_token_threshold=16)
    p0, p1 = driver.worker("p0"), driver.worker("p1")
    assert not driver.cluster.registry.shares_compute_with_decodes(p0)  # the decode worker is idle
    driver.submit("first", prompt(20), max_tokens=50)
    driver.step("p0")
    driver.deliver_sends()
    driver.step("d0")
    assert driver.cluster.registry.shares_compute_with_decodes(p0)
    assert not driver.cluster.registry.shares_compute_with_decodes(p1)
    driver.cluster.heartbeat("p1", draining=True)
    driver.submit("long", prompt(100, first=40), max_tokens=2)
    driver.start_step("p0")
    assert driver.steps["p0"].plan.output.num_batched_tokens == 16
    driver.run()
    driver.check_deltas(ended=True)
    driver.assert_quiescent()
