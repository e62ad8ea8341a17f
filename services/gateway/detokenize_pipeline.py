"""The gateway's one Detokenize stream to the tokenizer: batches go out in order without waiting
for earlier answers, and each answer is handed back with the context its batch was sent with."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import grpc

from services.api.kvrelay.v1 import tokenizer_pb2
from services.common.log import get_logger

log = get_logger(__name__)
RECONNECT_DELAY_S = 0.5


class DetokenizePipeline:
    def __init__(self, tokenizer_stub, outbox: asyncio.Queue,
                 on_result: Callable[[object, object], None],
                 on_failure: Callable[[str], None]) -> None:
        self.stub = tokenizer_stub
        # (DetokenizeBatch, context) pairs to send, queued by the router (queue_sender below)
        self.outbox = outbox
        self.on_result = on_result  # (context, DetokenizeBatchResult)
        self.on_failure = on_failure  # every tokenizer-side state is gone

    async def run(self) -> None:
        while True:
            call = self.stub.Detokenize(wait_for_ready=True)
            contexts: deque = deque()  # contexts of the batches written and not yet answered
            tasks = {asyncio.create_task(self._write(call, contexts)),
                     asyncio.create_task(self._read(call, contexts))}
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                call.cancel()
            message = _failure_message(done.pop())
            log.warning("detokenize stream failed", error=message)
            self._discard_outbox()
            self.on_failure(message)
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _write(self, call, contexts: deque) -> None:
        while True:
            batch, context = await self.outbox.get()
            contexts.append(context)  # before the write, so the answer always finds it
            await call.write(batch)

    async def _read(self, call, contexts: deque) -> None:
        while True:
            result = await call.read()
            if result is grpc.aio.EOF:
                return
            self.on_result(contexts.popleft(), result)

    def _discard_outbox(self) -> None:
        # Their requests fail with the stream; a new stream must not get their half state.
        while not self.outbox.empty():
            self.outbox.get_nowait()


def _failure_message(task: asyncio.Task) -> str:
    exc = task.exception()
    if exc is None:
        return "the tokenizer closed the detokenize stream"
    if isinstance(exc, grpc.RpcError):
        return f"lost the tokenizer's detokenize stream: {exc.code().name} {exc.details() or ''}"
    log.error("detokenize pipeline error", exc_info=exc)
    return f"detokenization failed: {exc!r}"


def queue_sender(outbox: asyncio.Queue) -> Callable[[tokenizer_pb2.DetokenizeBatch, object], None]:
    """Queues a batch with its context for the pipeline; never blocks, so it is safe in
    `finally` blocks of cancelled tasks. The router gets this and the pipeline the queue, so
    neither needs the other to exist first."""
    return lambda batch, context: outbox.put_nowait((batch, context))
