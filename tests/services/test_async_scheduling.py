"""Async scheduling: while a step of plain decodes runs, the scheduler plans the next one and
sends it, so the worker goes on without waiting for the round trip. Driven through the real
ClusterScheduler (cluster_driver.py); the hypothesis machines in test_cluster_scheduler.py mix
these steps with everything else."""
from __future__ import annotations

import pytest

from kvrelay.scheduler.messages import DECODE, PREFILL
from tests.services.cluster_driver import (ABORT, EOS, FILLER, LENGTH, STOP, ClusterDriver,
                                           RecordingGrammar, colocated_driver, pd_driver, prompt, worker_info)


def _into_decode(driver: ClusterDriver, request_id: str) -> None:
    """Prefill the request and land its pages, so its next step is a decode."""
    driver.step("p0")
    driver.deliver_sends()
    assert driver.cluster.samples[f"{request_id}/0"].phase.value == "decode"


def _finish(driver: ClusterDriver) -> None:
    driver.run()
    driver.check_deltas(ended=True)
    driver.check_accounting()
    driver.assert_quiescent()


@pytest.mark.parametrize("topology", ["pd", "colocated"])
def test_a_pipelined_run_gives_the_same_tokens_with_steps_planned_ahead(topology):
    outputs = {}
    for pipeline in (False, True):
        driver = pd_driver() if topology == "pd" else colocated_driver()
        driver.pipeline = pipeline
        driver.submit("a", prompt(20), max_tokens=9)
        driver.submit("b", prompt(5, first=30), max_tokens=6, n=2)
        worker = driver.worker("d0" if topology == "pd" else "c0")
        steps_before = worker.core.stats.num_steps
        driver.script["a/0"] = [FILLER, 11, 12, 13]
        _finish(driver)
        outputs[pipeline] = ([driver.tokens("a")] + [driver.tokens("b", i) for i in range(2)],
                             worker.core.stats.num_steps - steps_before)
        assert (driver.num_planned_ahead > 3) == pipeline
    assert outputs[True][0] == outputs[False][0]
    assert outputs[True][0][0] == [FILLER, 11, 12, 13] + [FILLER] * 5
    # Each decode step is one either way: planned ahead they are not more.
    assert outputs[True][1] == outputs[False][1]


def test_a_step_is_planned_ahead_only_for_plain_decodes_with_nothing_joining():
    driver = pd_driver()
    driver.submit("a", prompt(20), max_tokens=8)
    assert driver.start_step("p0")
    assert not driver.start_ahead("p0")  # a prefill worker's steps end in a handoff
    driver.finish_step("p0")
    driver.deliver_sends()
    assert driver.start_step("d0") and driver.start_ahead("d0")
    [item] = driver.ahead["d0"].plan.output.scheduled
    assert item.request.sequence_id == "a/0" and item.num_new_tokens == 1
    driver.finish_step("d0")  # the ahead step is in flight now
    # b's pages land while a's step runs: the step after it is planned in full, with b in it.
    driver.submit("b", prompt(7, first=40), max_tokens=3)
    driver.step("p0")
    driver.deliver_sends()
    assert not driver.start_ahead("d0")
    driver.finish_step("d0")
    assert driver.start_step("d0")
    assert {i.request.sequence_id for i in driver.steps["d0"].plan.output.scheduled} == \
        {"a/0", "b/0"}
    _finish(driver)


def test_no_step_ahead_for_a_sequence_whose_next_token_is_its_last():
    driver = pd_driver()
    driver.submit("a", prompt(20), max_tokens=2)  # the prefill samples one, a decode the other
    _into_decode(driver, "a")
    assert driver.start_step("d0")
    assert not driver.start_ahead("d0")
    _finish(driver)
    assert driver.tokens("a") == [FILLER, FILLER] and driver.final("a").finish_reason == LENGTH


def test_a_stop_in_the_step_before_drops_the_token_of_the_step_ahead():
    driver = pd_driver()
    driver.submit("a", prompt(20), max_tokens=8)
    _into_decode(driver, "a")
    decode = driver.worker("d0")
    assert driver.start_step("d0") and driver.start_ahead("d0")
    driver.script["a/0"] = [EOS]
    free_before = decode.core.kv.num_free_blocks
    driver.finish_step("d0")
    assert driver.tokens("a") == [FILLER, EOS] and driver.final("a").finish_reason == STOP
    # The worker is computing a's next position in its blocks: they stay out of the pool.
    assert decode.core.held_for_steps and decode.core.kv.num_free_blocks == free_before
    driver.finish_step("d0")  # the step ahead returns; what it sampled goes nowhere
    assert driver.tokens("a") == [FILLER, EOS]
    assert not decode.core.held_for_steps
    driver.check_deltas(ended=True)
    _finish(driver)


def test_an_abort_while_a_decode_step_runs_keeps_its_blocks_from_a_waiting_push():
    """The decode worker is full with a; b waits for room. a is aborted while its step runs:
    its blocks go to b only once that step is back, else b's pages could land in a block the
    step still writes (the driver asserts no push targets such a block)."""
    driver = pd_driver(decode_blocks=2)
    driver.submit("a", prompt(20), max_tokens=20)
    _into_decode(driver, "a")
    driver.submit("b", prompt(20, first=40), max_tokens=2)
    driver.step("p0")  # b prefilled; no decode room for its pages
    assert [s.sequence_id for s in driver.cluster.awaiting_decode] == ["b/0"]
    assert driver.start_step("d0") and driver.start_ahead("d0")
    driver.abort("a")
    assert driver.final("a").finish_reason == ABORT
    assert driver.cluster.awaiting_decode and not driver.pending_sends("p0")
    driver.finish_step("d0")
    assert driver.cluster.awaiting_decode  # the step ahead still writes a's blocks
    driver.finish_step("d0")
    assert not driver.cluster.awaiting_decode and driver.pending_sends("p0") == ["b/0"]
    _finish(driver)
    assert driver.tokens("b") == [FILLER, FILLER]


def test_a_decode_worker_dying_with_two_steps_in_flight_frees_what_they_held():
    driver = pd_driver()
    driver.submit("a", prompt(20), max_tokens=8)
    _into_decode(driver, "a")
    assert driver.start_step("d0") and driver.start_ahead("d0")
    driver.abort("a")
    dead = driver.worker("d0")
    assert dead.core.held_for_steps
    driver.kill("d0")
    assert not dead.core.held_for_steps
    driver.register(worker_info("d0", DECODE, 16))
    _finish(driver)


def test_grammars_and_drafts_are_planned_in_full():
    """A grammar's mask depends on the token the step in flight samples; drafts likewise."""
    driver = pd_driver()
    driver.submit("g", prompt(20), grammar=RecordingGrammar(), max_tokens=6)
    _into_decode(driver, "g")
    assert driver.start_step("d0") and not driver.start_ahead("d0")
    _finish(driver)


def test_planned_ahead_steps_release_held_blocks_on_every_path_under_load():
    """Many samples through a small decode pool with every step planned ahead: stops, length
    ends and preemption-free waits, then nothing left anywhere."""
    driver = ClusterDriver([worker_info("p0", PREFILL, 32), worker_info("d0", DECODE, 6)],
                           max_num_batched_tokens=64, max_num_seqs=4)
    driver.pipeline = True
    for index in range(8):
        driver.submit(f"r{index}", prompt(10 + index, first=index * 3), max_tokens=3 + index % 4)
        driver.script[f"r{index}/0"] = [FILLER] * (index % 3) + [EOS]
    _finish(driver)
    for index in range(8):
        assert driver.final(f"r{index}").finish_reason in (STOP, LENGTH)

