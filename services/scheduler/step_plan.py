"""One worker's step: the engine core's schedule turned into a StepRequest (full state for
sequences new to the worker, only what changed for the rest), and the StepResult applied back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from services.api.kvrelay.v1 import worker_pb2
from services.engine.scheduler import ScheduledRequest, SchedulerOutput
from services.scheduler import handoff
from services.scheduler.deltas import token_delta
from services.scheduler.records import PREFILL, Phase, WorkerRecord

_step_ids = itertools.count(1)  # 0 marks results that are not a step's (KV send results)


@dataclass(slots=True)
class StepPlan:
    message: worker_pb2.StepRequest
    output: SchedulerOutput
    num_sends: int = 0
    first_tokens: list[str] = field(default_factory=list)


def plan_step(cluster, worker: WorkerRecord) -> StepPlan | None:
    output = worker.core.schedule(cluster.step_budget(worker),
                                  decodes_elsewhere=cluster.shares_compute_with_decodes(worker))
    for request in output.preempted:  # recomputed later: the worker gets it anew then
        cluster.forget_on(worker, request.request_id)
    message = worker_pb2.StepRequest(step_id=next(_step_ids), finished_seq_ids=worker.forget)
    worker.forget = []
    for item in output.scheduled:
        _add_item(cluster, worker, message, item)
    message.kv_sends.extend(worker.pending_sends)
    worker.pending_sends = []
    handoff.share_pushes(cluster, message.kv_sends)
    for order in message.kv_sends:
        sample = cluster.transfers[order.transfer_id]
        sample.send_in_flight, sample.send_step = True, message.step_id
    if not message.scheduled and not message.kv_sends:
        worker.forget = list(message.finished_seq_ids)  # nothing to run: keep them for later
        return None
    return StepPlan(message, output, len(message.kv_sends))


def _add_item(cluster, worker: WorkerRecord, message: worker_pb2.StepRequest,
              item: ScheduledRequest) -> None:
    request = item.request
    seq_id = request.request_id
    known = worker.known_blocks.get(seq_id)
    if known is None:
        sample = cluster.samples[seq_id]
        message.new_sequences.append(worker_pb2.NewSequence(
            seq_id=seq_id, token_ids=request.all_token_ids, params=sample.parent.params,
            block_ids=item.block_ids, num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=request.eos_token_ids, child_index=sample.index,
            num_prompt_tokens=request.num_prompt_tokens))
        known = len(item.block_ids)
    message.scheduled.append(worker_pb2.ScheduledSequence(
        seq_id=seq_id, num_new_tokens=item.num_new_tokens, new_block_ids=item.block_ids[known:]))
    worker.known_blocks[seq_id] = len(item.block_ids)
    if worker.role == PREFILL and item.samples:
        sample = cluster.samples[seq_id]
        order = handoff.reserve(cluster, sample, during_step=True)
        if order is not None:  # the pages go out layer by layer during this very step
            message.kv_sends.append(order)


def apply_result(cluster, worker: WorkerRecord, plan: StepPlan,
                 result: worker_pb2.StepResult) -> None:
    sampled = {token.seq_id: token for token in result.sampled}
    token_ids = {seq_id: token.token_id for seq_id, token in sampled.items()}
    worker.core.update_from_output(plan.output, token_ids)
    for item in plan.output.scheduled:
        token = sampled.get(item.request.request_id)
        sample = cluster.samples.get(item.request.request_id)
        if token is None or sample is None or sample.phase is Phase.DONE:
            continue
        logprobs = [token.logprob] if token.HasField("logprob") else []
        delta = token_delta(sample, item.request, 1, logprobs)
        if item.request.is_finished:
            cluster.end_sample(sample, delta)
            continue
        cluster.sink.emit(sample.parent.gateway_id, delta)
        if sample.phase is Phase.PREFILL:
            handoff.after_first_token(cluster, sample)
