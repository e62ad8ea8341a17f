"""The OpenAI request bodies the gateway accepts (plus vLLM's extra sampling fields).

Types and wire-size bounds live here; sampling value ranges are checked once, by the engine's
SamplingParams. Unknown fields are ignored, as OpenAI's and vLLM's servers do."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

UINT32 = 2**32 - 1
INT32 = 2**31 - 1
INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=UINT32)]
Count = Annotated[int, Field(le=UINT32)]  # the lower bound is SamplingParams' to check


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    """What chat and completions requests share."""
    model: str | None = None
    n: Count = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(le=INT32)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=-INT64 - 1, le=INT64)] | None = None
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=-INT32 - 1, le=INT32)] = 0


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(le=UINT32)] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(le=UINT32)] | None = None
    suffix: str | None = None  # rejected when set: there is no fill-in-the-middle


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[TokenId]
