"""The PD handoff's state machine (transfers.py) and the sample phases (records.py): each
transfer passes through the states its events call for, and an illegal transition raises."""
from __future__ import annotations

import pytest

from kvrelay.scheduler.records import IllegalPhase, Phase
from kvrelay.scheduler.transfers import IllegalTransition, TransferState
from kvrelay.scheduler.messages import DECODE
from tests.services.cluster_driver import (ABORT, ERROR, FILLER, LENGTH, pd_driver, prompt,
                                          worker_info)

S = TransferState


def _only_transfer(driver):
    [transfer] = driver.cluster.transfers.open.values()
    return transfer


def _sending(max_tokens: int, **scheduler_config):
    """Request "r" in the prefill step that computes its prompt and carries its send."""
    driver = pd_driver(scheduler_config=scheduler_config)
    driver.submit("r", prompt(40), max_tokens=max_tokens)
    driver.start_step("p0")
    return driver, _only_transfer(driver)


def test_a_handoff_goes_in_flight_then_delivered_then_activated():
    driver, transfer = _sending(3)  # the step that computes the prompt carries the order
    assert transfer.state is S.IN_FLIGHT and transfer.during_step
    driver.send_result(transfer.transfer_id)  # layer by layer: before the step's result
    assert transfer.state is S.DELIVERED and driver.cluster.samples["r/0"].phase is Phase.PREFILL
    driver.finish_step("p0")  # the first token: the sample decodes now
    assert transfer.state is S.ACTIVATED and not driver.cluster.transfers.open
    sample = driver.cluster.samples["r/0"]
    assert sample.phase is Phase.DECODE and sample.worker.worker_id == "d0"
    driver.run()
    assert driver.tokens("r") == [FILLER] * 3
    driver.assert_quiescent()


def test_an_order_reserved_after_the_first_token_waits_for_the_next_step():
    driver = pd_driver(decode_blocks=4)  # one 40-token prompt at a time
    driver.submit("a", prompt(40), max_tokens=2)
    driver.submit("b", prompt(40, first=50), max_tokens=2)
    driver.step("p0")
    driver.deliver_sends()
    while driver.cluster.awaiting_decode:  # a decodes to its end, freeing room for b
        driver.step("d0")
    transfer = driver.cluster.samples["b/0"].transfer
    assert transfer.state is S.RESERVED and driver.pending_sends("p0") == ["b/0"]
    driver.start_step("p0")
    assert transfer.state is S.IN_FLIGHT and not driver.pending_sends("p0")
    driver.run()
    driver.assert_quiescent()


def test_a_sample_ended_in_flight_orphans_its_transfer_until_the_result():
    driver, transfer = _sending(6)
    driver.finish_step("p0")
    driver.abort("r")
    assert transfer.state is S.ORPHANED
    assert driver.worker("d0").core.num_reserved == 1  # the pages may still land there
    assert "r" in driver.cluster.requests  # kept while its send is out
    driver.send_result(transfer.transfer_id)
    assert transfer.state is S.RELEASED
    assert driver.final("r").finish_reason == ABORT
    driver.run()
    driver.assert_quiescent()


def test_a_lost_sender_sets_the_destination_blocks_aside():
    driver, transfer = _sending(6, max_request_retries=0)
    driver.kill("p0", zombie=True)
    assert transfer.state is S.LOST and driver.final("r").finish_reason == ERROR
    [entry] = driver.cluster.transfers.set_aside
    assert entry.worker.worker_id == "d0" and len(entry.blocks) == 3
    driver.cluster.release_set_aside(entry.until)
    driver.assert_quiescent()


def test_a_lost_destination_drops_its_transfers():
    driver, transfer = _sending(6, max_request_retries=0)
    driver.kill("d0")
    assert transfer.state is S.DROPPED and driver.final("r").finish_reason == ERROR
    driver.send_result(transfer.transfer_id, ok=False)  # late: nothing left to do
    driver.finish_step("p0")
    driver.run()
    driver.assert_quiescent()


def test_a_second_result_for_one_transfer_changes_nothing():
    driver, transfer = _sending(3)
    driver.finish_step("p0")
    driver.send_result(transfer.transfer_id)
    assert transfer.state is S.ACTIVATED
    driver.cluster.on_send_result(transfer.transfer_id, False, "a duplicate")
    assert transfer.state is S.ACTIVATED
    driver.run()
    assert driver.tokens("r") == [FILLER] * 3
    driver.assert_quiescent()


def test_an_illegal_handoff_transition_raises():
    driver, transfer = _sending(3)
    for illegal in (S.RESERVED, S.ACTIVATED, S.RELEASED, S.CANCELLED):
        with pytest.raises(IllegalTransition, match="in flight -> "):
            transfer.move(illegal)
    assert transfer.state is S.IN_FLIGHT  # a refused transition changes nothing
    driver.finish_step("p0")
    driver.deliver_sends()
    assert transfer.state is S.ACTIVATED
    for state in S:  # an ended transfer goes nowhere
        with pytest.raises(IllegalTransition):
            transfer.move(state)
    driver.run()
    driver.assert_quiescent()


def test_an_illegal_sample_phase_raises():
    driver = pd_driver()
    driver.submit("r", prompt(40), max_tokens=3)
    sample = driver.cluster.samples["r/0"]
    with pytest.raises(IllegalPhase, match="prefill -> decode"):
        sample.move(Phase.DECODE)  # its pages have not gone anywhere yet
    driver.run()
    with pytest.raises(IllegalPhase):
        sample.move(Phase.PREFILL)
    driver.assert_quiescent()


def test_a_lost_destination_sends_its_sample_to_be_prefilled_again():
    driver, transfer = _sending(6)
    driver.kill("d0")
    assert transfer.state is S.DROPPED
    sample = driver.cluster.samples["r/0"]
    assert sample.retries == 1 and sample.phase is Phase.PREFILL  # queued on p0 again
    driver.finish_step("p0")  # the old step's token is dropped: the sample starts over
    driver.register(worker_info("d0", DECODE, 16))
    driver.run()
    assert driver.final("r").finish_reason == LENGTH and len(driver.tokens("r")) == 6
    driver.assert_quiescent()
