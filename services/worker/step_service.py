"""The Worker service: the scheduler's step stream. Each StepRequest, converted to a StepOrder
at the edge (edge.py), updates the sequence table, starts the KV sends it orders, runs the
forward pass in the compute thread and answers with the sampled tokens. Send results go back on
the same stream when they finish (step_id 0)."""
from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from kvrelay.api.kvrelay.v1 import worker_pb2, worker_pb2_grpc
from kvrelay.common import metrics
from kvrelay.common.log import get_logger
from kvrelay.step_messages import SendOrder, StepOrder, StepOutcome
from kvrelay.worker import edge
from kvrelay.worker.adapter_service import AdapterCalls
from kvrelay.worker.kv_connector import KvSender, LayerFeed
from kvrelay.worker.sequences import SequenceTable
from kvrelay.worker.step_executor import StartedStep, StepExecutor

log = get_logger(__name__)
# A pipeline worker with a step in flight looks this often whether it is done, while it waits
# for the next order (which it starts first if that comes sooner).
POLL_S = 0.0005
STEP_SECONDS = metrics.histogram("worker_step_seconds", "Forward pass + sampling per step")
STEP_TOKENS = metrics.counter("worker_step_tokens", "Tokens computed by this worker")
RUNNING_SEQUENCES = metrics.gauge("worker_sequences", "Sequences this worker holds state for")


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, layerwise_push: bool = True) -> None:
        # Layer by layer, sends overlap the forward pass; on CPU the hook's per-layer copies
        # and event-loop wake-ups contend with the compute thread for the GIL and cores (the
        # prefill of chat-64 took 21% longer), so there the pages go right after the pass.
        self.layerwise_push = layerwise_push
        # Registered with the server before the model loads (handlers cannot be added to a
        # started server); `attach` makes it usable.
        self.executor: StepExecutor | None = None
        self.sender: KvSender | None = None
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.num_streams = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.adapter_calls = AdapterCalls(self)

    def attach(self, executor: StepExecutor, sender: KvSender) -> None:
        self.executor, self.sender = executor, sender

    async def LoadAdapter(self, request, context):
        await self.adapter_calls.load(request, context)
        return worker_pb2.LoadAdapterResponse()

    async def UnloadAdapter(self, request, context):
        await self.adapter_calls.unload(request, context)
        return worker_pb2.UnloadAdapterResponse()

    async def Steps(self, request_iterator, context):
        if self.executor is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        # A new scheduler connection starts from a clean slate: its plan knows no sequences.
        self.executor.table = SequenceTable()
        outbox: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._serve_steps(request_iterator, outbox))
        reader.add_done_callback(lambda _: outbox.put_nowait(None))
        self.idle.clear()
        try:
            while (message := await outbox.get()) is not None:
                await context.write(message)
            if not reader.cancelled() and reader.exception() is not None:
                error = reader.exception()
                log.error("step failed", error=repr(error))
                await context.abort(grpc.StatusCode.INTERNAL, f"step failed: {error!r}")
        finally:
            reader.cancel()
            self.idle.set()

    async def _serve_steps(self, request_iterator, outbox: asyncio.Queue) -> None:
        """Steps in the order they come. A pipeline worker starts the next step (its first
        stage) before it collects the one before, when the next is already here and fewer
        than its stages are in flight: the scheduler sends such steps for other sequences
        (Scheduler.schedule's pipeline_depth); every other worker finishes each step first."""
        sends: set[asyncio.Task] = set()
        orders: asyncio.Queue = asyncio.Queue()
        reading = asyncio.create_task(_read_orders(request_iterator, orders))
        depth = self.executor.runner.pp.size
        in_flight: collections.deque[_InFlight] = collections.deque()
        getting: asyncio.Task | None = None
        try:
            while True:
                if in_flight and (depth == 1 or len(in_flight) >= depth
                                  or self._done(in_flight[0])):
                    await self._finish(in_flight.popleft(), outbox)
                    continue
                # room for a step: the next order, or (while the oldest step in flight is
                # still in a later stage) a look at whether that one is done
                getting = getting or asyncio.ensure_future(orders.get())
                await asyncio.wait({getting}, timeout=POLL_S if in_flight else None)
                if not getting.done():
                    continue
                order, getting = getting.result(), None
                if order is None:  # the stream ended (or broke: raised below)
                    break
                in_flight.append(await self._start(order, outbox, sends))
            while in_flight:
                await self._finish(in_flight.popleft(), outbox)
            await reading
        finally:
            reading.cancel()
            if getting is not None:
                getting.cancel()
            for task in sends:
                task.cancel()

    def _done(self, step: _InFlight) -> bool:
        pending = step.started.pending
        return pending is None or self.executor.runner.result_ready(pending)

    async def _start(self, order: StepOrder, outbox: asyncio.Queue, sends: set) -> _InFlight:
        log.debug("step received", step_id=order.step_id)
        started_at = time.perf_counter()
        batch = self.executor.apply(order)
        RUNNING_SEQUENCES.set(len(self.executor.table))
        feeds = self._start_sends(order.kv_sends, outbox, sends)
        hook = _fan_out(feeds) if feeds and self.layerwise_push else None
        try:
            started = await asyncio.get_running_loop().run_in_executor(
                self.compute, self.executor.start, order, batch, hook)
        except BaseException as exc:
            for feed in feeds:
                feed.fail(exc)
            raise
        return _InFlight(started, feeds, hook is None, started_at)

    async def _finish(self, step: _InFlight, outbox: asyncio.Queue) -> None:
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(
                self.compute, self._complete, step)
        except BaseException as exc:
            for feed in step.feeds:
                feed.fail(exc)
            raise
        if step.sends_after:
            for feed in step.feeds:
                feed.fill_now()  # those with a lander landed in the compute thread already
        STEP_SECONDS.observe(time.perf_counter() - step.started_at)
        STEP_TOKENS.inc(step.started.batch.num_batched_tokens)
        log.debug("step computed", step_id=outcome.step_id)
        outbox.put_nowait(edge.outcome_to_proto(outcome))

    def _complete(self, step: _InFlight) -> StepOutcome:
        """The compute thread's part: the step's outputs, then the sends that land their pages
        straight in the destination do so on the same thread (both cores, and before any later
        step can reuse the source blocks)."""
        outcome = self.executor.finish(step.started)
        for feed in step.feeds if step.sends_after else ():
            feed.land()
        return outcome

    def _start_sends(self, orders: list[SendOrder], outbox: asyncio.Queue,
                     sends: set) -> list[LayerFeed]:
        """Start every ordered send; return the feeds that this step's forward pass fills."""
        loop = asyncio.get_running_loop()
        during_step = []
        for order in orders:
            # pages that stream layer by layer during the pass go through the feed's queue
            streams = order.during_step and self.layerwise_push
            runner = self.executor.runner
            feed = LayerFeed(runner.kv_pages, list(order.src_block_ids), loop,
                             None if streams else self.sender.lander(order),
                             runner.slots_done_after)
            if order.during_step:
                during_step.append(feed)
            else:
                feed.fill_now()
            task = asyncio.create_task(self._send(order, feed, outbox))
            sends.add(task)
            task.add_done_callback(sends.discard)
        return during_step

    async def _send(self, order: SendOrder, feed: LayerFeed, outbox: asyncio.Queue) -> None:
        result = await self.sender.send(order, feed)
        outbox.put_nowait(edge.send_result_to_proto(result))


@dataclass(slots=True)
class _InFlight:
    """A step started on this worker and not yet answered."""
    started: StartedStep
    feeds: list[LayerFeed]  # the KV sends it fills
    sends_after: bool  # they go once the step is done (not layer by layer during it)
    started_at: float  # perf_counter()


async def _read_orders(request_iterator, orders: asyncio.Queue) -> None:
    """The scheduler's step orders as they arrive; None once the stream ends (or breaks)."""
    try:
        async for request in request_iterator:
            orders.put_nowait(edge.step_from_proto(request))
    finally:
        orders.put_nowait(None)


def _fan_out(feeds: list[LayerFeed]):
    def on_layer_done(layer: int) -> None:
        for feed in feeds:
            feed.on_layer_done(layer)
    return on_layer_done
