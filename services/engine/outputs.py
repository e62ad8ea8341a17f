"""Results of the offline API, shaped as vLLM users know them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per output token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # with SamplingParams.pooling

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # [hidden], unit length


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM's offline API shapes it."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
