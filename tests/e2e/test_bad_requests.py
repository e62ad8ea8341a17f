"""Every kind of bad request gets a 400 with an OpenAI error body, and the stack keeps serving."""
from __future__ import annotations

import httpx
import pytest

GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_BODIES = {
    "malformed json": b'{"messages": [{"role": "user", "content": "Hi"}',
    "messages not a list": {"messages": "Hi", "max_tokens": 4},
    "max_tokens a string": {**GOOD_CHAT, "max_tokens": "ten"},
    "temperature -1": {**GOOD_CHAT, "temperature": -1},
    "top_p 2": {**GOOD_CHAT, "top_p": 2},
    "n 0": {**GOOD_CHAT, "n": 0},
    "empty messages": {"messages": [], "max_tokens": 4},
    "max_tokens beyond the context": {**GOOD_CHAT, "max_tokens": 10_000_000},
}


@pytest.fixture(scope="module")
def http(pd_stack, model_id):
    with httpx.Client(base_url=pd_stack.base_url, timeout=60, trust_env=False) as client:
        client.model_id = model_id
        yield client


def post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json={"model": http.model_id, **body})  # the body's model wins


def assert_openai_error(response: httpx.Response, status: int = 400) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_chat_request_gets_400_then_next_request_works(http, case):
    assert_openai_error(post(http, "/chat/completions", BAD_BODIES[case]))
    good = post(http, "/chat/completions", GOOD_CHAT)
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["message"]["content"]


def test_unknown_model_gets_404_model_not_found_then_next_request_works(http):
    response = post(http, "/chat/completions", {**GOOD_CHAT, "model": "no-such-model"})
    assert_openai_error(response, 404)
    assert response.json()["error"]["code"] == "model_not_found"
    assert post(http, "/chat/completions", GOOD_CHAT).status_code == 200


@pytest.mark.parametrize("body", [
    {"prompt": "Hi", "max_tokens": -1},
    {"prompt": 42, "max_tokens": 4},
    {"prompt": "Hi", "logprobs": 1000},
    {"prompt": [10**9], "max_tokens": 4},  # a token id outside the vocabulary
], ids=["negative max_tokens", "prompt a number", "logprobs too many", "bad token id"])
def test_bad_completion_request_gets_400(http, body):
    assert_openai_error(post(http, "/completions", body))
    good = post(http, "/completions", {"prompt": "Hi", "max_tokens": 4})
    assert good.status_code == 200, good.text


def test_bad_streaming_request_gets_400_not_an_event_stream(http):
    response = post(http, "/chat/completions", {**GOOD_CHAT, "stream": True, "temperature": -1})
    assert_openai_error(response)
