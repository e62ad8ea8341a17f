"""The scheduler core's own messages: what a worker registers with, what a step orders and
returns, what a sample's progress looks like to a gateway. Frozen, protobuf-free dataclasses;
the service edge (edge.py) converts the wire's messages to and from them, once. The step's
messages are the step protocol's (kvrelay.step_messages), which the workers share."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kvrelay.step_messages import (NewSequence, Pooled, PromptLogprobs, Sampled,
                                   ScheduledSequence, SendOrder, SendResult, StepOrder,
                                   StepOutcome, TokenLogprob)

__all__ = ["Role", "PREFILL", "DECODE", "BOTH", "FinishReason", "WorkerInfo", "Delta",
           "NewSequence", "Pooled", "PromptLogprobs", "Sampled", "ScheduledSequence", "SendOrder", "SendResult", "StepOrder",
           "StepOutcome", "TokenLogprob"]


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
    # per KV group of the model's layers, its window (0: full attention; engine/kv_groups.py)
    kv_group_windows: tuple[int, ...] = (0,)
    kv_cache_dtype: str = ""  # its KV cache's element (empty: dtype); pages move only between equals
    max_loras: int = 0  # LoRA slots (0: LoRA off)
    max_lora_rank: int = 0
    tensor_parallel_size: int = 1  # the ranks of its group (its KV cache cut by head)
    # the stages of its pipeline: up to this many steps, of different sequences, in flight
    pipeline_parallel_size: int = 1

    @property
    def push_address(self) -> str:
        return self.kv_address or self.address


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
    # on a sample's first delta, where asked: each prompt token's after the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    embedding: tuple[float, ...] = ()  # on the only delta of a request with pooling
