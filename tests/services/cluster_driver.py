"""Drives the real ClusterScheduler in-process the way worker_link.py does, with no gRPC and no
model: plan a worker's step, answer it with the tokens a worker would sample, apply the result,
and deliver KV send results whenever a test says so. Checks the scheduler's accounting."""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field

from kvrelay.api.kvrelay.v1 import common_pb2, scheduler_pb2
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.prefix_hits import first_in_window
from kvrelay.engine.request import RequestStatus, make_sequence_id
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.scheduler import ScheduledRequest
from kvrelay.engine.stop_checker import banned_token_ids
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.scheduler.messages import (BOTH, DECODE, PREFILL, Role, Sampled, SendOrder,
                                         StepOutcome, WorkerInfo)
from kvrelay.scheduler.outputs import DeltaSink
from kvrelay.scheduler.records import Phase
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.step_plan import StepPlan, StepPlanner
from kvrelay.scheduler.transfers import SetAside, TransferState
from kvrelay.wire import params_from_proto, params_to_proto

BLOCK_SIZE = 16
EOS, STOP_ID, FILLER = 2, 3, 7  # FILLER: what the fake model samples unless told otherwise
VOCAB_SIZE = 64
GATEWAY = "gw"
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
ABORT, ERROR = common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR


def worker_info(worker_id: str, role: Role, num_blocks: int, max_model_len: int = 128,
                compute_domain: str = "", num_threads: int = 0,
                kv_group_windows: tuple[int, ...] = (0,)) -> WorkerInfo:
    """A fresh worker process: a replacement under the same id gets a new instance id."""
    return WorkerInfo(
        worker_id=worker_id, role=role, address=f"{worker_id}.test:1", num_blocks=num_blocks,
        block_size=BLOCK_SIZE, model="tiny", dtype="float32", kv_transports=("grpc",),
        max_model_len=max_model_len, vocab_size=VOCAB_SIZE, eos_token_ids=(EOS,),
        compute_domain=compute_domain, instance_id=f"{worker_id}#{next(_instance_ids)}",
        num_threads=num_threads, kv_group_windows=kv_group_windows)


_instance_ids = itertools.count()


def prompt(length: int, first: int = 10) -> list[int]:
    return [(first + i) % (VOCAB_SIZE - 8) + 8 for i in range(length)]  # never EOS/STOP/FILLER


@dataclass
class InFlightStep:
    plan: StepPlan
    sampling: list[ScheduledRequest]  # items whose chunk completes the known tokens
    writes: set[int] = field(default_factory=set)  # block ids whose KV the step writes


@dataclass
class InFlightSend:
    order: SendOrder
    prefill: WorkerRecord
    decode: WorkerRecord
    # the tokens whose KV the pages hold: the prompt, and a recovered sample's earlier outputs
    tokens: tuple[int, ...]
    indices: tuple[int, ...]  # per destination block, its place in its group's table


@dataclass
class Submitted:
    prompt: list[int]
    params: SamplingParams
    grammar: object = None  # its compiled grammar: one may end it (STOP, no stop token)
    deltas: dict[int, list[scheduler_pb2.SequenceDelta]] = field(
        default_factory=lambda: defaultdict(list))


class ClusterDriver:
    def __init__(self, workers: list[WorkerInfo], scheduler_config: dict | None = None,
                 **config) -> None:
        """config: EngineConfig's fields; scheduler_config: SchedulerConfig's."""
        engine = EngineConfig(**{"max_num_batched_tokens": 256, "max_num_seqs": 8, **config})
        self.cluster = ClusterScheduler(
            SchedulerConfig(engine=engine, lease_s=3600.0, **(scheduler_config or {})),
            DeltaSink())
        self.outputs = self.cluster.sink.subscribe(GATEWAY)
        self.all_workers: list[WorkerRecord] = []  # dead and replaced ones too
        for info in workers:
            self.register(info)
        self.steps: dict[str, InFlightStep] = {}  # worker id -> its unanswered step
        # worker id -> the step planned ahead behind it (async scheduling: worker_link.py)
        self.ahead: dict[str, InFlightStep] = {}
        self.pipeline = False  # run() plans ahead wherever the scheduler allows it
        self.num_planned_ahead = 0
        self.sends: dict[str, InFlightSend] = {}  # transfer id -> a send a prefill worker runs
        # sequence id -> tokens sampled for it, and tokens to sample next
        self.sampled: dict[str, list[int]] = defaultdict(list)
        self.script: dict[str, list[int]] = defaultdict(list)
        self.requests: dict[str, Submitted] = {}
        # (decode worker instance id, block id) -> the prompt prefix whose KV pages the block
        # holds, as the transfers wrote them; checked whenever a decode step reads a sequence's
        # blocks. A push lands only in the worker process it was ordered for (the receiver
        # refuses a replacement's chunks), so pages are kept per instance, not per worker id.
        self.pages: dict[tuple[str, int], tuple] = {}
        self.zombie_sends: list[InFlightSend] = []  # sends of workers declared dead, still running
        # sequence id -> how many of its tokens its latest transfer pushed (the decode side reads
        # their pages rather than computing them)
        self.num_pushed: dict[str, int] = {}

    # ---- what the gateway does ------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], grammar=None, **params) -> None:
        """grammar: params' structured_outputs compiled, as the service does."""
        # through the wire's form, as the service receives them (float32 rounding)
        sampling = params_from_proto(params_to_proto(SamplingParams(**params)))
        self.cluster.submit(request_id, GATEWAY, prompt_ids, sampling, 0, grammar)
        self.requests[request_id] = Submitted(prompt_ids, sampling, grammar)
        self.flush()

    def abort(self, *ids: str) -> list[str]:
        aborted = self.cluster.abort(list(ids))
        self.flush()  # as SchedulerService.Abort does
        return aborted

    def flush(self) -> None:
        self.cluster.sink.flush()
        while not self.outputs.empty():
            for delta in self.outputs.get_nowait().deltas:
                self.requests[delta.request_id].deltas[delta.index].append(delta)

    # ---- what a worker does ----------------------------------------------------------------------
    def worker(self, worker_id: str) -> WorkerRecord:
        return self.cluster.registry.workers[worker_id]

    def has_work(self, worker_id: str) -> bool:
        return self.cluster.has_work(self.worker(worker_id))

    def pending_sends(self, worker_id: str) -> list[str]:
        """Seq ids of the orders waiting for the worker's next step."""
        outbox = self.cluster.transfers.outbox.get(self.worker(worker_id).info.instance_id, [])
        return [transfer.sequence_id for transfer in outbox]

    def start_step(self, worker_id: str) -> bool:
        """Plan the worker's next step and hand it over; False when there is nothing to run."""
        assert worker_id not in self.steps, f"{worker_id} already has a step in flight"
        worker = self.worker(worker_id)
        plan = self._planner(worker).plan()
        if plan is None:
            self.flush()
            return False
        pushed_now = {(order.dst_instance_id, block_id) for order in plan.order.kv_sends
                      for block_id in order.dst_block_ids}
        for order in plan.order.kv_sends:
            self._check_order(order, worker, pushed_now)
            transfer = self.cluster.transfers.open[order.transfer_id]
            self.sends[order.transfer_id] = InFlightSend(
                order, worker, transfer.destination, tuple(transfer.decode_request.all_token_ids),
                _table_indices(transfer.destination, order))
            self.num_pushed[order.sequence_id] = transfer.decode_request.num_tokens
        self.steps[worker_id] = self._in_flight(worker, plan, ahead=False)
        return True

    def start_ahead(self, worker_id: str) -> bool:
        """Plan the step after the one in flight, as WorkerLink does while it runs; False when
        the scheduler does not continue this way."""
        assert worker_id in self.steps and worker_id not in self.ahead, worker_id
        worker = self.worker(worker_id)
        plan = self._planner(worker).plan_ahead(self.steps[worker_id].plan)
        if plan is None:
            return False
        assert not plan.order.kv_sends and not plan.order.new_sequences
        self.ahead[worker_id] = self._in_flight(worker, plan, ahead=True)
        self.num_planned_ahead += 1
        return True

    def _planner(self, worker: WorkerRecord) -> StepPlanner:
        """As the worker's WorkerLink holds it (it keeps nothing between calls)."""
        return StepPlanner(self.cluster, worker)

    def _in_flight(self, worker: WorkerRecord, plan: StepPlan, ahead: bool) -> InFlightStep:
        if worker.role == DECODE and not ahead:
            for item in plan.output.scheduled:
                self._read_pages(worker, item)
        writes = set()
        for item in plan.output.scheduled:
            # A step planned ahead computes the token the one before it samples.
            start = item.request.num_computed_tokens + (1 if ahead else 0)
            for position in range(start, start + item.num_new_tokens):
                writes.update(table[position // BLOCK_SIZE] for table in item.block_ids)
        sampling = [item for item in plan.output.scheduled if item.samples]
        return InFlightStep(plan, sampling, writes)

    def finish_step(self, worker_id: str) -> None:
        """The worker answers: one sampled token per sequence whose chunk reached its end."""
        step = self.steps.pop(worker_id)
        worker = self.worker(worker_id)
        requests = {item.request.sequence_id: item.request for item in step.sampling}
        sampled = []
        for token in self._run_step(worker, step):
            # A sample that ended (or was recovered) while the step ran: the scheduler drops
            # whatever the worker sampled for it.
            if not requests[token.sequence_id].is_finished:
                self.sampled[token.sequence_id].extend(token.token_ids)
                sampled.append(token)
        self._planner(worker).apply(step.plan,
                                    StepOutcome(step.plan.order.step_id, tuple(sampled)))
        if worker_id in self.ahead:  # the worker goes straight on to it
            self.steps[worker_id] = self.ahead.pop(worker_id)
        self.cluster.retry_awaiting()  # as WorkerLink._step_loop does after each step
        self.flush()

    def step(self, worker_id: str) -> bool:
        if not self.start_step(worker_id):
            return False
        self.finish_step(worker_id)
        return True

    def send_result(self, transfer_id: str, ok: bool = True) -> None:
        send = self.sends.pop(transfer_id)
        self._write_pages(send, ok)
        self.cluster.on_send_result(transfer_id, ok, "" if ok else "connection refused")
        self.flush()

    def kill(self, worker_id: str, zombie: bool = False) -> None:
        """The worker's stream breaks: its step and its own sends never answer. A zombie is
        only cut off: its sends may still write their pages (land_zombie_pages)."""
        worker = self.worker(worker_id)
        self.cluster.worker_died(worker, "step stream broke")
        self.flush()
        self.steps.pop(worker_id, None)
        self.ahead.pop(worker_id, None)
        for transfer_id, send in list(self.sends.items()):
            if send.prefill is worker:
                del self.sends[transfer_id]
                if zombie:
                    self.zombie_sends.append(send)

    def land_zombie_pages(self) -> None:
        """The cut-off sends write their pages now, before their deadline."""
        for send in self.zombie_sends:
            self._write_pages(send, ok=True)
        self.zombie_sends.clear()

    def _run_step(self, worker: WorkerRecord, step: InFlightStep) -> list[Sampled]:
        """What the worker samples in the step: here, scripted tokens (FILLER by default)."""
        return [Sampled(item.request.sequence_id, (self._next_token(item.request),))
                for item in step.sampling if not item.request.is_finished]

    def register(self, info: WorkerInfo) -> None:
        """A (fresh) worker process registers, maybe under a dead one's id."""
        self.all_workers.append(self.cluster.register(info))

    def _next_token(self, request) -> int:
        script = self.script[request.sequence_id]
        token_id = script.pop(0) if script else FILLER
        # A real worker never samples a stop token before min_tokens (stop_checker bans them).
        return FILLER if token_id in banned_token_ids(request) else token_id

    def _write_pages(self, send: InFlightSend, ok: bool) -> None:
        """What the push wrote: the pages of its tokens, whole, or torn when it failed part
        way."""
        for index, block_id in zip(send.indices, send.order.dst_block_ids):
            pages = _prompt_pages(send.tokens, index)
            key = (send.order.dst_instance_id, block_id)
            if ok or self.pages.get(key) == pages:  # a torn write of the same pages is harmless
                self.pages[key] = pages
            else:
                self.pages[key] = ("torn",)

    def _read_pages(self, worker: WorkerRecord, item: ScheduledRequest) -> None:
        """A decode step reads the blocks of the pushed tokens (the prompt, and a recovered
        sample's earlier outputs) that it does not compute (a sequence preempted on the decode
        worker computes them again there): each must hold those tokens' KV."""
        request = item.request
        start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
        num_pushed = self.num_pushed[request.sequence_id]
        pushed = request.all_token_ids[:num_pushed]
        kv = worker.core.kv
        for window, table in zip(kv.windows, kv.req_blocks[request.sequence_id]):
            # a window group's step reads only the blocks its window reaches
            for index in range(first_in_window(start, window, BLOCK_SIZE),
                               min(_num_blocks(num_pushed), _num_blocks(end))):
                block = table[index]
                assert block is not None, f"{request.sequence_id} block {index} was freed"
                key = (worker.info.instance_id, block.block_id)
                pages = _prompt_pages(pushed, index)
                if (index + 1) * BLOCK_SIZE <= start or start >= num_pushed:
                    assert self.pages.get(key) == pages, \
                        f"{request.sequence_id} block {index} on {worker.worker_id} holds " \
                        f"other pages"
                elif index * BLOCK_SIZE < end:
                    self.pages[key] = pages

    def _check_order(self, order: SendOrder, prefill: WorkerRecord,
                     pushed_now: set[tuple[str, int]]) -> None:
        """A send may only write into blocks reserved for its sequence on a live decode worker;
        each leading block it skips holds that prefix already (a decode-side prefix hit) or
        another send of the same step pushes it."""
        transfer = self.cluster.transfers.open.get(order.transfer_id)
        assert transfer is not None and transfer.sequence_id == order.sequence_id, order
        assert transfer.state is TransferState.IN_FLIGHT and transfer.source is prefill
        sample = self.cluster.samples[order.sequence_id]
        assert not sample.done and sample.transfer is transfer, f"send for {order.sequence_id}"
        decode = transfer.destination
        assert decode.alive and decode.role is DECODE
        assert order.dst_instance_id == decode.info.instance_id
        written = set().union(*(step.writes for steps in (self.steps, self.ahead)
                                for worker_id, step in steps.items()
                                if self.worker(worker_id) is decode))
        assert not written & set(order.dst_block_ids), \
            f"a push into blocks a running step of {decode.worker_id} writes: {self.describe()}"
        clone = transfer.decode_request
        assert decode.core.requests[order.sequence_id] is clone
        assert clone.status is RequestStatus.TRANSFERRING
        # It pushes every token before the one the prefill worker samples: the prompt, and a
        # recovered sample's earlier outputs, which stay outputs on the decode side too.
        request = sample.request
        assert clone.prompt_token_ids == request.prompt_token_ids
        assert clone.all_token_ids == request.all_token_ids[:clone.num_tokens]
        assert clone.num_tokens == (request.num_tokens if sample.phase is Phase.PREFILL
                                    else request.num_tokens - 1)
        assert clone.params is request.params and clone.grammar is request.grammar
        num_blocks = _num_blocks(clone.num_tokens)
        assert list(order.dst_block_ids) == [block_id for table in transfer.dst_block_ids
                                             for block_id in table]
        assert list(order.src_block_ids) == [block_id for table in transfer.src_block_ids
                                             for block_id in table]
        groups = zip(decode.core.kv.windows, decode.core.kv.block_ids(order.sequence_id),
                     prefill.core.kv.block_ids(order.sequence_id), transfer.dst_block_ids,
                     transfer.src_block_ids)
        for window, decode_blocks, prefill_blocks, dst, src in groups:
            # per group: a tail of the blocks the decode worker reads, at least one
            assert len(decode_blocks) == num_blocks
            first = first_in_window(clone.num_tokens, window, BLOCK_SIZE)
            num_held = len(decode_blocks) - len(dst)
            assert first <= num_held < len(decode_blocks) or (not dst and first >= num_blocks)
            assert dst == decode_blocks[num_held:]
            assert src == prefill_blocks[num_held:num_blocks]
            for index in range(first, num_held):
                block_id = decode_blocks[index]
                assert (order.dst_instance_id, block_id) in pushed_now or \
                    self.pages.get((decode.info.instance_id, block_id)) == \
                    _prompt_pages(clone.all_token_ids, index), "skipped unlanded pages"

    # ---- driving to the end ------------------------------------------------------------------------
    def run(self, sends: str = "after", max_rounds: int = 1000) -> None:
        """Every worker steps while it has work and every send succeeds, until nothing is left.
        sends: results of the sends a step carried arrive "before" that step's result, "after"
        it, or "late" (after the worker's next step has been planned)."""
        for _ in range(max_rounds):
            if not self.cluster.requests and not self.steps and not self.sends:
                self.cluster.release_set_aside(math.inf)  # all that is left is to wait
                return
            progressed = bool(self.steps or self.sends)
            carried = list(self.sends)
            if sends == "before":
                self.deliver_sends(carried)
            for worker_id in list(self.steps):
                self.finish_step(worker_id)
            if sends == "after":
                self.deliver_sends(carried)
            for worker in list(self.cluster.registry.workers.values()):
                if (worker.alive and worker.worker_id not in self.steps
                        and self.cluster.has_work(worker)):
                    progressed |= self.start_step(worker.worker_id)
            if self.pipeline:
                for worker_id in list(self.steps):
                    if worker_id not in self.ahead and self.worker(worker_id).alive:
                        self.start_ahead(worker_id)
            self.deliver_sends(carried)
            if not progressed and self.cluster.transfers.set_aside:
                # What waits may wait for blocks a lost sender's deadline holds: time passes.
                self.cluster.release_set_aside(math.inf)
                continue
            if not progressed and self.cluster.stranded:
                # Recovered samples wait for a worker of their role: none comes, time passes.
                self.cluster.expire_waits(math.inf)
                self.flush()
                continue
            if not progressed:
                raise AssertionError(f"stuck with live requests: {self.describe()}")
        raise AssertionError(f"no end after {max_rounds} rounds: {self.describe()}")

    def deliver_sends(self, transfer_ids: list[str] | None = None) -> None:
        """Results for these sends (all by default): ok unless the decode worker is gone."""
        for transfer_id in list(self.sends) if transfer_ids is None else transfer_ids:
            send = self.sends.get(transfer_id)
            if send is not None:
                self.send_result(transfer_id, ok=send.decode.alive)

    def describe(self) -> str:
        samples = {sequence_id: (s.phase.value, s.request.status.value,
                            s.transfer.state.value if s.transfer else None)
                   for sequence_id, s in self.cluster.samples.items()}
        workers = {w.worker_id: (w.alive, len(w.core.running), len(w.core.waiting),
                                 w.core.num_reserved, w.core.kv.num_free_blocks,
                                 len(self.pending_sends(w.worker_id)))
                   for w in self.cluster.registry.workers.values()}
        transfers = {t.transfer_id: t.state.value for t in self.cluster.transfers.open.values()}
        return (f"samples={samples} workers(alive, running, waiting, reserved, free, pending)="
                f"{workers} awaiting={[s.sequence_id for s in self.cluster.awaiting_decode]} "
                f"transfers={transfers}")

    # ---- checks ---------------------------------------------------------------------------------
    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return [t for d in self.requests[request_id].deltas[index] for t in d.new_token_ids]

    def final(self, request_id: str, index: int = 0) -> scheduler_pb2.SequenceDelta:
        deltas = self.requests[request_id].deltas[index]
        assert deltas and deltas[-1].finish_reason, f"{request_id}/{index} has not ended"
        return deltas[-1]

    def check_deltas(self, ended: bool = False) -> None:
        """Each sample: at most one final delta, nothing after it, its tokens those the workers
        sampled for it, stopping where its parameters say; with ended, every sample has ended."""
        for request_id, submitted in self.requests.items():
            for index in range(submitted.params.n):
                self._check_sample_deltas(request_id, index, submitted, ended)

    def _check_sample_deltas(self, request_id: str, index: int, submitted: Submitted,
                             ended: bool) -> None:
        deltas = submitted.deltas[index]
        finals = [i for i, d in enumerate(deltas) if d.finish_reason]
        assert finals in ([], [len(deltas) - 1]), f"{request_id}/{index}: finals at {finals}"
        if ended:
            assert finals, f"{request_id}/{index} never got a final delta: {self.describe()}"
        tokens = self.tokens(request_id, index)
        sequence_id = make_sequence_id(request_id, index)
        sampled = self.sampled[sequence_id]
        assert tokens == sampled[:len(tokens)], (tokens, sampled)
        params = submitted.params
        stops = set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set())
        assert len(tokens) <= params.max_tokens
        for position, token_id in enumerate(tokens[:-1]):
            assert token_id not in stops or position + 1 < params.min_tokens, tokens
        if not finals:
            return
        final = deltas[-1]
        if final.finish_reason == LENGTH:
            assert len(tokens) == params.max_tokens, (sequence_id, tokens)
            assert not tokens or tokens[-1] not in stops or len(tokens) < params.min_tokens
        elif final.finish_reason == STOP and submitted.grammar is not None \
                and not final.HasField("stop_token_id"):
            pass  # the grammar is complete
        elif final.finish_reason == STOP:
            assert tokens[-1] in stops and len(tokens) >= params.min_tokens
            assert final.stop_token_id == tokens[-1]
        else:
            assert final.finish_reason in (ABORT, ERROR), final
            assert (final.finish_reason == ERROR) == bool(final.error), final

    def check_accounting(self) -> None:
        """What must hold between any two events, on every worker, dead ones included."""
        cluster = self.cluster
        book = cluster.transfers
        for worker in self.all_workers:
            _check_pool(worker, [entry for entry in book.set_aside if entry.worker is worker])
            for sequence_id, request in worker.core.requests.items():
                sample = cluster.samples.get(sequence_id)
                assert sample is not None, f"{worker.worker_id} holds orphan {sequence_id}"
                transfer = sample.transfer
                assert request is sample.request or (
                    transfer is not None and request is transfer.decode_request), sequence_id
                assert not sample.done or sample.holds_orphan, \
                    f"{worker.worker_id} still holds ended {sequence_id}: {self.describe()}"
            reservations = [r for sequence_id, r in worker.core.requests.items()
                            if r.status is RequestStatus.TRANSFERRING
                            and cluster.samples[sequence_id].transfer is not None
                            and r is cluster.samples[sequence_id].transfer.decode_request]
            assert worker.core.num_reserved == len(reservations), self.describe()
        for transfer_id, transfer in book.open.items():
            sample = cluster.samples[transfer.sequence_id]
            assert transfer.transfer_id == transfer_id and sample.transfer is transfer
            outbox = book.outbox.get(transfer.source.info.instance_id, [])
            if transfer.state is TransferState.RESERVED:  # waits for its sender's next step
                assert transfer in outbox and sample.phase is Phase.TRANSFER, self.describe()
            else:
                assert transfer not in outbox, self.describe()
            if transfer.awaits_result:
                assert transfer in book.groups[transfer.step_id], self.describe()
            assert sample.done == (transfer.state is TransferState.ORPHANED), self.describe()
        for transfer_id, send in self.sends.items():
            if send.decode.alive:  # a result for a send to a dead worker may be ignored
                transfer = book.open.get(transfer_id)
                assert transfer is not None and transfer.awaits_result, transfer_id
        for sample in cluster.awaiting_decode:
            assert sample.phase is Phase.TRANSFER and sample.transfer is None
        for record in cluster.requests.values():
            assert all(cluster.samples.get(s.sequence_id) is s for s in record.samples)
        for sample in cluster.samples.values():
            if sample.done:
                continue
            # Wherever it is, recovered or not, its engine request is the original one: the
            # submitted prompt and parameters, and as outputs every token its client has.
            request, submitted = sample.request, self.requests[sample.parent.request_id]
            assert request.prompt_token_ids == submitted.prompt, sample.sequence_id
            assert request.params is sample.parent.params, sample.sequence_id
            assert request.output_token_ids == self.tokens(sample.parent.request_id,
                                                           sample.index), self.describe()
            if isinstance(submitted.grammar, RecordingGrammar):
                # Its one matcher, wherever it runs, has taken each of its tokens once.
                matcher = submitted.grammar.matchers[sample.index]
                assert request.grammar is matcher, sample.sequence_id
                assert matcher.accepted == request.output_token_ids, sample.sequence_id

    def assert_quiescent(self) -> None:
        """Nothing left anywhere: every block free on every worker, no record of any request."""
        cluster = self.cluster
        assert not cluster.requests and not cluster.samples, self.describe()
        assert not cluster.transfers.open and not cluster.awaiting_decode, self.describe()
        assert not cluster.transfers.groups and not cluster.transfers.dependents, self.describe()
        for worker in self.all_workers:
            core = worker.core
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, self.describe()
            assert not core.running and not core.waiting and not core.requests, self.describe()
            assert core.num_reserved == 0, self.describe()
            assert not core.kv.req_blocks, self.describe()
            if worker.alive:
                assert not self.pending_sends(worker.worker_id), self.describe()
                assert not worker.known_blocks, self.describe()


class RecordingMatcher:
    """A grammar matcher that allows every token and records the ones it is fed."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, row) -> None:
        row[:] = -1

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def valid_prefix(self, token_ids: list[int]) -> int:
        return len(token_ids)

    @property
    def is_terminated(self) -> bool:
        return False


class RecordingGrammar:
    """A compiled grammar whose matchers (one per sample, in index order) record their tokens."""

    def __init__(self) -> None:
        self.matchers: list[RecordingMatcher] = []

    def matcher(self) -> RecordingMatcher:
        self.matchers.append(RecordingMatcher())
        return self.matchers[-1]


def _num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _prompt_pages(prompt_ids: list[int], index: int) -> tuple[int, ...]:
    """The KV of block `index` of a prompt depends on every token up to the block's end."""
    return tuple(prompt_ids[:(index + 1) * BLOCK_SIZE])


def _table_indices(decode: WorkerRecord, order: SendOrder) -> tuple[int, ...]:
    """Per block the order writes, its place in its group's table on the decode worker."""
    index_of = {block.block_id: index
                for table in decode.core.kv.req_blocks[order.sequence_id]
                for index, block in enumerate(table) if block is not None}
    return tuple(index_of[block_id] for block_id in order.dst_block_ids)


def _check_pool(worker: WorkerRecord, set_aside: list[SetAside]) -> None:
    kv = worker.core.kv
    for block in kv.landing.values():  # reserved, pages not in yet: never a prefix hit
        assert block.block_hash is None and block.ref_cnt > 0, (worker.worker_id, block)
    holders: dict[int, int] = defaultdict(int)
    held = [kv.held_blocks(sequence_id) for sequence_id in kv.req_blocks]
    for blocks in [*held, *(entry.blocks for entry in set_aside),
                   *worker.core.held_for_steps]:
        for block in blocks:
            holders[block.block_id] += 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (worker.worker_id, block)
    assert sum(1 for _ in kv.pool.free_queue) == kv.num_free_blocks
    assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    assert set(kv.req_blocks) <= set(worker.core.requests), worker.worker_id


def pd_driver(prefill_blocks: int = 16, decode_blocks: int = 16, **config) -> ClusterDriver:
    return ClusterDriver([worker_info("p0", PREFILL, prefill_blocks),
                          worker_info("d0", DECODE, decode_blocks)], **config)


def colocated_driver(num_blocks: int = 16, **config) -> ClusterDriver:
    return ClusterDriver([worker_info("c0", BOTH, num_blocks)], **config)
