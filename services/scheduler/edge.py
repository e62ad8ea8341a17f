"""The scheduler's service edge: protobuf messages to the core's dataclasses (messages.py) and
back. Nothing past this module (and the gRPC handlers that call it) sees a `_pb2` type."""
from __future__ import annotations

from kvrelay.api.kvrelay.v1 import common_pb2, scheduler_pb2, worker_pb2
from kvrelay.scheduler.messages import (Delta, FinishReason, NewSequence, Pooled,
                                         PromptLogprobs, Role, Sampled, ScheduledSequence, SendOrder,
                                         SendResult, StepOrder, StepOutcome, TokenLogprob,
                                         WorkerInfo)
from kvrelay.wire import group_tables_to_wire, params_to_proto, token_logprob_to_proto

ROLES = {scheduler_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
         scheduler_pb2.WORKER_ROLE_DECODE: Role.DECODE,
         scheduler_pb2.WORKER_ROLE_BOTH: Role.BOTH}
ROLE_TO_PROTO = {role: value for value, role in ROLES.items()}
FINISH_REASON_TO_PROTO = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
                          FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
                          FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
                          FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR}


# ---- registration -------------------------------------------------------------------------------
def worker_info_from_proto(message: scheduler_pb2.RegisterWorkerRequest) -> WorkerInfo:
    """Raises ValueError for a registration the core cannot take."""
    if message.role not in ROLES:
        raise ValueError(f"worker {message.worker_id!r} registered without a role")
    if not message.worker_id or not message.address or not message.num_blocks \
            or not message.block_size:
        raise ValueError("a worker registers with an id, an address, a block count and a "
                         "block size")
    return WorkerInfo(
        worker_id=message.worker_id, role=ROLES[message.role], address=message.address,
        kv_address=message.kv_address,
        num_blocks=message.num_blocks, block_size=message.block_size, model=message.model,
        dtype=message.dtype, max_model_len=message.max_model_len,
        vocab_size=message.vocab_size, instance_id=message.instance_id,
        eos_token_ids=tuple(message.eos_token_ids),
        kv_transports=tuple(message.kv_transports), host_id=message.host_id,
        shm_path=message.shm_path, compute_domain=message.compute_domain,
        attention_crossover=message.attention_crossover, num_threads=message.num_threads,
        kv_group_windows=tuple(message.kv_group_windows) or (0,),
        kv_cache_dtype=message.kv_cache_dtype or message.dtype,
        max_loras=message.max_loras, max_lora_rank=message.max_lora_rank,
        tensor_parallel_size=max(1, message.tensor_parallel_size),
        pipeline_parallel_size=max(1, message.pipeline_parallel_size))


# ---- steps --------------------------------------------------------------------------------------
def step_to_proto(order: StepOrder) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=order.step_id,
        new_sequences=[_new_sequence_to_proto(seq) for seq in order.new_sequences],
        scheduled=[_scheduled_to_proto(item) for item in order.scheduled],
        finished_seq_ids=order.finished_sequence_ids,
        kv_sends=[send_order_to_proto(send) for send in order.kv_sends],
        num_threads=order.num_threads)


def _scheduled_to_proto(item: ScheduledSequence) -> worker_pb2.ScheduledSequence:
    block_ids, counts = group_tables_to_wire(item.new_block_ids)
    return worker_pb2.ScheduledSequence(
        seq_id=item.sequence_id, num_new_tokens=item.num_new_tokens, new_block_ids=block_ids,
        group_block_counts=counts, token_bitmask=item.token_bitmask,
        draft_token_ids=item.draft_token_ids, new_token_ids=item.new_token_ids)


def _new_sequence_to_proto(seq: NewSequence) -> worker_pb2.NewSequence:
    block_ids, counts = group_tables_to_wire(seq.block_ids)
    return worker_pb2.NewSequence(
        seq_id=seq.sequence_id, token_ids=seq.token_ids, params=params_to_proto(seq.params),
        block_ids=block_ids, group_block_counts=counts,
        num_computed_tokens=seq.num_computed_tokens,
        eos_token_ids=seq.eos_token_ids, child_index=seq.child_index,
        num_prompt_tokens=seq.num_prompt_tokens, adapter_id=seq.adapter_id)


def send_order_to_proto(order: SendOrder) -> worker_pb2.KvSendOrder:
    return worker_pb2.KvSendOrder(
        transfer_id=order.transfer_id, seq_id=order.sequence_id, src_block_ids=order.src_block_ids,
        dst_address=order.dst_address, dst_block_ids=order.dst_block_ids,
        transport=order.transport, dst_shm_path=order.dst_shm_path,
        during_step=order.during_step, deadline_unix_ms=order.deadline_unix_ms,
        dst_instance_id=order.dst_instance_id, dst_kv_shards=order.dst_kv_shards)


def outcome_from_proto(message: worker_pb2.StepResult) -> StepOutcome:
    return StepOutcome(step_id=message.step_id, sampled=tuple(
        Sampled(token.seq_id, tuple(token.token_ids),
                tuple(_logprob_from_proto(entry) for entry in token.logprobs))
        for token in message.sampled), prompt_logprobs=tuple(
        PromptLogprobs(chunk.seq_id, chunk.first_position,
                       tuple(_logprob_from_proto(entry) for entry in chunk.entries))
        for chunk in message.prompt_logprobs), pooled=tuple(
        Pooled(pooled.seq_id, tuple(pooled.values)) for pooled in message.pooled))


def send_results_from_proto(message: worker_pb2.StepResult) -> list[SendResult]:
    return [SendResult(send.transfer_id, send.ok, send.error) for send in message.kv_sends]


def _logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(message.token_id, message.logprob, message.rank,
                        tuple((top.token_id, top.logprob) for top in message.top))


# ---- outputs ------------------------------------------------------------------------------------
def delta_to_proto(delta: Delta) -> scheduler_pb2.SequenceDelta:
    message = scheduler_pb2.SequenceDelta(
        request_id=delta.request_id, index=delta.index, new_token_ids=delta.new_token_ids,
        logprobs=[token_logprob_to_proto(entry) for entry in delta.logprobs], error=delta.error,
        num_cached_prompt_tokens=delta.num_cached_prompt_tokens)
    if delta.prompt_logprobs:
        message.prompt_logprobs.extend(token_logprob_to_proto(entry)
                                       for entry in delta.prompt_logprobs)
    if delta.embedding:
        message.embedding.extend(delta.embedding)
    if delta.finish_reason is not None:
        message.finish_reason = FINISH_REASON_TO_PROTO[delta.finish_reason]
    if delta.stop_token_id is not None:
        message.stop_token_id = delta.stop_token_id
    return message


# ---- LoRA adapters ------------------------------------------------------------------------------
def adapter_stats_to_proto(names: dict[int, str],
                           use: dict[int, tuple[int, int]]) -> list[scheduler_pb2.AdapterInfo]:
    return [scheduler_pb2.AdapterInfo(name=name, adapter_id=adapter_id,
                                      num_running=use.get(adapter_id, (0, 0))[0],
                                      num_waiting=use.get(adapter_id, (0, 0))[1])
            for adapter_id, name in names.items()]
