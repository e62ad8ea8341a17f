"""The worker's service edge (worker/edge.py): a step order the scheduler's edge writes arrives
as the same StepOrder, field for field; the worker's outcome and send results read back on the
scheduler's side as they were; the KvTransfer servicer hands chunks over as PageChunks."""
from __future__ import annotations

import asyncio

from kvrelay.api.kvrelay.v1 import kv_transfer_pb2, worker_pb2
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.scheduler import edge as scheduler_edge
from kvrelay.step_messages import (NewSequence, Sampled, ScheduledSequence, SendOrder,
                                   SendResult, StepOrder, StepOutcome, TokenLogprob)
from kvrelay.worker import edge
from kvrelay.worker.kv_connector import KvReceiver, KvTransferService, PageChunk
from kvrelay.worker.kv_connector.grpc_transport import chunk_from_proto


def _order() -> StepOrder:
    send = SendOrder("r/0#1", "r/0", (1, 2), "d0:1", (5, 6), "shm", "/dev/shm/d0.kv", True,
                     123, "d0#1")
    params = SamplingParams(max_tokens=5, n=2, seed=7, temperature=0.5, logprobs=2)
    # block tables of two KV groups (a full one and a window one: kv_groups.py), and of one
    return StepOrder(7, [NewSequence("r/0", (3, 4, 8), params, ((1, 2), (5,)), 1, (2,), 1, 2),
                         NewSequence("r/1", (3,), params, ((6,),), 0, (2,), 0, 1)],
                     [ScheduledSequence("r/0", 2, ((1,), (2, 3)), b"\x01\x00\x00\x00", (9,),
                                        (4,)),
                      ScheduledSequence("r/1", 1, ((),))],
                     ["old/0"], [send], num_threads=3)


def test_a_step_order_arrives_as_it_was_sent():
    assert edge.step_from_proto(scheduler_edge.step_to_proto(_order())) == _order()


def test_a_new_sequence_without_a_prompt_length_is_all_prompt():
    message = worker_pb2.StepRequest(step_id=1, new_sequences=[
        worker_pb2.NewSequence(seq_id="r/0", token_ids=[3, 4, 5])])
    [new] = edge.step_from_proto(message).new_sequences
    assert new.num_prompt_tokens == 3 and new.token_ids == (3, 4, 5)


def test_an_outcome_and_a_send_result_read_back_as_they_were():
    outcome = StepOutcome(7, (Sampled("r/0", (9, 4), (TokenLogprob(9, -0.5, 1, ((9, -0.5),)),
                                                       TokenLogprob(4, -1.5, 2, ((1, -0.25),
                                                                                 (4, -1.5))))),
                              Sampled("r/1", (3,))))
    back = scheduler_edge.outcome_from_proto(edge.outcome_to_proto(outcome))
    assert back == outcome
    message = edge.send_result_to_proto(SendResult("r/0#1", True, num_bytes=4096, seconds=0.25))
    assert message.step_id == 0 and not message.sampled
    [result] = message.kv_sends
    assert (result.transfer_id, result.ok, result.num_bytes, result.seconds) == (
        "r/0#1", True, 4096, 0.25)
    assert scheduler_edge.send_results_from_proto(message)[0].transfer_id == "r/0#1"


def test_a_kv_chunk_reaches_the_receiver_as_a_page_chunk():
    message = kv_transfer_pb2.KvChunk(transfer_id="t1", layer=2, dst_block_ids=[4, 5],
                                      keys=b"kk", values=b"vv", dtype="bfloat16",
                                      deadline_unix_ms=99, dst_instance_id="d0#1", last=True)
    assert chunk_from_proto(message) == PageChunk("t1", 2, (4, 5), b"kk", b"vv", "bfloat16", 99,
                                                  "d0#1", True)


def test_the_kv_transfer_servicer_answers_a_push_to_a_loading_worker():
    async def chunks():
        yield kv_transfer_pb2.KvChunk(transfer_id="t1", last=True)

    ack = asyncio.run(KvTransferService(KvReceiver()).Push(chunks(), None))
    assert not ack.ok and "loading" in ack.error
