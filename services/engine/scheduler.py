"""The engine core's scheduler: one token budget shared by prefill chunks and decodes.

Each request carries `num_computed_tokens` and `num_tokens`; a step gives chosen requests a number
of tokens so the first catches up with the second. Chunked prefill, prefix-cache hits and
preemption by recompute all fall out of that. No I/O here: the service layer drives it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.block_pool import KVBlock
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.prefill_chunks import long_prefill_chunk, prompts_first
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.spec.drafter import Drafter
from kvrelay.engine.stop_checker import advance_grammar, check_stop
from kvrelay.engine.waiting_queue import WaitingQueue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the draft tokens included
    block_ids: list[list[int]]  # per KV group of the model's layers, its block table
    # Speculative decoding: tokens proposed to follow the request's last one, computed in
    # this step after it and verified by sampling at every position (spec/verify.py).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so this step samples the next one."""
        return (self.request.num_computed_tokens + self.num_new_tokens
                == self.request.num_tokens + len(self.draft_token_ids))


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 attention_crossover: int = 0, drafter: Drafter | None = None,
                 group_windows: tuple[int, ...] = (0,)) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # The model's context length at which attention costs as much as the weight matmuls
        # (prefill_chunks.py); 0: long-prompt chunks keep one size.
        self.attention_crossover = attention_crossover
        # group_windows: per KV group of the model's layers, its window (kv_groups.py)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 group_windows)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Speculative decoding: proposes drafts for decoding sequences (None: off).
        self.drafter = drafter
        self.reserved: set[str] = set()  # decode-side requests waiting for their KV pages
        # Whether waiting prompts went first in the last step (prefill_chunks.py): then they
        # fill the step whole, and a prefill worker does not give cores to decodes.
        self.prompts_first = False
        # This step's long-prompt chunking (see EngineConfig.long_prefill_token_threshold):
        # the threshold (0: off) and how many long prompts may still advance.
        self._long_threshold = 0
        self._long_slots = 0
        self._step_prefill = 0  # prompt tokens scheduled in this step so far
        self._deferred: list[Request] = []  # prompts part way through their chunks
        # A pipeline worker's micro-batches (schedule's pipeline_depth): how many steps may be
        # in flight, and how many running requests this step may still take.
        self._depth = 1
        self._running_left = 0
        # Steps sent to the worker and not yet applied, per request they compute (the service
        # marks them: begin_step). A request that ends meanwhile keeps its blocks out of the
        # pool until then, since the worker may still write its KV there and a block handed
        # to another worker's push could be overwritten (see finish_step).
        self._in_flight: dict[str, int] = {}
        # (by id: a sample recovered onto this worker comes back under the same id)
        self._held_for_step: dict[str, list[list[KVBlock]]] = {}

    # ---- admission and removal -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.sequence_id in self.requests:
            raise ValueError(f"sequence id {request.sequence_id!r} is already in use")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {request.num_tokens} tokens; the model's context is "
                             f"{self.max_model_len} tokens including at least one output token")
        # every group holds the whole prompt while it computes in one step
        blocks_needed = self.kv.num_groups * -(-(request.num_tokens + 1)
                                               // self.config.block_size)
        if blocks_needed > self.kv.pool.num_blocks:
            raise ValueError(f"prompt needs {blocks_needed} KV blocks; the cache has only "
                             f"{self.kv.pool.num_blocks}")
        self.requests[request.sequence_id] = request
        self.waiting.push(request)

    def abort(self, sequence_ids) -> list[Request]:
        aborted = []
        for sequence_id in sequence_ids:
            request = self.requests.get(sequence_id)
            if request is None or request.is_finished:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def prompts_go_first(self, decodes_elsewhere: int = 0) -> bool:
        """Whether the waiting prompts go first in the next step (prefill_chunks.py), with
        `decodes_elsewhere` sequences decoding on workers that share this one's compute.
        Asked by the core share before the step takes its turn; schedule decides the same."""
        return self._prompts_go_first(decodes_elsewhere + self._num_decoding())

    def _prompts_go_first(self, num_decoding: int) -> bool:
        return prompts_first(self.prompts_first, self._num_awaiting(), num_decoding)

    def _num_decoding(self) -> int:
        return sum(map(_decoding, self.running))

    def tokens_to_prefill(self, request: Request) -> int:
        """The tokens the request has yet to compute, a waiting one's cached prefix aside."""
        left = request.num_tokens - request.num_computed_tokens
        if request.num_computed_tokens == 0 and request.reads_prefix_cache:
            left -= self.kv.get_computed_blocks(request).num_blocks * self.config.block_size
        return left

    def _num_awaiting(self, sampling: frozenset[int] = frozenset()) -> int:
        """Requests without a first token: waiting, or part way through their prompt (those
        whose id(request) is in `sampling` get theirs from the step being planned)."""
        return len(self.waiting) + sum(1 for request in self.running
                                       if not request.num_output_tokens
                                       and id(request) not in sampling)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, token_budget: int | None = None, decodes_elsewhere: int = 0,
                 pipeline_depth: int = 1) -> SchedulerOutput:
        """One step's work; `token_budget` overrides max_num_batched_tokens for this step.
        `decodes_elsewhere`: sequences decoding on other workers that wait for this step
        (shared hardware), counted with this worker's own (prefill_chunks.py).
        `pipeline_depth` > 1: a pipeline worker's micro-batch, planned while up to depth - 1
        others are in flight: it leaves out the sequences they compute, and takes at most its
        share (1/depth) of the running ones, so the stages each have a micro-batch."""
        output = SchedulerOutput()
        self._depth = pipeline_depth
        self._running_left = -(-len(self.running) // pipeline_depth)
        budget = token_budget or self.config.max_num_batched_tokens
        # The tail of `running` is the first to be preempted, so keep it in policy order.
        self.running.sort(key=lambda req: req.sort_key(self.config.scheduling_policy))
        num_decoding = decodes_elsewhere + self._num_decoding()
        self.prompts_first = self._prompts_go_first(num_decoding)
        chunking = num_decoding and not self.prompts_first
        self._long_threshold = self.config.long_prefill_token_threshold if chunking else 0
        self._long_slots = self.config.max_long_partial_prefills
        self._step_prefill = 0
        self._deferred = []
        budget = self._schedule_running(output, budget)
        if not output.preempted:
            budget = self._schedule_waiting(output, budget)
            self._schedule_deferred(output, budget)
        sampling = frozenset(id(item.request) for item in output.scheduled if item.samples)
        if self._num_awaiting(sampling) <= 1:
            self.prompts_first = False  # the burst is through (prefill_chunks.py)
        self.stats.num_steps += 1
        return output

    def schedule_ahead(self, previous: SchedulerOutput,
                       token_budget: int | None = None) -> SchedulerOutput | None:
        """The step after `previous`, planned while `previous` still runs (async scheduling):
        each of its sequences computes the token `previous` samples for it, which the worker
        already holds when it gets there. Only a batch of plain decodes continues this way,
        with nothing else to join it; None when a full `schedule` has to come first (a new
        sequence, drafts, a grammar, a prefill chunk, blocks that do not fit without
        preempting). Sequences whose previous token is their last are left out."""
        if self.drafter is not None or self.waiting:
            return None
        live = [item for item in previous.scheduled if not item.request.is_finished]
        if not all(_plain_decode(item) for item in live):
            return None
        requests = [item.request for item in live]
        in_batch = {id(request) for request in requests}
        if any(id(request) not in in_batch for request in self.running):
            return None  # a sequence joined: the next step is planned in full
        output = SchedulerOutput()
        for request in requests:
            if self.ends_after_next_token(request):
                continue
            if not self.kv.allocate_slots(request, 2):  # (slots taken early stay its own)
                return None
            output.scheduled.append(self._scheduled(request, 1))
        if output.is_empty or len(output.scheduled) > (token_budget
                                                       or self.config.max_num_batched_tokens):
            return None
        self.stats.num_steps += 1
        return output

    def ends_after_next_token(self, request: Request) -> bool:
        """The token the step in flight samples is the request's last by length."""
        max_tokens = request.params.max_tokens
        return ((max_tokens is not None and request.num_output_tokens + 1 >= max_tokens)
                or request.num_tokens + 1 >= self.max_model_len)

    def begin_step(self, output: SchedulerOutput) -> None:
        """The step goes to the worker: until finish_step, what it computes keeps its blocks."""
        for item in output.scheduled:
            sequence_id = item.request.sequence_id
            self._in_flight[sequence_id] = self._in_flight.get(sequence_id, 0) + 1

    def finish_step(self, output: SchedulerOutput) -> None:
        """The step's result is in (or it will never come): blocks held for it go back."""
        for item in output.scheduled:
            sequence_id = item.request.sequence_id
            count = self._in_flight.get(sequence_id)
            if count is None:
                continue  # never marked (the offline engine, tests)
            if count > 1:
                self._in_flight[sequence_id] = count - 1
                continue
            del self._in_flight[sequence_id]
            for blocks in self._held_for_step.pop(sequence_id, ()):
                self.kv.release(blocks)

    def abandon_steps(self) -> None:
        """The worker is gone: no step in flight will answer, and nothing writes these blocks."""
        self._in_flight.clear()
        for blocks in self.held_for_steps:
            self.kv.release(blocks)
        self._held_for_step.clear()

    @property
    def held_for_steps(self) -> list[list[KVBlock]]:
        """Ended requests' blocks, out of the pool until the steps in flight that write them
        are back."""
        return [blocks for held in self._held_for_step.values() for blocks in held]

    def _chunk_long(self, num_new: int, num_computed: int) -> int:
        """A new prompt's share of this step: whole within the threshold; a long one gets a
        chunk while a long-prompt slot is left, else nothing (it waits for the next step)."""
        if not self._long_threshold or num_new <= self._long_threshold:
            return num_new
        if self._long_slots <= 0:
            return 0
        self._long_slots -= 1
        return min(num_new, self._long_chunk(num_computed))

    def _long_chunk(self, num_computed: int) -> int:
        """The chunk after `num_computed` tokens, less the prompt tokens this step already
        carries: a short prompt and a long chunk together would make the longest steps."""
        size = self.config.long_prefill_chunk_size or self._long_threshold
        chunk = long_prefill_chunk(size, num_computed, self.attention_crossover)
        return max(self.config.block_size, chunk - self._step_prefill)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._depth > 1:
                if self._running_left <= 0:
                    break  # this micro-batch's share: the rest go in the next one
                if self._in_flight.get(request.sequence_id):
                    index += 1  # computed by a micro-batch still in flight
                    continue
                self._running_left -= 1
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._long_threshold and num_new > 1 and request.num_tokens > self._long_threshold:
                # A long prompt part way through its chunks: it keeps its long-prompt slot, and
                # its chunk is sized after this step's new prompts (_schedule_deferred). What
                # is left of a short one (cut where a step's budget ran out) goes whole, first,
                # as vLLM's running prefills do: as a long prompt it waited behind every new
                # prompt and then went one a step (a 64-prompt burst ended in 5-7 extra steps).
                if self._long_slots > 0:
                    self._long_slots -= 1
                    self._deferred.append(request)
                index += 1
                continue
            if num_new <= 0:
                index += 1
                continue
            drafts = self._drafts(request, budget) if num_new == 1 else []
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                # (Drafts that fit only by preempting someone are not worth it: none then.)
                output.scheduled.append(self._scheduled(request, 1 + len(drafts), drafts))
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pop_victim(index)
                if victim is None:
                    break  # only micro-batches in flight to take from: it waits
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                if num_new > 1:
                    self._step_prefill += num_new  # a prompt's rest: long chunks make room
                index += 1
                continue
            break  # the request preempted itself: nothing behind it is left to schedule
        return budget

    def _pop_victim(self, index: int) -> Request | None:
        """The request to preempt: the tail of `running` (not yet scheduled in this step, at
        `index` or after it), leaving out those a micro-batch in flight computes."""
        for position in range(len(self.running) - 1, index - 1, -1):
            if not self._in_flight.get(self.running[position].sequence_id) \
                    or self._depth == 1:
                return self.running.pop(position)
        return None

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        skipped = []  # long prompts waiting for a long-prompt slot
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed, num_cached = None, 0
            if request.num_computed_tokens == 0 and request.reads_prefix_cache:
                computed = self.kv.get_computed_blocks(request)
                num_cached = computed.num_blocks * self.config.block_size
            num_new = min(self._chunk_long(request.num_tokens - num_cached, num_cached), budget)
            if not self.adapter_fits(request):
                # every LoRA slot is held by running requests' adapters: the requests behind
                # it with those adapters or none go now; it waits for a slot to come free
                skipped.append(self.waiting.pop())
                continue
            if num_new <= 0:
                # A long prompt, and this step's long-prompt slots are taken: the shorter ones
                # behind it go now (it keeps its place in the queue for the next free slot).
                skipped.append(self.waiting.pop())
                continue
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            self.waiting.pop()
            if request.num_computed_tokens == 0:
                self.kv.record_lookup(request.num_tokens, num_cached)
            if request.status == RequestStatus.WAITING:
                request.num_cached_prompt_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            self._step_prefill += num_new
        for request in skipped:
            self.waiting.push(request)
        return budget

    def _schedule_deferred(self, output: SchedulerOutput, budget: int) -> None:
        """The chunks of prompts part way through, after this step's new prompts."""
        for request in self._deferred:
            if budget <= 0:
                return
            num_new = min(request.num_tokens - request.num_computed_tokens,
                          self._long_chunk(request.num_computed_tokens), budget)
            if not self.kv.allocate_slots(request, num_new):
                continue  # no room now: it waits rather than preempt anything
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            self._step_prefill += num_new

    def _drafts(self, request: Request, budget: int) -> list[int]:
        if self.drafter is None:
            return []
        # The drafts' KV positions and the tokens they may add stay inside the context.
        room = min(budget - 1, self.max_model_len - request.num_tokens - 1)
        return self.drafter.drafts(request, len(self.running), room)

    def _scheduled(self, request: Request, num_new: int,
                   drafts: list[int] | None = None) -> ScheduledRequest:
        return ScheduledRequest(request, num_new, self.kv.block_ids(request.sequence_id),
                                drafts or [])

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.push(request)

    # ---- PD handoff ----------------------------------------------------------------------------
    # On the prefill worker a request leaves `running` once its first token is sampled but keeps
    # its blocks until the KV pages are pushed; on the decode worker blocks are reserved before
    # the pages arrive and the request joins `running` once they have.
    @property
    def num_reserved(self) -> int:
        return len(self.reserved)

    def adapter_fits(self, request: Request) -> bool:
        """Whether the request may join the running set without it needing more LoRA slots
        than the worker has (max_loras distinct adapters, so every step's adapters fit)."""
        if request.adapter_id == 0:
            return True
        live = {other.adapter_id for other in self.running}
        live.update(self.requests[sequence_id].adapter_id for sequence_id in self.reserved
                    if sequence_id in self.requests)
        live.discard(0)
        return request.adapter_id in live or len(live) < self.config.max_loras

    def detach_for_transfer(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.TRANSFERRING

    def release_transferred(self, request: Request) -> None:
        """The pages left: free the prefill side's blocks (their hashes stay cached)."""
        self.kv.forget(request)
        self.requests.pop(request.sequence_id, None)

    def reserve_for_transfer(self, request: Request) -> int | None:
        """Blocks on this (decode) worker for the KV of the request's tokens, which the prefill
        worker pushes: its prompt, and a recovered sample's outputs from before its recovery.
        Returns how many leading blocks it holds already (their pages need no push), or None
        when they do not fit."""
        if len(self.running) + self.num_reserved >= self.config.max_num_seqs:
            return None
        if not self.adapter_fits(request):
            return None
        num_held = self.kv.allocate_for_transfer(request)
        if num_held is None:
            return None
        request.status = RequestStatus.TRANSFERRING
        self.requests[request.sequence_id] = request
        self.reserved.add(request.sequence_id)
        return num_held

    def activate_transferred(self, request: Request) -> None:
        """The pages of every token the request holds arrived: it joins the batch, and decodes
        once the caller has appended the token sampled on the prefill worker."""
        self.reserved.discard(request.sequence_id)
        self.kv.register_landed(request)
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def set_aside(self, request: Request) -> list[KVBlock]:
        """A reservation whose sender was lost: it leaves this worker's books, and its blocks,
        still referenced, go to the caller to free once no late page can land in them."""
        self.reserved.discard(request.sequence_id)
        self.requests.pop(request.sequence_id, None)
        request.status = RequestStatus.FINISHED_ABORTED
        return self.kv.set_aside(request)

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Advance progress, append sampled tokens, finish what must stop; return finished ones.
        sampled: per sequence id, the tokens the step emitted (a verified speculative step: its
        accepted drafts, then the token sampled after them)."""
        finished = []
        self.finish_step(output)
        for item in output.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran, or ended by an earlier one
                continue
            request.num_computed_tokens += item.num_new_tokens
            token_ids = sampled.get(request.sequence_id)
            if token_ids:
                if item.draft_token_ids:
                    self._verified(request, item, len(token_ids) - 1)
                status = self._append(request, token_ids)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    continue
            # Only verified progress counts: no later query (drafts and the step planned
            # ahead included) reaches behind the window of the computed tokens.
            self.kv.free_out_of_window(request)
        return finished

    def _verified(self, request: Request, item: ScheduledRequest, num_accepted: int) -> None:
        """The KV of rejected drafts is garbage: progress goes back to the last accepted one
        (their slots stay allocated and are overwritten by the next step)."""
        request.num_computed_tokens -= len(item.draft_token_ids) - num_accepted
        self.drafter.record(request, len(item.draft_token_ids), num_accepted)

    def _append(self, request: Request, token_ids: list[int]) -> RequestStatus | None:
        """One token at a time, so a stop inside an accepted run drops what follows it."""
        for token_id in token_ids:
            request.append_token(token_id)
            status = advance_grammar(request) or check_stop(request, self.max_model_len)
            if status is not None:
                return status
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.sequence_id in self.reserved:
            self.reserved.discard(request.sequence_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.grammar = None  # the matcher's memory goes with the sequence
        if self.drafter is not None and status != RequestStatus.FINISHED_ABORTED:
            self.drafter.on_finished(request)
        request.draft_state = None
        if self._in_flight.get(request.sequence_id):
            self._held_for_step.setdefault(request.sequence_id, []).append(
                self.kv.set_aside(request))
        else:
            self.kv.forget(request)
        del self.requests[request.sequence_id]


def _plain_decode(item: ScheduledRequest) -> bool:
    """One token computed and one sampled, nothing a grammar or a draft depends on."""
    request = item.request
    return (item.num_new_tokens == 1 and not item.draft_token_ids and request.grammar is None
            and request.status == RequestStatus.RUNNING and item.samples)


def _decoding(request: Request) -> bool:
    """A running request whose next step computes just its last sampled token. One that is
    computing its tokens again (recomputed after a preemption, or recovered on another
    worker: its outputs come with it) has outputs but does not decode yet."""
    return bool(request.num_output_tokens) and \
        request.num_tokens - request.num_computed_tokens == 1
