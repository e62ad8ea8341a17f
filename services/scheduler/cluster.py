"""The scheduler's core across workers: registry, placement, admission, aborts, worker death.

Each worker has its own engine `Scheduler` (queues + block pool). In the PD topology a sample
is queued and prefilled on a prefill worker, its pages go to blocks reserved on a decode worker
(see handoff.py) and it decodes there; with `--role both` workers it runs start to end on one.
Plain Python, driven by the service layer (service.py); every method runs on the event loop.
"""
from __future__ import annotations

import time
from dataclasses import replace

from services.api.kvrelay.v1 import common_pb2, scheduler_pb2
from services.engine.config import EngineConfig
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.scheduler import handoff
from services.scheduler.deltas import DeltaSink, finish_delta
from services.scheduler.records import (BOTH, DECODE, PREFILL, Phase, RequestRecord,
                                        SampleRecord, SetAside, WorkerRecord)


class Unavailable(Exception):
    """No worker can take the request now (gRPC UNAVAILABLE)."""


class ClusterScheduler:
    def __init__(self, config: EngineConfig, lease_s: float, sink: DeltaSink) -> None:
        self.config = config  # per-worker scheduling knobs; block counts come from workers
        self.prefill_max_num_batched_tokens: int | None = None  # prefill-only workers' budget
        self.lease_s = lease_s
        self.sink = sink
        self.workers: dict[str, WorkerRecord] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.samples: dict[str, SampleRecord] = {}
        self.transfers: dict[str, SampleRecord] = {}  # transfer id -> sample being sent
        self.awaiting_decode: list[SampleRecord] = []  # prefilled, no decode blocks free yet
        self.set_aside: list[SetAside] = []  # decode blocks a lost sender may still write
        self.transfer_timeout_s = 30.0  # an order's pages are written within this, or never
        self.num_transfer_shared_prefix_tokens = 0  # prompt tokens no transfer had to push
        self.kv_transport = "grpc"  # "shm": same-host pairs copy pages through shared memory
        # Steps of workers in one compute domain run in turn (service.py); while a decode
        # worker there has sequences running, a prefill step this big at most keeps its
        # inter-token latency in check (None: no limit beyond the worker's own budget).
        self.shared_prefill_max_num_batched_tokens: int | None = None
        self.on_work = lambda worker: None  # set by the service: wake that worker's step loop
        self.accepting = True  # False while draining

    # ---- registry ------------------------------------------------------------------------------
    def register(self, info: scheduler_pb2.RegisterWorkerRequest) -> None:
        """Raises ValueError when the worker cannot join this group."""
        for other in self.workers.values():
            if other.alive and (other.info.block_size, other.info.dtype, other.info.model) != \
                    (info.block_size, info.dtype, info.model):
                raise ValueError(f"worker {info.worker_id} ({info.model}, {info.dtype}, block "
                                 f"{info.block_size}) does not match {other.worker_id}")
        if info.worker_id in self.workers and self.workers[info.worker_id].alive:
            self.worker_died(self.workers[info.worker_id], "worker re-registered")
        config = replace(self.config, block_size=info.block_size)
        if info.role == PREFILL and self.prefill_max_num_batched_tokens:
            # A prefill-only worker has no decodes whose inter-token latency a long step would
            # hurt: bigger steps prefill the same prompts in fewer, more efficient passes.
            config = replace(config, max_num_batched_tokens=self.prefill_max_num_batched_tokens)
        core = Scheduler(config, info.num_blocks, info.max_model_len, info.attention_crossover)
        self.workers[info.worker_id] = WorkerRecord(info, core,
                                                    time.monotonic() + self.lease_s)
        handoff.retry_awaiting(self)  # a new decode worker may be what they wait for

    def heartbeat(self, worker_id: str, draining: bool) -> bool:
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return False
        worker.lease_deadline = time.monotonic() + self.lease_s
        if draining and not worker.draining:
            worker.draining = True
            self.move_queued(worker)
        if worker.draining:
            self.on_work(worker)  # its step loop lets go once it holds nothing
        return True

    def move_queued(self, worker: WorkerRecord) -> int:
        """A draining worker's requests that have not started yet go to other workers of its
        role, so it can leave without making them wait; the ones it computes stay. Returns how
        many samples moved."""
        others = self.live(worker.role)
        if not others:
            return 0  # no one to take them: they finish where they are
        moved = 0
        for sample in list(self.samples.values()):
            request = sample.request
            if (sample.worker is not worker or request.status is not RequestStatus.WAITING
                    or request.num_computed_tokens or request.num_output_tokens):
                continue
            target = _best_placed(others, request.prompt_token_ids)
            worker.core.abort([sample.seq_id])
            self.forget_on(worker, sample.seq_id)
            sample.request = Request(sample.seq_id, request.prompt_token_ids, request.params,
                                     request.eos_token_ids, request.priority,
                                     request.arrival_time, request.cache_salt)
            sample.worker = target
            target.core.add_request(sample.request)
            self.on_work(target)
            moved += 1
        return moved

    def holds_sequences(self, worker: WorkerRecord) -> bool:
        """Anything still queued, running, reserved or being sent on this worker (a prefill
        worker is done with a sample once its pages have landed)."""
        return any((sample.phase is not Phase.DONE and _depends_on(sample, worker))
                   or (sample.send_in_flight and sample.worker is worker)
                   for sample in self.samples.values())

    def retire(self, worker: WorkerRecord) -> None:
        """A drained worker leaves the group; it holds nothing any more."""
        worker.alive = False

    def shares_compute_with_decodes(self, worker: WorkerRecord) -> bool:
        """A prefill worker whose compute domain a decode worker with running sequences
        shares: its steps make those sequences wait (or slow them, with overlapping steps)."""
        if worker.role != PREFILL or not worker.info.compute_domain:
            return False
        return any(other.alive and other.role != PREFILL and other.core.running
                   and other.info.compute_domain == worker.info.compute_domain
                   for other in self.workers.values())

    def step_budget(self, worker: WorkerRecord) -> int | None:
        """This step's token budget when it differs from the worker's own: the opt-in cap on
        a prefill worker's steps while it shares compute with running decodes."""
        limit = self.shared_prefill_max_num_batched_tokens
        if limit and self.shares_compute_with_decodes(worker):
            return min(limit, worker.core.config.max_num_batched_tokens)
        return None

    def live(self, *roles: int) -> list[WorkerRecord]:
        return [w for w in self.workers.values()
                if w.alive and not w.draining and w.role in roles]

    @property
    def pd_ready(self) -> bool:
        return bool(self.live(PREFILL)) and bool(self.live(DECODE))

    @property
    def ready(self) -> bool:
        return self.pd_ready or bool(self.live(BOTH))

    @property
    def max_model_len(self) -> int:
        lengths = [w.info.max_model_len for w in self.workers.values() if w.alive]
        return min(lengths) if lengths else 0

    @property
    def model(self) -> str:
        names = [w.info.model for w in self.workers.values() if w.alive]
        return names[0] if names else ""

    # ---- admission -----------------------------------------------------------------------------
    def submit(self, request_id: str, gateway_id: str, prompt: list[int],
               params: SamplingParams, params_proto: common_pb2.SamplingParams,
               priority: int) -> None:
        """Raises ValueError (bad input) or Unavailable (no workers)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not self.accepting:
            raise Unavailable("the scheduler is shutting down")
        if not self.ready:
            raise Unavailable("no workers are registered yet")
        worker = self._place(prompt)
        self._check_prompt(prompt, params, worker)
        record = RequestRecord(request_id, gateway_id, len(prompt), params_proto)
        # With prefix caching off, the samples of one request still share the prompt's blocks.
        salt = None if self.config.enable_prefix_caching else request_id
        eos = frozenset(worker.info.eos_token_ids)
        phase = Phase.PREFILL if worker.role == PREFILL else Phase.COLOCATED
        for index in range(params.n):
            seq_id = f"{request_id}/{index}"
            request = Request(seq_id, prompt, params, eos, priority, record.arrival, salt)
            worker.core.add_request(request)
            sample = SampleRecord(seq_id, index, record, request, worker, phase)
            record.samples.append(sample)
            self.samples[seq_id] = sample
        self.requests[request_id] = record
        self.on_work(worker)

    def _place(self, prompt: list[int]) -> WorkerRecord:
        return _best_placed(self.live(PREFILL) if self.pd_ready else self.live(BOTH), prompt)

    def _check_prompt(self, prompt: list[int], params: SamplingParams,
                      worker: WorkerRecord) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab_size = worker.info.vocab_size
        bad = [t for t in prompt if t >= vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
        limit = self.max_model_len
        if len(prompt) + (params.max_tokens or 1) > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the "
                             f"prompt has {len(prompt)} tokens and max_tokens is "
                             f"{params.max_tokens}")
        if worker.role == PREFILL:
            self._check_decode_room(prompt, worker.info.block_size)

    def _check_decode_room(self, prompt: list[int], block_size: int) -> None:
        """The prefill worker's core checks its own pool; a prompt that no decode worker could
        ever hold would wait for a decode reservation forever."""
        largest = max(w.info.num_blocks for w in self.live(DECODE))
        blocks_needed = -(-(len(prompt) + 1) // block_size)
        if blocks_needed > largest:
            raise ValueError(f"prompt needs {blocks_needed} KV blocks; the decode workers' "
                             f"caches have at most {largest}")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.max_model_len - prompt_len)

    # ---- removal -------------------------------------------------------------------------------
    def abort(self, ids: list[str]) -> list[str]:
        """ids: "<request id>" (all samples) or "<request id>/<index>"."""
        aborted = []
        for target in ids:
            record = self.requests.get(target)
            samples = record.samples if record else [self.samples.get(target)]
            for sample in samples:
                if sample is not None and sample.phase is not Phase.DONE:
                    self.end_sample(sample, finish_delta(sample, common_pb2.FINISH_REASON_ABORT))
                    aborted.append(sample.seq_id)
        # Freed decode blocks go to samples waiting for them now: no step may follow to retry.
        handoff.retry_awaiting(self)
        return aborted

    def end_sample(self, sample: SampleRecord, delta) -> None:
        """Finish a sample in any phase, free what it holds and emit its final delta."""
        if sample.phase is Phase.DONE:
            return
        if sample in self.awaiting_decode:
            self.awaiting_decode.remove(sample)
        if not sample.send_in_flight:
            self._withdraw_send(sample)
        self._free_prefill_side(sample)
        self._free_decode_side(sample)
        sample.phase = Phase.DONE
        self.sink.emit(sample.parent.gateway_id, delta)
        self._drop_if_done(sample.parent)

    def _withdraw_send(self, sample: SampleRecord) -> None:
        """An order the prefill worker has not been given yet must never go out: it would write
        into decode blocks that are about to be freed and given to another request."""
        if sample.transfer_id is None:
            return
        self.transfers.pop(sample.transfer_id, None)
        pending = sample.worker.pending_sends
        pending[:] = [order for order in pending if order.transfer_id != sample.transfer_id]

    def release_ended(self, sample: SampleRecord) -> None:
        """An ended sample whose send held its blocks: free both sides now that it is back."""
        self._free_prefill_side(sample)
        self._free_decode_side(sample)
        self._drop_if_done(sample.parent)

    def _free_prefill_side(self, sample: SampleRecord) -> None:
        worker = sample.worker
        if sample.phase is Phase.DECODE:
            return  # already released when the pages landed
        if sample.send_in_flight and sample.request.status is not RequestStatus.RUNNING:
            return  # pages still being sent; handoff frees them on the send's result
        # A send ordered in a step that is still running copies its pages out during that step,
        # and this worker's blocks are not handed out again before the step's result, so a
        # request in the running batch is aborted now: kept there, the next step would compute
        # it again and reserve a second set of decode blocks for it.
        if sample.request.status is RequestStatus.TRANSFERRING:
            worker.core.release_transferred(sample.request)
        elif not sample.request.is_finished:
            worker.core.abort([sample.seq_id])
        self.forget_on(worker, sample.seq_id)
        self.on_work(worker)

    def _free_decode_side(self, sample: SampleRecord) -> None:
        worker = sample.decode_worker
        if worker is None or sample.send_in_flight:
            return
        if not sample.decode_request.is_finished:
            worker.core.abort([sample.seq_id])
        self.forget_on(worker, sample.seq_id)
        self.on_work(worker)

    def forget_on(self, worker: WorkerRecord, seq_id: str) -> None:
        if worker.known_blocks.pop(seq_id, None) is not None:
            worker.forget.append(seq_id)

    def _drop_if_done(self, record: RequestRecord) -> None:
        if record.finished and not any(s.send_in_flight for s in record.samples):
            self.requests.pop(record.request_id, None)
            for sample in record.samples:
                self.samples.pop(sample.seq_id, None)

    # ---- failures ------------------------------------------------------------------------------
    def worker_died(self, worker: WorkerRecord, reason: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        error = f"worker {worker.worker_id} failed: {reason}"
        for sample in list(self.samples.values()):
            if not _depends_on(sample, worker):
                continue
            if sample.send_in_flight:  # no result may come, or it comes too late to matter
                self.transfers.pop(sample.transfer_id, None)
                sample.send_in_flight = False
                if sample.worker is worker:  # the sender may still run, cut off from us
                    self._set_aside_decode_side(sample)
            if sample.phase is Phase.DONE:  # ended earlier; only its send held the blocks
                self.release_ended(sample)
            else:
                self.end_sample(sample, finish_delta(sample, common_pb2.FINISH_REASON_ERROR,
                                                     error))
        handoff.activate_waiting_groups(self)  # their last send may have been a dead one
        handoff.retry_awaiting(self)

    def _set_aside_decode_side(self, sample: SampleRecord) -> None:
        """A prefill worker declared dead may be alive and still pushing (a partition, a stall):
        its pages could land in the decode blocks after they went to another request. The
        blocks stay held, by no request, until the order's deadline has passed."""
        decode = sample.decode_worker
        if decode is None:
            return
        blocks = decode.core.set_aside(sample.decode_request)
        # The lease as a margin: the sender checks the deadline on its own clock.
        self.set_aside.append(SetAside(decode, blocks, sample.send_deadline + self.lease_s))
        self.forget_on(decode, sample.seq_id)
        sample.decode_worker, sample.decode_request = None, None

    def release_set_aside(self, now: float) -> None:
        """Free the set-aside blocks whose deadline has passed."""
        due = [entry for entry in self.set_aside if entry.until <= now]
        if not due:
            return
        self.set_aside = [entry for entry in self.set_aside if entry.until > now]
        for entry in due:
            entry.worker.core.kv.release(entry.blocks)
            self.on_work(entry.worker)
        handoff.retry_awaiting(self)

    def extend_leases(self, seconds: float) -> None:
        """Time this scheduler could not run (its loop stalled) is not a worker's silence: its
        heartbeats were waiting to be handled."""
        for worker in self.workers.values():
            if worker.alive:
                worker.lease_deadline += seconds

    def expire_leases(self) -> list[WorkerRecord]:
        now = time.monotonic()
        expired = [w for w in self.workers.values() if w.alive and w.lease_deadline < now]
        for worker in expired:
            self.worker_died(worker, "missed its heartbeat lease")
        return expired


def _depends_on(sample: SampleRecord, worker: WorkerRecord) -> bool:
    """Does the sample need this worker? Once decoding, it no longer needs its prefill worker."""
    if sample.decode_worker is worker:
        return True
    return sample.worker is worker and sample.phase is not Phase.DECODE


def _best_placed(candidates: list[WorkerRecord], prompt: list[int]) -> WorkerRecord:
    """The worker that would finish this prompt's prefill soonest: the fewest tokens to compute
    there, counting its queue and this prompt less what its prefix cache already holds. Cache
    affinity wins while queues are even; a backlog outweighs it, so a burst of prompts that
    share a system prompt still spreads over the workers."""
    def cost(worker: WorkerRecord) -> tuple:
        cached_tokens = _cached_blocks(worker, prompt) * worker.info.block_size
        return (_tokens_to_compute(worker) + len(prompt) - cached_tokens, worker.load())
    return min(candidates, key=cost)


def _tokens_to_compute(worker: WorkerRecord) -> int:
    """Tokens the worker's queued and running requests still need computed (a decoding one
    counts its next token)."""
    return sum(request.num_tokens - request.num_computed_tokens
               for request in worker.core.requests.values()
               if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING))


def _cached_blocks(worker: WorkerRecord, prompt: list[int]) -> int:
    """How many leading blocks of the prompt this worker's prefix cache holds (placement)."""
    return worker.core.kv.num_cached_blocks(prompt)
