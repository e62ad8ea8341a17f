"""Block pool, free queue and KV cache manager: unit tests and hypothesis state machines."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrelay.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.prefix_hits import first_in_window
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.spec.config import SpeculativeConfig
from kvrelay.engine.spec.drafter import Drafter

BLOCK_SIZE = 4


def test_free_queue_is_lru_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and queue.num_free == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 0]
    with pytest.raises(RuntimeError):
        queue.append(blocks[1])  # already queued


def test_double_free_is_an_error():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(2)
    block_hash = hash_block(None, [1, 2, 3, 4])
    (block,) = pool.allocate(1)
    pool.cache_block(block, block_hash)
    pool.free([block])
    assert pool.lookup(block_hash) is block  # revivable
    pool.allocate(2)  # the free queue hands it out again: the hash is gone
    assert pool.lookup(block_hash) is None


def test_hash_hit_verifies_token_ids():
    pool = BlockPool(2)
    real = hash_block(None, [1, 2, 3, 4])
    (block,) = pool.allocate(1)
    pool.cache_block(block, real)
    forged = type(real)(real.value, (9, 9, 9, 9), None)  # same hash value, other tokens
    assert pool.lookup(forged) is None


def _request(sequence_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(sequence_id, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_shared_prefix_is_found_and_capped_before_the_last_token():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    first = _request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    second = _request("b", list(range(8)) + [77, 78])
    hit = kv.get_computed_blocks(second)
    assert hit.num_blocks == 2 and hit.blocks == [kv.req_blocks["a"][0][:2]]
    exact = _request("c", list(range(8)))  # fully cached prompt: keep one token to compute
    assert kv.get_computed_blocks(exact).num_blocks == 1


class KVManagerMachine(RuleBasedStateMachine):
    """admit / append / finish / abort / preempt in any order; accounting must always hold."""
    GROUP_WINDOWS = (0,)  # per KV group, its window (0: full attention)
    NUM_BLOCKS = 12

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True,
                                 group_windows=self.GROUP_WINDOWS)
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def admit(self, prefix, tail):
        request = _request(f"r{self.next_id}", prefix + tail)
        self.next_id += 1
        hit = self.kv.get_computed_blocks(request)
        num_cached = hit.num_blocks * BLOCK_SIZE
        if self.kv.allocate_slots(request, request.num_tokens - num_cached, hit):
            request.num_computed_tokens = request.num_tokens
            request.status = RequestStatus.RUNNING
            self.live[request.sequence_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.append_token(token)
        if self.kv.allocate_slots(request, 1):
            request.num_computed_tokens += 1
        else:
            request.all_token_ids.pop()
            request.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data, aborted):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.forget(request)
        request.status = (RequestStatus.FINISHED_ABORTED if aborted
                          else RequestStatus.FINISHED_STOPPED)
        self.done.append(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED

    @invariant()
    def accounting_holds(self):
        _check_accounting(self.kv, self.done)


class WindowKVManagerMachine(KVManagerMachine):
    """The same with a full group and two window groups, and the window sliding: a window
    group's blocks out of reach are freed (and stay cached), prefix hits span every group."""
    GROUP_WINDOWS = (0, 6, 9)
    NUM_BLOCKS = 30

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide(self, data):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.kv.free_out_of_window(request)

    @invariant()
    def out_of_window_entries_are_freed_and_the_rest_held(self):
        _check_windows(self.kv, self.live.values(), slid=False)


def _check_windows(kv: KVCacheManager, requests, slid: bool) -> None:
    """Freed entries (None) lead each table and are out of the window; with `slid`, every
    block out of the window of the computed tokens is freed."""
    for request in requests:
        tables = kv.req_blocks.get(request.sequence_id)
        if tables is None:
            continue
        for window, table, dropped in zip(kv.windows, tables,
                                          kv.req_num_dropped[request.sequence_id]):
            assert all(block is None for block in table[:dropped])
            assert all(block is not None for block in table[dropped:])
            first = first_in_window(request.num_computed_tokens, window, BLOCK_SIZE)
            assert dropped <= first  # nothing a later query reads
            if slid:
                assert dropped == min(first, len(table))


def _check_accounting(kv: KVCacheManager, finished: list[Request]):
    pool = kv.pool
    used = sum(1 for block in pool.blocks if block.ref_cnt > 0)
    assert pool.num_free_blocks + used == pool.num_blocks
    assert sum(1 for _ in pool.free_queue) == pool.num_free_blocks
    holders: dict[int, int] = {}
    for sequence_id in kv.req_blocks:
        for block in kv.held_blocks(sequence_id):
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    for (group, value), block in pool.cached.items():
        assert block.block_hash is not None and block.block_hash.value == value
        assert block.group == group
    for request in finished:
        assert request.sequence_id not in kv.req_blocks


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowKVManagerMachine = WindowKVManagerMachine.TestCase
TestWindowKVManagerMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)


class SchedulerMachine(RuleBasedStateMachine):
    """The real scheduler on a tiny pool: preemption happens; nothing leaks."""
    GROUP_WINDOWS = (0,)
    NUM_BLOCKS = 10

    def __init__(self):
        super().__init__()
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=16, max_num_seqs=4,
                              long_prefill_token_threshold=8)
        self.scheduler = Scheduler(config, num_blocks=self.NUM_BLOCKS, max_model_len=64,
                                   group_windows=self.GROUP_WINDOWS)
        self.finished: list[Request] = []
        self.next_id = 0

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 12), shared=st.booleans())
    def admit(self, length, max_tokens, shared):
        tokens = ([5] * length) if shared else [self.next_id % 7] + [1] * (length - 1)
        self.scheduler.add_request(_request(f"q{self.next_id}", tokens, max_tokens))
        self.next_id += 1

    @rule(eos_row=st.integers(0, 5))
    def step(self, eos_row):
        output = self.scheduler.schedule()
        sampled = {item.request.sequence_id: [2 if row == eos_row else 3]
                   for row, item in enumerate(output.scheduled) if item.samples}
        for request in output.scheduled:
            request.request.eos_token_ids = frozenset({2})
        self.finished += self.scheduler.update_from_output(output, sampled)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        sequence_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.finished += self.scheduler.abort([sequence_id])

    @invariant()
    def accounting_holds(self):
        _check_accounting(self.scheduler.kv, self.finished)
        for request in self.finished:
            assert request.is_finished and request.sequence_id not in self.scheduler.requests

    def teardown(self):
        # Drain: every request ends and every block comes back.
        for _ in range(500):
            if not self.scheduler.has_unfinished:
                break
            self.step(eos_row=99)
        assert not self.scheduler.has_unfinished
        assert self.scheduler.kv.num_free_blocks == self.NUM_BLOCKS


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class SpeculativeSchedulerMachine(SchedulerMachine):
    """The same, with n-gram drafts in the steps and a random number of them accepted: the
    rejected drafts' progress goes back, no block leaks, only verified tokens are cached."""

    def __init__(self):
        super().__init__()
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                   prompt_lookup_min=1, prompt_lookup_max=3,
                                   disable_by_batch_size=0)
        self.scheduler.drafter = Drafter(config)

    @rule(eos_row=st.integers(0, 5), data=st.data())
    def speculative_step(self, eos_row, data):
        output = self.scheduler.schedule()
        sampled = {}
        for row, item in enumerate(output.scheduled):
            if not item.samples:
                continue
            num_accepted = data.draw(st.integers(0, len(item.draft_token_ids)))
            sampled[item.request.sequence_id] = (item.draft_token_ids[:num_accepted]
                                                + [2 if row == eos_row else 3])
            item.request.eos_token_ids = frozenset({2})
        self.finished += self.scheduler.update_from_output(output, sampled)
        for item in output.scheduled:  # a verified step leaves only the last token to compute
            if item.draft_token_ids and not item.request.is_finished:
                assert item.request.num_computed_tokens == item.request.num_tokens - 1

    @invariant()
    def progress_and_cache_hold_only_verified_tokens(self):
        kv = self.scheduler.kv
        for request in self.scheduler.running:
            # drafts never count as computed (a recomputing request may be further behind)
            assert request.num_computed_tokens <= request.num_tokens - 1
            for table in kv.req_blocks.get(request.sequence_id, ()):  # per group
                assert len(table) <= -(-(request.num_tokens + 3) // BLOCK_SIZE)
            assert kv.req_num_cached.get(request.sequence_id, 0) <= \
                request.num_tokens // BLOCK_SIZE


TestSpeculativeSchedulerMachine = SpeculativeSchedulerMachine.TestCase
TestSpeculativeSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                                    deadline=None)


class WindowSchedulerMachine(SchedulerMachine):
    """The scheduler over a full group and two window groups: after every step each running
    request's window groups hold only the blocks their window reaches (the rest freed while it
    runs), beside prefix hits, chunked prompts and preemption; nothing leaks."""
    GROUP_WINDOWS = (0, 5, 8)
    NUM_BLOCKS = 24

    @invariant()
    def windows_hold_only_what_they_reach(self):
        _check_windows(self.scheduler.kv, self.scheduler.running, slid=True)


TestWindowSchedulerMachine = WindowSchedulerMachine.TestCase
TestWindowSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40,
                                               deadline=None)


class WindowSpeculativeSchedulerMachine(SpeculativeSchedulerMachine):
    """Drafts with window groups: rejected drafts never free a block a later query reads."""
    GROUP_WINDOWS = (0, 5, 8)
    NUM_BLOCKS = 24

    @invariant()
    def windows_hold_only_what_they_reach(self):
        _check_windows(self.scheduler.kv, self.scheduler.running, slid=True)


TestWindowSpeculativeSchedulerMachine = WindowSpeculativeSchedulerMachine.TestCase
TestWindowSpeculativeSchedulerMachine.settings = settings(max_examples=100,
                                                          stateful_step_count=40, deadline=None)
