"""A pipeline worker's micro-batches (Scheduler.schedule's pipeline_depth): each step planned
while others are in flight leaves out their sequences and takes its share of the running ones,
so the stages each get one; preemption never takes a sequence a step in flight computes."""
from __future__ import annotations

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.request import Request
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


def _scheduler(num_blocks=64) -> Scheduler:
    return Scheduler(EngineConfig(block_size=4), num_blocks=num_blocks, max_model_len=128)


def _request(sequence_id: str, num_tokens: int = 3) -> Request:
    """Prompts of their own (no prefix shared through the cache)."""
    token = 10 + sum(map(ord, sequence_id))
    return Request(sequence_id, [token] * num_tokens,
                   SamplingParams(temperature=0.0, max_tokens=50), eos_token_ids=frozenset({2}))


def _ids(output) -> set[str]:
    return {item.request.sequence_id for item in output.scheduled}


def _step(scheduler: Scheduler, depth: int = 2):
    output = scheduler.schedule(pipeline_depth=depth)
    scheduler.begin_step(output)
    return output


def _finish(scheduler: Scheduler, output) -> None:
    scheduler.update_from_output(output, {sequence_id: [3] for sequence_id in _ids(output)})


def test_two_micro_batches_alternate_over_disjoint_sequences():
    scheduler = _scheduler()
    for index in range(4):
        scheduler.add_request(_request(f"r{index}"))
    first = _step(scheduler)  # every prompt: nothing is running yet
    assert _ids(first) == {"r0", "r1", "r2", "r3"}
    assert _step(scheduler).is_empty  # all in flight
    _finish(scheduler, first)
    one, two = _step(scheduler), _step(scheduler)
    assert len(_ids(one)) == len(_ids(two)) == 2 and not _ids(one) & _ids(two)
    assert _step(scheduler).is_empty
    _finish(scheduler, one)
    again = _step(scheduler)  # the first micro-batch's sequences, one token on
    assert _ids(again) == _ids(one)
    assert all(item.num_new_tokens == 1 for item in again.scheduled)


def test_a_new_prompt_joins_the_micro_batch_being_planned():
    scheduler = _scheduler()
    for index in range(2):
        scheduler.add_request(_request(f"r{index}"))
    _finish(scheduler, _step(scheduler))
    one = _step(scheduler)
    scheduler.add_request(_request("late"))
    two = _step(scheduler)
    assert "late" in _ids(two) and not _ids(one) & _ids(two)


def test_preemption_spares_sequences_in_flight():
    """Blocks run out: the step being planned preempts the last sequence no step in flight
    computes, not the tail of the running list when that one is in flight."""
    scheduler = _scheduler(num_blocks=9)
    for index in range(4):
        scheduler.add_request(_request(f"r{index}", num_tokens=8))  # 2 full blocks each
    _finish(scheduler, _step(scheduler))  # 8 blocks held; each next token needs a third
    tail = scheduler.running[-1]
    # the tail is computed by a micro-batch in flight
    scheduler.begin_step(SchedulerOutput([ScheduledRequest(tail, 1, [])]))
    step = scheduler.schedule(pipeline_depth=2)
    assert [request.sequence_id for request in step.preempted] == ["r2"]
    assert _ids(step) == {"r0", "r1"}
