"""Scheduler unit tests without a model: budget, chunking, preemption, policies, stop rules."""
from __future__ import annotations

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler

EOS = 2


def _scheduler(num_blocks=64, **overrides) -> Scheduler:
    config = EngineConfig(block_size=4, **overrides)
    return Scheduler(config, num_blocks=num_blocks, max_model_len=128)


def _request(sequence_id, num_tokens, priority=0, arrival=None, **params) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(sequence_id, [7] * num_tokens, SamplingParams(**params),
                   eos_token_ids=frozenset({EOS}), priority=priority, arrival_time=arrival)


def _run(scheduler: Scheduler, token=3, max_steps=1000) -> list[Request]:
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return finished
        output = scheduler.schedule()
        assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        sampled = {item.request.sequence_id: [token] for item in output.scheduled if item.samples}
        finished += scheduler.update_from_output(output, sampled)
    raise AssertionError("scheduler did not drain")


def test_token_budget_chunks_a_long_prompt():
    scheduler = _scheduler(max_num_batched_tokens=8)
    request = _request("a", 20, max_tokens=2)
    scheduler.add_request(request)
    sizes = []
    for _ in range(3):
        output = scheduler.schedule()
        sizes.append(output.scheduled[0].num_new_tokens)
        scheduler.update_from_output(output, {"a": [3]} if output.scheduled[0].samples else {})
    assert sizes == [8, 8, 4] and request.num_output_tokens == 1


def test_long_prefill_threshold_lets_decodes_through():
    scheduler = _scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=4)
    short = _request("short", 3, max_tokens=5)
    scheduler.add_request(short)
    scheduler.update_from_output(scheduler.schedule(), {"short": [3]})
    scheduler.add_request(_request("long", 40, max_tokens=1))
    output = scheduler.schedule()
    assert {i.request.sequence_id: i.num_new_tokens for i in output.scheduled} == \
        {"short": 1, "long": 4}


def _start_decoding(scheduler: Scheduler, count: int, max_tokens: int = 40) -> list[str]:
    """`count` short requests, prefilled in one step: they decode from the next."""
    names = [f"d{index}" for index in range(count)]
    for name in names:
        scheduler.add_request(_request(name, 3, max_tokens=max_tokens, arrival=0.0))
    output = scheduler.schedule()
    scheduler.update_from_output(output, {name: [3] for name in names})
    return names


def _sizes(output) -> dict[str, int]:
    return {item.request.sequence_id: item.num_new_tokens for item in output.scheduled}


def test_a_long_prompt_takes_the_whole_budget_while_nothing_decodes():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(_request("long", 40, max_tokens=2))
    assert _sizes(scheduler.schedule()) == {"long": 40}


def test_one_long_prompt_advances_per_step_while_sequences_decode():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    decoding = _start_decoding(scheduler, 4)
    for index, name in enumerate(("long-a", "long-b", "tiny")):
        scheduler.add_request(_request(name, 5 if name == "tiny" else 40, max_tokens=1,
                                       arrival=float(index + 1)))
    output = scheduler.schedule()
    # 3 prompts and 4 decodes: the decodes go first. long-b may not start while long-a holds
    # the one long slot; tiny, behind it, goes now.
    assert set(_sizes(output)) == {*decoding, "long-a", "tiny"}
    assert _sizes(output)["long-a"] == 8 and _sizes(output)["d0"] == 1
    scheduler.update_from_output(output, {name: [3] for name in (*decoding, "tiny")})
    assert _sizes(scheduler.schedule()) == {**{name: 1 for name in decoding}, "long-a": 8}
    assert [request.sequence_id for request in [scheduler.waiting.peek()]] == ["long-b"]


def test_decodes_on_shared_hardware_chunk_long_prompts_too():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(_request("long", 40, max_tokens=1))
    scheduler.add_request(_request("short", 6, max_tokens=1))
    sizes = _sizes(scheduler.schedule(decodes_elsewhere=2))
    assert sizes["long"] == 8 and "short" in sizes  # a short prompt still goes whole


def test_more_prompts_than_decodes_elsewhere_go_whole():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(_request("long", 40, max_tokens=1))
    scheduler.add_request(Request("short", list(range(100, 106)), SamplingParams(max_tokens=1),
                                  eos_token_ids=frozenset({EOS})))
    assert _sizes(scheduler.schedule(decodes_elsewhere=1)) == {"long": 40, "short": 6}


def test_a_burst_gets_its_first_tokens_in_budget_steps_not_one_prompt_a_step():
    """N equal prompts, longer than the threshold, arrive while sequences decode elsewhere (a
    PD prefill worker, whose prompts go on to decode elsewhere once they have their first
    token): their first tokens come in ceil(N * len / budget) steps, in arrival order."""
    budget, length, count = 64, 24, 10
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=8, long_prefill_chunk_size=8)
    for index in range(count):  # distinct prompts: no prefix cache hits
        scheduler.add_request(_distinct(f"p{index}", index, length, arrival=float(index)))
    decoding_elsewhere, first_tokens = 2, []
    while scheduler.has_unfinished:
        output = scheduler.schedule(decodes_elsewhere=decoding_elsewhere)
        assert output.num_batched_tokens <= budget
        sampled = {item.request.sequence_id: [3] for item in output.scheduled if item.samples}
        first_tokens.append(sorted(sampled))
        scheduler.update_from_output(output, sampled)
        decoding_elsewhere += len(sampled)
    assert len(first_tokens) == -(-count * length // budget) == 4
    assert sum(first_tokens, []) == [f"p{index}" for index in range(count)]
    assert not scheduler.prompts_first and scheduler.kv.num_free_blocks == 256
    # Once the burst is through, a lone long prompt goes in chunks again.
    scheduler.add_request(_distinct("lone", 50, length, arrival=20.0))
    assert _sizes(scheduler.schedule(decodes_elsewhere=decoding_elsewhere)) == {"lone": 8}


def _distinct(sequence_id: str, index: int, length: int, arrival: float) -> Request:
    return Request(sequence_id, list(range(100 * index, 100 * index + length)),
                   SamplingParams(max_tokens=1), eos_token_ids=frozenset({EOS}),
                   arrival_time=arrival)


def test_long_prompts_chunked_while_decoding_all_finish():
    scheduler = _scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8,
                           max_long_partial_prefills=2)
    for index in range(6):
        scheduler.add_request(_request(f"r{index}", 5 + 9 * index, max_tokens=4,
                                       arrival=float(index)))
    finished = _run(scheduler)
    assert sorted(r.sequence_id for r in finished) == [f"r{i}" for i in range(6)]
    assert scheduler.kv.num_free_blocks == 64


def test_preemption_by_recompute_when_blocks_run_out():
    scheduler = _scheduler(num_blocks=8, max_num_batched_tokens=64)
    for index in range(3):
        scheduler.add_request(_request(f"r{index}", 8, arrival=float(index), max_tokens=12))
    finished = _run(scheduler)
    assert scheduler.stats.num_preemptions > 0
    assert sorted(r.sequence_id for r in finished) == ["r0", "r1", "r2"]
    assert all(r.num_output_tokens == 12 for r in finished)
    assert scheduler.kv.num_free_blocks == 8


def test_latest_arrival_is_preempted_first_under_fcfs():
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=64)
    early = _request("early", 8, arrival=0.0, max_tokens=20)
    late = _request("late", 8, arrival=1.0, max_tokens=20)
    scheduler.add_request(early)
    scheduler.add_request(late)
    for _ in range(6):
        output = scheduler.schedule()
        if output.preempted:
            assert output.preempted == [late]
            return
        scheduler.update_from_output(output, {i.request.sequence_id: [3]
                                              for i in output.scheduled})
    raise AssertionError("no preemption happened")


def test_priority_policy_admits_and_keeps_high_priority_first():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add_request(_request("low", 4, priority=5, arrival=0.0, max_tokens=1))
    scheduler.add_request(_request("high", 4, priority=-1, arrival=1.0, max_tokens=1))
    output = scheduler.schedule()
    assert [i.request.sequence_id for i in output.scheduled] == ["high"]


def test_stop_conditions():
    scheduler = _scheduler()
    eos = _request("eos", 4, max_tokens=10)
    ignore = _request("ignore", 4, max_tokens=3, ignore_eos=True)
    stop_id = _request("stop_id", 4, max_tokens=10, stop_token_ids=[3])
    min_tok = _request("min", 4, max_tokens=10, min_tokens=2, stop_token_ids=[3])
    for request in (eos, ignore, stop_id, min_tok):
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"eos": [EOS], "ignore": [EOS], "stop_id": [3], "min": [3]})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_token_id == EOS
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_token_id == 3
    assert ignore.status == RequestStatus.RUNNING
    assert min_tok.status == RequestStatus.RUNNING  # below min_tokens: not yet
    _run(scheduler, token=EOS)
    assert ignore.finish_reason == "length" and ignore.num_output_tokens == 3
    assert min_tok.finish_reason == "stop"


def test_max_model_len_ends_with_length():
    scheduler = _scheduler()
    request = _request("a", 120, max_tokens=None)
    scheduler.add_request(request)
    _run(scheduler)
    assert request.finish_reason == "length" and request.num_tokens == 128


def test_abort_frees_blocks_in_every_state():
    scheduler = _scheduler(num_blocks=16, max_num_batched_tokens=8)
    running = _request("running", 6, max_tokens=50)
    chunking = _request("chunking", 30, max_tokens=5)
    waiting = _request("waiting", 4, max_tokens=5)
    for request in (running, chunking, waiting):
        scheduler.add_request(request)
    for _ in range(2):
        output = scheduler.schedule()
        scheduler.update_from_output(output, {i.request.sequence_id: [3]
                                              for i in output.scheduled if i.samples})
    assert chunking.num_computed_tokens > 0 and not chunking.output_token_ids
    scheduler.abort(["running", "chunking", "waiting"])
    assert not scheduler.has_unfinished
    assert scheduler.kv.num_free_blocks == 16
    assert all(r.finish_reason == "abort" for r in (running, chunking, waiting))



def test_prefix_cache_stats_count_each_admission_once():
    # Room for one request at a time: "late" is looked up at every step until "first" is done,
    # but counted once, when it is admitted; its prompt starts with first's, a 3-block hit.
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=64)
    prompts = {"first": list(range(10, 30)), "late": list(range(10, 22)) + [99] * 8}
    for sequence_id, prompt in prompts.items():
        scheduler.add_request(Request(sequence_id, prompt, SamplingParams(temperature=0.0,
                                                                         max_tokens=3),
                                      eos_token_ids=frozenset({EOS})))
    first_step = scheduler.schedule()
    assert [item.request.sequence_id for item in first_step.scheduled] == ["first"]
    scheduler.update_from_output(first_step, {"first": [3]})
    _run(scheduler)
    assert scheduler.kv.stats.queries == 40
    assert scheduler.kv.stats.hits == 12


def test_chunk_size_below_the_threshold_chunks_only_long_prompts():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16,
                           long_prefill_chunk_size=8)
    decoding = _start_decoding(scheduler, 3)
    scheduler.add_request(_request("long", 40, max_tokens=1, arrival=1.0))
    scheduler.add_request(_request("short", 13, max_tokens=1, arrival=2.0))
    sizes = []
    for _ in range(5):
        output = scheduler.schedule()
        sizes.append({i.request.sequence_id: i.num_new_tokens for i in output.scheduled
                      if i.request.sequence_id not in decoding})
        scheduler.update_from_output(output, {i.request.sequence_id: [3]
                                              for i in output.scheduled if i.samples})
    # The short prompt (13 <= 16) goes whole; the long one in chunks of 8 to its end, even
    # once fewer than the threshold are left.
    assert sizes[0]["long"] == 8 and sizes[0]["short"] <= 13
    assert [s.get("long") for s in sizes] == [8, 8, 8, 8, 8]


def test_a_short_prompt_cut_by_the_budget_finishes_first_in_the_next_step():
    # A burst of short prompts: the step's budget cuts one of them. What is left of it is no
    # long prompt: it goes whole at the head of the next step, before the prompts still
    # waiting, and not one a step after all of them.
    scheduler = _scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=16)
    scheduler.add_request(_request("decoding", 3, max_tokens=40))
    scheduler.update_from_output(scheduler.schedule(), {"decoding": [3]})
    for index in range(8):  # distinct prompts: no prefix cache hits
        scheduler.add_request(Request(f"p{index}", list(range(100 * index, 100 * index + 12)),
                                      SamplingParams(max_tokens=1), eos_token_ids=frozenset({EOS}),
                                      arrival_time=1.0 + index))
    first = scheduler.schedule()
    assert _sizes(first) == {"decoding": 1, "p0": 12, "p1": 12, "p2": 7}
    scheduler.update_from_output(first, {i.request.sequence_id: [3] for i in first.scheduled
                                         if i.samples})
    second = scheduler.schedule()
    order = [item.request.sequence_id for item in second.scheduled]
    assert order.index("p2") < order.index("p3")
    assert _sizes(second) == {"decoding": 1, "p2": 5, "p3": 12, "p4": 12, "p5": 2}
    assert [i.samples for i in second.scheduled if i.request.sequence_id == "p2"] == [True]


def test_a_new_short_prompt_goes_first_and_the_long_chunk_shrinks_by_it():
    scheduler = _scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16,
                           long_prefill_chunk_size=12)
    decoding = _start_decoding(scheduler, 2)
    long_request = Request("long", list(range(100, 140)), SamplingParams(max_tokens=1),
                           eos_token_ids=frozenset({EOS}), arrival_time=1.0)
    scheduler.add_request(long_request)
    output = scheduler.schedule()
    assert _sizes(output)["long"] == 12
    scheduler.update_from_output(output, {name: [3] for name in decoding})
    short = Request("short", list(range(200, 210)), SamplingParams(max_tokens=1),
                    eos_token_ids=frozenset({EOS}), arrival_time=2.0)
    scheduler.add_request(short)
    sizes = _sizes(scheduler.schedule())
    # 10 prompt tokens of the short one leave 2 of the 12; a chunk is at least one block (4).
    assert sizes == {"d0": 1, "d1": 1, "short": 10, "long": 4}
