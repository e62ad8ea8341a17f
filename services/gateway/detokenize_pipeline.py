"""The gateway's one Detokenize stream to the tokenizer: batches go out in order without waiting
for earlier answers, and each answer is handed back with the context its batch was sent with.

The tokenizer keeps nothing but each text stream's incremental detokenizer state, so a broken
stream (the tokenizer killed or restarted, the connection cut) need not cost a request: the
pipeline opens a new stream, to the restarted tokenizer or another replica, and sends on it
first the states of the samples in flight, rebuilt from the tokens whose text came back
(`resume_batch`), then every batch the old stream left unanswered, in order, then what was
queued meanwhile. The text goes on where it stopped, nothing repeated or skipped. Requests wait
for that at most `wait_s` (also on a new stream that has not answered yet); past it, or when the
tokenizer refused a batch, they fail (`on_failure`).

    CONNECTING --a request's batch goes out--> RESUMING (the wait starts)
    CONNECTING, RESUMING --an answer--> OPEN
    any --the stream broke--> RESUMING if something waits on it (the wait goes on), else
        CONNECTING
    any --the wait ran out, or the tokenizer refused a batch--> CONNECTING (the requests failed)
"""
from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Callable

import grpc

from kvrelay.common.log import get_logger
from kvrelay.gateway import metrics
from kvrelay.gateway.messages import Detokenized, DetokenizeItem

log = get_logger(__name__)
# Between two tries at a new stream: doubled after each failed one, from the first to the last
# (a tokenizer still loading refuses streams at once).
RETRY_DELAYS_S = (0.05, 1.0)
# The context of the batch that rebuilds the detokenizer states on a new stream: its answer
# (empty texts) goes to no one, and it is never sent again as it is (it is rebuilt each time).
RESUME = object()
# The tokenizer refused what was sent: sending it again on a new stream would fail the same way.
REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


class Link(enum.Enum):
    CONNECTING = "connecting"  # no answer on this stream yet, and no request waits for one
    OPEN = "open"  # the tokenizer has answered on this stream
    RESUMING = "resuming"  # no answer on this stream yet, and requests wait: until the deadline


_NEXT: dict[Link, frozenset[Link]] = {
    Link.CONNECTING: frozenset({Link.CONNECTING, Link.OPEN, Link.RESUMING}),
    Link.OPEN: frozenset({Link.CONNECTING, Link.RESUMING}),
    Link.RESUMING: frozenset({Link.RESUMING, Link.OPEN, Link.CONNECTING}),
}


class IllegalLink(RuntimeError):
    pass


class DetokenizePipeline:
    def __init__(self, open_stream: Callable[[], object], outbox: asyncio.Queue,
                 on_result: Callable[[object, list[Detokenized]], None],
                 on_failure: Callable[[str], None],
                 resume_items: Callable[[], list[DetokenizeItem]],
                 wait_s: float = 30.0) -> None:
        if wait_s <= 0:
            raise ValueError(f"the tokenizer wait must be positive, got {wait_s}")
        # A new Detokenize stream, reading and writing the core's types (edge.DetokenizeStream)
        self.open_stream = open_stream
        # (batch: list of DetokenizeItem, context) pairs to send, queued by the router
        # (queue_sender below)
        self.outbox = outbox
        self.on_result = on_result  # (context, the batch's answer: one Detokenized per item)
        self.on_failure = on_failure  # every request waiting on the tokenizer must end
        self.resume_items = resume_items  # the states of the samples in flight, as items
        # How long requests wait for a tokenizer that has not answered on the current stream;
        # positive: even a healthy one needs a moment for a new stream's first answer.
        self.wait_s = wait_s
        self.link = Link.CONNECTING
        # What the next stream sends before the outbox: the states, then (batch, context)
        # pairs a broken stream had written and never got an answer for.
        self.resume_batch: list[DetokenizeItem] | None = None
        self.replay: deque = deque()
        self.expired = asyncio.Event()  # the RESUMING wait ran out
        self.deadline: asyncio.TimerHandle | None = None
        self.retry_delay_s = RETRY_DELAYS_S[0]

    # ---- the link's state: every change goes through _move -------------------------------------
    def _move(self, to: Link) -> None:
        if to not in _NEXT[self.link]:
            raise IllegalLink(f"detokenize link: {self.link.value} -> {to.value}")
        if to is Link.RESUMING and self.link is not Link.RESUMING:
            self.deadline = asyncio.get_running_loop().call_later(self.wait_s, self.expired.set)
        elif to is not Link.RESUMING and self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
            self.expired.clear()
        if to is Link.OPEN:
            self.retry_delay_s = RETRY_DELAYS_S[0]
        self.link = to

    # ---- streams ---------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self._one_stream()
            if not self.expired.is_set():  # the wait running out cuts the pause short
                await _wait_event(self.expired, self.retry_delay_s)
                self.retry_delay_s = min(2 * self.retry_delay_s, RETRY_DELAYS_S[1])

    async def _one_stream(self) -> None:
        """One Detokenize stream, until it breaks or the requests' wait runs out."""
        if self.expired.is_set():
            self._give_up(self._not_back())
            return
        call = self.open_stream()
        pending: deque = deque()  # (batch, context) written on this stream, not yet answered
        tasks = {asyncio.create_task(self._write(call, pending)),
                 asyncio.create_task(self._read(call, pending))}
        expiry = asyncio.create_task(self.expired.wait())
        try:
            while True:
                done, _ = await asyncio.wait({*tasks, expiry},
                                             return_when=asyncio.FIRST_COMPLETED)
                if tasks & done or self.expired.is_set():
                    break
                # An answer came with the deadline (OPEN cleared it): this stream goes on.
                expiry = asyncio.create_task(self.expired.wait())
        finally:
            for task in (*tasks, expiry):
                task.cancel()
            call.cancel()
        if tasks & done:  # broken; if the wait ran out too, the next round gives up
            self._broken(pending, *await _failure(call, (tasks & done).pop()))
        else:
            self._give_up(self._not_back())

    async def _write(self, call, pending: deque) -> None:
        if self.resume_batch is not None:
            pending.append((self.resume_batch, RESUME))
            await call.write(self.resume_batch)
        while self.replay:
            pending.append(self.replay.popleft())  # before the write: a failed one is kept
            await call.write(pending[-1][0])
        while True:
            batch, context = await self.outbox.get()
            if self.link is Link.CONNECTING:
                self._move(Link.RESUMING)  # a request waits for this stream now: bound it
            pending.append((batch, context))  # before the write, so the answer always finds it
            await call.write(batch)

    async def _read(self, call, pending: deque) -> None:
        while True:
            result = await call.read()
            if result is None:  # the tokenizer ended the stream
                return
            batch, context = pending.popleft()
            if self.link is not Link.OPEN:
                self._move(Link.OPEN)  # the tokenizer took the states: the requests go on
            if context is RESUME:
                metrics.DETOKENIZE_RESUMED.inc(len(batch))
                log.info("detokenize stream resumed", num_samples=len(batch))
            else:
                self.on_result(context, result)

    def _broken(self, pending: deque, message: str, resumable: bool) -> None:
        """The stream broke: keep what it left unanswered for the next one, unless that
        cannot be taken over (`resumable`)."""
        log.warning("detokenize stream failed", error=message, link=self.link.value,
                    unanswered=len(pending))
        if not resumable:
            self._give_up(message)
            return
        # Unanswered, ahead of what the old stream had not written yet; the states are
        # rebuilt afresh from what has been answered by now.
        self.replay.extendleft(reversed([entry for entry in pending if entry[1] is not RESUME]))
        self.resume_batch = self.resume_items() or None
        waiting = self.resume_batch is not None or self.replay or not self.outbox.empty()
        self._move(Link.RESUMING if waiting else Link.CONNECTING)

    def _not_back(self) -> str:
        return (f"the tokenizer did not come back within {self.wait_s:g} s "
                "(--tokenizer-wait-timeout)")

    def _give_up(self, message: str) -> None:
        """Every request waiting on the tokenizer fails; the next stream starts empty."""
        log.warning("detokenize stream given up", error=message)
        metrics.DETOKENIZE_GIVE_UPS.inc()
        self.resume_batch = None
        self.replay.clear()
        while not self.outbox.empty():  # their requests fail now: no half state on the new one
            self.outbox.get_nowait()
        self._move(Link.CONNECTING)
        self.on_failure(message)


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass


async def _failure(call, task: asyncio.Task) -> tuple[str, bool]:
    """(what broke the stream, whether a new stream can take over what it left)."""
    if task.cancelled():  # gRPC cancelled the call under it
        return "the detokenize stream was cancelled", True
    exc = task.exception()
    if exc is None:
        return "the tokenizer closed the detokenize stream", True
    if isinstance(exc, asyncio.InvalidStateError):  # a write after the call ended: it says why
        code, details = await call.code(), await call.details()
        return (f"lost the tokenizer's detokenize stream: {code.name} {details or ''}",
                code not in REFUSED)
    if isinstance(exc, grpc.RpcError):
        return (f"lost the tokenizer's detokenize stream: {exc.code().name} "
                f"{exc.details() or ''}", exc.code() not in REFUSED)
    # A fault of ours, maybe halfway through an answer: its text would be lost or doubled.
    log.error("detokenize pipeline error", exc_info=exc)
    return f"detokenization failed: {exc!r}", False


def queue_sender(outbox: asyncio.Queue) -> Callable[[list[DetokenizeItem], object], None]:
    """Queues a batch with its context for the pipeline; never blocks, so it is safe in
    `finally` blocks of cancelled tasks. The router gets this and the pipeline the queue, so
    neither needs the other to exist first."""
    return lambda batch, context: outbox.put_nowait((batch, context))
