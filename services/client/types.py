"""What the kvrelay client returns: plain dataclasses, no protobuf."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from kvrelay.api.kvrelay.v1 import common_pb2


class SamplingOptions(TypedDict, total=False):
    """Sampling and stopping, as the engine's SamplingParams; unset means the server default
    (max_tokens unset: up to the end of the model's context)."""
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: str | list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int  # the sampled token's logprob plus this many alternatives
    prompt_logprobs: int  # each prompt token's logprob (after the first) plus this many
    skip_special_tokens: bool
    # One output constraint, vLLM's spelling: {"json": schema}, {"regex": ...}, {"choice": [...]},
    # {"grammar": lark_or_gbnf} or {"json_object": True}.
    structured_outputs: dict
    logit_bias: dict[int, float]  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int]
    disable_speculation: bool  # plain decoding where the server speculates


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]  # alternative token id -> logprob


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """New output of one choice. The last chunk of a request carries its usage."""
    request_id: str
    index: int  # which of the n choices
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort" when this choice ended
    stop_reason: str | None  # the stop string or stop token id that ended it
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk
    # on a choice's first chunk, with prompt_logprobs: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    usage: Usage | None

    # The first choice's fields (the only choice unless n > 1).
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    max_model_len: int


class KvrelayError(Exception):
    """A failed call: `code` is the gRPC status name (INVALID_ARGUMENT, UNAVAILABLE, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


FINISH_REASONS = {common_pb2.FINISH_REASON_UNSPECIFIED: None,
                  common_pb2.FINISH_REASON_STOP: "stop",
                  common_pb2.FINISH_REASON_LENGTH: "length",
                  common_pb2.FINISH_REASON_ABORT: "abort",
                  common_pb2.FINISH_REASON_ERROR: "error"}
