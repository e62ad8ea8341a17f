"""The scheduler core's own messages: what a worker registers with, what a step orders and
returns, what a sample's progress looks like to a gateway. Frozen, protobuf-free dataclasses;
the service edge (edge.py) converts the wire's messages to and from them, once."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvrelay.engine.sampling_params import SamplingParams


class Role(enum.Enum):
    PREFILL = "prefill"  # computes prompts, pushes their KV pages to decode workers
    DECODE = "decode"  # generates from pages pushed to it
    BOTH = "both"  # colocated: a request runs start to end on it


PREFILL, DECODE, BOTH = Role.PREFILL, Role.DECODE, Role.BOTH


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or the operator
    ERROR = "error"  # a worker or a transfer failed; the delta says why


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker process registers with."""
    worker_id: str
    role: Role
    address: str  # host:port of its Worker and KvTransfer services
    num_blocks: int
    block_size: int
    model: str
    dtype: str
    max_model_len: int
    vocab_size: int
    instance_id: str  # unique to the process: a replacement under the same id differs
    eos_token_ids: tuple[int, ...] = ()
    kv_transports: tuple[str, ...] = ("grpc",)
    host_id: str = ""  # workers with the same host id may use the shm transport
    shm_path: str = ""  # where its KV cache is mapped, for the shm transport
    compute_domain: str = ""  # workers on the same CPUs or GPU report the same domain
    attention_crossover: int = 0  # see prefill_chunks.py; 0: unknown
    num_threads: int = 0  # its forward pass's threads (0: not reported)
    kv_address: str = ""  # where other workers push KV pages over gRPC (empty: address)

    @property
    def push_address(self) -> str:
        return self.kv_address or self.address


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
    deadline_unix_ms: int  # no page is written after this (wall clock)
    dst_instance_id: str


@dataclass(frozen=True, slots=True)
class SendResult:
    transfer_id: str
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A sequence the worker has no state for: everything it needs to compute it."""
    sequence_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    eos_token_ids: tuple[int, ...]
    child_index: int
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    sequence_id: str
    num_new_tokens: int
    new_block_ids: tuple[int, ...]
    # In a step that samples a constrained sequence: its grammar's allowed tokens, packed as
    # little-endian int32 words (engine/structured/backend.py). Empty: unconstrained.
    token_bitmask: bytes = b""  # with drafts: one mask per sampled position, concatenated
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: to verify after the last


@dataclass(slots=True)
class StepOrder:
    """One step for one worker. Built by step_plan; the thread count is set by the step loop
    when the step gets its cores."""
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_sequence_ids: list[str] = field(default_factory=list)
    kv_sends: list[SendOrder] = field(default_factory=list)
    num_threads: int = 0  # 0: all of the worker's


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


@dataclass(frozen=True, slots=True)
class Sampled:
    """A step's tokens for one sequence: one, or its accepted drafts and the one after."""
    sequence_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token where the request asked


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step_id: int
    sampled: tuple[Sampled, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """A sample's progress for its gateway: new tokens, and its end where it ended."""
    request_id: str
    index: int
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error: str = ""
    num_cached_prompt_tokens: int = 0  # on a sample's first delta
