"""The OpenAI request bodies the gateway accepts (plus vLLM's extra sampling fields).

Types and wire-size bounds live here; sampling value ranges are checked once, by the engine's
SamplingParams. Nothing is silently ignored: a field not declared here (one of OpenAI's that
kvrelay does not implement, or a misspelt one) is answered with a 400 naming it, and a declared
field whose value kvrelay cannot honour is refused the same way (openai_params.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UINT32 = 2**32 - 1
INT32 = 2**31 - 1
INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=UINT32)]
Count = Annotated[int, Field(le=UINT32)]  # the lower bound is SamplingParams' to check


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None  # honoured either way: the output is always held to the schema


class ResponseFormat(Strict):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Strict):
    """vLLM's structured_outputs: exactly one constraint, and for JSON its whitespace (unset:
    none, compact JSON; disable_any_whitespace false: any; or a regex of what is allowed)."""
    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class SamplingFields(Strict):
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
    # kvrelay's: plain decoding for this request where the server speculates
    disable_speculation: bool = False
    min_tokens: Count = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user identifier, recorded in the request's log line
    priority: Annotated[int, Field(ge=-INT32 - 1, le=INT32)] = 0
    # Output constraints (openai_structured.py): one of response_format, structured_outputs
    # or a guided_* alias; logit_bias and allowed_token_ids combine with any of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    # vLLM's: each prompt token's logprob and its top k alternatives (openai_logprobs.py)
    prompt_logprobs: Annotated[int, Field(le=UINT32)] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                         Field(max_length=256)] | None = None  # vLLM's; openai_params.py


class TextPart(Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(Strict):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=1 << 20)]  # JSON text


class AssistantToolCall(Strict):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # honoured either way: calls are always held to the schema


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(Strict):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    refusal: str | None = None  # an earlier assistant refusal: rendered as its content
    # an earlier reply's reasoning (--reasoning-parser), passed back: not rendered, as thinking
    # models' templates drop earlier turns' reasoning
    reasoning_content: str | None = None
    # What the SDK writes back when a reply is passed on as is: accepted only as null.
    audio: None = None
    function_call: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or self.refusal or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # OpenAI fields honoured only with the values that describe what kvrelay does (one tier,
    # text out, nothing stored, prefix caching automatic); other values get a 400.
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    store: Literal[False] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None  # caching is automatic
    safety_identifier: Annotated[str, Field(max_length=1024)] | None = None  # like user
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Count | None = None
    # for a chat template that reads it (a thinking model's); other templates: a 400
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(le=UINT32)] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(le=UINT32)] | None = None
    suffix: str | None = None  # rejected when set: there is no fill-in-the-middle


class EmbeddingRequest(Strict):
    """OpenAI's embeddings body (one input, or a batch of texts or token id lists)."""
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=UINT32)] | None = None  # only the model's width
    user: str | None = None
    priority: Annotated[int, Field(ge=-INT32 - 1, le=INT32)] = 0


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=128)
