"""The body of POST /v1/responses as kvrelay takes it: OpenAI's Responses API for text, with
function tools. As for chat, a field not declared here is a 400 naming it, and a declared one is
accepted only with the values kvrelay honours (no reasoning summaries, no background mode, no
server-side truncation, no built-in tools)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvrelay.gateway.openai_protocol import Count, FunctionName, Strict

ItemId = Annotated[str, Field(max_length=256)]


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    # what an earlier response's output_text carries when passed back as input
    annotations: Annotated[list, Field(max_length=0)] | None = None
    logprobs: Annotated[list, Field(max_length=0)] | None = None


class MessageItem(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A call the model made (an earlier response's output, passed back)."""
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: Annotated[str, Field(max_length=1 << 20)]  # JSON text of an object
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    """The result of a call, for the model to read."""
    type: Literal["function_call_output"]
    call_id: ItemId
    output: str | list[InputText]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningPart(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier response's reasoning, passed back: accepted and not rendered, as the chat
    templates of thinking models drop the reasoning of earlier turns."""
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # honoured either way: calls are always held to the schema


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(Strict):
    """text.format: plain text, any JSON object, or JSON held to a schema."""
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None  # honoured either way: the output is always held to the schema


class ReasoningConfig(Strict):
    """The effort, for a chat template that reads it (reasoning_effort); no summaries."""
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=1024)]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    # Kept for previous_response_id and GET /v1/responses/{id} unless false (OpenAI's default
    # is to keep); the gateway's store is bounded (responses_store.py).
    store: bool | None = None
    previous_response_id: ItemId | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None  # caching is automatic
    # Only the values that describe what kvrelay does; others are a 400.
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    background: Literal[False] | None = None
    include: Annotated[list, Field(max_length=0)] | None = None
    reasoning: ReasoningConfig | None = None
