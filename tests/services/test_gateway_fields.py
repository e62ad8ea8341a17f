"""Every field of OpenAI's chat-completions and completions request bodies (and vLLM's extra
ones) is either honoured or refused with a 400 naming it: sent to a real gateway with no
scheduler, an honoured field gets as far as the missing scheduler (503), a refused one a 400
whose param is the field. /openapi.json documents every body it takes."""
from __future__ import annotations

import pytest

from tests.services.test_gateway_service import GOOD_CHAT, assert_openai_error, gateway, post

__all__ = ["gateway"]  # the fixture, shared with test_gateway_service

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# OpenAI's chat-completions body: field -> a typical value (as of the 2025 API reference).
OPENAI_CHAT_HONOURED = {
    "model": "smol-test", "frequency_penalty": 0.5, "logit_bias": {"42": 3},
    "logprobs": True, "max_completion_tokens": 4, "max_tokens": 4, "n": 1,
    "presence_penalty": 0.1, "response_format": {"type": "json_object"}, "seed": 1,
    "service_tier": "auto", "stop": ["\n"], "store": False, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.7,
    "tool_choice": "auto", "tools": [TOOL], "parallel_tool_calls": False, "top_p": 0.9,
    "user": "u-1", "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "s",
}
OPENAI_CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "mp3"}, "function_call": "auto",
    "functions": [{"name": "f"}], "metadata": {"a": "b"}, "prediction": {
        "type": "content", "content": "x"},
    "verbosity": "low", "web_search_options": {}, "store": True, "service_tier": "flex",
    "modalities": ["text", "audio"],
}
VLLM_CHAT_HONOURED = {
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [2],
    "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "add_generation_prompt": True, "priority": 1, "allowed_token_ids": [5, 6],
    "bad_words": ["x"], "structured_outputs": {"regex": "a+"}, "guided_regex": "a+",
    "guided_json": {"type": "object"}, "guided_choice": ["a"], "guided_grammar": 'start: "a"',
    "prompt_logprobs": 1,
}
VLLM_CHAT_REFUSED = {
    "best_of": 2, "use_beam_search": True, "length_penalty": 1.0,
    "include_stop_str_in_output": True, "continue_final_message": True,
    "chat_template": "{{ x }}", "chat_template_kwargs": {}, "documents": [],
    "guided_decoding_backend": "xgrammar", "logits_processors": [],
    "truncate_prompt_tokens": 4, "return_tokens_as_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {}, "request_id": "r", "spaces_between_special_tokens": False,
}
OPENAI_COMPLETION_HONOURED = {
    "model": "smol-test", "echo": True, "frequency_penalty": 0.1, "logit_bias": {"3": 1},
    "max_tokens": 4, "n": 1, "presence_penalty": 0.1, "seed": 2, "stop": "x", "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.5, "user": "u",
    "logprobs": 2,
}
OPENAI_COMPLETION_REFUSED = {"best_of": 2, "suffix": "tail"}


def _check(gateway, path: str, base: dict, field: str, value, honoured: bool) -> None:
    body = {**base, field: value}
    if field == "stream_options":
        body["stream"] = True
    response = post(gateway, path, body)
    if honoured:
        error = assert_openai_error(response, 503)  # valid: it got as far as the scheduler
        assert "scheduler" in error["message"], (field, error)
    else:
        error = assert_openai_error(response, 400)
        assert error["param"] == field, (field, error)


@pytest.mark.parametrize("field, value, honoured", [
    *((f, v, True) for f, v in {**OPENAI_CHAT_HONOURED, **VLLM_CHAT_HONOURED}.items()),
    *((f, v, False) for f, v in {**OPENAI_CHAT_REFUSED, **VLLM_CHAT_REFUSED}.items()),
])
def test_each_chat_field_is_honoured_or_refused_by_name(gateway, field, value, honoured):
    if field == "tool_choice" or field == "parallel_tool_calls":
        base = {**GOOD_CHAT, "tools": [TOOL]}
    else:
        base = GOOD_CHAT
    _check(gateway, "/v1/chat/completions", base, field, value, honoured)


@pytest.mark.parametrize("field, value, honoured", [
    *((f, v, True) for f, v in OPENAI_COMPLETION_HONOURED.items()),
    *((f, v, False) for f, v in OPENAI_COMPLETION_REFUSED.items()),
])
def test_each_completion_field_is_honoured_or_refused_by_name(gateway, field, value, honoured):
    _check(gateway, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}, field, value,
           honoured)


def test_openapi_documents_every_body(gateway):
    schema = gateway.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, name in (("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/completions", "CompletionRequest"), ("/tokenize", "TokenizeRequest"),
                       ("/detokenize", "DetokenizeRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{name}"
    chat = components["ChatCompletionRequest"]["properties"]
    for field in [*OPENAI_CHAT_HONOURED, *VLLM_CHAT_HONOURED]:
        assert field in chat, field
    refs = [value for value in _walk(schema) if isinstance(value, str) and value.startswith("#/")]
    for ref in refs:  # every reference resolves
        node = schema
        for part in ref[2:].split("/"):
            node = node[part]
    assert "additionalProperties" in components["ChatCompletionRequest"]


def _walk(node):
    if isinstance(node, dict):
        for value in node.values():
            yield value
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)
