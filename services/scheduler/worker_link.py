"""The scheduler's side of one worker's step stream: plan a step, send it, wait for its result,
apply it, repeat while the worker has work. While a step of plain decodes runs, the next one is
planned and sent ahead, so the worker never waits for this round trip between them. Steps to
different workers run concurrently; KV send results arrive on the same stream between steps."""
from __future__ import annotations

import asyncio
import collections

import grpc

from kvrelay.api.kvrelay.v1 import worker_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.common.log import get_logger
from kvrelay.scheduler import edge, scheduler_metrics
from kvrelay.scheduler.cluster import ClusterScheduler
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.step_gate import StepGate
from kvrelay.scheduler.step_plan import StepPlan, StepPlanner

log = get_logger(__name__)


class WorkerLink:
    def __init__(self, cluster: ClusterScheduler, worker: WorkerRecord, gate: StepGate) -> None:
        self.cluster = cluster
        self.worker = worker
        self.gate = gate  # when the worker may step, and on how many threads (step_gate.py)
        self.steps = StepPlanner(cluster, worker)
        self.wakeup = asyncio.Event()
        self.wakeup.set()
        self.pending: dict[int, asyncio.Future] = {}  # step id -> its result, steps in flight
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        chan = channel(self.worker.info.address, "worker")
        call = worker_pb2_grpc.WorkerStub(chan).Steps()
        reader = asyncio.create_task(self._read(call))
        try:
            await self._step_loop(call, reader)
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, ConnectionError) as exc:
            self._fail(f"step stream broke: {_describe(exc)}")
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
            log.exception("step loop crashed", worker_id=self.worker.worker_id)
            self._fail(f"scheduler error: {exc!r}")
        finally:
            reader.cancel()
            call.cancel()
            await chan.close()

    async def _step_loop(self, call, reader: asyncio.Task) -> None:
        while self.worker.alive:
            await self.wakeup.wait()
            self.wakeup.clear()
            if not self.worker.alive:
                return
            if self.worker.draining and not self.cluster.holds_sequences(self.worker):
                log.info("worker drained", worker_id=self.worker.worker_id)
                self.cluster.retire(self.worker)
                await call.done_writing()
                return
            async with self.gate.turn(self.worker) as num_threads:
                await self._one_step(call, reader, num_threads)
            if self.cluster.has_work(self.worker):
                self.wakeup.set()

    async def _one_step(self, call, reader: asyncio.Task, num_threads: int) -> None:
        """One planned step, and while each step runs the next one planned ahead (async
        scheduling: plain decodes, and no other worker waiting for these cores)."""
        if not self.worker.alive:  # died while waiting for its turn
            return
        if self.worker.info.pipeline_parallel_size > 1:
            await self._micro_batches(call, reader, num_threads)
            return
        plan = self.steps.plan()
        if plan is None:
            self.cluster.sink.flush()
            return
        await self._send(call, plan, num_threads)
        while plan is not None:
            ahead = None
            if (self.cluster.config.async_scheduling and self.worker.alive
                    and not self.gate.contended(self.worker)):
                ahead = self.steps.plan_ahead(plan)
            if ahead is not None:
                await self._send(call, ahead, num_threads)
            await self._collect(plan, reader)
            plan = ahead

    async def _micro_batches(self, call, reader: asyncio.Task, num_threads: int) -> None:
        """A pipeline worker's turn: up to one step per stage in flight, each of other
        sequences (Scheduler.schedule's pipeline_depth), the next planned as soon as one comes
        back, so every stage has a micro-batch to compute. Another worker waiting for these
        cores ends the turn once the steps in flight are back."""
        depth = self.worker.info.pipeline_parallel_size
        in_flight: collections.deque[StepPlan] = collections.deque()
        planning = True
        while True:
            while planning and len(in_flight) < depth and self.worker.alive:
                if in_flight and self.gate.contended(self.worker):
                    planning = False
                    break
                plan = self.steps.plan()
                if plan is None:
                    break
                await self._send(call, plan, num_threads)
                in_flight.append(plan)
            if not in_flight:
                self.cluster.sink.flush()
                return
            await self._collect(in_flight.popleft(), reader)

    async def _collect(self, plan: StepPlan, reader: asyncio.Task) -> None:
        """The step's outcome, applied."""
        outcome = edge.outcome_from_proto(await _first(self.pending[plan.order.step_id],
                                                       reader))
        del self.pending[plan.order.step_id]
        log.debug("step done", worker_id=self.worker.worker_id, step_id=outcome.step_id,
                  num_sampled=len(outcome.sampled))
        num_emitted = self.steps.apply(plan, outcome)
        self.cluster.retry_awaiting()
        self.cluster.sink.flush()
        scheduler_metrics.after_step(self.cluster, self.worker, plan, num_emitted)

    async def _send(self, call, plan: StepPlan, num_threads: int) -> None:
        plan.order.num_threads = num_threads
        self.pending[plan.order.step_id] = asyncio.get_running_loop().create_future()
        await call.write(edge.step_to_proto(plan.order))
        log.debug("step sent", worker_id=self.worker.worker_id,
                  step_id=plan.order.step_id, num_scheduled=len(plan.order.scheduled),
                  num_tokens=sum(item.num_new_tokens for item in plan.order.scheduled),
                  num_threads=num_threads)

    async def _read(self, call) -> None:
        try:
            await self._read_results(call)
        except Exception:
            log.exception("step stream reader failed", worker_id=self.worker.worker_id)
            raise

    async def _read_results(self, call) -> None:
        async for result in call:
            if result.step_id == 0:  # KV send results, between steps
                log.debug("kv send results", num_results=len(result.kv_sends))
                for send in edge.send_results_from_proto(result):
                    scheduler_metrics.transfer_result(send.ok)
                    self.cluster.on_send_result(send.transfer_id, send.ok, send.error)
                self.cluster.sink.flush()
            elif (pending := self.pending.get(result.step_id)) is not None \
                    and not pending.done():
                pending.set_result(result)
        raise ConnectionError("the worker closed its step stream")

    def _fail(self, reason: str) -> None:
        log.warning("worker lost", worker_id=self.worker.worker_id, reason=reason)
        self.cluster.worker_died(self.worker, reason)
        self.cluster.sink.flush()


async def _first(result: asyncio.Future, reader: asyncio.Task):
    """The step's result, or the reader's failure if the stream breaks first."""
    done, _ = await asyncio.wait({result, reader}, return_when=asyncio.FIRST_COMPLETED)
    if result in done:
        return result.result()
    reader.result()  # raises the stream's error
    raise ConnectionError("the step stream ended")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
