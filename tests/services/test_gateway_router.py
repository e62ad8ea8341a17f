"""The gateway's output path on a real tokenizer service: scheduler deltas (given here as the
protobuf batches the scheduler sends, through the gateway's edge) -> one Detokenize stream ->
each request's SampleDeltas, with stop strings, per-sample aborts, logprob pieces, and no
detokenizer state left behind; and when that stream breaks (a cut connection through a proxy):
the text goes on exactly, or, with no tokenizer back in time, the requests end with an error and
are aborted."""
from __future__ import annotations

import asyncio

from kvrelay.api.kvrelay.v1 import common_pb2, scheduler_pb2
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway.detokenize_pipeline import DetokenizePipeline, queue_sender
from kvrelay.gateway.edge import output_deltas
from kvrelay.gateway.request_state import RequestState
from kvrelay.gateway.router import OutputRouter
from kvrelay.gateway.upstream import Upstream
from tests.services.tcp_proxy import TcpProxy

OPEN_STATES = "kvrelay:tokenizer_detokenize_states"
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class Harness:
    """OutputRouter + DetokenizePipeline wired as GatewayCore wires them, the scheduler's batches
    converted by the gateway's edge; aborts recorded."""

    def __init__(self, address: str, wait_s: float = 30.0) -> None:
        self.upstream = Upstream(address, [])
        self.aborted: list[str] = []
        outbox: asyncio.Queue = asyncio.Queue()
        self.router = OutputRouter(lambda scheduler, ids: self.aborted.extend(ids),
                                   queue_sender(outbox))
        self.pipeline = DetokenizePipeline(self.upstream.open_detokenize,
                                           outbox, self.router.on_detokenized,
                                           lambda message: self.router.fail_all(message, False),
                                           self.router.resume_items, wait_s)
        self.task = asyncio.create_task(self.pipeline.run())

    def add(self, request_id: str, params: SamplingParams) -> tuple[RequestState, asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        state = RequestState(request_id, 0, [1, 2, 3], params, queue)
        self.router.add(state)
        return state, queue

    def route(self, deltas: list[scheduler_pb2.SequenceDelta]) -> None:
        self.router.route(output_deltas(scheduler_pb2.OutputBatch(deltas=deltas)))

    async def close(self) -> None:
        while not self.pipeline.outbox.empty():  # let forget items reach the tokenizer
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        self.task.cancel()
        await self.upstream.close()


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
            harness.route(deltas)
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
        harness.route([delta(
            "r2", 0, ids, STOP, logprobs=logprobs, stop_token_id=eos)])
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
        harness.route([delta("r3", i, ids[:3]) for i in range(2)])
        await asyncio.wait_for(queue.get(), 10)
        open_while_running = tokenizer_service.metric(OPEN_STATES)
        harness.router.drop("r3")  # the client left; later deltas must be ignored
        harness.route([delta("r3", 0, ids[3:5])])
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


# ---- a broken Detokenize stream ----------------------------------------------------------------
def test_a_cut_detokenize_stream_loses_no_text(tokenizer_service, tokenizer):
    """The connection to the tokenizer is cut with three batches unanswered (the tokenizer took
    them, its answers were held back and lost), and no new connection is let through for a
    while. The new stream gets each sample's state rebuilt, then those batches again, then
    what queued meanwhile: a stop string that spans the cut is still found and cut out, a
    character whose bytes straddle it comes out whole, and a sample that began during the
    outage is whole too. Nothing repeated, nothing skipped, no tokenizer state left over."""
    first, second, third = (tokenizer.encode(text) for text in (
        "The capital of France is Paris. It is lovely.", "你好，世界！🚀 Rockets fly.",
        "Ünïcödé àccents, Ελληνικά."))
    after_paris = next(k for k in range(len(first))
                       if tokenizer.decode(first[:k]).endswith("Paris"))
    mid_char = next(k for k in range(len(second))  # a byte of "界" answered, the rest not
                    if tokenizer.decode(second[:k]).endswith("世\ufffd"))
    cut_at = max(after_paris, mid_char)  # the step whose answer is the first one held back
    # (tokens, the step of their first one): each sample's first held token is the one above
    samples = [(first, cut_at - after_paris), (second, cut_at - mid_char), (third, cut_at + 4)]
    proxy = TcpProxy(tokenizer_service.address)

    async def scenario():
        harness = Harness(proxy.address)
        state, queue = harness.add("r4", SamplingParams(n=3, stop=["Paris. It"], max_tokens=64))
        last_step = max(start + len(ids) for ids, start in samples)
        for step in range(last_step):
            if step == cut_at:
                proxy.hold()
            elif step == cut_at + 3:
                proxy.cut(refuse=True)
            elif step == cut_at + 6:
                proxy.accept()
            deltas = [delta("r4", i, ids[step - start:step - start + 1],
                            LENGTH if step - start == len(ids) - 1 else 0)
                      for i, (ids, start) in enumerate(samples) if 0 <= step - start < len(ids)]
            harness.route(deltas)
            await asyncio.sleep(0.1 if cut_at + 3 <= step < cut_at + 6 else 0.01)
        by_sample = await drain(queue, 3)
        open_states = await wait_for_metric(tokenizer_service, OPEN_STATES, 0)
        await harness.close()
        return state, by_sample, harness, open_states

    try:
        state, by_sample, harness, open_states = asyncio.run(scenario())
    finally:
        proxy.close()
    assert proxy.num_connections >= 2  # the stream did break and a new one took over
    texts = {i: "".join(d.text for d in deltas) for i, deltas in by_sample.items()}
    assert texts == {0: "The capital of France is ", 1: "你好，世界！🚀 Rockets fly.",
                     2: "Ünïcödé àccents, Ελληνικά."}
    assert all("\ufffd" not in d.text for deltas in by_sample.values() for d in deltas)
    assert [(by_sample[i][-1].finish_reason, by_sample[i][-1].stop_reason) for i in range(3)] == [
        ("stop", "Paris. It"), ("length", None), ("length", None)]
    assert all(d.error is None for deltas in by_sample.values() for d in deltas)
    assert [sample.num_tokens for sample in state.samples] == [
        next(k for k in range(len(first)) if "Paris. It" in tokenizer.decode(first[:k])),
        len(second), len(third)]
    assert harness.aborted == ["r4/0"]  # the stop string's abort, nothing else
    assert open_states == 0


def test_a_tokenizer_that_stays_away_fails_requests_and_aborts_them(tokenizer_service,
                                                                     tokenizer):
    """No tokenizer within the wait: each request's unfinished samples end with an error that
    says so (after the wait, not before) and the request is aborted at the scheduler; once a
    tokenizer is reachable again, new requests are detokenized as before."""
    ids = tokenizer.encode("A tale of two cities, in three parts.")
    proxy = TcpProxy(tokenizer_service.address)

    async def scenario():
        harness = Harness(proxy.address, wait_s=0.5)
        _, queue = harness.add("r5", SamplingParams(n=2))
        harness.route([delta("r5", i, ids[:3]) for i in range(2)])
        await asyncio.wait_for(queue.get(), 10)
        proxy.cut(refuse=True)
        cut = asyncio.get_running_loop().time()
        harness.route([delta("r5", i, ids[3:5]) for i in range(2)])
        failed = await drain(queue, 2)
        waited = asyncio.get_running_loop().time() - cut
        aborted = list(harness.aborted)
        proxy.accept()
        _, later = harness.add("r6", SamplingParams())
        harness.route([delta("r6", 0, ids, LENGTH)])
        served = await drain(later, 1)
        await harness.close()
        return failed, waited, aborted, served, harness

    try:
        failed, waited, aborted, served, harness = asyncio.run(scenario())
    finally:
        proxy.close()
    errors = [deltas[-1] for deltas in failed.values()]
    assert [(d.finish_reason, d.text) for d in errors] == [("error", "")] * 2
    assert all("did not come back within 0.5 s" in d.error for d in errors), errors
    assert 0.5 <= waited < 3, waited
    assert aborted == ["r5"]
    assert "".join(d.text for d in served[0]) == tokenizer.decode(ids)
    assert not harness.router.requests


def test_a_batch_the_tokenizer_refuses_fails_its_requests_at_once(tokenizer_service, tokenizer):
    """INVALID_ARGUMENT (a token id out of the vocabulary) would fail again on any new stream:
    no waiting, no resending; the requests in flight end with the tokenizer's message and are
    aborted."""
    async def scenario():
        harness = Harness(tokenizer_service.address, wait_s=30)
        _, queue = harness.add("r7", SamplingParams())
        harness.route([delta("r7", 0, [10**6])])
        started = asyncio.get_running_loop().time()
        failed = await drain(queue, 1)
        took = asyncio.get_running_loop().time() - started
        await harness.close()
        return failed[0][-1], took, harness.aborted

    last, took, aborted = asyncio.run(scenario())
    assert last.finish_reason == "error" and "INVALID_ARGUMENT" in last.error, last
    assert "out of the vocabulary" in last.error and took < 5
    assert aborted == ["r7"]
