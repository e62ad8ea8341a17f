"""The step protocol between the scheduler and its workers, as both cores see it: what a step
orders (sequences to start, to continue, to forget; KV pages to send) and what it returns
(sampled tokens, send results). Protobuf-free dataclasses; each side's service edge
(scheduler/edge.py, worker/edge.py) converts worker.proto's messages to and from them, once.

They are frozen, but for the two built once per row of every step on both sides
(ScheduledSequence, Sampled): a frozen dataclass's __init__ sets each field through
object.__setattr__, which made the worker's conversion of a 64-row decode step ~40% slower
than reading the message in place. Nothing changes them after construction all the same."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.step_results import (Pooled, PromptLogprobs,  # noqa: F401 (re-exported)
                                          TokenLogprob)
from kvrelay.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SendOrder:
    """Push a sequence's KV pages into blocks reserved on a decode worker."""
    transfer_id: str
    sequence_id: str
    src_block_ids: tuple[int, ...]
    dst_address: str
    dst_block_ids: tuple[int, ...]
    transport: str  # "grpc" or "shm"
    dst_shm_path: str
    during_step: bool  # the carrying step computes the last KV: push layer by layer
    deadline_unix_ms: int  # no page is written after this (wall clock; 0: none)
    dst_instance_id: str
    dst_kv_shards: int = 1  # the destination's cache is cut by KV head for a group this size


@dataclass(frozen=True, slots=True)
class SendResult:
    transfer_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0  # moved, on success
    seconds: float = 0.0  # the send took, on success


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the worker has no state for: everything it needs to compute it."""
    sequence_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    block_ids: tuple[tuple[int, ...], ...]  # per KV group, its block table
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...]
    child_index: int
    num_prompt_tokens: int
    adapter_id: int = 0  # the LoRA adapter computing it (0: the base model)


@dataclass(slots=True)
class ScheduledSequence:  # not frozen: one per row per step (above)
    sequence_id: str
    num_new_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...]  # per KV group, appended to its table
    # In a step that samples a constrained sequence: its grammar's allowed tokens, packed as
    # little-endian int32 words (engine/structured/backend.py). Empty: unconstrained.
    token_bitmask: bytes = b""  # with drafts: one mask per sampled position, concatenated
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: to verify after the last
    new_token_ids: tuple[int, ...] = ()  # tokens it did not sample itself, to append first


@dataclass(slots=True)
class StepOrder:
    """One step for one worker. Built by the scheduler's step_plan; the thread count is set by
    its step loop when the step gets its cores."""
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_sequence_ids: list[str] = field(default_factory=list)
    kv_sends: list[SendOrder] = field(default_factory=list)
    num_threads: int = 0  # 0: all of the worker's



@dataclass(slots=True)
class Sampled:  # not frozen: one per sampled row per step (above)
    """A step's tokens for one sequence: one, or its accepted drafts and the one after."""
    sequence_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token where the request asked


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step_id: int
    sampled: tuple[Sampled, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # of the prompt chunks the step computed
    pooled: tuple[Pooled, ...] = ()  # the embeddings the step finished


def token_logprob(entry: dict[int, float], rank: int, token_id: int,
                  num_top: int) -> TokenLogprob:
    """entry: {token id: logprob} for the sampled token and the top `num_top` alternatives (one
    dict, so it has num_top entries when the sampled token is among them)."""
    ordered = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
    return TokenLogprob(token_id, entry[token_id], rank, tuple(ordered))
