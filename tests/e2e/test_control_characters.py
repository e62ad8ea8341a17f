"""Every prompt a real client sends is served: text with every C0 and C1 control character and
ANSI escapes gets completions through the PD stack on REST (openai SDK, chat and completions,
streamed and not) and on the gRPC API; only text that cannot reach the tokenizer (a lone
surrogate) gets the 400 naming its field."""
from __future__ import annotations

import httpx
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2
from tests.e2e.grpc_api import generate

C0 = "".join(chr(code) for code in range(0x00, 0x20))
C1 = "".join(chr(code) for code in range(0x7F, 0xA0))  # DEL, then C1
ANSI = "\x1b[31mred\x1b[0m \x1b[1;32mbold green\x1b[0m\r\n$ ls\x1b[K"
TEXTS = [f"Terminal output: {ANSI}", f"C0 {C0} end", f"C1 {C1} end", "\x10\x10 data \x10"]


@pytest.mark.parametrize("text", TEXTS, ids=["ansi", "c0", "c1", "dle"])
def test_rest_serves_prompts_with_control_characters(pd_client, model_id, text):
    chat = pd_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": text}], max_tokens=4,
        temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    completion = pd_client.completions.create(model=model_id, prompt=text, max_tokens=4,
                                              temperature=0, stop=["\x1b[0m", "\x07"])
    assert completion.usage.prompt_tokens > 0 and completion.choices[0].finish_reason
    streamed = pd_client.completions.create(model=model_id, prompt=text, max_tokens=4,
                                            temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == \
        completion.choices[0].text


def test_grpc_serves_prompts_with_control_characters(pd_stack):
    for text in TEXTS:
        result = generate(pd_stack.grpc_address, generation_pb2.GenerateRequest(
            prompt=text, params=common_pb2.SamplingParams(temperature=0, max_tokens=4)))
        assert result.finish_reason[0] == "FINISH_REASON_LENGTH"
        assert result.usage.completion_tokens == 4


def test_a_lone_surrogate_is_still_a_400_naming_the_field(pd_stack, model_id):
    # (the openai SDK cannot even encode one: a raw body carries the JSON escape)
    body = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}' % model_id.encode()
    response = httpx.post(f"{pd_stack.rest_url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt is not valid UTF-8"
