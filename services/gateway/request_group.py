"""What one API call generates: one scheduler request per prompt, all feeding one queue."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from kvrelay.common.log import get_logger
from kvrelay.gateway import metrics
from kvrelay.gateway.request_state import RequestState, SampleDelta

log = get_logger(__name__)


class RequestGroup:
    def __init__(self, core, client_request_id: str, states: list[RequestState],
                 queue: asyncio.Queue) -> None:
        self.core = core
        self.client_request_id = client_request_id  # the key of core.groups
        self.states = states
        self.queue = queue
        self.num_open_samples = sum(len(state.samples) for state in states)
        self.closed = False
        self.deadline_timer: asyncio.TimerHandle | None = None  # the gateway's --request-timeout
        self.timed_out = False
        # (prompt index, sample index) -> its text and token ids so far, kept only to be
        # logged with --log-request-text
        self.outputs: dict[tuple[int, int], tuple[list[str], list[int]]] | None = \
            {} if core.log_request_text else None
        metrics.IN_FLIGHT.inc()

    async def steps(self) -> AsyncIterator[tuple[int, list[SampleDelta]]]:
        """(prompt index, that prompt's sample deltas of one engine step) until all finish."""
        while self.num_open_samples:
            prompt_index, deltas = await self.queue.get()
            for delta in deltas:
                if delta.finish_reason is not None:
                    self.num_open_samples -= 1
                if self.outputs is not None:
                    self._log_output(prompt_index, delta)
            yield prompt_index, deltas

    def _log_output(self, prompt_index: int, delta: SampleDelta) -> None:
        texts, token_ids = self.outputs.setdefault((prompt_index, delta.index), ([], []))
        texts.append(delta.text)
        token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            log.info("output text", prompt_index=prompt_index, index=delta.index,
                     text="".join(texts), token_ids=token_ids,
                     finish_reason=delta.finish_reason)

    def close(self) -> None:
        """Abort whatever is unfinished (client gone, error); never awaits, so it is safe in
        the `finally` of a cancelled task."""
        if self.closed:
            return
        self.closed = True
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
        metrics.IN_FLIGHT.dec()
        self.core.groups.pop(self.client_request_id, None)
        for state in self.states:
            if state.num_unfinished:
                self.core.abort_nowait(state.scheduler, [state.request_id])
                self.core.router.drop(state.request_id)

    def expire(self, timeout_s: float) -> None:
        """The deadline passed: every unfinished sample ends with an error delta now, and the
        scheduler is told to abort it (its blocks freed as for any abort)."""
        if self.closed:
            return
        self.timed_out = True
        message = f"the request ran past its deadline of {timeout_s:g} s (--request-timeout)"
        for state in self.states:
            unfinished = [sample for sample in state.samples if not sample.finished]
            if not unfinished:
                continue
            self.core.abort_nowait(state.scheduler, [sample.sequence_id for sample in unfinished])
            self.core.router.drop(state.request_id)
            state.publish([sample.error_delta(message) for sample in unfinished],
                          time.monotonic())

    def __enter__(self) -> "RequestGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- usage ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(state.prompt_token_ids) for state in self.states)

    @property
    def num_output_tokens(self) -> int:
        return sum(state.num_output_tokens for state in self.states)

    @property
    def num_cached_tokens(self) -> int:
        return sum(state.num_cached_prompt_tokens for state in self.states)
