"""Routes the scheduler's per-step output batches through the tokenizer to each request.

One step's OutputDeltas become one batch of DetokenizeItems; its answer, zipped with the deltas
it was built from, becomes one list of SampleDelta per request, put on that request's queue."""
from __future__ import annotations

import time
from collections.abc import Callable

from kvrelay.gateway.messages import Detokenized, DetokenizeItem, OutputDelta
from kvrelay.gateway.request_state import RequestState, SampleDelta


class OutputRouter:
    def __init__(self, abort_nowait: Callable[[object, list[str]], None],
                 send_nowait: Callable[[list[DetokenizeItem], object], None]) -> None:
        self.requests: dict[str, RequestState] = {}
        # (the scheduler group holding them, scheduler ids: "<request id>" or "<id>/<index>")
        self.abort_nowait = abort_nowait
        self.send_nowait = send_nowait  # (batch, context) to the tokenizer, without waiting

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def drop(self, request_id: str) -> None:
        """Its consumer is gone: forget it here and in the tokenizer; later deltas are ignored."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            self._forget([s for s in state.samples if s.detokenizing])

    def route(self, deltas: list[OutputDelta]) -> None:
        """One engine step's deltas to the tokenizer."""
        items, routed = [], []
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None or delta.index >= len(state.samples):
                continue
            sample = state.samples[delta.index]
            if sample.finished:
                continue
            if delta.num_cached_prompt_tokens:
                state.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
            items.append(sample.detokenize_item(delta, state.prompt_token_ids[0]))
            routed.append((state, sample, delta))
        if items:
            self.send_nowait(items, routed)

    def on_detokenized(self, routed, result: list[Detokenized]) -> None:
        if routed is None:  # a batch of forget items
            return
        now = time.monotonic()
        updates: dict[RequestState, list[SampleDelta]] = {}
        for (state, sample, delta), item in zip(routed, result):
            if sample.finished:  # a stop string ended it in an earlier answer
                continue
            updates.setdefault(state, []).append(
                sample.apply(delta, item.text, item.pieces, state.prompt_token_ids[0]))
            if sample.cut_short:
                self.abort_nowait(state.scheduler, [sample.sequence_id])
                self._forget([sample])
        for state, deltas in updates.items():
            state.publish(deltas, now)
            if state.num_unfinished == 0:
                self.requests.pop(state.request_id, None)

    def resume_items(self) -> list[DetokenizeItem]:
        """What rebuilds, on a new Detokenize stream, the detokenizer state of every sample
        still in flight (the broken stream took them all)."""
        return [item for state in self.requests.values() for sample in state.samples
                if (item := sample.resume_item()) is not None]

    def fail_all(self, message: str, forget: bool = True, scheduler=None) -> None:
        """End every request (or those sent to one scheduler group) with an error, and abort
        them at the scheduler: a stream to the scheduler or tokenizer broke for good. Their
        consumers see them finished, so nothing else would stop the scheduler computing them
        (and holding their KV blocks) to the end."""
        now = time.monotonic()
        for state in list(self.requests.values()):
            if scheduler is not None and state.scheduler is not scheduler:
                continue
            unfinished = [s for s in state.samples if not s.finished]
            if forget:
                self._forget([s for s in unfinished if s.detokenizing])
            state.publish([s.error_delta(message) for s in unfinished], now)
            del self.requests[state.request_id]
            self.abort_nowait(state.scheduler, [state.request_id])

    def _forget(self, samples) -> None:
        if samples:
            items = [sample.forget_item() for sample in samples]
            self.send_nowait(items, None)
