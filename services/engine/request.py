"""A request as the scheduler sees it: tokens, progress, status."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from kvrelay.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # only an annotation: the scheduler process imports this and never needs torch
    import torch

    from kvrelay.engine.spec.state import DraftState
    from kvrelay.engine.structured.backend import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # PD handoff: prompt KV final on the prefill worker, pages on their way to the decode worker
    TRANSFERRING = "transferring"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


def make_sequence_id(request_id: str, index: int) -> str:
    """The id of a request's `index`th sequence (of its n), offline and in the services. Nothing
    parses it back: the index travels beside it where it is needed (NewSequence.child_index,
    Delta.index)."""
    return f"{request_id}/{index}"


def prefix_cache_key(cache_salt: str | None, adapter_id: int):
    """The base model's key is the salt alone, as before adapters existed."""
    return cache_salt if adapter_id == 0 else (cache_salt, adapter_id)


class Request:
    """One sequence (`sequence_id`: make_sequence_id). A request with n > 1 becomes n of these
    sharing a `cache_salt`."""

    def __init__(self, sequence_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 generator: torch.Generator | None = None, adapter_id: int = 0) -> None:
        self.sequence_id = sequence_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt  # blocks are shared only between requests of one salt
        # the LoRA adapter computing it (0: the base model); a load's id, never reused, so a
        # name unloaded and loaded again with other weights gets other blocks
        self.adapter_id = adapter_id
        self.generator = generator
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # per output token: ({token id: logprob} for it and the top alternatives, its rank)
        self.output_logprobs: list[tuple[dict[int, float], int]] = []
        # with params.prompt_logprobs: per prompt position, its TokenLogprob once computed
        # (position 0 never is); filled by position, so a recomputed prompt changes nothing
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None \
            else [None] * len(prompt_token_ids)
        # with params.pooling: the embedding once computed; a mean's running sum meanwhile
        self.embedding: tuple[float, ...] | None = None
        self.pooled_sum = None
        self.pooled_count = 0
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None
        # Under structured output: the sample's matcher, advanced with each appended token by
        # the scheduler. A copy of the request for another worker (PD) shares it: one sample,
        # one matcher, wherever the sample runs.
        self.grammar: GrammarMatcher | None = None
        # Under speculative decoding: the proposer's index over this sample's tokens and its
        # recent acceptance (spec/state.py); like the tokens, it survives preemption.
        self.draft_state: DraftState | None = None

    def add_prompt_logprobs(self, first_position: int, entries) -> None:
        self.prompt_logprobs[first_position:first_position + len(entries)] = entries

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs and a mean's pooling need every prompt position computed: no cache
        hit skips any."""
        return self.params.prompt_logprobs is None and self.params.pooling != "mean"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def continued(self, num_tokens: int | None = None) -> Request:
        """The same sequence as a new request, for another worker (moved, recovered, or handed
        over to a decode worker): its prompt and parameters and its first `num_tokens` tokens
        (all by default), the generated ones among them still outputs. Stop checks, max_tokens,
        min_tokens, penalties and a seeded sample's draws (the worker skips one per output:
        worker/sequences.py) then count them as an uninterrupted run does. No progress carries
        over (computed tokens, blocks, status, draft state). The grammar matcher does: one
        sample, one matcher, and it has taken every output already, so none of them is fed
        to it again (only tokens sampled from now on are: stop_checker.advance_grammar)."""
        num_tokens = self.num_tokens if num_tokens is None else num_tokens
        if not self.num_prompt_tokens <= num_tokens <= self.num_tokens:
            raise ValueError(f"sequence {self.sequence_id}: {num_tokens} tokens of "
                             f"{self.num_prompt_tokens} + {self.num_output_tokens}")
        copy = Request(self.sequence_id, self.prompt_token_ids, self.params, self.eos_token_ids,
                       self.priority, self.arrival_time, self.cache_salt,
                       adapter_id=self.adapter_id)
        for token_id in self.all_token_ids[self.num_prompt_tokens:num_tokens]:
            copy.append_token(token_id)
        copy.output_logprobs = self.output_logprobs[:copy.num_output_tokens]
        if self.prompt_logprobs is not None:
            copy.prompt_logprobs = list(self.prompt_logprobs)
        copy.grammar = self.grammar
        return copy

    @property
    def cache_key(self):
        """What a full block's hash mixes in besides its tokens: the salt and the adapter (KV
        computed with one adapter is never another's)."""
        return prefix_cache_key(self.cache_salt, self.adapter_id)

    def sort_key(self, policy: str) -> tuple:
        """Smaller runs first: by arrival (fcfs) or by priority then arrival."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.sequence_id)
        return (self.arrival_time, self.sequence_id)
