"""The gateway core's own messages: a generation it submits to a scheduler group, the deltas that
come back on the group's Outputs stream, the group's stats, and what goes to and comes back from
the tokenizer's Detokenize stream. Protobuf-free dataclasses; the service edge (edge.py, used by
scheduler_group.py and upstream.py) converts the wire's messages to and from them, once.

Ids: `client_request_id` is the id a client gave (or one made up for it), for the logs;
`request_id` is the scheduler's id of one prompt (the gateway's own, never the client's);
`sequence_id` is one sample of it, "<request_id>/<index>"."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.engine.sampling_params import SamplingParams


# ---- scheduler groups ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_blocks: int
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What a group's Stats answer tells the gateway: whether it serves, what, and its load."""
    ready: bool = False  # enough workers registered to serve
    model: str = ""  # empty until a worker has registered
    max_model_len: int = 0
    num_waiting: int = 0
    num_running: int = 0
    workers: tuple[WorkerLoad, ...] = ()
    adapters: tuple[str, ...] = ()  # the LoRA adapters loaded, by name
    max_loras: int = 0  # 0: LoRA off


@dataclass(frozen=True, slots=True)
class SubmittedPrompt:
    request_id: str  # the scheduler's id for this prompt
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Generation:
    """What one API call submits to one scheduler group: a scheduler request per prompt."""
    client_request_id: str  # travels with each call as x-request-id metadata, for the logs
    gateway_id: str  # whose Outputs stream the deltas come back on
    prompts: tuple[SubmittedPrompt, ...]
    params: SamplingParams
    priority: int = 0
    lora_name: str = ""  # a LoRA adapter's name; empty: the base model


# ---- the Outputs stream --------------------------------------------------------------------------
@dataclass(slots=True)
class SampledLogprob:
    """A sampled token's logprob as the scheduler sends it, before the tokenizer gives the text."""
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass(slots=True)
class OutputDelta:
    """What one engine step added to one sample, as the scheduler reports it."""
    request_id: str  # the scheduler's id
    index: int  # which of the n samples
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop, length, abort, error; None: it goes on
    stop_token_id: int | None = None  # the stop token (EOS or from stop_token_ids) that ended it
    logprobs: tuple[SampledLogprob, ...] = ()
    error: str = ""  # with finish reason error
    num_cached_prompt_tokens: int = 0
    # on a sample's first delta, where asked: each prompt token's after the first
    prompt_logprobs: tuple[SampledLogprob, ...] = ()
    embedding: tuple[float, ...] = ()  # a request with pooling's, on its only delta


# ---- the Detokenize stream -----------------------------------------------------------------------
@dataclass(slots=True)
class DetokenizeItem:
    """One sample's tokens for the tokenizer, which keeps a detokenizer state per sequence id."""
    sequence_id: str
    new_token_ids: Sequence[int] = ()
    finished: bool = False  # flush and forget the state
    skip_special_tokens: bool = False
    piece_token_ids: Sequence[int] = ()  # tokens whose own text is wanted (logprobs)
    # On a new stream after one broke: every token detokenized before, to rebuild the state.
    resume_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class Detokenized:
    """The tokenizer's answer to one DetokenizeItem."""
    text: str  # the new text
    pieces: Sequence[str] = ()  # the text of each piece_token_ids entry
