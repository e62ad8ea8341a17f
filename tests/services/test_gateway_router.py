"""The gateway's output path on a real tokenizer service: scheduler deltas (given here as the
protobuf batches the scheduler sends) -> one Detokenize stream -> each request's SampleDeltas,
with stop strings, per-sample aborts, logprob pieces, and no detokenizer state left behind."""
from __future__ import annotations

import asyncio

import grpc

from services.api.kvrelay.v1 import common_pb2, scheduler_pb2, tokenizer_pb2_grpc
from services.engine.sampling_params import SamplingParams
from services.gateway.detokenize_pipeline import DetokenizePipeline, queue_sender
from services.gateway.request_state import RequestState
from services.gateway.router import OutputRouter

OPEN_STATES = "kvrelay:tokenizer_detokenize_states"
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class Harness:
    """OutputRouter + DetokenizePipeline wired as GatewayCore wires them; aborts recorded."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.aborted: list[str] = []
        outbox: asyncio.Queue = asyncio.Queue()
        self.router = OutputRouter(self.aborted.extend, queue_sender(outbox))
        self.pipeline = DetokenizePipeline(tokenizer_pb2_grpc.TokenizerStub(self.channel),
                                           outbox, self.router.on_detokenized,
                                           self.router.fail_all)
        self.task = asyncio.create_task(self.pipeline.run())

    def add(self, request_id: str, params: SamplingParams) -> tuple[RequestState, asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        state = RequestState(request_id, 0, [1, 2, 3], params, queue)
        self.router.add(state)
        return state, queue

    async def close(self) -> None:
        while not self.pipeline.outbox.empty():  # let forget items reach the tokenizer
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        self.task.cancel()
        await self.channel.close()


def delta(request_id, index, token_ids, finish=0, **fields) -> scheduler_pb2.SequenceDelta:
    return scheduler_pb2.SequenceDelta(request_id=request_id, index=index,
                                       new_token_ids=token_ids, finish_reason=finish, **fields)


async def drain(queue: asyncio.Queue, num_samples: int) -> dict[int, list]:
    by_sample: dict[int, list] = {}
    while num_samples:
        _, deltas = await asyncio.wait_for(queue.get(), 10)
        for d in deltas:
            by_sample.setdefault(d.index, []).append(d)
            num_samples -= d.finish_reason is not None
    return by_sample


def test_stop_string_ends_one_sample_and_aborts_only_it(tokenizer_service, tokenizer):
    first = tokenizer.encode("The capital of France is Paris. It is lovely.")
    second = tokenizer.encode("你好，世界！🚀")

    async def scenario():
        harness = Harness(tokenizer_service.address)
        state, queue = harness.add("r1", SamplingParams(n=2, stop=["Paris"], max_tokens=64))
        for step in range(max(len(first), len(second))):  # one batch per engine step
            deltas = [delta("r1", 0, first[step:step + 1])] if step < len(first) else []
            if step < len(second):
                deltas.append(delta("r1", 1, second[step:step + 1],
                                    LENGTH if step == len(second) - 1 else 0))
            harness.router.route(scheduler_pb2.OutputBatch(deltas=deltas))
            await asyncio.sleep(0.002)  # deltas keep coming while answers are in flight
        by_sample = await drain(queue, 2)
        open_states = await wait_for_metric(tokenizer_service, OPEN_STATES, 0)
        await harness.close()
        return state, by_sample, harness, open_states

    state, by_sample, harness, open_states = asyncio.run(scenario())
    stopped, full = by_sample[0], by_sample[1]
    assert "".join(d.text for d in stopped) == "The capital of France is "
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", "Paris")
    paris_done = next(k for k in range(1, len(first) + 1)
                      if "Paris" in tokenizer.decode(first[:k]))
    assert state.samples[0].num_tokens == paris_done  # through the token completing "Paris"
    assert harness.aborted == ["r1/0"]
    assert "".join(d.text for d in full) == "你好，世界！🚀"
    assert full[-1].finish_reason == "length" and state.samples[1].num_tokens == len(second)
    assert "r1" not in harness.router.requests
    assert open_states == 0  # the stopped sample's state was freed, not left to the stream's end


def test_logprob_pieces_and_stop_token_reason(tokenizer_service, tokenizer):
    ids = tokenizer.encode("Hi 🚀")
    eos = tokenizer.eos_token_id
    logprobs = [common_pb2.TokenLogprob(token_id=t, logprob=-0.5, rank=1,
                                        top=[common_pb2.TopLogprob(token_id=ids[0], logprob=-1)])
                for t in ids]

    async def scenario():
        harness = Harness(tokenizer_service.address)
        _, queue = harness.add("r2", SamplingParams(logprobs=1, stop_token_ids=[eos]))
        harness.router.route(scheduler_pb2.OutputBatch(deltas=[delta(
            "r2", 0, ids, STOP, logprobs=logprobs, stop_token_id=eos)]))
        by_sample = await drain(queue, 1)
        await harness.close()
        return by_sample[0]

    [result] = asyncio.run(scenario())
    pieces = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(ids)]
    assert [entry.text for entry in result.logprobs] == pieces
    assert [entry.top[0].text for entry in result.logprobs] == [pieces[0]] * len(ids)
    assert (result.text, result.finish_reason, result.stop_reason) == ("Hi 🚀", "stop", eos)


def test_dropped_request_frees_its_tokenizer_state(tokenizer_service, tokenizer):
    ids = tokenizer.encode("A story that the client stops reading")

    async def scenario():
        harness = Harness(tokenizer_service.address)
        _, queue = harness.add("r3", SamplingParams(n=2))
        harness.router.route(scheduler_pb2.OutputBatch(
            deltas=[delta("r3", i, ids[:3]) for i in range(2)]))
        await asyncio.wait_for(queue.get(), 10)
        open_while_running = tokenizer_service.metric(OPEN_STATES)
        harness.router.drop("r3")  # the client left; later deltas must be ignored
        harness.router.route(scheduler_pb2.OutputBatch(deltas=[delta("r3", 0, ids[3:5])]))
        # Freed while the stream stays open (closing it would free everything anyway).
        open_after_drop = await wait_for_metric(tokenizer_service, OPEN_STATES, 0)
        await harness.close()
        return open_while_running, open_after_drop, queue

    open_while_running, open_after_drop, queue = asyncio.run(scenario())
    assert (open_while_running, open_after_drop) == (2, 0)
    assert queue.empty()


async def wait_for_metric(service, name: str, value: float, timeout: float = 3.0) -> float:
    deadline = asyncio.get_running_loop().time() + timeout
    while (current := service.metric(name)) != value \
            and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return current
