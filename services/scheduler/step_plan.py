"""One worker's step: the engine core's schedule turned into a StepOrder (full state for
sequences new to the worker, only what changed for the rest, the KV sends it carries), and the
worker's StepOutcome applied back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvrelay.engine.scheduler import ScheduledRequest, SchedulerOutput
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


def plan_step(cluster: ClusterScheduler, worker: WorkerRecord) -> StepPlan | None:
    registry = cluster.registry
    output = worker.core.schedule(registry.step_budget(worker),
                                  decodes_elsewhere=registry.shares_compute_with_decodes(worker))
    for request in output.preempted:  # recomputed later: the worker gets it anew then
        cluster.forget_on(worker, request.request_id)
    return _order(cluster, worker, output)


def plan_ahead(cluster: ClusterScheduler, worker: WorkerRecord,
               previous: StepPlan) -> StepPlan | None:
    """The step after `previous`, planned and sent while it runs, so the worker starts it as
    soon as `previous` is done instead of after a round trip through here (the scheduler's
    apply and plan, two messages): a batch of plain decodes only (Scheduler.schedule_ahead).
    A prefill worker's steps end in a handoff, and never continue this way."""
    if worker.role is PREFILL or previous.order.kv_sends:
        return None
    output = worker.core.schedule_ahead(previous.output, cluster.registry.step_budget(worker))
    return None if output is None else _order(cluster, worker, output, ahead=True)


def _order(cluster: ClusterScheduler, worker: WorkerRecord, output: SchedulerOutput,
           ahead: bool = False) -> StepPlan | None:
    order = StepOrder(step_id=next(_step_ids), finished_seq_ids=worker.forget)
    worker.forget = []
    sends: list[Transfer] = []
    for item in output.scheduled:
        transfer = _add_item(cluster, worker, order, item)
        if transfer is not None:  # the pages go out layer by layer during this very step
            sends.append(transfer)
    sends.extend(cluster.transfers.take_outgoing(worker))
    order.kv_sends = cluster.transfers.send(sends, order.step_id)
    if not order.scheduled and not order.kv_sends:
        worker.forget = order.finished_seq_ids  # nothing to run: keep them for later
        return None
    worker.core.begin_step(output)
    return StepPlan(order, output, ahead)


def _add_item(cluster: ClusterScheduler, worker: WorkerRecord, order: StepOrder,
              item: ScheduledRequest) -> Transfer | None:
    """Adds the item to the order; the transfer this step carries for it, if any."""
    request = item.request
    seq_id = request.request_id
    known = worker.known_blocks.get(seq_id)
    if known is None:
        sample = cluster.samples[seq_id]
        order.new_sequences.append(NewSequence(
            seq_id=seq_id, token_ids=tuple(request.all_token_ids), params=sample.parent.params,
            block_ids=tuple(item.block_ids), num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=tuple(request.eos_token_ids), child_index=sample.index,
            num_prompt_tokens=request.num_prompt_tokens))
        known = len(item.block_ids)
    bitmask = b""
    if item.samples and request.grammar is not None:  # the matcher's state after its last token
        bitmask = step_bitmasks(request.grammar, item.draft_token_ids,
                                worker.info.vocab_size).tobytes()
    order.scheduled.append(ScheduledSequence(seq_id, item.num_new_tokens,
                                             tuple(item.block_ids[known:]), bitmask,
                                             tuple(item.draft_token_ids)))
    worker.known_blocks[seq_id] = len(item.block_ids)
    if worker.role is PREFILL and item.samples:
        return cluster.reserve_decode(cluster.samples[seq_id], during_step=True)
    return None


def apply_result(cluster: ClusterScheduler, worker: WorkerRecord, plan: StepPlan,
                 outcome: StepOutcome) -> int:
    """Returns how many tokens the step added to its sequences (a step planned ahead computes
    sequences that ended meanwhile: their tokens are dropped)."""
    num_emitted = 0
    sampled = {token.seq_id: token for token in outcome.sampled}
    num_before = {item.request.request_id: item.request.num_output_tokens
                  for item in plan.output.scheduled}
    worker.core.update_from_output(
        plan.output, {seq_id: list(token.token_ids) for seq_id, token in sampled.items()})
    for item in plan.output.scheduled:
        request = item.request
        token = sampled.get(request.request_id)
        sample = cluster.samples.get(request.request_id)
        # (a sample recovered while this step ran lives on in another engine request)
        if token is None or sample is None or sample.done or sample.request is not request:
            continue
        # fewer than the step emitted where a stop came inside an accepted run
        num_new = request.num_output_tokens - num_before[request.request_id]
        if num_new <= 0:
            continue
        num_emitted += num_new
        *leading, delta = token_deltas(sample, request, num_new, token.logprobs[:num_new])
        for earlier in leading:
            cluster.sink.emit(sample.parent.gateway_id, earlier)
        if request.is_finished:
            cluster.end_sample(sample, delta)
            continue
        cluster.sink.emit(sample.parent.gateway_id, delta)
        if sample.phase is Phase.PREFILL:
            cluster.after_first_token(sample)
    return num_emitted
