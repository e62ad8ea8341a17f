"""Per-request state in the gateway: each sample's stop strings, counts and what its consumer
sees (SampleDelta), fed from the scheduler's deltas and the tokenizer's text (messages.py)."""
from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass, field

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway import metrics
from kvrelay.gateway.messages import DetokenizeItem, OutputDelta, SampledLogprob
from kvrelay.gateway.stop_strings import StopStringMatcher


@dataclass(slots=True)
class TopToken:
    token_id: int
    logprob: float
    text: str


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None (and rank None) for a prompt's first token: nothing before it
    rank: int | None
    text: str
    top: list[TopToken]


@dataclass(slots=True)
class SampleDelta:
    """What one engine step added to one sample, as its consumer sees it."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: str | int | None = None  # the stop string or stop token id
    error: str | None = None
    # on the first delta, where asked: one per prompt token (the first's logprob is None)
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: tuple[float, ...] = ()  # a request with pooling's


class SampleState:
    __slots__ = ("sequence_id", "index", "matcher", "stop_token_ids", "skip_special_tokens",
                 "num_tokens", "finished", "cut_short", "detokenizing", "detokenized_ids")

    def __init__(self, request_id: str, index: int, params: SamplingParams) -> None:
        # the scheduler's id for this sample, and its text stream's at the tokenizer
        self.sequence_id = f"{request_id}/{index}"
        self.index = index
        self.matcher = StopStringMatcher(params.stop) if params.stop else None
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.skip_special_tokens = params.skip_special_tokens
        self.num_tokens = 0
        self.finished = False  # its consumer has seen its finish
        self.cut_short = False  # a stop string ended it before the scheduler did
        self.detokenizing = False  # the tokenizer holds a detokenizer state for it
        # The tokens whose text the tokenizer has answered with, in order: what rebuilds its
        # detokenizer state on a new Detokenize stream when the old one broke (4 bytes each).
        self.detokenized_ids = array("I")

    def detokenize_item(self, delta: OutputDelta, first_prompt_token: int) -> DetokenizeItem:
        final = delta.finish_reason is not None
        self.detokenizing = not final
        pieces = _piece_token_ids(delta.logprobs) if delta.logprobs else ()
        if delta.prompt_logprobs:  # the prompt's pieces go first, its first token's too
            pieces = [first_prompt_token, *_piece_token_ids(delta.prompt_logprobs), *pieces]
        return DetokenizeItem(self.sequence_id, delta.new_token_ids, final,
                              self.skip_special_tokens, pieces)

    def resume_item(self) -> DetokenizeItem | None:
        """Rebuilds its state on a new Detokenize stream (None: it needs none). Goes ahead of
        every item the broken stream did not answer, which are sent again after it."""
        if self.finished or not self.detokenized_ids:
            return None
        return DetokenizeItem(self.sequence_id, skip_special_tokens=self.skip_special_tokens,
                              resume_token_ids=self.detokenized_ids.tolist())

    def forget_item(self) -> DetokenizeItem:
        """Frees the tokenizer's state for a sample that ends before the scheduler says so."""
        self.detokenizing = False
        return DetokenizeItem(self.sequence_id, finished=True)

    def apply(self, delta: OutputDelta, text: str, pieces,
              first_prompt_token: int = -1) -> SampleDelta:
        # Counts every token of the step that completed a stop string, as the offline engine.
        self.num_tokens += len(delta.new_token_ids)
        self.detokenized_ids.extend(delta.new_token_ids)
        finish_reason = delta.finish_reason
        stop_reason: str | int | None = None
        if self.matcher is not None and finish_reason != "error":
            text, stop = self.matcher.feed(text, final=finish_reason is not None)
            if stop is not None:
                self.cut_short = finish_reason is None
                finish_reason, stop_reason = "stop", stop
        if finish_reason == "stop" and stop_reason is None \
                and delta.stop_token_id in self.stop_token_ids:
            stop_reason = delta.stop_token_id  # EOS leaves it None, as in vLLM
        self.finished = finish_reason is not None
        prompt_logprobs = None
        if delta.prompt_logprobs:
            first = TokenLogprob(first_prompt_token, None, None, pieces[0], [])
            prompt_logprobs = [first, *_logprobs(delta.prompt_logprobs, pieces[1:])]
            pieces = pieces[1 + _num_pieces(delta.prompt_logprobs):]
        logprobs = _logprobs(delta.logprobs, pieces) if delta.logprobs else None
        # The delta's token list is the consumer's now: nothing else changes it.
        return SampleDelta(self.index, text, delta.new_token_ids, logprobs,
                           finish_reason, stop_reason, delta.error or None, prompt_logprobs,
                           delta.embedding)

    def error_delta(self, message: str) -> SampleDelta:
        self.finished = True
        return SampleDelta(self.index, "", [], None, "error", None, message)


def _piece_token_ids(entries: tuple[SampledLogprob, ...]) -> list[int]:
    """Each sampled token, then its top alternatives: the tokens whose own text the logprobs
    show (the answer's pieces, in this order)."""
    token_ids = []
    for entry in entries:
        token_ids.append(entry.token_id)
        token_ids.extend(token_id for token_id, _ in entry.top)
    return token_ids


def _num_pieces(entries: tuple[SampledLogprob, ...]) -> int:
    return sum(1 + len(entry.top) for entry in entries)


def _logprobs(entries: tuple[SampledLogprob, ...], pieces) -> list[TokenLogprob]:
    result, position = [], 0
    for entry in entries:
        text = pieces[position]
        top = [TopToken(token_id, logprob, pieces[position + 1 + i])
               for i, (token_id, logprob) in enumerate(entry.top)]
        position += 1 + len(entry.top)
        result.append(TokenLogprob(entry.token_id, entry.logprob, entry.rank, text, top))
    return result


@dataclass(eq=False)
class RequestState:
    """One scheduler request (one prompt, n samples); its updates go to `sink` as
    (prompt_index, [SampleDelta, ...]) once per engine step."""
    request_id: str  # the scheduler's id (the gateway's own, never the client's)
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    samples: list[SampleState] = field(init=False)
    num_unfinished: int = field(init=False)
    num_cached_prompt_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    scheduler: object = None  # the SchedulerGroup it was submitted to

    def __post_init__(self) -> None:
        self.samples = [SampleState(self.request_id, i, self.params)
                        for i in range(self.params.n)]
        self.num_unfinished = len(self.samples)

    @property
    def num_output_tokens(self) -> int:
        return sum(sample.num_tokens for sample in self.samples)

    def publish(self, deltas: list[SampleDelta], now: float) -> None:
        counts = [len(delta.token_ids) for delta in deltas]
        if any(counts):
            metrics.observe_tokens(self, sum(counts), max(counts), now)
        for delta in deltas:
            if delta.finish_reason is not None:
                self.num_unfinished -= 1
                metrics.observe_sample_finished(delta.finish_reason)
        if self.num_unfinished == 0:
            metrics.observe_request_finished(self, now)
        self.sink.put_nowait((self.prompt_index, deltas))
