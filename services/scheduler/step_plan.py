"""One worker's step: the engine core's schedule turned into a StepOrder (full state for
sequences new to the worker, only what changed for the rest, the KV sends it carries), and the
worker's StepOutcome applied back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvrelay.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvrelay.engine.step_outputs import apply_step_outputs
from kvrelay.engine.structured.backend import step_bitmasks
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.deltas import token_deltas
from kvrelay.scheduler.messages import (PREFILL, NewSequence, ScheduledSequence, StepOrder,
                                         StepOutcome)
from kvrelay.scheduler.records import Phase
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.transfers import Transfer

_step_ids = itertools.count(1)  # 0 marks results that are not a step's (KV send results)


@dataclass(slots=True)
class StepPlan:
    order: StepOrder
    output: SchedulerOutput  # what the worker's engine core scheduled
    ahead: bool = False  # planned while the step before it ran (async scheduling)


class StepPlanner:
    """One worker's steps: its engine core's schedule turned into a StepOrder, and the
    StepOutcome applied back to the cluster's samples. The worker's link owns it."""

    def __init__(self, cluster: ClusterScheduler, worker: WorkerRecord) -> None:
        self.cluster = cluster
        self.worker = worker

    def plan(self) -> StepPlan | None:
        worker = self.worker
        registry = self.cluster.registry
        output = worker.core.schedule(
            registry.step_budget(worker),
            decodes_elsewhere=registry.decodes_sharing_compute(worker),
            pipeline_depth=worker.info.pipeline_parallel_size)
        for request in output.preempted:  # recomputed later: the worker gets it anew then
            self.cluster.forget_on(worker, request.sequence_id)
        return self._order(output)

    def plan_ahead(self, previous: StepPlan) -> StepPlan | None:
        """The step after `previous`, planned and sent while it runs, so the worker starts it as
        soon as `previous` is done instead of after a round trip through here (the scheduler's
        apply and plan, two messages): a batch of plain decodes only (Scheduler.schedule_ahead).
        A prefill worker's steps end in a handoff, and never continue this way."""
        worker = self.worker
        if worker.role is PREFILL or previous.order.kv_sends:
            return None
        output = worker.core.schedule_ahead(previous.output,
                                            self.cluster.registry.step_budget(worker))
        return None if output is None else self._order(output, ahead=True)

    def _order(self, output: SchedulerOutput, ahead: bool = False) -> StepPlan | None:
        worker = self.worker
        order = StepOrder(step_id=next(_step_ids), finished_sequence_ids=worker.forget)
        worker.forget = []
        sends: list[Transfer] = []
        for item in output.scheduled:
            transfer = self._add_item(order, item)
            if transfer is not None:  # the pages go out layer by layer during this very step
                sends.append(transfer)
        transfers = self.cluster.transfers
        sends.extend(transfers.take_outgoing(worker))
        order.kv_sends = transfers.send(sends, order.step_id)
        if not order.scheduled and not order.kv_sends:
            worker.forget = order.finished_sequence_ids  # nothing to run: keep them for later
            return None
        worker.core.begin_step(output)
        return StepPlan(order, output, ahead)

    def _add_item(self, order: StepOrder, item: ScheduledRequest) -> Transfer | None:
        """Adds the item to the order; the transfer this step carries for it, if any."""
        worker = self.worker
        request = item.request
        sequence_id = request.sequence_id
        known = worker.known_blocks.get(sequence_id)
        if known is None:
            sample = self.cluster.samples[sequence_id]
            order.new_sequences.append(NewSequence(
                sequence_id=sequence_id, token_ids=tuple(request.all_token_ids),
                params=sample.parent.params,
                block_ids=tuple(tuple(table) for table in item.block_ids),
                num_computed_tokens=request.num_computed_tokens,
                eos_token_ids=tuple(request.eos_token_ids), child_index=sample.index,
                num_prompt_tokens=request.num_prompt_tokens, adapter_id=request.adapter_id))
            known = [len(table) for table in item.block_ids]
        bitmask = b""
        if item.samples and request.grammar is not None:
            # the allowed tokens in the matcher's state after its last token
            bitmask = step_bitmasks(request.grammar, item.draft_token_ids,
                                    worker.info.vocab_size).tobytes()
        # per KV group, the entries the worker has not seen (the ones it has keep their ids:
        # those a window group freed since are never read)
        new_block_ids = tuple(tuple(table[count:])
                              for table, count in zip(item.block_ids, known))
        order.scheduled.append(ScheduledSequence(sequence_id, item.num_new_tokens,
                                                 new_block_ids, bitmask,
                                                 tuple(item.draft_token_ids)))
        worker.known_blocks[sequence_id] = [len(table) for table in item.block_ids]
        # (a sample that ends with the token this step samples, by length, needs no decode
        # worker: an embedding, a one-token request)
        if worker.role is PREFILL and item.samples \
                and not worker.core.ends_after_next_token(request):
            return self.cluster.reserve_decode(self.cluster.samples[sequence_id], during_step=True)
        return None

    def apply(self, plan: StepPlan, outcome: StepOutcome) -> int:
        """Returns how many tokens the step added to its sequences (a step planned ahead
        computes sequences that ended meanwhile: their tokens are dropped)."""
        cluster, worker = self.cluster, self.worker
        sampled = {token.sequence_id: list(token.token_ids) for token in outcome.sampled}
        logprobs = {token.sequence_id: token.logprobs for token in outcome.sampled}
        if outcome.prompt_logprobs or outcome.pooled:
            requests = {item.request.sequence_id: item.request for item in plan.output.scheduled}
            for chunk in outcome.prompt_logprobs:
                request = requests.get(chunk.sequence_id)
                if request is not None and request.prompt_logprobs is not None:
                    request.add_prompt_logprobs(chunk.first_position, chunk.entries)
            for pooled in outcome.pooled:
                if pooled.sequence_id in requests:
                    requests[pooled.sequence_id].embedding = pooled.values
        num_emitted = 0
        for update in apply_step_outputs(worker.core, plan.output, sampled, logprobs):
            request = update.request
            sample = cluster.samples.get(request.sequence_id)
            # (a sample recovered while this step ran lives on in another engine request)
            if sample is None or sample.done or sample.request is not request:
                continue
            num_emitted += len(update.new_token_ids)
            *leading, delta = token_deltas(sample, update)
            for earlier in leading:
                cluster.sink.emit(sample.parent.gateway_id, earlier)
            if update.finished:
                cluster.end_sample(sample, delta)
                continue
            cluster.sink.emit(sample.parent.gateway_id, delta)
            if sample.phase is Phase.PREFILL:
                cluster.after_first_token(sample)
        return num_emitted
