"""The Scheduler gRPC service: submissions, aborts, per-gateway output streams, the worker
registry and stats, over one ClusterScheduler."""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.log import bind_request_id, get_logger, request_id_from
from kvrelay.scheduler import lease_reaper, scheduler_metrics
from kvrelay.scheduler.cluster import ClusterScheduler, Overloaded, Unavailable
from kvrelay.scheduler.config import SchedulerConfig
from kvrelay.engine.structured.backend import GrammarError
from kvrelay.scheduler.core_share import DomainGates
from kvrelay.scheduler.grammars import scheduler_grammars
from kvrelay.scheduler.adapters import AdapterDirectory, adapter_use
from kvrelay.scheduler.edge import ROLE_TO_PROTO, adapter_stats_to_proto, worker_info_from_proto
from kvrelay.scheduler.outputs import DeltaSink
from kvrelay.scheduler.registry import WorkerRecord
from kvrelay.scheduler.worker_link import WorkerLink
from kvrelay.wire import params_from_proto

log = get_logger(__name__)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """The gRPC edge: each handler converts what it receives into the core's types (edge.py),
    calls the core and converts the answer back."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cluster = ClusterScheduler(config, DeltaSink(), wake=self._wake)
        self.links: dict[str, WorkerLink] = {}
        self.gates = DomainGates(config.shared_compute_steps,
                                 config.engine.long_prefill_token_threshold,
                                 self.cluster.has_work)
        self.grammars = scheduler_grammars(config, self.cluster.registry)
        self._background: set[asyncio.Task] = set()
        self.adapters = AdapterDirectory(config.engine.enable_lora, config.lora_modules,
                                         config.max_cpu_loras)

    def _wake(self, worker: WorkerRecord) -> None:
        link = self.links.get(worker.worker_id)
        if link is not None and link.worker is worker:
            link.wakeup.set()
            link.gate.refresh()

    async def Submit(self, request, context):
        bind_request_id(request_id_from(context) or request.request_id)
        prompt = list(request.prompt_token_ids)
        try:
            params = params_from_proto(request.params,
                                       self.cluster.default_max_tokens(len(prompt)))
            grammar = None
            if params.structured_outputs is not None:  # compiled before the request queues
                grammar = await self.grammars.compile_async(params.structured_outputs)
            adapter_id = self.adapters.resolve(request.lora_name) if request.lora_name else 0
            self.cluster.submit(request.request_id, request.gateway_id, prompt, params,
                                request.priority, grammar, adapter_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no LoRA adapter named {request.lora_name!r} is loaded")
        except (ValueError, GrammarError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RuntimeError as exc:  # the grammar backend cannot be built here
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"structured output is unavailable: {exc}")
        log.debug("submitted", num_prompt_tokens=len(prompt), n=params.n,
                  lora=request.lora_name or None)
        return scheduler_pb2.SubmitResponse()

    async def Abort(self, request, context):
        aborted = self.cluster.abort(list(request.request_ids))
        self.cluster.sink.flush()
        return scheduler_pb2.SchedulerAbortResponse(aborted=aborted)

    async def Outputs(self, request, context):
        queue = self.cluster.sink.subscribe(request.gateway_id)
        # Tells the gateway its stream is registered, so no Submit of it can overtake it.
        await context.send_initial_metadata((("kvrelay-outputs", "registered"),))
        log.info("gateway connected", gateway_id=request.gateway_id)
        try:
            while True:
                yield await queue.get()
        finally:
            self.cluster.sink.unsubscribe(request.gateway_id, queue)
            self._abort_gateway(request.gateway_id)

    def _abort_gateway(self, gateway_id: str) -> None:
        """A gateway that went away cannot receive its requests' tokens: stop computing them."""
        orphans = [rid for rid, record in self.cluster.requests.items()
                   if record.gateway_id == gateway_id]
        if orphans and gateway_id not in self.cluster.sink.streams:
            log.info("gateway gone, aborting its requests", gateway_id=gateway_id,
                     num_requests=len(orphans))
            self.cluster.abort(orphans)
            self.cluster.sink.pending.pop(gateway_id, None)

    async def RegisterWorker(self, request, context):
        try:
            info = worker_info_from_proto(request)
            await self.adapters.sync_worker(info)  # AdapterRefused is a ValueError
            worker = self.cluster.register(info)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        old = self.links.pop(worker.worker_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        link = WorkerLink(self.cluster, worker, self.gates.gate_for(worker))
        self.links[worker.worker_id] = link
        link.start()
        log.info("worker registered", worker_id=worker.worker_id, address=worker.info.address,
                 role=worker.role.value, num_blocks=worker.info.num_blocks)
        return scheduler_pb2.RegisterWorkerResponse(lease_ms=int(self.config.lease_s * 1000))

    async def Heartbeat(self, request, context):
        known = self.cluster.heartbeat(request.worker_id, request.draining)
        return scheduler_pb2.HeartbeatResponse(known=known)

    async def Stats(self, request, context):
        cluster = self.cluster
        workers = [w for w in cluster.registry.workers.values() if w.alive]
        return scheduler_pb2.StatsResponse(
            num_waiting=sum(len(w.core.waiting) for w in workers),
            num_running=sum(len(w.core.running) for w in workers),
            workers=[scheduler_pb2.WorkerStats(
                worker_id=w.worker_id, role=ROLE_TO_PROTO[w.role],
                num_blocks=w.core.kv.pool.num_blocks,
                num_free_blocks=w.core.kv.num_free_blocks, num_running=len(w.core.running))
                for w in workers],
            prefix_cache_queries=sum(w.core.kv.stats.queries for w in workers),
            prefix_cache_hits=sum(w.core.kv.stats.hits for w in workers),
            num_preemptions=sum(w.core.stats.num_preemptions for w in workers),
            model=cluster.registry.model, max_model_len=cluster.registry.max_model_len,
            ready=cluster.registry.ready, num_transferring=cluster.transfers.num_open,
            adapters=adapter_stats_to_proto(self.adapters.names(), adapter_use(workers)),
            max_loras=min((w.info.max_loras for w in workers), default=0)
            if self.adapters.enabled else 0)

    async def LoadAdapter(self, request, context):
        workers = [w.info for w in self.cluster.registry.workers.values() if w.alive]
        try:
            ref = await self.adapters.load(request.name, request.path, workers)
        except ValueError as exc:  # AdapterRefused too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return scheduler_pb2.SchedulerLoadAdapterResponse(adapter_id=ref.adapter_id)

    async def UnloadAdapter(self, request, context):
        try:
            self.adapters.unload(request.name)
            await self._release_adapters()
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no LoRA adapter named {request.name!r} is loaded")
        return scheduler_pb2.SchedulerUnloadAdapterResponse()

    async def _release_adapters(self) -> None:
        held = {sample.request.adapter_id for sample in self.cluster.samples.values()}
        workers = [w.info for w in self.cluster.registry.workers.values() if w.alive]
        await self.adapters.release(held, workers)

    async def reap_leases(self) -> None:
        await lease_reaper.reap_leases(self.cluster, self.config.lease_s / 4,
                                       self._forget_link, self._after_sweep)

    def _forget_link(self, worker) -> None:
        link = self.links.pop(worker.worker_id, None)
        if link is not None and link.task is not None:
            link.task.cancel()

    def _after_sweep(self) -> None:
        scheduler_metrics.blocks_set_aside(self.cluster)
        scheduler_metrics.refresh_gauges(self.cluster)
        if self.adapters.enabled:
            scheduler_metrics.lora_requests(self.cluster, self.adapters.names())
        if self.adapters.retired and not self.adapters.lock.locked():
            self._background.add(task := asyncio.create_task(self._release_adapters()))
            task.add_done_callback(self._background.discard)
        self.cluster.sink.flush()

    async def drain(self) -> None:
        """SIGTERM: take no new requests, let the ones in flight finish."""
        self.cluster.accepting = False
        while self.cluster.requests:
            await asyncio.sleep(0.1)
