"""The transport-neutral gateway: submit prompts, stream each step's SampleDeltas back, abort.

Both front ends (OpenAI REST and the public gRPC API) use it. It keeps one Outputs stream from
each scheduler group and one Detokenize stream to the tokenizer for all requests, sends each
request to the least loaded group, and polls the services to know whether it can serve. A lost
Detokenize stream costs no request unless the tokenizer stays away (detokenize_pipeline.py); a
lost Outputs stream fails that group's requests, and their aborts wait for it to be back.

It works on its own messages (messages.py): the service edge (scheduler_group.py, upstream.py,
edge.py) converts the wire's. A request is known by its client's id (`client_request_id`, the
key of `groups`); each of its prompts has a scheduler id of the gateway's own (`request_id`)."""
from __future__ import annotations

import asyncio
import uuid

import grpc

from kvrelay.common.log import get_logger
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway import metrics
from kvrelay.gateway.detokenize_pipeline import DetokenizePipeline, queue_sender
from kvrelay.gateway.errors import GatewayError, model_not_found
from kvrelay.gateway.limits import RequestLimits
from kvrelay.gateway.messages import Generation, SubmittedPrompt
from kvrelay.gateway.redaction import withhold_library_exception_messages
from kvrelay.gateway.request_group import RequestGroup
from kvrelay.gateway.request_state import RequestState
from kvrelay.gateway.router import OutputRouter
from kvrelay.gateway.scheduler_group import SchedulerGroup, least_loaded
from kvrelay.gateway.upstream import Upstream

log = get_logger(__name__)
# Stats steer placement between scheduler groups, so with several groups they are polled often.
# With one they only tell readiness (a lost Outputs stream is noticed at once anyway), and each
# poll wakes three idle processes, which costs the model's threads CPU on a small machine.
STATS_POLL_S = 0.5
SINGLE_GROUP_STATS_POLL_S = 2.0
RECONNECT_DELAY_S = 0.5
ABORT_RETRY_S = 0.5  # after an Abort call failed on a connected group
READY_POLL_S = 0.25  # while a request waits for a ready scheduler group


class GatewayCore:
    def __init__(self, upstream: Upstream, gateway_id: str,
                 served_model_name: str | None = None, submit_wait_s: float = 0.0,
                 request_timeout_s: float = 0.0, limits: RequestLimits | None = None,
                 log_request_text: bool = False, tokenizer_wait_s: float = 30.0,
                 reasoning_parser: str = "none", pooling: str = "last") -> None:
        self.upstream = upstream
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (reasoning.py)
        self.pooling = pooling  # --pooling, of /v1/embeddings (openai_embeddings.py)
        self.limits = limits or RequestLimits()
        # Prompts, outputs and their token ids are the users' data: logged only when asked
        # (--log-request-text), for debugging.
        self.log_request_text = log_request_text
        self.request_timeout_s = request_timeout_s  # 0: requests have no deadline
        # A request that finds no scheduler group ready (one restarting, or whose only decode
        # worker is) waits this long for one before its 503: it has not started anywhere.
        self.submit_wait_s = submit_wait_s
        self.gateway_id = gateway_id
        self.served_model_name_flag = served_model_name
        outbox: asyncio.Queue = asyncio.Queue()  # router -> tokenizer, in order
        self.router = OutputRouter(self.abort_nowait, queue_sender(outbox))
        # Given up on the tokenizer: its states went with the stream, nothing to forget there.
        self.pipeline = DetokenizePipeline(upstream.open_detokenize, outbox,
                                           self.router.on_detokenized,
                                           lambda message: self.router.fail_all(message, False),
                                           self.router.resume_items, tokenizer_wait_s)
        self.groups: dict[str, RequestGroup] = {}
        self.draining = False  # SIGTERM: no new request, on REST or gRPC
        self.abort_wakeup = asyncio.Event()  # aborts are queued on their groups
        self.tokenizer_serving = False
        self.on_health_change = []  # callbacks(ready: bool)
        self.was_ready: bool | None = None
        self.health_lock = asyncio.Lock()  # callbacks see the changes in order
        self.health_tasks: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.log_request_text:
            withhold_library_exception_messages()
        coros = [self.pipeline.run(), self._send_aborts(), self._poll_stats(),
                 self.upstream.watch_tokenizer(self._on_tokenizer_health),
                 *(self._consume_outputs(group) for group in self.upstream.groups)]
        self._tasks = [asyncio.create_task(coro) for coro in coros]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.upstream.close()

    async def drain(self) -> None:
        """Refuse new requests and wait until every request in flight has finished (SIGTERM)."""
        self.draining = True
        while self.groups:
            await asyncio.sleep(0.1)

    # ---- health and model ----------------------------------------------------------------------
    @property
    def ready_groups(self) -> list[SchedulerGroup]:
        return [group for group in self.upstream.groups if group.ready]

    @property
    def ready(self) -> bool:
        return self.tokenizer_serving and bool(self.ready_groups)

    @property
    def model_name(self) -> str | None:
        if self.served_model_name_flag:
            return self.served_model_name_flag
        names = [group.stats.model for group in self.ready_groups if group.stats.model]
        return names[0] if names else None

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters every ready group serves (a request may go to any of them)."""
        groups = [set(group.stats.adapters) for group in self.ready_groups]
        return sorted(set.intersection(*groups)) if groups else []

    async def load_adapter(self, name: str, path: str) -> None:
        """On every scheduler group, or on none: one that refuses undoes the others."""
        loaded = []
        try:
            for group in self.upstream.groups:
                await group.load_adapter(name, path)
                loaded.append(group)
        except GatewayError:
            for group in loaded:
                await group.unload_adapter(name)
            raise

    async def unload_adapter(self, name: str) -> None:
        if name not in {n for group in self.upstream.groups if group.stats
                        for n in group.stats.adapters}:
            raise model_not_found(name, self.model_name or "", self.adapter_names)
        for group in self.upstream.groups:
            if group.stats is not None and name in group.stats.adapters:
                await group.unload_adapter(name)

    @property
    def max_model_len(self) -> int:
        """The smallest of the ready groups': a request must fit wherever it is placed."""
        return min((group.stats.max_model_len for group in self.ready_groups), default=0)

    def _on_tokenizer_health(self, serving: bool) -> None:
        self.tokenizer_serving = serving
        task = asyncio.create_task(self._follow_health())
        self.health_tasks.add(task)
        task.add_done_callback(self.health_tasks.discard)

    async def _poll_stats(self) -> None:
        while True:
            await asyncio.gather(*(group.refresh_stats() for group in self.upstream.groups))
            await self._follow_health()
            steady = self.ready and len(self.upstream.groups) == 1
            await asyncio.sleep(SINGLE_GROUP_STATS_POLL_S if steady else STATS_POLL_S)

    async def _follow_health(self) -> None:
        async with self.health_lock:
            if self.ready == self.was_ready:
                return
            self.was_ready = self.ready
            log.info("gateway health", ready=self.was_ready, tokenizer=self.tokenizer_serving,
                     groups={group.address: group.ready for group in self.upstream.groups})
            for callback in self.on_health_change:
                await callback(self.was_ready)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, client_request_id: str, prompts: list[list[int]],
                       params: SamplingParams, priority: int = 0,
                       lora_name: str = "") -> RequestGroup:
        """Submit one scheduler request per prompt; their deltas come out of the group."""
        if self.draining:
            raise GatewayError("unavailable", "the gateway is shutting down")
        scheduler = await self._ready_group()
        if client_request_id in self.groups:
            raise GatewayError("invalid_request",
                               f"request id {client_request_id!r} is in use")
        queue: asyncio.Queue = asyncio.Queue()
        # The scheduler's ids are the gateway's own, never the client's: a client's id (its
        # x-request-id header, the gRPC request_id) may equal a scheduler id of another request,
        # here ("r-0" next to prompt 0 of "r") or at another gateway, and a shared id crosses
        # their outputs and aborts (the other request hung). The client's id still travels
        # with every call as x-request-id metadata, for the logs.
        request_ids = [uuid.uuid4().hex for _ in prompts]
        states = [RequestState(request_id, index, prompt, params, queue, scheduler=scheduler)
                  for index, (request_id, prompt) in enumerate(zip(request_ids, prompts))]
        group = RequestGroup(self, client_request_id, states, queue)
        for state in states:
            self.router.add(state)
        self.groups[client_request_id] = group
        try:
            await scheduler.submit(Generation(
                client_request_id, self.gateway_id,
                tuple(SubmittedPrompt(state.request_id, state.prompt_token_ids)
                      for state in states), params, priority, lora_name))
        except BaseException:
            group.close()
            raise
        metrics.PROMPT_TOKENS.inc(sum(map(len, prompts)))
        if self.log_request_text:
            log.info("prompt tokens", prompt_token_ids=prompts)
        if self.request_timeout_s:
            group.deadline_timer = asyncio.get_running_loop().call_later(
                self.request_timeout_s, group.expire, self.request_timeout_s)
        return group

    async def wait_for_ready_group(self) -> None:
        """Until a scheduler group is ready; 503 (unavailable) past submit_wait_s."""
        await self._ready_group()

    async def _ready_group(self) -> SchedulerGroup:
        """The least loaded ready scheduler group, waiting up to submit_wait_s for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.submit_wait_s
        while (scheduler := least_loaded(self.upstream.groups)) is None:
            if self.draining or loop.time() >= deadline:
                raise GatewayError("unavailable", "no scheduler group is ready")
            await asyncio.sleep(READY_POLL_S)
        return scheduler

    async def abort(self, client_request_id: str) -> bool:
        """The public Abort: the scheduler ends the request's samples with finish reason abort."""
        group = self.groups.get(client_request_id)
        if group is None:
            return False
        for state in group.states:
            self.abort_nowait(state.scheduler, [state.request_id])
        return True

    def abort_nowait(self, scheduler: SchedulerGroup, ids: list[str]) -> None:
        """Queue scheduler aborts ("<id>" or "<id>/<index>") for the group holding them: sent
        in one call soon after, or once its Outputs stream is back (SchedulerGroup.send_aborts),
        so that no aborted request keeps computing."""
        scheduler.queue_aborts(ids)
        self.abort_wakeup.set()

    async def _send_aborts(self) -> None:
        while True:
            await self.abort_wakeup.wait()
            self.abort_wakeup.clear()
            sent = await asyncio.gather(*(group.send_aborts() for group in self.upstream.groups))
            if not all(sent):
                await asyncio.sleep(ABORT_RETRY_S)
                self.abort_wakeup.set()

    # ---- the scheduler's output stream ---------------------------------------------------------
    async def _consume_outputs(self, group: SchedulerGroup) -> None:
        while True:
            stream = group.outputs(self.gateway_id)
            try:
                await stream.registered()
                group.outputs_connected = True
                self.abort_wakeup.set()  # the aborts queued while it was down go out now
                log.info("outputs stream open", gateway_id=self.gateway_id,
                         scheduler=group.address)
                async for deltas in stream:
                    self.router.route(deltas)
                message = "the scheduler closed the output stream"
            except grpc.RpcError as exc:
                message = f"lost the scheduler's output stream: {exc.code().name}"
            finally:
                group.outputs_connected = False
                stream.cancel()
            log.warning("outputs stream failed", error=message, scheduler=group.address)
            # Also queues their aborts: the scheduler may not have noticed (a half-open cut).
            self.router.fail_all(message, scheduler=group)
            await asyncio.sleep(RECONNECT_DELAY_S)

