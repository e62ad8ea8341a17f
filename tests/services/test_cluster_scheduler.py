"""The scheduler service's core (ClusterScheduler + step_plan + handoff) with its real engine
cores, driven in-process: PD handoff and colocated runs, stops, n > 1, and every way a request
can end (finish, abort in each phase, failed transfer, worker death) leaving every block free."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.engine.request import RequestStatus
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL
from kvrelay.scheduler.records import Phase
from tests.services.cluster_driver import (ABORT, EOS, ERROR, FILLER, LENGTH, STOP, STOP_ID,
                                           ClusterDriver, RecordingGrammar, colocated_driver,
                                           pd_driver, prompt, worker_info)

TOPOLOGIES = {"pd": pd_driver, "colocated": colocated_driver}


def _finish(driver, sends: str = "after") -> None:
    driver.run(sends)
    driver.check_deltas(ended=True)
    driver.check_accounting()
    driver.assert_quiescent()


def _no_work_left_for(driver, sequence_id: str) -> None:
    """An ended sample is computed nowhere: in no running batch, no waiting queue."""
    for worker in driver.all_workers:
        assert all(r.sequence_id != sequence_id for r in worker.core.running), worker.worker_id
        assert all(r.sequence_id != sequence_id for r in worker.core.waiting._members.values())


# ---- finishing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sends", ["before", "after", "late"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_sample_gets_its_tokens_then_one_final_delta(topology, sends):
    driver = TOPOLOGIES[topology]()
    driver.submit("long", prompt(40), max_tokens=5)
    driver.submit("one", prompt(3, first=20), max_tokens=1)
    driver.submit("many", prompt(17, first=30), max_tokens=3, n=3)
    _finish(driver, sends)
    assert driver.tokens("long") == [FILLER] * 5 and driver.final("long").finish_reason == LENGTH
    assert driver.tokens("one") == [FILLER] and driver.final("one").finish_reason == LENGTH
    for index in range(3):
        assert driver.tokens("many", index) == [FILLER] * 3


def test_pd_first_token_streams_before_the_pages_land():
    driver = pd_driver()
    driver.submit("r", prompt(40), max_tokens=4)
    assert driver.start_step("p0")
    [transfer_id] = driver.sends  # ordered in the step that computes the prompt's last KV
    assert driver.sends[transfer_id].order.during_step
    driver.finish_step("p0")
    assert driver.tokens("r") == [FILLER]  # TTFT does not wait for the transfer
    sample = driver.cluster.samples["r/0"]
    assert sample.phase is Phase.TRANSFER and not driver.has_work("d0")
    driver.send_result(transfer_id)
    assert sample.phase is Phase.DECODE and driver.worker("d0").core.running
    assert driver.worker("p0").core.kv.num_free_blocks == 16  # the prefill side let go
    _finish(driver)
    assert driver.tokens("r") == [FILLER] * 4


def test_pd_chunked_prefill_orders_the_send_only_with_the_last_chunk():
    driver = pd_driver(max_num_batched_tokens=16)
    driver.submit("r", prompt(40), max_tokens=2)
    for _ in range(2):
        assert driver.step("p0") and not driver.sends and not driver.tokens("r")
    assert driver.start_step("p0") and len(driver.sends) == 1
    _finish(driver)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_eos_stops_once_min_tokens_are_out(topology):
    driver = TOPOLOGIES[topology]()
    driver.submit("r", prompt(20), max_tokens=8, min_tokens=3)
    driver.script["r/0"] = [EOS, EOS, FILLER, EOS, FILLER]  # the first two EOS are banned
    _finish(driver)
    assert driver.tokens("r") == [FILLER, FILLER, FILLER, EOS]
    final = driver.final("r")
    assert final.finish_reason == STOP and final.stop_token_id == EOS


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_stop_token_ids_stop_and_ignore_eos_ignores_eos(topology):
    driver = TOPOLOGIES[topology]()
    driver.submit("r", prompt(20), max_tokens=6, stop_token_ids=[STOP_ID], ignore_eos=True)
    driver.script["r/0"] = [EOS, FILLER, STOP_ID, FILLER]
    _finish(driver)
    assert driver.tokens("r") == [EOS, FILLER, STOP_ID]
    assert driver.final("r").stop_token_id == STOP_ID


def test_pd_eos_as_first_token_frees_the_decode_reservation():
    driver = pd_driver()
    driver.submit("r", prompt(40), max_tokens=8)
    driver.script["r/0"] = [EOS]
    driver.start_step("p0")
    assert driver.worker("d0").core.num_reserved == 1
    _finish(driver)
    assert driver.tokens("r") == [EOS] and driver.final("r").finish_reason == STOP


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_n_samples_run_and_end_independently(topology):
    driver = TOPOLOGIES[topology]()
    driver.submit("r", prompt(33), max_tokens=4, n=3)
    driver.script["r/1"] = [FILLER, EOS]
    driver.script["r/2"] = [EOS]
    _finish(driver)
    assert driver.tokens("r", 0) == [FILLER] * 4
    assert driver.tokens("r", 1) == [FILLER, EOS] and driver.tokens("r", 2) == [EOS]
    assert [driver.final("r", i).finish_reason for i in range(3)] == [LENGTH, STOP, STOP]


def test_pd_decode_worker_full_then_room_frees_up():
    driver = pd_driver(decode_blocks=4)  # room for one 40-token prompt and its outputs
    driver.submit("a", prompt(40), max_tokens=6)
    driver.submit("b", prompt(40, first=50), max_tokens=6)
    driver.step("p0")
    assert [s.sequence_id for s in driver.cluster.awaiting_decode] == ["b/0"]
    assert driver.tokens("b") == [FILLER]  # its first token is out all the same
    _finish(driver)


def test_pd_prompt_no_decode_worker_can_hold_is_refused_at_submit():
    driver = pd_driver(decode_blocks=2)
    driver.submit("fits", prompt(31), max_tokens=1)  # 32 tokens with its first output
    with pytest.raises(ValueError, match="decode"):
        driver.submit("r", prompt(32), max_tokens=4)
    assert "r" not in driver.cluster.requests
    _finish(driver)


def test_a_worker_whose_kv_cache_dtype_differs_is_refused_at_registration():
    """Pages move between the workers of a group as bytes: an 8-bit cache (kernels/kv_quant.py)
    and a float one cannot share them, so the second worker is refused with both named."""
    driver = pd_driver()
    odd = replace(worker_info("d1", DECODE, 16), kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"KV cache fp8_e4m3.*does not match.*KV cache float32"):
        driver.register(odd)
    assert "d1" not in driver.cluster.registry.workers
    _finish(driver)


# ---- aborts ------------------------------------------------------------------------------------------
def _to_phase(driver, phase: str) -> None:
    """Bring request "r" (submitted by the caller) to `phase`."""
    if phase == "queued":
        return
    if phase == "prefilling":  # mid-chunk: the first chunk's step is in flight
        assert driver.start_step("p0") and not driver.sends
        return
    while not driver.sends:  # the last chunk's step, carrying the send
        if "p0" in driver.steps:
            driver.finish_step("p0")
        assert driver.start_step("p0")
    if phase == "last-chunk":  # that step still in flight
        return
    driver.finish_step("p0")
    if phase == "transferring":  # first token out, pages in flight
        return
    driver.deliver_sends()
    if phase == "decoding":
        assert driver.step("d0") and driver.tokens("r", 0) == [FILLER, FILLER]
        return
    raise ValueError(phase)


PD_PHASES = ["queued", "prefilling", "last-chunk", "transferring", "decoding"]


@pytest.mark.parametrize("target", ["r", "r/1"])
@pytest.mark.parametrize("phase", PD_PHASES)
def test_pd_abort_in_each_phase_frees_everything(phase, target):
    driver = pd_driver(max_num_batched_tokens=16)
    driver.submit("r", prompt(40), max_tokens=6, n=2)
    driver.submit("other", prompt(20, first=40), max_tokens=3)
    _to_phase(driver, phase)
    aborted = driver.abort(target)
    assert aborted == (["r/0", "r/1"] if target == "r" else ["r/1"])
    driver.check_accounting()
    for sequence_id in aborted:
        _no_work_left_for(driver, sequence_id)
    _finish(driver)
    for index in range(2):
        expected = ABORT if f"r/{index}" in aborted else LENGTH
        assert driver.final("r", index).finish_reason == expected
    assert driver.final("other").finish_reason == LENGTH


@pytest.mark.parametrize("phase", PD_PHASES)
def test_pd_abort_with_a_late_send_result_after_more_steps(phase):
    """The prefill worker plans more steps before the aborted sample's send result arrives."""
    driver = pd_driver(max_num_batched_tokens=16)
    driver.submit("r", prompt(40), max_tokens=6)
    driver.submit("other", prompt(20, first=40), max_tokens=3)
    _to_phase(driver, phase)
    driver.abort("r")
    _finish(driver, sends="late")
    assert driver.final("r").finish_reason == ABORT


def test_pd_abort_while_awaiting_a_decode_reservation():
    driver = pd_driver(decode_blocks=4)
    driver.submit("a", prompt(40), max_tokens=6)
    driver.submit("r", prompt(40, first=50), max_tokens=6)
    driver.step("p0")
    assert driver.cluster.awaiting_decode[0].sequence_id == "r/0"
    driver.abort("r")
    assert not driver.cluster.awaiting_decode
    _finish(driver)
    assert driver.final("r").finish_reason == ABORT and driver.tokens("a") == [FILLER] * 6


def test_pd_abort_on_the_decode_worker_lets_an_awaiting_sample_in():
    """Room freed by an abort must reach samples waiting for decode blocks, even when no worker
    has a step to run (nothing else would retry them)."""
    driver = pd_driver(decode_blocks=4)
    driver.submit("a", prompt(40), max_tokens=6)
    driver.submit("b", prompt(40, first=50), max_tokens=6)
    driver.step("p0")
    driver.deliver_sends()
    assert driver.cluster.awaiting_decode[0].sequence_id == "b/0"
    driver.abort("a")
    _finish(driver)
    assert driver.final("a").finish_reason == ABORT and driver.tokens("b") == [FILLER] * 6


def test_pd_abort_after_the_send_is_ordered_but_before_the_prefill_worker_has_it():
    """The order waits for the prefill worker's next step; it must not go out any more, or it
    writes into decode blocks that are free again."""
    driver = pd_driver(decode_blocks=4)
    driver.submit("a", prompt(40), max_tokens=3)
    driver.submit("b", prompt(40, first=50), max_tokens=3)
    driver.step("p0")
    driver.deliver_sends()
    while driver.cluster.awaiting_decode:  # a decodes to its end, freeing room for b
        assert driver.step("d0")
    assert driver.pending_sends("p0") == ["b/0"]
    driver.abort("b")
    assert not driver.has_work("p0")
    _finish(driver)


@pytest.mark.parametrize("in_flight", [False, True])
def test_colocated_abort_frees_everything(in_flight):
    driver = colocated_driver(max_num_batched_tokens=16)
    driver.submit("r", prompt(40), max_tokens=6, n=2)
    driver.step("c0")
    if in_flight:
        driver.start_step("c0")
    driver.abort("r/0")
    _finish(driver)
    assert [driver.final("r", i).finish_reason for i in range(2)] == [ABORT, LENGTH]


# ---- failures ------------------------------------------------------------------------------------------
def _failed_transfer(moment: str, **scheduler_config):
    """Request "r"'s push fails, before or after the step that carried it answers."""
    driver = pd_driver(scheduler_config=scheduler_config)
    driver.submit("r", prompt(40), max_tokens=6)
    driver.submit("other", prompt(20, first=40), max_tokens=3)
    driver.start_step("p0")
    transfer_id = next(t for t, s in driver.sends.items() if s.order.sequence_id == "r/0")
    if moment == "after-step-result":
        driver.finish_step("p0")
    driver.send_result(transfer_id, ok=False)
    return driver


@pytest.mark.parametrize("moment", ["before-step-result", "after-step-result"])
def test_pd_failed_transfer_prefills_the_sample_again(moment):
    driver = _failed_transfer(moment)
    driver.check_accounting()
    _finish(driver)
    assert driver.final("r").finish_reason == LENGTH  # re-prefilled, then decoded to its end
    assert len(driver.tokens("r")) == 6
    assert driver.final("other").finish_reason == LENGTH
    assert driver.cluster.num_recoveries == 1


@pytest.mark.parametrize("moment", ["before-step-result", "after-step-result"])
def test_pd_failed_transfer_without_retries_ends_the_sample_with_an_error(moment):
    driver = _failed_transfer(moment, max_request_retries=0)
    assert driver.final("r").finish_reason == ERROR
    assert "KV transfer failed" in driver.final("r").error
    _finish(driver)
    assert driver.final("other").finish_reason == LENGTH


def _death_in_phase(phase: str, dead: str, **scheduler_config):
    """Request "r" brought to `phase`, then `dead` dies and a replacement registers."""
    driver = pd_driver(max_num_batched_tokens=16, scheduler_config=scheduler_config)
    driver.submit("r", prompt(40), max_tokens=6)
    _to_phase(driver, phase)
    driver.kill(dead)
    driver.check_accounting()
    driver.register(worker_info(dead, driver.worker(dead).role, 16))  # its replacement
    _finish(driver)
    return driver.final("r")


@pytest.mark.parametrize("dead", ["p0", "d0"])
@pytest.mark.parametrize("phase", PD_PHASES)
def test_pd_worker_death_in_each_phase_costs_no_request(phase, dead):
    final = _death_in_phase(phase, dead)
    assert final.finish_reason == LENGTH, final  # re-prefilled where its worker died


@pytest.mark.parametrize("dead", ["p0", "d0"])
@pytest.mark.parametrize("phase", PD_PHASES)
def test_pd_worker_death_without_retries_frees_everything(phase, dead):
    final = _death_in_phase(phase, dead, max_request_retries=0)
    # Only what the dead worker held is lost: a sample already decoding on d0 survives p0.
    survives = dead == "d0" and phase in ("queued", "prefilling") or \
        dead == "p0" and phase == "decoding"
    assert final.finish_reason == (LENGTH if survives else ERROR), final
    if not survives:
        assert "failed" in final.error


def test_a_recovered_sample_waits_for_a_worker_of_its_role_within_the_bound():
    driver = pd_driver(max_num_batched_tokens=16, scheduler_config={"worker_wait_s": 30.0})
    driver.submit("r", prompt(40), max_tokens=6)
    _to_phase(driver, "decoding")
    driver.kill("p0")
    driver.kill("d0")  # nobody left to re-prefill it on
    assert driver.cluster.stranded and not driver.requests["r"].deltas[0][-1].finish_reason
    now = time.monotonic()
    driver.cluster.expire_waits(now + 10)
    assert driver.cluster.stranded  # within the bound: still waiting
    driver.cluster.expire_waits(now + 31)
    driver.flush()
    assert driver.final("r").finish_reason == ERROR
    assert "came back within 30s" in driver.final("r").error
    driver.check_accounting()


def test_a_sample_grown_past_the_prefill_workers_cache_ends_with_an_error_on_recovery():
    """Recovered, a sample is prefilled over its prompt and outputs: where that no longer fits
    the prefill worker's whole cache, it ends with an error, and the others recover."""
    driver = pd_driver(prefill_blocks=4, max_num_batched_tokens=64)
    driver.submit("long", prompt(40), max_tokens=40)
    driver.submit("short", prompt(20, first=30), max_tokens=40)
    assert driver.step("p0")  # both prefilled in one step
    driver.deliver_sends()
    while len(driver.tokens("long")) < 25:  # 65 tokens and one to come: five blocks
        assert driver.step("d0")
    driver.kill("d0")
    assert "cannot continue on p0" in driver.final("long").error
    driver.register(worker_info("d0", DECODE, 16))
    _finish(driver)
    assert driver.final("short").finish_reason == LENGTH and len(driver.tokens("short")) == 40


def test_a_poison_request_stops_after_its_retry_budget():
    driver = pd_driver(max_num_batched_tokens=16, scheduler_config={"max_request_retries": 2})
    driver.submit("r", prompt(40), max_tokens=6)
    sample = driver.cluster.samples["r/0"]
    for _ in range(3):  # it "kills" its decode worker each time it gets there
        while sample.phase is not Phase.DECODE:
            if driver.sends:
                driver.deliver_sends()
            else:
                assert driver.step("p0")
        driver.kill("d0")
        driver.register(worker_info("d0", DECODE, 16))
    driver.flush()
    assert driver.final("r").finish_reason == ERROR
    assert "after 2 retries" in driver.final("r").error
    driver.check_accounting()


def test_pd_worker_death_of_the_prefill_worker_with_an_aborted_sample_in_flight():
    """The send's result can never come from a dead worker: its reservation ends, and its
    blocks are held only until the send's deadline."""
    driver = pd_driver()
    driver.submit("r", prompt(40), max_tokens=6)
    driver.start_step("p0")
    driver.finish_step("p0")
    driver.abort("r")
    driver.kill("p0")
    driver.check_accounting()
    decode = driver.worker("d0").core
    assert decode.num_reserved == 0 and not decode.requests
    assert decode.kv.num_free_blocks == 16 - 3
    driver.run()  # the deadline passes
    driver.assert_quiescent()


def test_pd_lost_prefill_workers_late_pages_land_in_no_one_elses_blocks():
    """A prefill worker declared dead may still be running and pushing (a partition, a
    stall). Its destination blocks go to no one until its orders' deadline has passed."""
    driver = pd_driver(decode_blocks=3, scheduler_config={"max_request_retries": 0})  # one 40-token prompt fills the decode worker
    driver.submit("a", prompt(40), max_tokens=3)
    driver.start_step("p0")  # a's send is on its way
    driver.kill("p0", zombie=True)
    assert driver.final("a").finish_reason == ERROR
    driver.register(worker_info("p1", PREFILL, 16))
    driver.submit("b", prompt(40, first=50), max_tokens=3)
    driver.step("p1")
    assert [s.sequence_id for s in driver.cluster.awaiting_decode] == ["b/0"]  # nothing free
    driver.land_zombie_pages()  # late pages, into the blocks set aside
    driver.cluster.release_set_aside(time.monotonic())  # the deadline has not passed yet
    assert driver.cluster.awaiting_decode
    [entry] = driver.cluster.transfers.set_aside
    driver.cluster.release_set_aside(entry.until)
    assert not driver.cluster.awaiting_decode  # b got the blocks, and pushes its own pages
    _finish(driver)  # every block b's decode steps read holds b's prompt
    assert driver.tokens("b") == [FILLER] * 3


def test_pd_replacement_decode_worker_takes_samples_that_waited_for_one():
    driver = pd_driver(decode_blocks=4, scheduler_config={"max_request_retries": 0})
    driver.submit("a", prompt(40), max_tokens=6)
    driver.submit("b", prompt(40, first=50), max_tokens=6)
    driver.step("p0")
    driver.deliver_sends()
    driver.kill("d0")
    assert driver.final("a").finish_reason == ERROR
    assert [s.sequence_id for s in driver.cluster.awaiting_decode] == ["b/0"]
    driver.register(worker_info("d0", DECODE, 16))
    _finish(driver)
    assert driver.tokens("b") == [FILLER] * 6


def test_colocated_worker_death_without_retries_ends_its_requests_with_an_error():
    driver = colocated_driver(scheduler_config={"max_request_retries": 0})
    driver.submit("r", prompt(40), max_tokens=6, n=2)
    driver.step("c0")
    driver.kill("c0")
    driver.check_deltas(ended=True)
    assert {driver.final("r", i).finish_reason for i in range(2)} == {ERROR}
    driver.assert_quiescent()


def test_colocated_worker_death_continues_both_samples_on_its_replacement():
    driver = colocated_driver()
    driver.submit("r", prompt(40), max_tokens=6, n=2)
    driver.step("c0")
    driver.step("c0")
    driver.kill("c0")
    assert {s.sequence_id for s in driver.cluster.stranded} == {"r/0", "r/1"}  # none to go to yet
    driver.register(worker_info("c0", BOTH, 16))
    _finish(driver)
    driver.check_deltas(ended=True)
    assert [len(driver.tokens("r", i)) for i in range(2)] == [6, 6]
    assert {driver.final("r", i).finish_reason for i in range(2)} == {LENGTH}
    driver.assert_quiescent()


def test_pd_a_lost_shared_prefix_push_takes_its_delivered_dependents_with_it():
    """n = 2 samples share their prompt's first block on the decode worker: the first order
    pushes it, the second only its own block. The second's result is in, the first's is not,
    when the prefill worker dies: the second must not decode over the shared block that was
    never written; both start over and end with their tokens (found by the machines below)."""
    driver = pd_driver()
    driver.submit("r", prompt(17), max_tokens=2, n=2)
    driver.start_step("p0")
    first, second = sorted(driver.sends)
    assert driver.cluster.transfers.open[second].relies_on == {first}
    driver.send_result(second)
    driver.finish_step("p0")
    driver.kill("p0")
    driver.register(worker_info("p0", PREFILL, 16))
    _finish(driver)
    assert [driver.tokens("r", index) for index in range(2)] == [[FILLER] * 2] * 2


def test_decode_reservations_are_prompt_sized_and_on_a_decode_worker():
    driver = pd_driver()
    driver.submit("r", prompt(33), max_tokens=2)
    driver.start_step("p0")
    transfer = driver.cluster.samples["r/0"].transfer
    assert transfer.destination.role is DECODE
    assert transfer.decode_request.status is RequestStatus.TRANSFERRING
    assert len(driver.worker("d0").core.kv.block_ids("r/0")[0]) == 3  # ceil(33 / 16)
    _finish(driver)


# ---- everything interleaved ------------------------------------------------------------------------
class PDClusterMachine(RuleBasedStateMachine):
    """Submits, steps of either worker, send results (ok, failed, before or after their step's
    result, or never: the worker dies), aborts and worker deaths in any order, on tiny pools so
    decode reservations wait and requests get preempted. Accounting holds after every event; at
    the end every request has ended with one final delta and every block is free."""

    WORKERS = (("p0", PREFILL, 8), ("d0", DECODE, 6))
    PIPELINE = True  # the teardown's run plans steps ahead too
    KV_GROUP_WINDOWS = (0,)  # per KV group of the model's layers, its window

    def __init__(self):
        super().__init__()
        self.driver = ClusterDriver([self._info(*w) for w in self.WORKERS],
                                    max_num_batched_tokens=24, max_num_seqs=3)
        self.driver.pipeline = self.PIPELINE
        self.next_id = 0

    @rule(length=st.integers(1, 40), shared=st.booleans(), max_tokens=st.integers(1, 5),
          min_tokens=st.integers(0, 2), n=st.integers(1, 2), stop=st.booleans(),
          constrained=st.booleans())
    def submit(self, length, shared, max_tokens, min_tokens, n, stop, constrained):
        if not self.driver.cluster.registry.ready:
            return
        request_id = f"q{self.next_id}"
        self.next_id += 1
        # (a constrained sample's matcher must take each of its tokens once, however often it
        # moves or is recovered: check_accounting)
        self.driver.submit(request_id, prompt(length, first=0 if shared else self.next_id),
                           grammar=RecordingGrammar() if constrained else None,
                           max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), n=n,
                           stop_token_ids=[STOP_ID] if stop else [])

    @rule(index=st.integers(0, 2))
    def start_step(self, index):
        worker = self.WORKERS[index % len(self.WORKERS)][0]
        if self.driver.worker(worker).alive and worker not in self.driver.steps:
            self.driver.start_step(worker)

    @precondition(lambda self: set(self.driver.steps) - set(self.driver.ahead))
    @rule(data=st.data())
    def plan_ahead(self, data):
        """While a step runs, the next one is planned and sent (async scheduling), where the
        scheduler lets it: tokens, stops, aborts and deaths then meet two steps in flight."""
        worker = data.draw(st.sampled_from(sorted(set(self.driver.steps) - set(self.driver.ahead))))
        self.driver.start_ahead(worker)

    @precondition(lambda self: self.driver.steps)
    @rule(data=st.data())
    def finish_step(self, data):
        worker = data.draw(st.sampled_from(sorted(self.driver.steps)))
        for item in self.driver.steps[worker].sampling:
            token = data.draw(st.sampled_from([FILLER, FILLER, EOS, STOP_ID]))
            self.driver.script[item.request.sequence_id] = [token]
        self.driver.finish_step(worker)

    @precondition(lambda self: self.driver.sends)
    @rule(data=st.data(), ok=st.booleans())
    def send_result(self, data, ok):
        transfer_id = data.draw(st.sampled_from(sorted(self.driver.sends)))
        ok = ok and self.driver.sends[transfer_id].decode.alive
        self.driver.send_result(transfer_id, ok)

    @precondition(lambda self: self.driver.requests)
    @rule(data=st.data(), whole=st.booleans())
    def abort(self, data, whole):
        request_id = data.draw(st.sampled_from(sorted(self.driver.requests)))
        n = self.driver.requests[request_id].params.n
        target = request_id if whole else f"{request_id}/{data.draw(st.integers(0, n - 1))}"
        self.driver.abort(target)

    @rule(index=st.integers(0, 2))
    def kill_and_replace(self, index):
        worker_id, role, num_blocks = self.WORKERS[index % len(self.WORKERS)]
        self.driver.kill(worker_id)
        self.driver.register(self._info(worker_id, role, num_blocks))

    def _info(self, worker_id, role, num_blocks):
        return worker_info(worker_id, role, num_blocks, max_model_len=64,
                           kv_group_windows=self.KV_GROUP_WINDOWS)

    @invariant()
    def accounting_holds(self):
        self.driver.check_accounting()
        self.driver.check_deltas()

    def teardown(self):
        self.driver.run()
        self.driver.check_deltas(ended=True)
        self.driver.check_accounting()
        self.driver.assert_quiescent()


class ColocatedClusterMachine(PDClusterMachine):
    WORKERS = (("c0", BOTH, 6),)


class WindowPDClusterMachine(PDClusterMachine):
    """A model with a full-attention group and a window group (kv_groups.py): the window
    group's blocks out of reach are freed on both workers while the request runs, a push
    carries only the blocks the decode worker reads (the driver checks every block a decode
    step reads holds its pages), beside everything else."""
    WORKERS = (("p0", PREFILL, 12), ("d0", DECODE, 10))
    KV_GROUP_WINDOWS = (0, 20)


class DrainingPDClusterMachine(PDClusterMachine):
    """Two prefill workers, either of which may start draining at any moment: its queued
    samples move to the other one, the rest finish where they are."""
    WORKERS = (("p0", PREFILL, 8), ("p1", PREFILL, 8), ("d0", DECODE, 6))
    PIPELINE = False

    @rule(index=st.integers(0, 1))
    def drain_prefill_worker(self, index):
        worker_id = self.WORKERS[index][0]
        self.driver.cluster.heartbeat(worker_id, draining=True)
        self.driver.flush()


# print_blob: a failure found on CI prints the @reproduce_failure line that replays it here.
TestPDClusterMachine = PDClusterMachine.TestCase
TestPDClusterMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                         print_blob=True)
TestDrainingPDClusterMachine = DrainingPDClusterMachine.TestCase
TestDrainingPDClusterMachine.settings = settings(max_examples=80, stateful_step_count=50,
                                                 deadline=None, print_blob=True)
TestWindowPDClusterMachine = WindowPDClusterMachine.TestCase
TestWindowPDClusterMachine.settings = settings(max_examples=100, stateful_step_count=50,
                                               deadline=None, print_blob=True)
TestColocatedClusterMachine = ColocatedClusterMachine.TestCase
TestColocatedClusterMachine.settings = settings(max_examples=80, stateful_step_count=40,
                                                deadline=None, print_blob=True)


def test_prefill_only_workers_take_their_own_larger_step_budget():
    driver = ClusterDriver([], {"prefill_max_num_batched_tokens": 512},
                           max_num_batched_tokens=64)
    for info in (worker_info("p0", PREFILL, 64, 1024), worker_info("d0", DECODE, 64, 1024),
                 worker_info("c0", BOTH, 64, 1024)):
        driver.register(info)
    budgets = {w.worker_id: w.core.config.max_num_batched_tokens for w in driver.all_workers}
    assert budgets == {"p0": 512, "d0": 64, "c0": 64}
    driver.submit("long", prompt(300), max_tokens=2)
    assert driver.start_step("p0")  # the whole 300-token prompt in one prefill step
    assert driver.cluster.samples["long/0"].transfer is not None


def test_pd_samples_of_one_prefill_step_join_the_decode_batch_together():
    driver = pd_driver()
    driver.submit("r", prompt(20), max_tokens=4, n=2)
    assert driver.start_step("p0")
    first, second = list(driver.sends)
    driver.finish_step("p0")
    driver.send_result(first)
    samples = [driver.cluster.samples[f"r/{i}"] for i in range(2)]
    assert [s.phase for s in samples] == [Phase.TRANSFER, Phase.TRANSFER]  # waits for its group
    driver.send_result(second)
    assert [s.phase for s in samples] == [Phase.DECODE, Phase.DECODE]
    assert len(driver.worker("d0").core.running) == 2
    _finish(driver)


# ---- decode-side prefix sharing -----------------------------------------------------------------
def _shared_prompt(tail_first: int) -> list[int]:
    """Two full blocks every such prompt shares, then a tail of its own."""
    return prompt(32) + prompt(8, first=tail_first)


def _order_for(driver, sequence_id: str):
    [send] = [s for s in driver.sends.values() if s.order.sequence_id == sequence_id]
    return send.order


def test_pd_decode_worker_holding_a_prefix_gets_only_the_rest_pushed():
    driver = pd_driver()
    driver.submit("a", _shared_prompt(50), max_tokens=2)
    _finish(driver)  # a's blocks are free again on the decode worker, and still cached
    driver.submit("b", _shared_prompt(60), max_tokens=2)
    driver.start_step("p0")
    order = _order_for(driver, "b/0")
    decode_blocks = driver.worker("d0").core.kv.block_ids("b/0")[0]
    assert list(order.dst_block_ids) == decode_blocks[2:]  # the shared two blocks stay home
    assert len(order.src_block_ids) == 1
    _finish(driver)  # the driver checks every block b's decode steps read holds b's prefix


def test_pd_whole_prompt_held_still_pushes_its_last_block():
    driver = pd_driver()
    driver.submit("a", prompt(32), max_tokens=2)
    _finish(driver)
    driver.submit("b", prompt(32), max_tokens=2)
    driver.start_step("p0")
    assert len(_order_for(driver, "b/0").dst_block_ids) == 1
    _finish(driver)


def test_pd_prefix_in_flight_is_shared_and_pushed_once_per_step():
    driver = pd_driver(decode_blocks=5)  # two unshared 40-token prompts would need six blocks
    driver.submit("a", _shared_prompt(50), max_tokens=3)
    driver.submit("b", _shared_prompt(60), max_tokens=3)
    driver.start_step("p0")  # one step prefills both and orders both sends
    a_blocks, b_blocks = (driver.worker("d0").core.kv.block_ids(s)[0] for s in ("a/0", "b/0"))
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] != b_blocks[2]
    assert list(_order_for(driver, "a/0").dst_block_ids) == a_blocks
    assert list(_order_for(driver, "b/0").dst_block_ids) == b_blocks[2:]  # a pushes the rest
    _finish(driver)  # b's decode steps read the shared blocks a filled
    assert len(driver.tokens("b")) == 3


def test_pd_a_failed_push_of_a_shared_prefix_fails_who_relies_on_it():
    driver = pd_driver(decode_blocks=5, scheduler_config={"max_request_retries": 0})
    driver.submit("a", _shared_prompt(50), max_tokens=3)
    driver.submit("b", _shared_prompt(60), max_tokens=3)
    driver.start_step("p0")
    driver.finish_step("p0")
    driver.send_result(_order_for(driver, "b/0").transfer_id)
    driver.send_result(_order_for(driver, "a/0").transfer_id, ok=False)
    assert driver.final("a").finish_reason == ERROR
    assert driver.final("b").finish_reason == ERROR and "shared prefix" in driver.final("b").error
    _finish(driver)


def test_pd_prefix_shared_with_an_earlier_steps_transfer_is_pushed_again():
    """Only sends of one step land together; across steps each transfer pushes its blocks."""
    driver = pd_driver(decode_blocks=5, max_num_batched_tokens=40, scheduler_config={"max_request_retries": 0})  # one prompt a step
    driver.submit("a", _shared_prompt(50), max_tokens=3)
    driver.submit("b", _shared_prompt(60), max_tokens=3)
    driver.step("p0")  # a, its send still in flight
    driver.start_step("p0")  # b
    b_blocks = driver.worker("d0").core.kv.block_ids("b/0")[0]
    assert b_blocks[:2] == driver.worker("d0").core.kv.block_ids("a/0")[0][:2]
    assert list(_order_for(driver, "b/0").dst_block_ids) == b_blocks
    driver.finish_step("p0")
    driver.send_result(_order_for(driver, "a/0").transfer_id, ok=False)
    driver.send_result(_order_for(driver, "b/0").transfer_id)
    _finish(driver)
    assert driver.final("a").finish_reason == ERROR and len(driver.tokens("b")) == 3


def test_pd_pages_of_a_failed_transfer_are_never_a_prefix_hit():
    driver = pd_driver(scheduler_config={"max_request_retries": 0})
    driver.submit("a", _shared_prompt(50), max_tokens=2)
    driver.start_step("p0")
    driver.finish_step("p0")
    driver.send_result(_order_for(driver, "a/0").transfer_id, ok=False)
    driver.submit("b", _shared_prompt(60), max_tokens=2)
    driver.start_step("p0")
    order = _order_for(driver, "b/0")
    assert len(order.dst_block_ids) == len(driver.worker("d0").core.kv.block_ids("b/0")[0]) == 3
    _finish(driver)


@pytest.mark.parametrize("retries", [0, 2])
def test_pd_a_shared_push_failing_while_a_dependent_push_is_in_flight(retries):
    """Sends go out during their step: the failure can come before the step's result, while b's
    own push is still writing. b waits for its result, then is prefilled again (or, with no
    retries, ends with the error): it never decodes over the shared blocks that did not land."""
    driver = pd_driver(decode_blocks=5, scheduler_config={"max_request_retries": retries})
    driver.submit("a", _shared_prompt(50), max_tokens=3)
    driver.submit("b", _shared_prompt(60), max_tokens=3)
    driver.start_step("p0")
    driver.send_result(_order_for(driver, "a/0").transfer_id, ok=False)
    deltas = driver.requests["b"].deltas[0]  # its pages may still be landing: it waits
    assert not (deltas and deltas[-1].finish_reason)
    driver.finish_step("p0")
    driver.check_accounting()
    driver.send_result(_order_for(driver, "b/0").transfer_id)
    driver.check_accounting()
    _finish(driver)
    if retries:
        assert [driver.final(r).finish_reason for r in "ab"] == [LENGTH, LENGTH]
        assert len(driver.tokens("b")) == 3 and driver.cluster.num_recoveries == 2
    else:
        assert "shared prefix" in driver.final("b").error


def test_pd_window_group_pushes_only_the_blocks_its_window_reaches():
    windows = (0, 20)  # a full-attention group and a window group
    driver = ClusterDriver([worker_info(worker_id, role, 32, max_model_len=256,
                                        kv_group_windows=windows)
                            for worker_id, role in (("p0", PREFILL), ("d0", DECODE))])
    driver.submit("r", prompt(100), max_tokens=40)
    driver.start_step("p0")
    order = _order_for(driver, "r/0")
    # 7 blocks of 100 tokens in the full group; the window group's from block (100 - 20) // 16
    assert len(order.dst_block_ids) == 7 + 2
    decode_tables = driver.worker("d0").core.kv.block_ids("r/0")
    assert list(order.dst_block_ids) == decode_tables[0] + decode_tables[1][5:]
    _finish(driver)  # every block a decode step reads held its pages
    assert driver.worker("p0").core.kv.num_window_freed == 5
    assert driver.worker("d0").core.kv.num_window_freed > 0  # the decode ring moved on
