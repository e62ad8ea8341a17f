"""The worker's service edge: worker.proto's step messages to the step protocol's dataclasses
(kvrelay.step_messages) and back, once per message. Past this module, the gRPC servicers that
call it and the gRPC KV transport's wire code, nothing in the worker sees a `_pb2` type."""
from __future__ import annotations

from kvrelay.api.kvrelay.v1 import worker_pb2
from kvrelay.step_messages import (NewSequence, Sampled, ScheduledSequence, SendOrder,
                                   SendResult, StepOrder, StepOutcome)
from kvrelay.wire import group_tables_from_wire, params_from_proto, token_logprob_to_proto


# ---- orders -------------------------------------------------------------------------------------
def step_from_proto(message: worker_pb2.StepRequest) -> StepOrder:
    """Raises ValueError for a new sequence's invalid sampling params. A decode step is
    mostly its scheduled rows: one small dataclass each, their (short) id lists copied once."""
    return StepOrder(
        step_id=message.step_id,
        new_sequences=[_new_sequence_from_proto(new) for new in message.new_sequences],
        scheduled=[ScheduledSequence(item.seq_id, item.num_new_tokens,
                                     group_tables_from_wire(item.new_block_ids,
                                                            item.group_block_counts),
                                     item.token_bitmask,
                                     tuple(item.draft_token_ids), tuple(item.new_token_ids))
                   for item in message.scheduled],
        finished_sequence_ids=list(message.finished_seq_ids),
        kv_sends=[send_order_from_proto(order) for order in message.kv_sends],
        num_threads=message.num_threads)


def _new_sequence_from_proto(message: worker_pb2.NewSequence) -> NewSequence:
    return NewSequence(
        sequence_id=message.seq_id, token_ids=tuple(message.token_ids),
        params=params_from_proto(message.params),
        block_ids=group_tables_from_wire(message.block_ids, message.group_block_counts),
        num_computed_tokens=message.num_computed_tokens,
        eos_token_ids=tuple(message.eos_token_ids), child_index=message.child_index,
        # unset (0) on the wire: every token is the prompt's
        num_prompt_tokens=message.num_prompt_tokens or len(message.token_ids),
        adapter_id=message.adapter_id)


def send_order_from_proto(message: worker_pb2.KvSendOrder) -> SendOrder:
    return SendOrder(
        transfer_id=message.transfer_id, sequence_id=message.seq_id,
        src_block_ids=tuple(message.src_block_ids), dst_address=message.dst_address,
        dst_block_ids=tuple(message.dst_block_ids), transport=message.transport,
        dst_shm_path=message.dst_shm_path, during_step=message.during_step,
        deadline_unix_ms=message.deadline_unix_ms, dst_instance_id=message.dst_instance_id,
        dst_kv_shards=max(1, message.dst_kv_shards))


# ---- results ------------------------------------------------------------------------------------
def outcome_to_proto(outcome: StepOutcome) -> worker_pb2.StepResult:
    message = worker_pb2.StepResult(step_id=outcome.step_id,
                                    sampled=[_sampled_to_proto(item) for item in outcome.sampled])
    for chunk in outcome.prompt_logprobs:
        message.prompt_logprobs.add(
            seq_id=chunk.sequence_id, first_position=chunk.first_position,
            entries=[token_logprob_to_proto(entry) for entry in chunk.entries])
    for pooled in outcome.pooled:
        message.pooled.add(seq_id=pooled.sequence_id, values=pooled.values)
    return message


def _sampled_to_proto(sampled: Sampled) -> worker_pb2.SampledToken:
    message = worker_pb2.SampledToken(seq_id=sampled.sequence_id, token_ids=sampled.token_ids)
    if sampled.logprobs:  # most steps have none: no list to build then
        message.logprobs.extend(token_logprob_to_proto(entry) for entry in sampled.logprobs)
    return message


def send_result_to_proto(result: SendResult) -> worker_pb2.StepResult:
    """A send's result goes up the step stream on its own, as step 0."""
    return worker_pb2.StepResult(step_id=0, kv_sends=[worker_pb2.KvSendResult(
        transfer_id=result.transfer_id, ok=result.ok, error=result.error,
        num_bytes=result.num_bytes, seconds=result.seconds)])
