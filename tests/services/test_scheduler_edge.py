"""The scheduler's service edge (edge.py): protobuf in, the core's dataclasses out, and back,
field for field; a registration the core cannot take is refused with a message."""
from __future__ import annotations

import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, scheduler_pb2, worker_pb2
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.scheduler import edge
from kvrelay.scheduler.messages import (DECODE, Delta, FinishReason, NewSequence,
                                         ScheduledSequence, SendOrder, StepOrder, TokenLogprob)


def _registration(**fields) -> scheduler_pb2.RegisterWorkerRequest:
    values = dict(worker_id="d0", role=scheduler_pb2.WORKER_ROLE_DECODE, address="d0:1",
                  num_blocks=64, block_size=16, model="m", dtype="bfloat16", max_model_len=2048,
                  vocab_size=100, instance_id="d0#1", eos_token_ids=[2], kv_transports=["shm"],
                  compute_domain="boot/cpus:0,1", num_threads=2)
    values.update(fields)
    return scheduler_pb2.RegisterWorkerRequest(**values)


def test_a_registration_becomes_worker_info():
    info = edge.worker_info_from_proto(_registration())
    assert info.role is DECODE and info.eos_token_ids == (2,) and info.kv_transports == ("shm",)
    assert (info.num_blocks, info.num_threads, info.compute_domain) == (64, 2, "boot/cpus:0,1")


def test_kv_pages_go_to_the_kv_address_where_one_is_registered():
    assert edge.worker_info_from_proto(_registration()).push_address == "d0:1"
    info = edge.worker_info_from_proto(_registration(kv_address="10.0.0.7:50070"))
    assert (info.address, info.push_address) == ("d0:1", "10.0.0.7:50070")


@pytest.mark.parametrize("fields", [{"role": scheduler_pb2.WORKER_ROLE_UNSPECIFIED},
                                    {"num_blocks": 0}, {"address": ""}])
def test_a_registration_the_core_cannot_take_is_refused(fields):
    with pytest.raises(ValueError):
        edge.worker_info_from_proto(_registration(**fields))


def test_a_step_order_goes_out_field_for_field():
    send = SendOrder("r/0#1", "r/0", (1, 2), "d0:1", (5, 6), "grpc", "", True, 123, "d0#1")
    order = StepOrder(7, [NewSequence("r/0", (3, 4), SamplingParams(max_tokens=5, n=2),
                                      ((1, 2),), 0, (2,), 1, 2)],
                      [ScheduledSequence("r/0", 2, ((1, 2),)),
                       ScheduledSequence("r/1", 1, ((3,), (), (4, 5)))],
                      ["old/0"], [send], num_threads=1)
    message = edge.step_to_proto(order)
    assert message.step_id == 7 and message.num_threads == 1
    assert list(message.finished_seq_ids) == ["old/0"]
    [new] = message.new_sequences
    assert list(new.token_ids) == [3, 4] and new.params.max_tokens == 5 and new.child_index == 1
    assert list(message.scheduled[0].new_block_ids) == [1, 2]
    assert not message.scheduled[0].group_block_counts  # one KV group: no counts
    assert list(message.scheduled[1].new_block_ids) == [3, 4, 5]
    assert list(message.scheduled[1].group_block_counts) == [1, 0, 2]
    [kv] = message.kv_sends
    assert (kv.transfer_id, list(kv.dst_block_ids), kv.during_step, kv.deadline_unix_ms,
            kv.dst_instance_id) == ("r/0#1", [5, 6], True, 123, "d0#1")


def test_a_step_result_and_a_delta_cross_the_edge_with_their_logprobs():
    result = worker_pb2.StepResult(step_id=3, sampled=[
        worker_pb2.SampledToken(seq_id="r/0", token_ids=[9], logprobs=[common_pb2.TokenLogprob(
            token_id=9, logprob=-0.5, rank=1, top=[common_pb2.TopLogprob(token_id=9,
                                                                          logprob=-0.5)])]),
        worker_pb2.SampledToken(seq_id="r/1", token_ids=[4, 7, 2])])
    outcome = edge.outcome_from_proto(result)
    assert outcome.sampled[0].logprobs == (TokenLogprob(9, -0.5, 1, ((9, -0.5),)),)
    assert outcome.sampled[1].token_ids == (4, 7, 2) and outcome.sampled[1].logprobs == ()
    message = edge.delta_to_proto(Delta("r", 0, (9,), outcome.sampled[0].logprobs,
                                        FinishReason.STOP, stop_token_id=9))
    assert message.finish_reason == common_pb2.FINISH_REASON_STOP and message.stop_token_id == 9
    assert message.logprobs[0].top[0].token_id == 9
    running = edge.delta_to_proto(Delta("r", 1, (4,)))
    assert running.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert not running.HasField("stop_token_id")
