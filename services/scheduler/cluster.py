"""The scheduler's core across workers: admission, placement, the PD handoff's moves, aborts
and worker death, over the worker registry (registry.py) and the transfer book (transfers.py).

In the PD topology a sample is queued and prefilled on a prefill worker, its pages go to
blocks reserved on a decode worker and it decodes there; with `--role both` workers it runs
start to end on one (records.py). Plain Python, driven by the service layer; every method runs
on the event loop. Whatever ends a sample frees what it holds, here and nowhere else.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from kvrelay.common.log import get_logger
from kvrelay.engine.prompt_checks import check_prompt_tokens
from kvrelay.engine.request import Request, RequestStatus, make_sequence_id, prefix_cache_key
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.backend import CompiledGrammar
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.deltas import finish_delta
from kvrelay.scheduler.messages import BOTH, DECODE, PREFILL, Delta, FinishReason, WorkerInfo
from kvrelay.scheduler.records import Phase, RequestRecord, SampleRecord
from kvrelay.scheduler.registry import WorkerRecord, WorkerRegistry
from kvrelay.scheduler.transfers import Transfer, TransferBook, TransferState

log = get_logger(__name__)


class Unavailable(Exception):
    """No worker can take the request now (gRPC UNAVAILABLE)."""


class Overloaded(Unavailable):
    """Too much work waits already (gRPC RESOURCE_EXHAUSTED: retry later)."""


class Sink(Protocol):
    def emit(self, gateway_id: str, delta: Delta) -> None: ...


class ClusterScheduler:
    def __init__(self, config: SchedulerConfig, sink: Sink,
                 wake: Callable[[WorkerRecord], None] = lambda worker: None) -> None:
        self.config = config
        self.sink = sink
        self.wake = wake  # the worker may have work now: its step loop should look
        self.registry = WorkerRegistry(config)
        self.transfers = TransferBook(config.transfer_timeout_s, config.lease_s)
        self.requests: dict[str, RequestRecord] = {}
        self.samples: dict[str, SampleRecord] = {}
        self.awaiting_decode: list[SampleRecord] = []  # prefilled, no decode blocks free yet
        self.no_decode_since: float | None = None  # a PD group has lost every decode worker
        self.num_recoveries = 0
        self.accepting = True  # False while draining

    # ---- workers -------------------------------------------------------------------------------
    def register(self, info: WorkerInfo) -> WorkerRecord:
        """Raises ValueError when the worker cannot join this group."""
        replaced = self.registry.register(info)
        if replaced is not None:
            self.worker_died(replaced, "worker re-registered")
        self._place_stranded()  # recovered samples may be waiting for this very role
        self.retry_awaiting()  # a new decode worker may be what they wait for
        return self.registry.workers[info.worker_id]

    def heartbeat(self, worker_id: str, draining: bool) -> bool:
        worker, started_draining = self.registry.heartbeat(worker_id, draining)
        if worker is None:
            return False
        if started_draining:
            self.move_queued(worker)
        if worker.draining:
            self.wake(worker)  # its step loop lets go once it holds nothing
        return True

    def has_work(self, worker: WorkerRecord) -> bool:
        return worker.has_core_work or self.transfers.has_outgoing(worker)

    def move_queued(self, worker: WorkerRecord) -> int:
        """A draining worker's requests that have not started yet go to other workers of its
        role, so it can leave without making them wait; the ones it computes stay (a recovered
        sample queued here moves with its outputs). Returns how many samples moved."""
        others = self.registry.live(worker.role)
        if not others:
            return 0  # no one to take them: they finish where they are
        moved = 0
        for sample in list(self.samples.values()):
            request = sample.request
            if (sample.worker is not worker or request.status is not RequestStatus.WAITING
                    or request.num_computed_tokens or sample.stranded):
                continue
            target = _best_placed(others, request.all_token_ids, request.cache_key)
            moved_request = request.continued()  # before the abort lets go of its grammar
            worker.core.abort([sample.sequence_id])
            self.forget_on(worker, sample.sequence_id)
            sample.request, sample.worker = moved_request, target
            target.core.add_request(sample.request)
            self.wake(target)
            moved += 1
        return moved

    def holds_sequences(self, worker: WorkerRecord) -> bool:
        """Anything still queued, running, reserved or being sent on this worker (a prefill
        worker is done with a sample once its pages have landed)."""
        return any(not s.done and s.worker is worker and not s.stranded
                   for s in self.samples.values()) or self.transfers.involves(worker)

    def retire(self, worker: WorkerRecord) -> None:
        """A drained worker leaves the group; it holds nothing any more."""
        worker.alive = False

    # ---- admission -----------------------------------------------------------------------------
    def submit(self, request_id: str, gateway_id: str, prompt: list[int],
               params: SamplingParams, priority: int,
               grammar: CompiledGrammar | None = None, adapter_id: int = 0) -> None:
        """params: max_tokens filled in; grammar: params.structured_outputs compiled (each
        sample gets its own matcher from it). Raises ValueError (bad input) or Unavailable."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not self.accepting:
            raise Unavailable("the scheduler is shutting down")
        if not self.registry.ready:
            raise Unavailable("no workers are registered yet")
        # With prefix caching off, the samples of one request still share the prompt's blocks.
        salt = None if self.config.engine.enable_prefix_caching else request_id
        worker = self._place(prompt, prefix_cache_key(salt, adapter_id))
        self._check_prompt(prompt, params, worker)
        self._check_load(len(prompt), params.n)
        record = RequestRecord(request_id, gateway_id, len(prompt), params)
        eos = frozenset(worker.info.eos_token_ids)
        phase = Phase.PREFILL if worker.role is PREFILL else Phase.COLOCATED
        for index in range(params.n):
            sequence_id = make_sequence_id(request_id, index)
            request = Request(sequence_id, prompt, params, eos, priority, record.arrival, salt,
                              adapter_id=adapter_id)
            if grammar is not None:
                request.grammar = grammar.matcher()
            worker.core.add_request(request)
            sample = SampleRecord(sequence_id, index, record, request, worker, phase)
            record.samples.append(sample)
            self.samples[sequence_id] = sample
        self.requests[request_id] = record
        self.wake(worker)

    def queued_work(self) -> tuple[int, int]:
        """Samples waiting for their first (or, preempted, next) step on any worker, and their
        tokens to compute."""
        num_samples = num_tokens = 0
        for worker in self.registry.workers.values():
            if worker.alive:
                num_samples += len(worker.core.waiting)
                num_tokens += sum(request.num_tokens for request in worker.core.waiting)
        return num_samples, num_tokens

    def _check_load(self, num_prompt_tokens: int, n: int) -> None:
        max_requests = self.config.max_queued_requests
        max_tokens = self.config.max_queued_prompt_tokens
        if not max_requests and not max_tokens:
            return
        num_samples, num_tokens = self.queued_work()
        if max_requests and num_samples + n > max_requests:
            raise Overloaded(f"overloaded: {num_samples} requests are waiting (limit "
                             f"{max_requests}); retry later")
        # (a prompt bigger than the whole limit still runs when nothing else waits)
        if max_tokens and num_samples and num_tokens + n * num_prompt_tokens > max_tokens:
            raise Overloaded(f"overloaded: {num_tokens} prompt tokens are waiting (limit "
                             f"{max_tokens}); retry later")

    def _place(self, prompt: list[int], cache_key) -> WorkerRecord:
        registry = self.registry
        roles = (PREFILL,) if registry.pd_ready else (BOTH,)
        return _best_placed(registry.live(*roles), prompt, cache_key)

    def _check_prompt(self, prompt: list[int], params: SamplingParams,
                      worker: WorkerRecord) -> None:
        check_prompt_tokens(prompt, params, worker.info.vocab_size)
        limit = self.registry.max_model_len
        if len(prompt) + (params.max_tokens or 1) > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the "
                             f"prompt has {len(prompt)} tokens and max_tokens is "
                             f"{params.max_tokens}")
        if worker.role is PREFILL:
            self._check_decode_room(prompt, worker.info.block_size)

    def _check_decode_room(self, prompt: list[int], block_size: int) -> None:
        """The prefill worker's core checks its own pool; a prompt that no decode worker could
        ever hold would wait for a decode reservation forever."""
        largest = max(w.info.num_blocks for w in self.registry.live(DECODE))
        # (every KV group holds the whole prompt while it computes)
        num_groups = max(len(w.info.kv_group_windows) for w in self.registry.live(DECODE))
        blocks_needed = num_groups * -(-(len(prompt) + 1) // block_size)
        if blocks_needed > largest:
            raise ValueError(f"prompt needs {blocks_needed} KV blocks; the decode workers' "
                             f"caches have at most {largest}")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.registry.max_model_len - prompt_len)

    # ---- the PD handoff ------------------------------------------------------------------------
    def reserve_decode(self, sample: SampleRecord, during_step: bool) -> Transfer | None:
        """Reserve decode-side blocks for the sample's pages and open its transfer; None if
        no decode worker has room now. during_step: the step being planned carries the order
        (its pages go out layer by layer as they are computed); otherwise it waits in the
        book's outbox for the prefill worker's next step."""
        request, source = sample.request, sample.worker
        # The pages hold every token before the one the prefill worker samples: the prompt,
        # and a recovered sample's outputs from before its recovery. While the step that
        # samples it is planned (PREFILL) that is all of the request's tokens; once it is out
        # (TRANSFER), all but that token, which has no KV yet.
        num_pushed = request.num_tokens
        if sample.phase is Phase.TRANSFER:
            num_pushed -= 1
        for decode in sorted(self.registry.live(DECODE), key=_decode_preference):
            # The prefill side's salt: prompts that share a prefix share its blocks on the
            # decode worker too, and blocks it already holds are not pushed again.
            clone = request.continued(num_pushed)
            num_held = decode.core.reserve_for_transfer(clone)
            if num_held is None:
                continue
            sample.transfer = self.transfers.open_transfer(
                sample.sequence_id, source, decode, clone, num_held,
                self._transport(source, decode), during_step)
            if not during_step:
                self.wake(source)
            return sample.transfer
        return None

    def _transport(self, prefill: WorkerRecord, decode: WorkerRecord) -> str:
        same_host = prefill.info.host_id and prefill.info.host_id == decode.info.host_id
        if (self.config.kv_transport == "shm" and same_host and decode.info.shm_path
                and "shm" in prefill.info.kv_transports):
            return "shm"
        return "grpc"

    def after_first_token(self, sample: SampleRecord) -> None:
        """The prefill worker sampled the first token and the sample goes on: it leaves the
        prefill worker's running batch and its pages go out (now, or once a decode worker has
        room), or, where they have landed already, it decodes with its group."""
        sample.worker.core.detach_for_transfer(sample.request)
        sample.move(Phase.TRANSFER)
        transfer = sample.transfer
        if transfer is None:  # none was reserved while it prefilled: reserve one now
            if self.reserve_decode(sample, during_step=False) is None:
                self.awaiting_decode.append(sample)
            return
        self.transfers.first_token(transfer)
        self._activate_ready(transfer.step_id)

    def retry_awaiting(self) -> None:
        """Blocks were freed somewhere: place samples still waiting for a decode worker."""
        while self.awaiting_decode:
            if self.reserve_decode(self.awaiting_decode[0], during_step=False) is None:
                return
            self.awaiting_decode.pop(0)

    def on_send_result(self, transfer_id: str, ok: bool, error: str) -> None:
        effects = self.transfers.result(transfer_id, ok, error)
        if effects.released is not None:  # finished or aborted while the pages were in flight
            self._release_orphan(effects.released)
        failed = [(self.samples[t.sequence_id], message) for t, message in effects.failed]
        for sample, message in failed:
            self._recover(sample, message)  # its pages never landed: prefilled again
        if effects.group is not None:
            self._activate_ready(effects.group)  # this result may have been the last
        self.retry_awaiting()

    def _activate_ready(self, step_id: int) -> None:
        for transfer in self.transfers.ready(step_id):
            self._activate(self.samples[transfer.sequence_id], transfer)

    def _activate(self, sample: SampleRecord, transfer: Transfer) -> None:
        """The pages are in: the sample leaves the prefill worker and decodes from the token
        sampled there."""
        prefill, decode = sample.worker, transfer.destination
        prefill.core.release_transferred(sample.request)
        self.forget_on(prefill, sample.sequence_id)
        clone = transfer.decode_request
        decode.core.activate_transferred(clone)  # it holds just the tokens whose pages landed
        for token_id in sample.request.output_token_ids[clone.num_output_tokens:]:
            clone.append_token(token_id)  # (the grammar has taken it on the prefill side)
        self.transfers.activate(transfer)
        sample.request, sample.worker, sample.transfer = clone, decode, None
        sample.move(Phase.DECODE)
        self.wake(decode)
        self.wake(prefill)

    # ---- removal -------------------------------------------------------------------------------
    def abort(self, ids: list[str]) -> list[str]:
        """ids: "<request id>" (all samples) or "<request id>/<index>"."""
        aborted = []
        for target in ids:
            record = self.requests.get(target)
            samples = record.samples if record else [self.samples.get(target)]
            for sample in samples:
                if sample is not None and not sample.done:
                    self.end_sample(sample, finish_delta(sample, FinishReason.ABORT))
                    aborted.append(sample.sequence_id)
        # Freed decode blocks go to samples waiting for them now: no step may follow to retry.
        self.retry_awaiting()
        return aborted

    def end_sample(self, sample: SampleRecord, delta: Delta) -> None:
        """Finish a sample in any phase, free what it holds and emit its final delta. A send
        still in flight keeps the decode blocks (and pages it reads) until its result."""
        if sample.done:
            return
        if sample in self.awaiting_decode:
            self.awaiting_decode.remove(sample)
        sample.stranded_since = None
        transfer = sample.transfer
        state = self.transfers.cancel(transfer) if transfer is not None else None
        # A send ordered in a step that is still running copies its pages out during that
        # step, and this worker's blocks are not handed out again before the step's result:
        # a request in the running batch is freed now (kept there, the next step would compute
        # it again). Pages of a detached request stay until the send's result.
        if state is not TransferState.ORPHANED or sample.request.status is RequestStatus.RUNNING:
            self._free_source(sample)
        if state in (TransferState.CANCELLED, TransferState.FAILED):
            self._let_go_of_destination(transfer)
        sample.move(Phase.DONE)
        self.sink.emit(sample.parent.gateway_id, delta)
        self._drop_if_done(sample.parent)

    def _release_orphan(self, transfer: Transfer) -> None:
        """An ended sample's send is back: free both sides it held."""
        sample = self.samples[transfer.sequence_id]
        self._free_source(sample)
        self._free_destination(transfer)
        self._drop_if_done(sample.parent)

    def _free_source(self, sample: SampleRecord) -> None:
        """The sample's engine request on the worker it lives on (once only)."""
        worker, request = sample.worker, sample.request
        if worker.core.requests.get(sample.sequence_id) is request:  # not finished or freed yet
            if request.status is RequestStatus.TRANSFERRING:
                worker.core.release_transferred(request)
            else:
                worker.core.abort([sample.sequence_id])
        self.forget_on(worker, sample.sequence_id)
        self.wake(worker)

    def _let_go_of_destination(self, transfer: Transfer) -> None:
        """The blocks of a transfer that ended without its pages: a failed send's bytes may
        still be on their way (a sender that gave up, a stream cut while its frames were in a
        buffer), so its blocks are set aside until its deadline; a cancelled one's are free."""
        if transfer.state is TransferState.FAILED:
            self._set_aside(transfer)
        else:
            self._free_destination(transfer)

    def _free_destination(self, transfer: Transfer) -> None:
        decode = transfer.destination
        if not transfer.decode_request.is_finished:
            decode.core.abort([transfer.sequence_id])
        self.forget_on(decode, transfer.sequence_id)
        self.wake(decode)

    def forget_on(self, worker: WorkerRecord, sequence_id: str) -> None:
        if worker.known_blocks.pop(sequence_id, None) is not None:
            worker.forget.append(sequence_id)

    def _drop_if_done(self, record: RequestRecord) -> None:
        if record.finished and not any(s.holds_orphan for s in record.samples):
            self.requests.pop(record.request_id, None)
            for sample in record.samples:
                self.samples.pop(sample.sequence_id, None)

    # ---- failures ------------------------------------------------------------------------------
    def worker_died(self, worker: WorkerRecord, reason: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        error = f"worker {worker.worker_id} failed: {reason}"
        # Looked up first: dropping one ended request must not lose another's sample.
        lost = [(t, self.samples[t.sequence_id]) for t in self.transfers.worker_lost(worker)]
        for transfer, sample in lost:
            self._transfer_lost(transfer, sample, error)
        for sample in list(self.samples.values()):
            if sample.worker is worker and not sample.done and not sample.stranded:
                self._recover(sample, error)
        worker.core.abandon_steps()
        self.retry_awaiting()

    def _transfer_lost(self, transfer: Transfer, sample: SampleRecord, error: str) -> None:
        """A transfer that a lost worker ended (transfers.worker_lost): free or set aside its
        blocks; its sample, unless it ended already, ends with the error."""
        if transfer.state is TransferState.LOST:
            self._set_aside(transfer)
        else:  # on a dead destination too: its books must balance like a live one's
            self._free_destination(transfer)
        sample.transfer = None
        if sample.done:  # an orphan: only its send held the blocks
            self._free_source(sample)
            self._drop_if_done(sample.parent)
        else:
            self._recover(sample, error)
        self._activate_ready(transfer.step_id)  # it may have been its group's last send

    def _set_aside(self, transfer: Transfer) -> None:
        """A prefill worker declared dead may be alive and still pushing (a partition, a
        stall), and a failed send's frames may still be in a buffer: its pages could land in
        the decode blocks after they went to another request. The blocks stay held, by no
        request, until the order's deadline has passed."""
        decode = transfer.destination
        self.transfers.hold_aside(transfer, decode.core.set_aside(transfer.decode_request))
        self.forget_on(decode, transfer.sequence_id)

    def release_set_aside(self, now: float) -> None:
        """Free the set-aside blocks whose deadline has passed."""
        due = self.transfers.due_aside(now)
        for entry in due:
            entry.worker.core.kv.release(entry.blocks)
            self.wake(entry.worker)
        if due:
            self.retry_awaiting()

    # ---- recovery ------------------------------------------------------------------------------
    def _recover(self, sample: SampleRecord, error: str) -> None:
        """Start the sample over on a live worker; past its retry budget, or with its pages
        still being copied out, it ends with the error.

        The scheduler holds every sample's tokens, so nothing is lost with the worker: a new
        engine request keeps the original prompt and the tokens generated so far as outputs
        (Request.continued) and is prefilled over all of them (what the new worker's prefix
        cache holds of them is a hit), then samples its next token and goes on like any other
        (in a PD group through the usual handoff, its pages covering those outputs too). Its
        max_tokens, min_tokens, stop checks and penalties count the outputs; the worker skips
        one draw of a seeded sample's generator per output (worker/sequences.py), so its
        random stream goes on where it stopped; its grammar matcher, which has taken them
        all, is not fed them again; the client's stream is untouched. The output is that of
        an uninterrupted run, token for token."""
        transfer = sample.transfer
        in_flight = transfer is not None and transfer.awaits_result
        if sample.retries >= self.config.max_request_retries or in_flight:
            suffix = f" (after {sample.retries} retries)" if sample.retries else ""
            self.end_sample(sample, finish_delta(sample, FinishReason.ERROR, error + suffix))
            return
        if sample in self.awaiting_decode:
            self.awaiting_decode.remove(sample)
        if transfer is not None:
            self.transfers.cancel(transfer)
            self._let_go_of_destination(transfer)
            sample.transfer = None
        resumed = sample.request.continued()  # before freeing it lets go of its grammar
        self._free_source(sample)
        sample.request = resumed
        sample.retries += 1
        self.num_recoveries += 1
        log.info("sample recovered", sequence_id=sample.sequence_id, retry=sample.retries,
                 num_tokens=sample.request.num_tokens,
                 num_output_tokens=sample.request.num_output_tokens, reason=error)
        self._place_recovered(sample)

    def _place_recovered(self, sample: SampleRecord) -> None:
        target = self._recovery_target(sample.request.all_token_ids)
        if target is None:  # none alive now: wait (bounded, expire_waits) for one to register
            if not sample.stranded:
                sample.stranded_since = time.monotonic()
            return
        sample.stranded_since = None
        sample.worker = target
        sample.move(Phase.PREFILL if target.role is PREFILL else Phase.COLOCATED)
        try:
            target.core.add_request(sample.request)
        except ValueError as exc:  # its tokens so far need more blocks than that cache has
            self.end_sample(sample, finish_delta(sample, FinishReason.ERROR,
                                                 f"cannot continue on {target.worker_id}: {exc}"))
            return
        self.wake(target)

    def _recovery_target(self, token_ids: list[int]) -> WorkerRecord | None:
        """Where a recovered sample prefills: a prefill worker in a PD group, else a `both`."""
        live = self.registry.live(PREFILL if self._is_pd_group() else BOTH)
        return _best_placed(live, token_ids) if live else None

    def _is_pd_group(self) -> bool:
        return any(w.role is PREFILL for w in self.registry.workers.values())

    @property
    def stranded(self) -> list[SampleRecord]:
        """Recovered samples waiting for a live worker of the role they need, in no queue."""
        return [sample for sample in self.samples.values() if sample.stranded]

    def _place_stranded(self) -> None:
        for sample in self.stranded:
            self._place_recovered(sample)

    def expire_waits(self, now: float) -> None:
        """Recovered samples end with an error once no worker of the role they need has come
        back within worker_wait_s: stranded ones, and prefilled ones awaiting a decode worker
        in a group that has none left."""
        wait_s = self.config.worker_wait_s
        for sample in self.stranded:
            if now - sample.stranded_since >= wait_s:
                self.end_sample(sample, finish_delta(
                    sample, FinishReason.ERROR, f"no worker to continue on came back within "
                                                f"{wait_s:.0f}s"))
        if not self._is_pd_group() or self.registry.live(DECODE):
            self.no_decode_since = None
            return
        if self.no_decode_since is None:
            self.no_decode_since = now
        elif now - self.no_decode_since >= wait_s:
            for sample in list(self.awaiting_decode):
                self.end_sample(sample, finish_delta(
                    sample, FinishReason.ERROR, f"no decode worker came back within "
                                                f"{wait_s:.0f}s"))

    def expire_leases(self) -> list[WorkerRecord]:
        expired = self.registry.expired(time.monotonic())
        for worker in expired:
            self.worker_died(worker, "missed its heartbeat lease")
        return expired



def _decode_preference(worker: WorkerRecord) -> tuple:
    return (-worker.core.kv.num_free_blocks, len(worker.core.running))


def _best_placed(candidates: list[WorkerRecord], token_ids: list[int],
                 cache_key=None) -> WorkerRecord:
    """The worker that would finish the prefill of these tokens (a prompt, or a recovered
    sample's prompt and outputs) soonest: the fewest tokens to compute there, counting its
    queue and these tokens less what its prefix cache already holds. Cache affinity wins while
    queues are even; a backlog outweighs it, so a burst of prompts that share a system prompt
    still spreads over the workers."""
    def cost(worker: WorkerRecord) -> tuple:
        cached_tokens = worker.core.kv.num_cached_blocks(token_ids, cache_key) \
            * worker.info.block_size
        return (_tokens_to_compute(worker) + len(token_ids) - cached_tokens, worker.load())
    return min(candidates, key=cost)


def _tokens_to_compute(worker: WorkerRecord) -> int:
    """Tokens the worker's queued and running requests still need computed (a decoding one
    counts its next token)."""
    return sum(request.num_tokens - request.num_computed_tokens
               for request in worker.core.requests.values()
               if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING))
